"""Responses and Anthropic Messages streams survive a backend SIGKILLed mid-generation.

Three sims behind a real gateway; the official `openai` (`responses.create(stream=True)`) and
`anthropic` (`messages.create(stream=True)`) clients read every event. All streams share one
`x-session-id`, so they start on one backend and each continuation goes to the same next
one: killing the serving sim twice breaks every stream twice.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest

from support import Gateway, Sim, backend_entry, fast_probes, wait_until

# 150 tokens at 20 ms: 3 s a stream, so the slowest starter is past the second kill point
# (50 tokens) long before the fastest ends, on a loaded 2-core box too.
TOKENS = 150
SESSION = {"x-session-id": "typed-resume"}
QUESTION = "tell me about gateways that never drop a stream"


@pytest.fixture
def fleet(start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]) -> dict[str, Any]:
    sims = {n: start_sim(n, "--ttft-ms", "5", "--itl-ms", "20") for n in ("a", "b", "c")}
    gw = start_gateway(
        {
            "backends": [backend_entry(s) for s in sims.values()],
            "probes": fast_probes(),
            "streaming": {"stall_timeout": "500ms"},
            # No bounded-load spill: every stream of the session stays on its home.
            "routing": {"affinity_epsilon": 100.0},
        }
    )
    gw.wait_all_ready()
    return {"sims": sims, "gw": gw}


def _oai(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0, timeout=20)


def _claude(gw: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0, timeout=20)


def _expected_response(sim: Sim, seed: int) -> str:
    body = {"model": "demo-7b", "input": QUESTION, "max_output_tokens": TOKENS, "seed": seed}
    out = httpx.post(f"{sim.url}/v1/responses", json=body, timeout=30).json()
    return out["output"][0]["content"][0]["text"]  # type: ignore[no-any-return]


def _expected_message(sim: Sim, seed: int) -> str:
    body = {"model": "demo-7b", "max_tokens": TOKENS, "seed": seed,
            "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
    out = httpx.post(f"{sim.url}/v1/messages", json=body, timeout=30).json()
    return out["content"][0]["text"]  # type: ignore[no-any-return]


class Reader:
    """One stream read in a thread: every event, and when each text piece arrived."""

    def __init__(self, api: str, gw: Gateway, seed: int) -> None:
        self.api, self.gw, self.seed = api, gw, seed
        self.events: list[Any] = []
        self.arrivals: list[float] = []
        self.text = ""
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        # Made here: 20 clients built at once in threads take longer than a stream lasts.
        self.client: Any = _oai(gw) if api == "responses" else _claude(gw)

    def _run(self) -> None:
        try:
            if self.api == "responses":
                stream: Any = self.client.responses.create(
                    model="demo-7b", input=QUESTION, max_output_tokens=TOKENS, stream=True,
                    extra_body={"seed": self.seed}, extra_headers=SESSION,
                )  # fmt: skip
            else:
                stream = self.client.messages.create(
                    model="demo-7b", max_tokens=TOKENS, stream=True,
                    messages=[{"role": "user", "content": QUESTION}],
                    extra_body={"seed": self.seed}, extra_headers=SESSION,
                )  # fmt: skip
            for ev in stream:
                self.events.append(ev)
                piece = _piece(ev)
                if piece:
                    self.text += piece
                    self.arrivals.append(time.monotonic())
        except BaseException as e:  # the assertion names it
            self.error = e


def _piece(ev: Any) -> str | None:
    if ev.type == "response.output_text.delta":
        return ev.delta  # type: ignore[no-any-return]
    if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
        return ev.delta.text  # type: ignore[no-any-return]
    return None


def _serving(sims: dict[str, Sim], readers: list[Reader]) -> str:
    """The live sim running the streams now (a probe may briefly run on another)."""
    running = {n: s.stats()["running"] for n, s in sims.items() if s.alive()}
    home = max(running, key=lambda n: running[n])
    assert running[home] >= 10, (running, [(r.api, len(r.arrivals), r.error) for r in readers])
    return home


def _warm_up(gw: Gateway) -> None:
    """One short stream per client first: their first parse of a typed event builds the
    SDK's models (seconds on a loaded box), while the events pile up in the socket."""
    list(_oai(gw).responses.create(model="demo-7b", input="hi", max_output_tokens=2, stream=True))
    msgs: Any = [{"role": "user", "content": "hi"}]
    list(_claude(gw).messages.create(model="demo-7b", max_tokens=2, messages=msgs, stream=True))


