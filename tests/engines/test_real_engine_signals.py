"""Real signals: the probers and the agent read real engines, not the simulator.

vLLM publishes Prometheus gauges (`vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`) that the metrics prober maps to the backend's queue, running
and KV-cache signals; transformers serve has no /metrics, so those stay unknown (None),
never invented. Micro-inference and canary are answered by the real engines, and the node
agent runs beside a real vLLM.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_kit import MODEL, EnginePool, backend, gateway_config, record_figures

from support import Gateway, Proc, wait_until

# The first test of a session waits for the engines to start: minutes on a busy box.
pytestmark = pytest.mark.timeout(600)
ENGINE_SIGNALS = ("queue", "running", "kv_cache_usage")


def signals(gw: Gateway, name: str) -> dict[str, Any]:
    return gw.backends()[name]["signals"]  # type: ignore[no-any-return]


def test_vllm_metrics_become_backend_signals(
    pool: EnginePool, start_gateway: Callable[..., Gateway]
) -> None:
    """With `metrics_path: /metrics`, queue, running and KV-cache usage become known numbers
    for vLLM; transformers serve (no /metrics) leaves them unknown."""
    a, hf = pool.get("vllm-a"), pool.get("hf")
    gw = start_gateway(gateway_config(backend(a), backend(hf)))
    gw.wait_all_ready(timeout=60)

    def known() -> dict[str, Any] | None:
        s = signals(gw, "vllm-a")
        return s if all(s[k] is not None for k in ENGINE_SIGNALS) else None

    s = wait_until(
        known,
        timeout=15,
        what="vLLM engine signals",
    )
    assert s["queue"] == 0 and s["running"] == 0
    assert 0.0 <= s["kv_cache_usage"] <= 1.0
    assert all(signals(gw, "hf")[k] is None for k in ENGINE_SIGNALS)


def test_running_and_kv_cache_follow_real_load(
    pool: EnginePool, start_gateway: Callable[..., Gateway]
) -> None:
    """While eight long generations run on vLLM, the gateway sees running >= 1 and a KV cache
    that is in use; both fall back to zero when they end."""
    a = pool.get("vllm-a")
    gw = start_gateway(gateway_config(backend(a)))
    gw.wait_all_ready(timeout=60)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello world"}],
        "max_tokens": 1900,
        "temperature": 0,
    }

    def generate() -> None:
        httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=120)

    # ~15k tokens: 25 s of work at the ~600 tokens/s of a quiet box. Four of 1,500 were done
    # in ~5 s, when a scrape or two may time out on the busy engine and none saw them run.
    threads = [threading.Thread(target=generate) for _ in range(8)]
    for t in threads:
        t.start()
    seen: list[tuple[Any, Any]] = []

    def busy_now() -> dict[str, Any] | None:
        s = signals(gw, "vllm-a")
        seen.append((s["running"], s["kv_cache_usage"]))
        return s if s["running"] and s["kv_cache_usage"] else None

    try:
        busy = wait_until(
            busy_now, timeout=30, interval=0.05, what="running > 0 and KV cache in use"
        )
    except AssertionError as e:
        raise AssertionError(f"{e}; (running, kv) seen: {sorted(set(seen), key=str)}") from e
    finally:
        for t in threads:
            t.join()
    idle = wait_until(
        lambda: (s := signals(gw, "vllm-a"))["running"] == 0 and s["kv_cache_usage"] == 0 and s,
        timeout=15,
        what="running and KV cache back to 0",
    )
    record_figures(
        "vLLM engine signals under 8 long generations",
        {
            "busy running / kv_cache_usage": f"{busy['running']} / {busy['kv_cache_usage']:.5f}",
            "idle running / kv_cache_usage": f"{idle['running']} / {idle['kv_cache_usage']}",
        },
    )


def test_micro_inference_and_canary_probe_real_engines(
    pool: EnginePool, start_gateway: Callable[..., Gateway]
) -> None:
    """Both engines become ready only through a real micro-inference, and both answer the
    canary: its latency and the micro-inference's are measured, no probe fails."""
    a, hf = pool.get("vllm-a"), pool.get("hf")
    gw = start_gateway(gateway_config(backend(a), backend(hf)))
    gw.wait_all_ready(timeout=60)
    views = wait_until(
        lambda: (
            (v := gw.backends())
            and all(b["signals"]["canary_ms"] is not None for b in v.values())
            and v
        ),
        timeout=20,
        what="canary latency of both",
    )
    figures = {}
    for name, b in views.items():
        assert b["last_reason"] == "engine ready, micro-inference ok", b["last_reason"]
        s = b["signals"]
        assert s["micro_failures"] == 0 and s["canary_failures"] == 0, s
        assert s["latency_ms"] is not None
        figures[f"{name} micro / canary (ms)"] = f"{s['latency_ms']:.0f} / {s['canary_ms']:.0f}"
    record_figures("probes against real engines", figures)


@pytest.mark.timeout(300)
def test_agent_beside_real_vllm(
    pool: EnginePool, start_gateway: Callable[..., Gateway], tmp_path: Path, procs: list[Proc]
) -> None:
    """The node agent runs beside a real vLLM: heartbeats flow (RTT known, no misses), its
    micro-inference makes the backend ready, and vLLM's gauges arrive through it."""
    a = pool.get("vllm-a")
    agent = Proc(
        ["agent", "--engine", a.url, "--listen", "127.0.0.1:0", "--gpu", "none"],
        tmp_path / "agent.log",
    )
    procs.append(agent)
    gw = start_gateway(gateway_config(backend(a, agent=f"{agent.host}:{agent.port}")))
    gw.wait_all_ready(timeout=60)
    s = wait_until(
        lambda: (s := signals(gw, "vllm-a"))["rtt_ms"] is not None and s["queue"] is not None and s,
        timeout=15,
        what="heartbeat RTT and engine gauges",
    )
    assert s["heartbeat_misses"] == 0
    record_figures("agent beside vLLM", {"heartbeat rtt (ms)": s["rtt_ms"]})
