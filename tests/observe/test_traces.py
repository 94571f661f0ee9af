"""OpenTelemetry traces through a real gateway into a real OTLP/HTTP receiver on loopback.

The receiver is an aiohttp server on its own thread and loop accepting `POST /v1/traces`
(protobuf), decoded with `opentelemetry-proto`; the gateway and the sims are real processes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from pulsegate.config import ConfigError, parse_config
from pulsegate.observe import otlp
from pulsegate.observe.otlp import Encoder
from pulsegate.observe.traces import parse_traceparent
from support import Gateway, Proc, Sim, backend_entry, fast_probes, sse_events, wait_until

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SERVER = Span.SpanKind.SPAN_KIND_SERVER
CLIENT = Span.SpanKind.SPAN_KIND_CLIENT
SLOW_PROBES = {
    "readiness": {"interval": "20s", "interval_unstable": "20s"},
    "micro_inference": {"interval": "20s", "jitter": "0s"},
    "canary": {"interval": "20s"},
}


class Receiver:
    """An OTLP/HTTP trace receiver: every span it was sent, with its resource's attributes."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], Span]] = []
        self.requests = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.port = 0

    async def _traces(self, request: web.Request) -> web.Response:
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        with self._lock:
            self.requests += 1
            for rs in msg.resource_spans:
                res = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans.extend((res, s) for s in ss.spans)
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def start(self) -> Receiver:
        self._thread.start()
        assert self._started.wait(10), "the OTLP receiver did not start"
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def trace(self, trace_id: str, count: int, timeout: float = 15.0) -> list[Span]:
        """The spans of `trace_id` once at least `count` have arrived."""

        def spans() -> list[Span] | None:
            with self._lock:
                got = [s for _, s in self.spans if s.trace_id.hex() == trace_id]
            return got if len(got) >= count else None

        return wait_until(spans, timeout=timeout, what=f"{count} span(s) of trace {trace_id}")

    def all(self) -> list[Span]:
        with self._lock:
            return [s for _, s in self.spans]


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


def attrs(span: Span) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in span.attributes}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


def _config(sims: list[Sim], receiver: Receiver, **extra: Any) -> dict[str, Any]:
    return {
        "backends": [backend_entry(s) for s in sims],
        "probes": fast_probes(),
        "observability": {
            "otlp_endpoint": f"http://127.0.0.1:{receiver.port}",
            "service_name": "gw-under-test",
        },
        **extra,
    }


def _request_span(spans: list[Span]) -> Span:
    (server,) = [s for s in spans if s.kind == SERVER]
    return server


def _sim_traceparents(sim: Sim) -> list[str]:
    r = httpx.get(f"{sim.url}/sim/requests", timeout=5).json()
    return [q["traceparent"] for q in r["requests"] if "traceparent" in q]


def test_request_and_attempt_spans_with_genai_attributes(
    start_sim: Callable[..., Sim],
    start_gateway: Callable[..., Gateway],
    receiver: Receiver,
) -> None:
    """A chat request is a SERVER span `chat demo-7b` with its attempt as a CLIENT child,
    GenAI attributes and usage; the backend got the attempt span's id in `traceparent`."""
    sim = start_sim("a")
    gw = start_gateway(_config([sim], receiver))
    gw.wait_all_ready()
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sk-not-checked", max_retries=0)
    out = client.chat.completions.create(
        model="demo-7b", messages=[{"role": "user", "content": "hello"}], max_tokens=7
    )
    assert out.usage is not None
    (tp,) = _sim_traceparents(sim)
    parsed = parse_traceparent(tp)
    assert parsed is not None
    trace_id = f"{parsed[0]:032x}"
    spans = receiver.trace(trace_id, 2)
    server = _request_span(spans)
    (attempt,) = [s for s in spans if s.kind == CLIENT]
    assert server.name == attempt.name == "chat demo-7b"
    assert server.parent_span_id == b""  # no traceparent from the client: a root span
    assert attempt.parent_span_id == server.span_id
    assert attempt.span_id.hex() == f"{parsed[1]:016x}"  # the id the backend was sent
    a = attrs(server)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "demo-7b"
    assert a["gen_ai.usage.input_tokens"] == out.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == out.usage.completion_tokens
    assert a["http.response.status_code"] == 200
    assert "error.type" not in a
    b = attrs(attempt)
    assert b["pulsegate.backend"] == "a"
    assert b["server.address"] == "127.0.0.1"
    assert b["server.port"] == sim.port
    assert b["http.response.status_code"] == 200
    assert b["pulsegate.attempt.kind"] == "first"
    assert b["pulsegate.backend.state"] == "ready"
    assert 0 <= b["pulsegate.backend.score"] <= 100
    assert server.start_time_unix_nano <= attempt.start_time_unix_nano
    assert attempt.end_time_unix_nano <= server.end_time_unix_nano
    (res, _) = next(x for x in receiver.spans if x[1].span_id == server.span_id)
    assert res["service.name"] == "gw-under-test"