def _check_responses(r: Reader, expected: str) -> None:
    types = [e.type for e in r.events]
    assert types.count("response.created") == 1 and types[0] == "response.created"
    terminal = [t for t in types if t in ("response.completed", "response.incomplete",
                                          "response.failed", "error")]  # fmt: skip
    assert terminal == ["response.completed"] and types[-1] == "response.completed"
    seqs = [e.sequence_number for e in r.events]
    assert all(b > a for a, b in itertools.pairwise(seqs)), seqs
    rid = r.events[0].response.id
    done = r.events[-1].response
    assert done.id == rid
    item_ids = {e.item_id for e in r.events if hasattr(e, "item_id")}
    assert len(item_ids) == 1 and done.output[0].id in item_ids
    assert types.count("response.output_item.added") == 1
    assert done.output[0].content[0].text == expected
    assert done.usage.output_tokens == TOKENS


def _check_messages(r: Reader, expected: str) -> None:
    types = [e.type for e in r.events]
    assert types.count("message_start") == 1 and types[0] == "message_start"
    assert types.count("message_stop") == 1 and types[-1] == "message_stop"
    assert types.count("content_block_start") == 1 and types.count("content_block_stop") == 1
    assert {e.index for e in r.events if e.type.startswith("content_block")} == {0}
    delta = next(e for e in r.events if e.type == "message_delta")
    assert delta.usage.output_tokens == TOKENS
    assert delta.delta.stop_reason == "max_tokens"


def test_twenty_typed_streams_survive_two_sigkills(fleet: dict[str, Any]) -> None:
    """20 streams (10 Responses, 10 Messages), each broken twice by SIGKILL of its backend,
    arrive whole: the clients parse every event, the text is one sim's, one created/start,
    one terminal event, one id, sequence numbers strictly increasing; Messages streams went
    on through the chat endpoint."""
    gw, sims = fleet["gw"], fleet["sims"]
    # Asked at once: each answer is paced like a stream (3 s), one after another they took
    # a minute.
    with ThreadPoolExecutor(20) as pool:
        asked = {("responses", s): pool.submit(_expected_response, sims["c"], s) for s in range(10)}
        asked |= {("messages", s): pool.submit(_expected_message, sims["c"], s) for s in range(10)}
        expected = {k: f.result() for k, f in asked.items()}
    _warm_up(gw)
    readers = [Reader(api, gw, s) for api, s in expected]
    for r in readers:
        r.thread.start()
    kills: list[float] = []
    last_kill_wall = 0.0
    for at in (10, 50):
        wait_until(
            lambda at=at: all(len(r.arrivals) >= at or r.error for r in readers),
            timeout=20,
            what=f"every stream past {at} tokens",
        )
        assert all(len(r.arrivals) < TOKENS for r in readers), "a stream ended before the kill"
        victim = _serving(sims, readers)
        kills.append(time.monotonic())
        last_kill_wall = time.time()
        sims[victim].kill()
    for r in readers:
        r.thread.join(timeout=30)
        assert not r.thread.is_alive()
    for r in readers:
        assert r.error is None, (r.api, r.seed, repr(r.error))
        assert r.text == expected[(r.api, r.seed)], (r.api, r.seed)
        if r.api == "responses":
            _check_responses(r, r.text)
        else:
            _check_messages(r, r.text)
    # The Messages streams went on through the chat endpoint (continue_final_message, as
    # vLLM continues a text), never as a `/v1/messages` prefill (vLLM starts a new turn).
    (survivor,) = [s for s in sims.values() if s.alive()]
    since = {"since": str(last_kill_wall)}
    arrived = httpx.get(f"{survivor.url}/sim/requests", params=since, timeout=5).json()
    paths = [a["path"] for a in arrived["requests"]]
    assert sorted(set(paths)) == ["/v1/chat/completions", "/v1/responses"], paths
    assert paths.count("/v1/chat/completions") == 10, paths
    # The seam: the longest gap between text pieces after each kill, as the client sees it.
    seams = []
    for r in readers:
        for k in kills:
            after = [t for t in r.arrivals if t > k]
            before = max((t for t in r.arrivals if t <= k), default=k)
            if after:
                seams.append(max(after[0] - before, 0.0))
    seams.sort()
    p50, worst = statistics.median(seams), seams[-1]
    print(f"typed seam pause over {len(seams)} seams: p50 {p50 * 1000:.1f} ms, "
          f"max {worst * 1000:.1f} ms")  # fmt: skip
    assert len(seams) == 40
    metrics = httpx.get(f"{gw.url}/metrics", timeout=5).text
    assert "pulsegate_stream_resumes_total 40" in metrics


