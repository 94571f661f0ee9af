"""Hostile backends (issue #22): a real gateway in front of one sim with each `pulsegate sim`
hostile fault in turn (`sim/hostile.py`) and one healthy sim.

For every fault, streamed and not, through the official `openai` client: the whole answer
(retried or resumed on the healthy sim) or OpenAI's error shape, never foreign bytes, never a
stream that just stops; the faulty backend counted as failing in `/metrics`; once the fault
is cleared, requests to that sim succeed (no pooled connection carried a broken response
into them); `/healthz` from another client answers meanwhile (figure printed, 1 s bound).
One gateway serves every case: faults are switched with `POST /sim/fault`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pulsegate.sim.text import TokenGen
from support import Gateway, Proc, Sim, wait_until

MODEL = "demo-7b"
TOKENS = 8
FOREIGN = (b"SMUGGLED", b"<html", b"\xff", b"aaaaaaaa", b"x-pad", b"bbbbbbbb")
FAULTS = [
    "bad_chunked",
    "long_length",
    "short_length",
    "endless_headers",
    "big_headers",
    "non_sse",
    "bad_utf8",
    "endless_event",
    "not_json",
    "trickle",
    "headers_reset",
]


def _expected() -> str:
    gen = TokenGen("x", 0)
    return "".join(gen.next() for _ in range(TOKENS))


EXPECTED = _expected()


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.procs: list[Proc] = []
        fast = ("--ttft-ms", "2", "--itl-ms", "1")
        self.bad = self._add(Sim(tmp, "bad", *fast))
        self.good = self._add(Sim(tmp, "good", *fast))
        config: dict[str, Any] = {
            "backends": [
                {"name": s.name, "url": s.url, "models": [MODEL]} for s in (self.bad, self.good)
            ],
            "probes": {
                "readiness": {"interval": "300ms", "interval_unstable": "100ms", "timeout": "1s"},
                "micro_inference": {
                    "interval": "2s",
                    "jitter": "200ms",
                    "timeout": "1s",
                    "failures_to_eject": 100,
                },
                "canary": {"interval": "1s", "timeout": "1s", "failures_to_isolate": 100},
                "metrics_interval": "500ms",
            },
            # Keep the hostile sim routable: each case must reach it, then reach it healthy.
            # Scores from queue and VRAM only, so its failures do not turn its sessions away.
            "health": {
                "max_ejected_fraction": 0.0,
                "consecutive_failures": 1000,
                "weights": {"latency": 0.0, "error_rate": 0.0, "queue": 0.5, "gpu_free": 0.5},
            },
            "retry": {"per_try_timeout": "1s", "per_token_timeout": "10ms"},
            "streaming": {"stall_timeout": "500ms"},
        }
        self.gw = self._add(Gateway(tmp, config))
        self.gw.wait_all_ready()
        self.client = openai.OpenAI(
            base_url=f"{self.gw.url}/v1", api_key="x", max_retries=0, timeout=20
        )

    def _add(self, p: Any) -> Any:
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("hostile"))
    try:
        yield f
    finally:
        f.stop()


def _bad_failures(gw: Gateway) -> float:
    """Requests to `bad` that did not end in 200, by `/metrics`."""
    total = 0.0
    for line in httpx.get(f"{gw.url}/metrics", timeout=5).text.splitlines():
        if line.startswith('pulsegate_requests_total{backend="bad"') and 'code="200"' not in line:
            total += float(line.rpartition(" ")[2])
    return total


class HealthzWatch:
    """Polls `/healthz` from its own client while a case runs; keeps the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst = 0.0
        self.answers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthzWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                c.get(f"{self.url}/healthz")
                self.worst = max(self.worst, time.perf_counter() - t0)
                self.answers += 1
                self._stop.wait(0.02)


def _ask(fleet: Fleet, stream: bool, session: str) -> tuple[str, str]:
    """One request through the official client: ("ok", backend) with the whole answer
    checked, or ("error", code) with OpenAI's error shape checked."""
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": TOKENS,
        "extra_headers": {"x-session-id": session},
    }
    if not stream:
        try:
            raw = fleet.client.chat.completions.with_raw_response.create(**kwargs)
        except openai.APIStatusError as e:
            body = e.response.content
            assert not any(f in body for f in FOREIGN), body[:300]
            err = e.response.json()["error"]
            assert isinstance(err["message"], str) and err["code"], err
            return "error", str(err["code"])
        assert not any(f in raw.http_response.content for f in FOREIGN)
        answer = raw.parse()
        assert answer.choices[0].message.content == EXPECTED, answer
        return "ok", raw.headers["x-pulsegate-backend"]
    try:
        with fleet.client.chat.completions.with_streaming_response.create(
            stream=True, **kwargs
        ) as resp:
            backend = resp.headers.get("x-pulsegate-backend", "")
            body = b"".join(resp.iter_bytes())
    except openai.APIStatusError as e:
        err = e.response.json()["error"]
        assert isinstance(err["message"], str) and err["code"], err
        return "error", str(err["code"])
    assert not any(f in body for f in FOREIGN), body[:300]
    body.decode()  # UTF-8 all through
    events = [e[6:] for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    assert events and events[-1] == b"[DONE]", body[-300:]  # never a stream that just stops
    text = ""
    for ev in events[:-1]:
        chunk = openai.types.chat.ChatCompletionChunk.model_validate_json(ev)
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert text == EXPECTED, body[-400:]
    return "ok", backend


@pytest.mark.parametrize("fault", FAULTS)
def test_hostile_backend(fleet: Fleet, fault: str) -> None:
    """Each hostile answer gives the client the whole answer or an OpenAI error, is counted
    against the backend, and leaves no broken connection for the requests after it."""
    bad, gw = fleet.bad, fleet.gw
    failures_before = _bad_failures(gw)
    bad.fault(fault)
    hits: list[str] = []  # sessions whose request reached the hostile sim
    with HealthzWatch(gw.url) as watch:
        for stream in (False, True):
            for i in range(30):
                session = f"{fault}-{stream}-{i}"
                before = bad.stats()["client_requests_total"]
                t0 = time.perf_counter()
                outcome = _ask(fleet, stream, session)
                if bad.stats()["client_requests_total"] > before:
                    hits.append(session)
                    took = time.perf_counter() - t0
                    print(f"\n{fault} stream={stream}: {outcome} in {took * 1000:.0f} ms", end="")
                    break
            else:
                what = "streamed" if stream else "whole"
                pytest.fail(f"no {what} request reached bad: {gw.backends()['bad']}")
    print(f"\n{fault}: /healthz worst {watch.worst * 1000:.1f} ms over {watch.answers} answers")
    assert watch.answers > 0
    assert watch.worst < 1.0, watch.worst
    wait_until(
        lambda: _bad_failures(gw) > failures_before, timeout=5, what="bad counted as failing"
    )

    bad.fault("none")
    served_by_bad = 0
    for i in range(40):
        outcome, backend = _ask(fleet, i % 2 == 1, f"{fault}-after-{i}")
        assert outcome == "ok", (outcome, backend)
        served_by_bad += backend == "bad"
        if served_by_bad >= 4:
            break
    state = gw.backends()["bad"]["state"]
    assert served_by_bad >= 1, f"the cleared sim was never used again ({state}): reuse untested"
