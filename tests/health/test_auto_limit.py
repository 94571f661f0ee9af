"""`max_inflight: auto`: the gateway's per-backend limit follows the engine's batch capacity."""

from __future__ import annotations

import random

import pytest

from pulsegate.config import (
    MAX_INFLIGHT_AUTO,
    BackendConfig,
    ConfigError,
    HealthConfig,
    ProbesConfig,
    parse_config,
)
from pulsegate.health.auto_limit import AutoLimit
from pulsegate.health.fleet import Fleet
from pulsegate.health.observations import EngineFacts, Heartbeat

from .harness import MICRO_OK, READY


def _fleet(limit: int) -> Fleet:
    cfg = BackendConfig(name="a", url="http://a", models=("m",), max_inflight=limit)
    fleet = Fleet([cfg], HealthConfig(), ProbesConfig(), random.Random(1), 0.0)
    fleet.observe("a", READY, 0.0)
    fleet.observe("a", MICRO_OK, 0.0)
    return fleet


def _limit(fleet: Fleet) -> int:
    (v,) = fleet.routable("m")
    return v.max_inflight


def test_reported_capacity_is_the_limit() -> None:
    fleet = _fleet(MAX_INFLIGHT_AUTO)
    assert _limit(fleet) == 0  # unknown: no limit yet, never a made-up one
    fleet.observe("a", EngineFacts(capacity=16, running=3, queue_waiting=0), 1.0)
    assert _limit(fleet) == 16
    fleet.observe("a", EngineFacts(capacity=32), 2.0)
    assert _limit(fleet) == 32


def test_capacity_learned_from_a_full_batch() -> None:
    """vLLM exports no batch size: requests running while others wait is a full batch."""
    fleet = _fleet(MAX_INFLIGHT_AUTO)
    fleet.observe("a", EngineFacts(running=5, queue_waiting=0), 1.0)
    assert _limit(fleet) == 0, "a batch with nobody waiting says nothing of the capacity"
    fleet.observe("a", EngineFacts(running=12, queue_waiting=4), 2.0)
    assert _limit(fleet) == 12
    fleet.observe("a", EngineFacts(running=7, queue_waiting=2), 3.0)
    assert _limit(fleet) == 12, "a smaller full batch (KV cache pressure) keeps the larger"
    hb = Heartbeat(0.001, EngineFacts(running=20, queue_waiting=1))
    fleet.observe("a", hb, 4.0)
    assert _limit(fleet) == 20, "the agent's facts count too"


def test_a_fixed_limit_ignores_the_engine() -> None:
    fleet = _fleet(8)
    fleet.observe("a", EngineFacts(capacity=64, running=30, queue_waiting=9), 1.0)
    assert _limit(fleet) == 8


def test_config_accepts_auto_and_names_the_key() -> None:
    base = {"url": "http://127.0.0.1:1", "models": ["m"]}
    cfg = parse_config({"backends": [{"name": "a", **base, "max_inflight": "auto"}]})
    assert cfg.backends[0].max_inflight == MAX_INFLIGHT_AUTO
    with pytest.raises(ConfigError) as e:
        parse_config({"backends": [{"name": "a", **base, "max_inflight": "lots"}]})
    assert "backends[0].max_inflight" in str(e.value) and "'auto'" in str(e.value)


def test_auto_limit_unit() -> None:
    """AutoLimit: fixed limits never move; `auto` reports a change only when it learns one."""
    fixed = AutoLimit(8)
    assert fixed.value == 8
    assert not fixed.learn(EngineFacts(capacity=64))
    auto = AutoLimit(MAX_INFLIGHT_AUTO)
    assert auto.value == 0
    assert auto.learn(EngineFacts(running=4, queue_waiting=1))
    assert not auto.learn(EngineFacts(running=4, queue_waiting=1))
    assert not auto.learn(EngineFacts(running=3, queue_waiting=5))
    assert auto.learn(EngineFacts(capacity=2)) and auto.value == 2