def test_client_traceparent_is_the_parent(
    start_sim: Callable[..., Sim],
    start_gateway: Callable[..., Gateway],
    receiver: Receiver,
) -> None:
    """A client's `traceparent` makes the request span its child in the client's trace, and
    the backend sees the same trace id with the attempt's span id."""
    sim = start_sim("a")
    gw = start_gateway(_config([sim], receiver))
    gw.wait_all_ready()
    r = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={"model": "demo-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
        timeout=10,
    )
    assert r.status_code == 200
    spans = receiver.trace(CLIENT_TRACE, 2)
    server = _request_span(spans)
    (attempt,) = [s for s in spans if s.kind == CLIENT]
    assert server.parent_span_id.hex() == CLIENT_SPAN
    (tp,) = _sim_traceparents(sim)
    assert tp == f"00-{CLIENT_TRACE}-{attempt.span_id.hex()}-01"


def test_unsampled_client_trace_is_propagated_not_exported(
    start_sim: Callable[..., Sim],
    start_gateway: Callable[..., Gateway],
    receiver: Receiver,
) -> None:
    """A client trace with the sampled flag off goes on to the backend (flag off) and no span
    of it is exported; a sampled request after it is."""
    sim = start_sim("a")
    gw = start_gateway(_config([sim], receiver))
    gw.wait_all_ready()
    body = {"model": "demo-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url = f"{gw.url}/v1/chat/completions"
    off = "11111111111111111111111111111111"
    httpx.post(url, json=body, headers={"traceparent": f"00-{off}-{CLIENT_SPAN}-00"}, timeout=10)
    httpx.post(url, json=body, headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    receiver.trace(CLIENT_TRACE, 2)  # exported after the unsampled one was recorded
    assert not [s for s in receiver.all() if s.trace_id.hex() == off]
    first = _sim_traceparents(sim)[0]
    assert first.startswith(f"00-{off}-") and first.endswith("-00")


def test_retry_and_resume_are_child_spans(
    start_sim: Callable[..., Sim],
    start_gateway: Callable[..., Gateway],
    receiver: Receiver,
) -> None:
    """A retried request has a failed first attempt span (error.type) and an ok retry; a
    stream broken mid-way has a resume span; each attempt's id reached its backend.

    Three backends: the one error can take `a`'s score under `eject_below` (how far depends
    on how many requests the session search sent it first), and a stall is cut only where
    the stream can go on (`Relay.may_cut`); with two, a stream on `b` then had nowhere to
    resume and waited for its request timeout."""
    sims = [start_sim(n, "--ttft-ms", "5", "--itl-ms", "15") for n in ("a", "b", "c")]
    gw = start_gateway(
        {
            **_config(sims, receiver, streaming={"stall_timeout": "500ms"}),
            "probes": SLOW_PROBES,  # real traffic alone judges the backends here
        }
    )
    gw.wait_all_ready()
    body = {"model": "demo-7b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    url = f"{gw.url}/v1/chat/completions"

    def home(session: str) -> str:
        r = httpx.post(url, json=body, headers={"x-session-id": session}, timeout=10)
        return str(r.headers["x-pulsegate-backend"])

    # A session whose home (affinity) is a, so the failing backend is surely tried first.
    session = next(k for k in (f"s{i}" for i in range(200)) if home(k) == "a")
    sims[0].fault("error", rate=1.0)
    trace = "22222222222222222222222222222222"
    headers = {"traceparent": f"00-{trace}-{CLIENT_SPAN}-01", "x-session-id": session}
    r = httpx.post(url, json=body, headers=headers, timeout=10)
    assert r.status_code == 200
    assert r.headers["x-pulsegate-attempts"] == "2"
    spans = receiver.trace(trace, 3)
    retried = _request_span(spans)
    assert attrs(retried)["pulsegate.attempts"] == 2
    kids = [s for s in spans if s.parent_span_id == retried.span_id]
    assert [attrs(k)["pulsegate.attempt.kind"] for k in kids] == ["first", "retry"]
    failed, ok = kids
    assert attrs(failed)["pulsegate.backend"] == "a"
    assert attrs(failed)["http.response.status_code"] == 500
    assert attrs(failed)["error.type"]
    assert failed.status.code == failed.status.STATUS_CODE_ERROR
    assert "error.type" not in attrs(ok)
    assert attrs(ok)["pulsegate.backend"] != "a"
    assert failed.span_id.hex() in " ".join(_sim_traceparents(sims[0]))
    assert ok.span_id.hex() in " ".join(tp for s in sims[1:] for tp in _sim_traceparents(s))

    # A stream whose backend stalls after a few tokens is resumed on another.
    sims[0].fault("none")
    stream_trace = "33333333333333333333333333333333"
    sbody = {**body, "max_tokens": 40, "stream": True}
    with httpx.stream(
        "POST",
        url,
        json=sbody,
        timeout=15,
        headers={"traceparent": f"00-{stream_trace}-{CLIENT_SPAN}-01"},
    ) as resp:
        first = resp.headers["x-pulsegate-backend"]
        victim = next(s for s in sims if s.name == first)
        for i, _ev in enumerate(sse_events(resp)):
            if i == 3:
                victim.fault("stall", after_tokens=1)
    spans = receiver.trace(stream_trace, 3)
    server = _request_span(spans)
    assert attrs(server)["pulsegate.resumes"] == 1
    assert attrs(server)["pulsegate.stream"] is True
    kinds = {attrs(s)["pulsegate.attempt.kind"]: s for s in spans if s.kind == CLIENT}
    assert set(kinds) == {"first", "resume"}
    assert attrs(kinds["first"])["error.type"] == "stream_broken"
    assert attrs(kinds["resume"])["pulsegate.backend"] != first


def test_bad_endpoints_are_config_errors() -> None:
    """`observability.otlp_endpoint` errors name the key and never echo a credential; a
    URL without a path gets OTLP's traces path."""
    backends = [{"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]}]

    def errors(endpoint: str) -> list[str]:
        with pytest.raises(ConfigError) as e:
            parse_config({"backends": backends, "observability": {"otlp_endpoint": endpoint}})
        return e.value.errors

    key = "observability.otlp_endpoint"
    assert errors("collector:4318") == [f"{key}: must start with http:// or https://"]
    assert errors("http://user:hunter2@c:4318") == [
        f"{key}: must not carry credentials (user:password@)"
    ]
    assert errors("http://c:port") == [f"{key}: must be a URL like http://collector:4318"]
    ok = parse_config({"backends": backends, "observability": {"otlp_endpoint": "http://c:4318"}})
    assert ok.observability.otlp_endpoint == "http://c:4318/v1/traces"
    kept = parse_config(
        {"backends": backends, "observability": {"otlp_endpoint": "https://c/otlp/v1/traces"}}
    )
    assert kept.observability.otlp_endpoint == "https://c/otlp/v1/traces"


def test_tracing_needs_no_opentelemetry_package(
    tmp_path: Path,
    start_sim: Callable[..., Sim],
    start_gateway: Callable[..., Gateway],
    procs: list[Proc],
    receiver: Receiver,
) -> None:
    """With every `opentelemetry` import failing in the gateway's process, it still starts
    and traces (OTLP is encoded by pulsegate itself), with tracing on and off."""
    shadow = tmp_path / "shadow" / "opentelemetry"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('opentelemetry is not installed')\n")
    env = {"PYTHONPATH": str(shadow.parent)}
    sim = start_sim("a")
    gw = start_gateway(_config([sim], receiver), env)
    gw.wait_all_ready()
    trace = "44444444444444444444444444444444"
    r = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={"model": "demo-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"},
        timeout=10,
    )
    assert r.status_code == 200
    assert len(receiver.trace(trace, 2)) == 2
    plain = Gateway(
        tmp_path, {"backends": [backend_entry(sim)], "probes": fast_probes()}, env, name="plain"
    )
    procs.append(plain)
    plain.wait_all_ready()
    before = len(_sim_traceparents(sim))
    r = httpx.post(
        f"{plain.url}/v1/chat/completions",
        json={"model": "demo-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=10,
    )
    assert r.status_code == 200
    assert len(_sim_traceparents(sim)) == before  # not traced: nothing propagated


def test_hand_encoding_matches_the_reference_decoder() -> None:
    """Every value kind, long strings, parents, status and flags decode with
    `opentelemetry-proto` to exactly what was encoded."""
    enc = Encoder((("service.name", "ünïcode-svc"), ("n", 7)), "pulsegate", "9.9")
    long_name = "x" * 300  # lengths past one varint byte
    fields = enc.group((("s", "välue"), ("b", True), ("b0", False), ("i", 1), ("neg", -5)))
    fields += enc.number("big", 2**40) + enc.number("f", 0.25) + enc.number("small", 127)
    fields += enc.group((("long", long_name),))
    one = enc.span(
        (1 << 127 | 5).to_bytes(16, "big"), 2**64 - 1, 0xABC, long_name, otlp.SERVER,
        1_796_135_608_000_000_001, 1_796_135_608_500_000_000, fields, otlp.ERROR, "boom",
        1 | otlp.HAS_IS_REMOTE | otlp.IS_REMOTE,
    )  # fmt: skip
    two = enc.span(b"\x01" * 16, 3, 0, "chat m", otlp.CLIENT, 10, 20, enc.group((("i", 1),)))
    msg = ExportTraceServiceRequest()
    msg.ParseFromString(enc.request([one, two]))
    (rs,) = msg.resource_spans
    assert {a.key: _value(a.value) for a in rs.resource.attributes} == {
        "service.name": "ünïcode-svc",
        "n": 7,
    }
    (ss,) = rs.scope_spans
    assert (ss.scope.name, ss.scope.version) == ("pulsegate", "9.9")
    a, b = ss.spans
    assert a.trace_id == (1 << 127 | 5).to_bytes(16, "big")
    assert a.span_id == b"\xff" * 8 and a.parent_span_id == (0xABC).to_bytes(8, "big")
    assert a.name == long_name and a.kind == SERVER
    assert (a.start_time_unix_nano, a.end_time_unix_nano) == (
        1_796_135_608_000_000_001,
        1_796_135_608_500_000_000,
    )
    assert attrs(a) == {
        "s": "välue", "b": True, "b0": False, "i": 1, "neg": -5, "big": 2**40, "f": 0.25,
        "small": 127, "long": long_name,
    }  # fmt: skip
    assert (a.status.code, a.status.message) == (a.status.STATUS_CODE_ERROR, "boom")
    assert a.flags == 0x301
    assert b.parent_span_id == b"" and b.kind == CLIENT and b.status.code == 0
    assert b.flags == 0x101 and attrs(b) == {"i": 1}
    assert isinstance(attrs(b)["i"], int)  # True and 1 are cached apart


def test_traceparent_parsing() -> None:
    """A valid W3C traceparent gives its ids and flags; malformed, all-zero or version-ff
    ones are ignored."""
    good = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    assert parse_traceparent(good) == (int(CLIENT_TRACE, 16), int(CLIENT_SPAN, 16), 1)
    assert parse_traceparent(f"01-{CLIENT_TRACE}-{CLIENT_SPAN}-00-future") is not None
    for bad in (
        None, "", "garbage", good.upper(), f"00-{'0' * 32}-{CLIENT_SPAN}-01",
        f"00-{CLIENT_TRACE}-{'0' * 16}-01", f"ff-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
        f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01-extra",
    ):  # fmt: skip
        assert parse_traceparent(bad) is None, bad


def test_reload_turns_tracing_on_and_off(
    start_sim: Callable[..., Sim],
    start_gateway: Callable[..., Gateway],
    receiver: Receiver,
) -> None:
    """A reload that adds `observability.otlp_endpoint` traces the next requests and sends
    their `traceparent`; one that removes it stops both."""
    sim = start_sim("a")
    plain = {"backends": [backend_entry(sim)], "probes": fast_probes()}
    gw = start_gateway(plain)
    gw.wait_all_ready()
    url = f"{gw.url}/v1/chat/completions"
    body = {"model": "demo-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(url, json=body, timeout=10).status_code == 200
    assert _sim_traceparents(sim) == []
    gw.write_config(_config([sim], receiver))
    assert gw.reload().status_code == 200
    trace = "55555555555555555555555555555555"
    tp = {"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"}
    assert httpx.post(url, json=body, headers=tp, timeout=10).status_code == 200
    assert len(receiver.trace(trace, 2)) == 2
    assert len(_sim_traceparents(sim)) == 1
    gw.write_config(plain)
    assert gw.reload().status_code == 200
    assert httpx.post(url, json=body, timeout=10).status_code == 200
    assert len(_sim_traceparents(sim)) == 1  # not traced: nothing propagated
