"""Shared fixtures: real simulated engines and a real gateway, stopped by PID afterwards."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from support import Gateway, Proc, Sim


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()


@pytest.fixture
def start_sim(tmp_path: Path, procs: list[Proc]) -> Callable[..., Sim]:
    def start(name: str, *extra: str, model: str = "demo-7b") -> Sim:
        sim = Sim(tmp_path, name, *extra, model=model)
        procs.append(sim)
        return sim

    return start


@pytest.fixture
def start_gateway(tmp_path: Path, procs: list[Proc]) -> Callable[..., Gateway]:
    def start(config: dict[str, Any], env: dict[str, str] | None = None) -> Gateway:
        gw = Gateway(tmp_path, config, env)
        procs.append(gw)
        return gw

    return start