def test_unresumable_typed_streams_end_with_their_apis_error_event(
    fleet: dict[str, Any],
) -> None:
    """Structured output cannot be resumed: Responses ends with `response.failed`, Messages
    with Anthropic's `event: error` (the SDK raises it), never a silent stop."""
    gw, sims = fleet["gw"], fleet["sims"]
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}
    events: list[Any] = []
    with _oai(gw).responses.with_streaming_response.create(
        model="demo-7b", input=QUESTION, max_output_tokens=TOKENS, stream=True, text=fmt,  # type: ignore[arg-type]
    ) as raw:  # fmt: skip
        first = raw.headers["x-pulsegate-backend"]
        for ev in raw.parse():
            events.append(ev)
            if sum(e.type == "response.output_text.delta" for e in events) == 5:
                sims[first].kill()
    types = [e.type for e in events]
    assert types.count("response.created") == 1
    assert types[-1] == "response.failed" and "response.completed" not in types
    assert "structured output" in events[-1].response.error.message
    assert events[-1].sequence_number > events[-2].sequence_number

    gw.wait_state(first, "ejected")
    pieces = 0
    with (  # noqa: PT012 - the stream raises while it is read
        pytest.raises(anthropic.APIStatusError) as err,
        _claude(gw).messages.with_streaming_response.create(
            model="demo-7b", max_tokens=TOKENS, stream=True,
            messages=[{"role": "user", "content": QUESTION}],
            extra_body={"output_format": {"type": "json_schema", "schema": {}}},
        ) as mraw,
    ):  # fmt: skip
        home = mraw.headers["x-pulsegate-backend"]
        for ev in mraw.parse():
            if ev.type == "content_block_delta":
                pieces += 1
                if pieces == 5:
                    sims[home].kill()
    assert pieces >= 5
    assert "structured output" in str(err.value) and "api_error" in str(err.value)


def test_previous_response_id_sticks_to_its_backend_and_says_when_it_is_gone(
    fleet: dict[str, Any],
) -> None:
    """A response's follow-ups go to the backend that holds it (the others would 404); once
    that backend is gone the answer is 503 previous_response_unavailable, not a 404 from
    another backend."""
    gw, sims = fleet["gw"], fleet["sims"]
    client = _oai(gw)
    first = client.responses.with_raw_response.create(
        model="demo-7b", input=QUESTION, max_output_tokens=4
    )
    home, rid = first.headers["x-pulsegate-backend"], first.parse().id
    for i in range(6):
        nxt = client.responses.with_raw_response.create(
            model="demo-7b", input=f"and then {i}?", max_output_tokens=4, previous_response_id=rid
        )
        assert nxt.headers["x-pulsegate-backend"] == home
        rid = nxt.parse().id
    # Learned from a stream's response.created too.
    with client.responses.with_streaming_response.create(
        model="demo-7b", input="more", max_output_tokens=4, previous_response_id=rid, stream=True
    ) as raw:
        assert raw.headers["x-pulsegate-backend"] == home
        events = list(raw.parse())  # read whole: the engine stores a response once done
        rid = events[0].response.id
    follow = client.responses.with_raw_response.create(
        model="demo-7b", input="last", max_output_tokens=4, previous_response_id=rid
    )
    assert follow.headers["x-pulsegate-backend"] == home

    sims[home].kill()
    gw.wait_state(home, "ejected")
    with pytest.raises(openai.APIStatusError) as err:
        client.responses.create(
            model="demo-7b", input="gone?", max_output_tokens=4, previous_response_id=rid
        )
    assert err.value.status_code == 503
    body = err.value.body
    assert isinstance(body, dict) and body.get("code") == "previous_response_unavailable", body
    assert rid in str(body.get("message"))
