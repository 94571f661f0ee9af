"""The chaos lab's baseline gateways behave like the simple systems they stand for."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from pulsegate.baselines import Baseline
from pulsegate.config import parse_config
from pulsegate.health.observations import Outcome, RequestResult
from support import Gateway, Sim, backend_entry


def _cfg(mode: str) -> Baseline:
    cfg = parse_config(
        {
            "gateway": {"mode": mode},
            "backends": [
                {"name": n, "url": f"http://127.0.0.1:{9000 + i}", "models": ["m"]}
                for i, n in enumerate("abc")
            ],
            "health": {"consecutive_failures": 3, "ejection_base": "10s"},
        }
    )
    return Baseline(mode, cfg)


def test_round_robin_ignores_health_and_skips_tried() -> None:
    """Round-robin visits every backend in turn, whatever happens to them."""
    b = _cfg("round_robin")
    fail = RequestResult(Outcome.HTTP_5XX)
    for _ in range(10):
        assert b.observe("a", fail, 0.0) == []
    picks = [b.pick("m", ()).name for _ in range(6)]  # type: ignore[union-attr]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    assert b.pick("m", ("a", "b", "c")) is None


def test_passive_ejects_after_consecutive_failures_then_returns() -> None:
    """Passive: N failures in a row eject for ejection_base x n, then the backend is back."""
    b = _cfg("passive")
    fail, ok = RequestResult(Outcome.HTTP_5XX), RequestResult(Outcome.OK)
    b.observe("a", fail, 0.0)
    b.observe("a", ok, 0.0)  # a success resets the streak
    assert [b.observe("a", fail, 1.0) for _ in range(2)] == [[], []]
    (ev,) = b.observe("a", fail, 1.0)
    assert ev.to_state == "ejected" and ev.cause == "consecutive_failures"
    assert all(b.pick("m", ()).name != "a" for _ in range(6))  # type: ignore[union-attr]
    assert b.tick(10.9) == []
    assert [e.to_state for e in b.tick(11.0)] == ["ready"]


def test_polling_needs_three_failed_polls() -> None:
    """Polling: 3 failed /health polls eject; one good poll brings the backend back."""
    b = _cfg("polling")
    assert b.poll("a", False, "timeout") == [] and b.poll("a", False, "timeout") == []
    (ev,) = b.poll("a", False, "timeout")
    assert ev.to_state == "ejected" and b.state("a") == "ejected"
    (back,) = b.poll("a", True, "")
    assert back.to_state == "ready"


def test_baseline_mode_needs_configured_models() -> None:
    """A baseline mode has no probes to discover models, so models are required."""
    import pytest

    from pulsegate.config import ConfigError

    with pytest.raises(ConfigError) as ei:
        parse_config(
            {"gateway": {"mode": "polling"}, "backends": [{"name": "a", "url": "http://x"}]}
        )
    assert "backends[0].models: required when gateway.mode is polling" in ei.value.errors[0]


def test_passive_gateway_ejects_on_real_traffic(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """A real gateway in passive mode serves at once (no probes) and ejects a 500ing engine."""
    sims = [start_sim(n) for n in ("a", "b")]
    gw = start_gateway(
        {"gateway": {"mode": "passive"}, "backends": [backend_entry(s) for s in sims]}
    )
    sims[1].fault("error", rate=1.0)
    body = {"model": "demo-7b", "messages": [{"role": "user", "content": "x"}]}
    codes = [
        httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=10).status_code
        for _ in range(12)
    ]
    assert codes == [200] * 12  # retried on a
    assert gw.backends()["b"]["state"] == "ejected"
    assert any(e["backend"] == "b" and e["to"] == "ejected" for e in gw.events())
