"""Cross-key config checks (pulsegate.config.validate): pure, on typed sections, no YAML."""

from __future__ import annotations

from dataclasses import replace

from pulsegate.config import (
    BackendConfig,
    CanaryConfig,
    Config,
    GatewayConfig,
    HealthConfig,
    HeartbeatConfig,
    MicroInferenceConfig,
    ProbesConfig,
    WeightsConfig,
)
from pulsegate.config.validate import (
    backend_problems,
    gateway_problems,
    health_problems,
    mode_problems,
    probes_problems,
    weights_problems,
)


def test_defaults_have_no_problems() -> None:
    """The documented defaults contradict nothing."""
    cfg = Config(backends=(BackendConfig("a", "http://a", models=("m",)),))
    assert backend_problems(cfg.backends) == []
    assert gateway_problems(cfg.gateway) == []
    assert probes_problems(cfg.probes) == []
    assert weights_problems(cfg.health.weights) == []
    assert health_problems(cfg.health) == []
    assert mode_problems(cfg) == []


def test_keys_are_relative_to_their_section() -> None:
    """Each problem names its key below the section it was read from, for the loader to prefix."""
    probes = ProbesConfig(
        heartbeat=HeartbeatConfig(interval=0.1, timeout=0.5, misses_to_dead=3),
        micro_inference=MicroInferenceConfig(interval=1.0, timeout=2.0),
        canary=CanaryConfig(interval=1.0, timeout=2.0),
    )
    assert [k for k, _ in probes_problems(probes)] == [
        "heartbeat.timeout",
        "micro_inference.timeout",
        "canary.timeout",
    ]
    health = HealthConfig(eject_below=50.0, rejoin_above=50.0, ejection_base=10.0, ejection_max=5.0)
    assert [k for k, _ in health_problems(health)] == ["rejoin_above", "ejection_max"]
    assert weights_problems(WeightsConfig(0.0, 0.0, 0.0, 0.0)) == [
        ("weights", "at least one weight must be positive")
    ]
    assert gateway_problems(GatewayConfig(workers=2, mode="polling")) == [
        ("workers", "must be 1 with gateway.mode 'polling'")
    ]


def test_backend_checks_name_every_offender_from_the_root() -> None:
    """Each duplicate points at the first backend of its name; baseline modes need models."""
    a, b = BackendConfig("a", "http://a"), BackendConfig("b", "http://b", models=("m",))
    assert backend_problems([a, b, a, a]) == [
        ("backends[2].name", "duplicate of backends[0] (a)"),
        ("backends[3].name", "duplicate of backends[0] (a)"),
    ]
    cfg = Config(backends=(a, b), gateway=GatewayConfig(mode="round_robin"))
    assert [k for k, _ in mode_problems(cfg)] == ["backends[0].models"]
    assert mode_problems(replace(cfg, gateway=GatewayConfig())) == []
