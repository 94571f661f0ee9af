"""Fixtures of the proxy tests: third-party engine stand-ins, stopped by PID afterwards."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from script_engines import ScriptEngine


@pytest.fixture
def start_engine() -> Iterator[Callable[..., ScriptEngine]]:
    started: list[ScriptEngine] = []

    def start(script: Path, *args: str) -> ScriptEngine:
        e = ScriptEngine(script, *args)
        started.append(e)
        return e

    yield start
    for e in reversed(started):
        e.stop()
