"""A gateway process that stands still (SIGSTOP: what CPU starvation, a container's CPU
quota or a debugger does to it) blames no backend for the time it was not running:
heartbeats, probes and a live stream all passed their deadlines meanwhile, on every
backend at once (docs/real-engines.md, findings 8 and 12; pulsegate.stall)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

from support import Gateway, Proc, Sim, backend_entry, fast_probes, sse_events, wait_until

PAUSE_S = 1.2
TOKENS = 120


def _metric(gw: Gateway, name: str) -> float:
    for line in httpx.get(f"{gw.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _failures(gw: Gateway) -> dict[str, float]:
    """Probe failures and heartbeat misses so far, by series."""
    out = {}
    for line in httpx.get(f"{gw.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(
            ("pulsegate_probe_failures_total{", "pulsegate_heartbeat_misses_total{")
        ):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _probe_counts(gw: Gateway) -> dict[str, float]:
    """Answered probes so far, by backend and kind (`pulsegate_probe_seconds_count`)."""
    out = {}
    for line in httpx.get(f"{gw.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("pulsegate_probe_seconds_count{"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_a_paused_gateway_blames_no_backend(
    start_sim: Callable[..., Sim],
    start_gateway: Callable[..., Gateway],
    tmp_path: Path,
    procs: list[Proc],
) -> None:
    # 100 ms to a first token: a micro-inference or canary is in flight much of the time,
    # so the pause catches some mid-way, as it would real engines (8-130 ms on CPU).
    sims = {n: start_sim(n, "--ttft-ms", "100", "--itl-ms", "20") for n in "ab"}
    agents = {}
    for n, sim in sims.items():
        agents[n] = Proc(
            ["agent", "--engine", sim.url, "--listen", "127.0.0.1:0", "--gpu", "engine"],
            tmp_path / f"agent-{n}.log",
        )
        procs.append(agents[n])
    gw = start_gateway(
        {
            "backends": [
                backend_entry(s, agent=f"127.0.0.1:{agents[n].port}") for n, s in sims.items()
            ],
            # Timeouts with room for a loaded two-core box: only the pause should matter.
            "probes": {**fast_probes(), "canary": {"interval": "1s", "timeout": "1s"}},
            "streaming": {"stall_timeout": "500ms"},
        }
    )
    gw.wait_all_ready()
    wait_until(
        lambda: all(b["signals"]["rtt_ms"] is not None for b in gw.backends().values()),
        timeout=10,
        what="heartbeats from both agents",
    )
    events_before = len(gw.events())
    failures_before = _failures(gw)

    # A 2.4 s stream (120 tokens, 20 ms apart); the gateway stops for 1.2 s in the middle:
    # longer than the stall timeout (0.5 s), the heartbeat's 3 misses (~0.3 s) and every
    # probe timeout in `fast_probes`.
    body = {
        "model": "demo-7b",
        "messages": [{"role": "user", "content": "tell a long story"}],
        "max_tokens": TOKENS,
        "stream": True,
    }
    pieces: list[str] = []
    errors: list[Any] = []
    done = threading.Event()
    started = threading.Event()

    def read() -> None:
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=30) as resp:
            for ev in sse_events(resp):
                data = ev.removeprefix(b"data: ")
                if data == b"[DONE]":
                    done.set()
                    continue
                obj = orjson.loads(data)
                if "error" in obj:
                    errors.append(obj)
                    continue
                for ch in obj["choices"]:
                    pieces.append(ch["delta"].get("content") or "")
                if len(pieces) >= 20:
                    started.set()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert started.wait(10), "the stream did not start"
        gw.signal(signal.SIGSTOP)
        time.sleep(PAUSE_S)  # the fault itself: how long the gateway stands still
        gw.signal(signal.SIGCONT)
    finally:
        gw.signal(signal.SIGCONT)
        reader.join(30)
    assert done.is_set() and not errors, errors
    assert _metric(gw, "pulsegate_stream_resumes_total") == 0  # not cut as "stalled"
    # The pause is measured, and operators can see it: at least the pause, about it.
    assert PAUSE_S - 0.1 <= _metric(gw, "pulsegate_event_loop_stall_seconds_total") < PAUSE_S + 1

    # A wrong verdict would come from the probes that were in flight during the pause, or
    # from those right after it: wait until two more rounds of each have been answered.
    after = _probe_counts(gw)
    wait_until(
        lambda: all(n >= after.get(k, 0) + 2 for k, n in _probe_counts(gw).items()),
        timeout=10,
        what="two more probe rounds of each kind on each backend",
    )
    views = gw.backends()
    assert all(v["state"] == "ready" for v in views.values()), {
        n: (v["state"], v["last_reason"]) for n, v in views.items()
    }
    new = gw.events()[events_before:]
    assert not [e for e in new if e.get("kind") == "transition"], new
    for name, v in views.items():
        s = v["signals"]
        assert s["micro_failures"] == 0 and s["canary_failures"] == 0, (name, s)
    assert _failures(gw) == failures_before
    log = gw.log_path.read_text()
    assert "event loop stood still for" in log
