"""Config loading: typed defaults, every error named by its key path, CLI exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pulsegate.config import ConfigError, load_config, parse_config, parse_duration


def _errors(data: object) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        parse_config(data)
    return ei.value.errors


def test_minimal_config_gets_documented_defaults() -> None:
    """A config with one backend loads and carries design.md's defaults."""
    cfg = parse_config({"backends": [{"name": "a", "url": "http://127.0.0.1:9001"}]})
    assert cfg.backends[0].name == "a"
    assert cfg.probes.heartbeat.interval == pytest.approx(0.1)
    assert cfg.probes.heartbeat.timeout == pytest.approx(0.08)
    assert cfg.probes.canary.timeout == pytest.approx(0.35)
    assert cfg.health.weights.latency == pytest.approx(0.3)
    assert cfg.health.eject_below == 30 and cfg.health.rejoin_after == 5
    assert cfg.retry.max_attempts == 3


def test_design_example_config_is_valid() -> None:
    """The full example from design.md parses without error."""
    example = Path(__file__).parent.parent / "examples" / "gateway.yaml"
    cfg = load_config(example)
    assert cfg.gateway.port == 8080
    assert cfg.backends[0].agent == "127.0.0.1:50051"
    assert cfg.probes.micro_inference.jitter == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("value", "seconds"), [("100ms", 0.1), ("3s", 3.0), ("2m", 120.0), (5, 5.0), ("1.5s", 1.5)]
)
def test_durations(value: object, seconds: float) -> None:
    """Durations accept ms/s/m suffixes and bare numbers of seconds."""
    assert parse_duration(value) == pytest.approx(seconds)


def test_every_error_is_reported_with_its_key_path() -> None:
    """All problems come back at once, each naming where it is."""
    errs = _errors(
        {
            "backends": [
                {"name": "a", "url": "ftp://x"},
                {"url": "http://127.0.0.1:1"},
                {"name": "a", "url": "http://127.0.0.1:2", "wieght": 2},
            ],
            "probes": {"heartbeat": {"interval": "fast"}},
            "health": {"eject_bellow": 10, "weights": {"latency": -1}},
            "retry": {"max_attempts": 0},
        }
    )
    text = "\n".join(errs)
    assert "backends[0].url: must start with http://" in text
    assert "backends[1].name: is required" in text
    assert "backends[2].wieght: unknown key" in text
    assert "backends[2].name: duplicate of backends[0]" in text
    assert "probes.heartbeat.interval: must be a duration" in text
    assert "health.eject_bellow: unknown key" in text
    assert "health.weights.latency: must be >= 0.0" in text
    assert "retry.max_attempts: must be >= 1" in text


def test_contradictions_are_rejected() -> None:
    """Values that cannot work together are refused at load, naming the key."""
    errs = _errors(
        {
            "backends": [{"name": "a", "url": "http://127.0.0.1:1"}],
            "health": {"eject_below": 80, "rejoin_above": 70},
            "probes": {"heartbeat": {"interval": "100ms", "timeout": "1s"}},
        }
    )
    assert any(e.startswith("health.rejoin_above:") for e in errs)
    assert any(e.startswith("probes.heartbeat.timeout:") for e in errs)


def test_missing_backends_and_bad_yaml(tmp_path: Path) -> None:
    """No backends, or unparseable YAML, is a clear error with a location."""
    assert _errors({}) == ["backends: is required (a list of at least one backend)"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: [\n  - name: a\n  url: x")
    with pytest.raises(ConfigError) as ei:
        load_config(bad)
    assert "not valid YAML (line" in ei.value.errors[0]


def test_check_command_exit_codes(tmp_path: Path) -> None:
    """`pulsegate check` exits 0 on a good config and 2 listing each bad key otherwise."""
    good = tmp_path / "good.yaml"
    good.write_text("backends:\n  - {name: a, url: 'http://127.0.0.1:9001'}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends:\n  - {name: a, url: 'http://127.0.0.1:9001', zone: 3}\nfoo: 1\n")
    run = [sys.executable, "-m", "pulsegate", "check", "-c"]
    ok = subprocess.run([*run, str(good)], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    ko = subprocess.run([*run, str(bad)], capture_output=True, text=True, timeout=30)
    assert ko.returncode == 2
    assert "backends[0].zone: must be a string" in ko.stderr
    assert "foo: unknown key" in ko.stderr


def test_min_ready_accepts_a_number_or_a_per_model_mapping() -> None:
    """routing.min_ready is one number for all models, or a mapping with a default."""
    base = {"backends": [{"name": "a", "url": "http://127.0.0.1:1"}]}
    cfg = parse_config({**base, "routing": {"min_ready": 2}})
    assert cfg.routing.min_ready_for("any") == 2
    cfg = parse_config({**base, "routing": {"min_ready": {"default": 1, "big-70b": 3}}})
    assert cfg.routing.min_ready_for("big-70b") == 3
    assert cfg.routing.min_ready_for("small") == 1
    errs = _errors({**base, "routing": {"min_ready": {"big": -1}}})
    assert errs == ["routing.min_ready: big: must be a non-negative integer, got -1"]


def test_workers_need_the_pulsegate_mode() -> None:
    """Several proxy workers share the primary's verdicts; the baselines have none to share."""
    backends = [{"name": "a", "url": "http://127.0.0.1:9001", "models": ["m"]}]
    assert parse_config({"gateway": {"workers": 4}, "backends": backends}).gateway.workers == 4
    errors = _errors({"gateway": {"workers": 2, "mode": "polling"}, "backends": backends})
    assert errors == ["gateway.workers: must be 1 with gateway.mode 'polling'"]
