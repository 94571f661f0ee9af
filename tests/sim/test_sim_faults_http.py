"""Runtime fault injection through /sim/fault on a real sim process, and /sim/stats."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
import openai
import orjson
import pytest

from pulsegate.sim.text import generate

if TYPE_CHECKING:
    from conftest import SimProc

SHORT = 0.4  # s: long enough for a healthy fast-sim answer (~25 ms), short for a hang


def _post(sim: SimProc, body: dict[str, object], timeout: float = 5.0) -> httpx.Response:
    return httpx.post(f"{sim.url}/v1/completions", json=body, timeout=timeout)


def _inflight(sim: SimProc) -> int:
    return int(sim.stats()["inflight"])


async def _wait_for(pred: Callable[[], object], within: float = 5.0) -> None:
    """Poll a cheap local condition with a deadline."""
    deadline = time.monotonic() + within
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def _until_inflight(c: httpx.AsyncClient, n: int, within: float = 5.0) -> None:
    """Poll /sim/stats until exactly ``n`` requests are in flight on the engine."""
    deadline = time.monotonic() + within
    while (await c.get("/sim/stats")).json()["inflight"] != n:
        assert time.monotonic() < deadline, f"inflight never reached {n}"
        await asyncio.sleep(0.02)


def _read_stream(sim: SimProc, body: dict[str, object], into: bytearray) -> None:
    with httpx.stream("POST", f"{sim.url}/v1/completions", json=body, timeout=5) as r:
        for chunk in r.iter_raw():
            into.extend(chunk)


def test_fault_validation_and_get(sim: SimProc) -> None:
    """Unknown modes, bad parameters and bad JSON are 400s; GET shows the current fault."""
    url = f"{sim.url}/sim/fault"
    r = httpx.post(url, json={"mode": "melt"}, timeout=5)
    assert r.status_code == 400 and "unknown mode 'melt'" in r.json()["error"]["message"]
    r = httpx.post(url, json={"mode": "error", "rate": 2}, timeout=5)
    assert r.status_code == 400 and "'rate' must be in [0, 1]" in r.json()["error"]["message"]
    r = httpx.post(url, json={"mode": "stall", "factor": 2}, timeout=5)
    assert r.status_code == 400 and "allowed: after_tokens" in r.json()["error"]["message"]
    assert httpx.post(url, content=b"{", timeout=5).status_code == 400
    assert httpx.get(url, timeout=5).json()["mode"] == "none"
    set_ = sim.fault("stall", after_tokens=3).json()
    assert set_["mode"] == "stall" and set_["after_tokens"] == 3
    assert httpx.get(url, timeout=5).json()["after_tokens"] == 3


def test_error_mode_rate(sim: SimProc) -> None:
    """rate 1 answers every inference 500 (OpenAI-shaped); rate 0 none; /health stays 200."""
    sim.fault("error")
    r = _post(sim, {"prompt": "x"})
    assert r.status_code == 500 and r.json()["error"]["code"] == 500
    with pytest.raises(openai.InternalServerError):
        openai.OpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0).completions.create(
            model="demo-7b", prompt="x"
        )
    assert httpx.get(f"{sim.url}/health", timeout=5).status_code == 200
    sim.fault("error", rate=0.0)
    assert _post(sim, {"prompt": "x"}).status_code == 200


async def test_hang_then_lift_completes_the_request(sim: SimProc) -> None:
    """`hang` holds requests and /health; after `none` the held request completes normally."""
    sim.fault("hang")
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as c:
        held = asyncio.create_task(c.post("/v1/completions", json={"prompt": "h i"}))
        await _until_inflight(c, 1)
        with pytest.raises(httpx.ReadTimeout):
            await c.get("/health", timeout=SHORT)
        assert not held.done()
        sim.fault("none")
        r = await asyncio.wait_for(held, 5)
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == "".join(generate("h i", 0, 16))


async def test_hung_request_released_into_new_fault_gets_it(sim: SimProc) -> None:
    """A hung request re-evaluates on change: switching hang -> error answers it 500."""
    sim.fault("cuda_hang")
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as c:
        held = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x"}))
        await _until_inflight(c, 1)
        sim.fault("error")
        assert (await asyncio.wait_for(held, 5)).status_code == 500


def test_client_disconnect_frees_hung_request(sim: SimProc) -> None:
    """A client that gives up on a hung request leaves nothing in flight on the engine."""
    sim.fault("hang")
    with pytest.raises(httpx.ReadTimeout):
        _post(sim, {"prompt": "x"}, timeout=SHORT)
    deadline = time.monotonic() + 5
    while _inflight(sim) != 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_cuda_hang_keeps_health_and_metrics(sim: SimProc) -> None:
    """`cuda_hang`: /health 200, /metrics and /v1/models answer, inference hangs."""
    sim.fault("cuda_hang")
    assert httpx.get(f"{sim.url}/health", timeout=SHORT).status_code == 200
    assert httpx.get(f"{sim.url}/metrics", timeout=SHORT).status_code == 200
    assert httpx.get(f"{sim.url}/v1/models", timeout=SHORT).json()["data"]
    with pytest.raises(httpx.ReadTimeout):
        _post(sim, {"prompt": "x", "stream": True}, timeout=SHORT)
    sim.fault("none")
    assert _post(sim, {"prompt": "x"}).status_code == 200


async def test_stall_stops_stream_mid_way_and_lift_finishes_it(sim: SimProc) -> None:
    """`stall`: a stream sends after_tokens tokens then nothing (still open); lift resumes."""
    sim.fault("stall", after_tokens=3)
    body = {"prompt": "s t", "max_tokens": 8, "stream": True}
    got = bytearray()

    async def read(c: httpx.AsyncClient) -> None:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            async for chunk in r.aiter_raw():
                got.extend(chunk)

    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as c:
        task = asyncio.create_task(read(c))
        await _wait_for(lambda: got.count(b"data: ") == 3)
        await asyncio.sleep(SHORT)  # proving silence needs a quiet interval
        assert got.count(b"data: ") == 3 and not task.done()
        sim.fault("none")
        await asyncio.wait_for(task, 5)
    events = bytes(got)[:-2].split(b"\n\n")
    texts = [orjson.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert texts == generate("s t", 0, 8) and events[-1] == b"data: [DONE]"


def test_stall_hangs_non_stream(sim: SimProc) -> None:
    """`stall`: non-streaming requests hang."""
    sim.fault("stall", after_tokens=3)
    with pytest.raises(httpx.ReadTimeout):
        _post(sim, {"prompt": "x", "max_tokens": 2}, timeout=SHORT)


def test_slow_multiplies_latency(sim: SimProc) -> None:
    """`slow` factor 10: 5 ms TTFT + 19 x 1 ms ITL (24 ms) becomes 240 ms."""
    # Two prompts no other test sends: a prefix-cache hit would cut the second TTFT to 30%.
    body = {"prompt": "a prompt no other test sends", "max_tokens": 20}
    t0 = time.monotonic()
    _post(sim, body)
    normal = time.monotonic() - t0
    sim.fault("slow", factor=10)
    t0 = time.monotonic()
    assert _post(sim, {**body, "prompt": "another prompt nobody sends"}).status_code == 200
    slow = time.monotonic() - t0
    assert slow >= 0.23 and normal < slow  # 10 ms slack: uvloop's clock ticks in ms


def test_oom_zeroes_free_vram_and_fails_requests(sim: SimProc) -> None:
    """`oom`: DCGM free VRAM 0, inference 500 'CUDA out of memory'; lifting restores both."""
    gpu = '{gpu="0",modelName="NVIDIA H100 80GB HBM3"}'
    sim.fault("oom")
    assert sim.metrics()[f"DCGM_FI_DEV_FB_FREE{gpu}"] == 0
    r = _post(sim, {"prompt": "x"})
    assert r.status_code == 500 and "CUDA out of memory" in r.json()["error"]["message"]
    sim.fault("none")
    assert sim.metrics()[f"DCGM_FI_DEV_FB_FREE{gpu}"] > 0
    assert _post(sim, {"prompt": "x"}).status_code == 200


def test_warming_ends_by_itself(sim: SimProc) -> None:
    """`warming`: /health 503, no models, inference 503; ready again after `seconds`."""
    # 3 s: long enough that the three checks below land inside it on a loaded machine.
    sim.fault("warming", seconds=3)
    assert httpx.get(f"{sim.url}/health", timeout=5).status_code == 503
    assert httpx.get(f"{sim.url}/v1/models", timeout=5).json()["data"] == []
    assert _post(sim, {"prompt": "x"}).status_code == 503
    deadline = time.monotonic() + 15
    while httpx.get(f"{sim.url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert httpx.get(f"{sim.url}/sim/fault", timeout=5).json()["mode"] == "none"
    assert _post(sim, {"prompt": "x"}).status_code == 200


def test_blackhole_swallows_only_large_requests(sim: SimProc) -> None:
    """`blackhole`: bodies over over_bytes are never answered (but counted); small ones work."""
    sim.fault("blackhole", over_bytes=1024)
    assert _post(sim, {"prompt": "small"}).status_code == 200
    before = sim.stats()["client_requests_total"]
    with pytest.raises(httpx.ReadTimeout):
        _post(sim, {"prompt": "big " * 600}, timeout=SHORT)
    assert sim.stats()["client_requests_total"] == before + 1
    sim.fault("none")
    assert _post(sim, {"prompt": "big " * 600}).status_code == 200


def test_reset_before_and_after_tokens(sim: SimProc) -> None:
    """`reset`: the connection is cut at once, or after after_tokens stream tokens."""
    sim.fault("reset")
    with pytest.raises(httpx.TransportError):
        _post(sim, {"prompt": "x"})
    sim.fault("reset", after_tokens=2)
    got = bytearray()
    with pytest.raises(httpx.TransportError):
        _read_stream(sim, {"prompt": "x", "stream": True, "max_tokens": 10}, got)
    assert got.count(b"data: ") == 2 and b"[DONE]" not in got
    sim.fault("none")
    assert _post(sim, {"prompt": "x"}).status_code == 200


def test_stats_count_probes_apart(sim: SimProc) -> None:
    """Requests with x-pulsegate-probe count as probes; only client ones move the clock."""
    s0 = sim.stats()
    t0 = time.time()
    for _ in range(2):
        _post(sim, {"prompt": "c"})
    for _ in range(3):
        httpx.post(
            f"{sim.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "p"}], "max_tokens": 1},
            headers={"x-pulsegate-probe": "micro"},
            timeout=5,
        )
    s1 = sim.stats()
    assert s1["requests_total"] == s0["requests_total"] + 5
    assert s1["client_requests_total"] == s0["client_requests_total"] + 2
    assert s1["probe_requests_total"] == s0["probe_requests_total"] + 3
    assert t0 <= s1["last_client_request_wall"] <= time.time()
    assert (s1["name"], s1["inflight"], s1["waiting"]) == ("fast", 0, 0)
    recent = httpx.get(f"{sim.url}/sim/requests", params={"since": t0}, timeout=5).json()
    assert [r["path"] for r in recent["requests"]] == ["/v1/completions"] * 2
    assert httpx.get(f"{sim.url}/sim/requests?since=x", timeout=5).status_code == 400


async def test_shutdown_does_not_wait_for_hung_requests(
    sim_factory: Callable[..., SimProc],
) -> None:
    """SIGTERM with requests hung by a fault exits 0 at once: 503, or a cut stream."""
    sp = sim_factory(name="shut")
    sp.fault("stall", after_tokens=1)
    got = bytearray()

    async def stream(c: httpx.AsyncClient) -> None:
        body = {"prompt": "x", "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            async for chunk in r.aiter_raw():
                got.extend(chunk)

    async with httpx.AsyncClient(base_url=sp.url, timeout=10) as c:
        held = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x"}))
        cut = asyncio.create_task(stream(c))
        await _until_inflight(c, 2)
        await _wait_for(lambda: got.count(b"data: ") == 1)
        t0 = time.monotonic()
        sp.proc.send_signal(signal.SIGTERM)
        assert (await asyncio.wait_for(held, 5)).status_code == 503
        with pytest.raises(httpx.TransportError):
            await asyncio.wait_for(cut, 5)
    assert await asyncio.to_thread(sp.proc.wait, 5) == 0
    assert time.monotonic() - t0 < 3
    assert b"[DONE]" not in got
