"""Fixtures for the agent tests: start real `pulsegate agent` processes, stopped by PID."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support import Proc


@pytest.fixture
def start_agent(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """`start_agent(engine_url, *extra_args, listen=..., env=...)` -> a running agent process."""
    started: list[Proc] = []

    def start(
        engine: str, *extra: str, listen: str = "127.0.0.1:0", env: dict[str, str] | None = None
    ) -> Proc:
        n = len(started)
        proc = Proc(
            ["agent", "--engine", engine, "--listen", listen, *extra],
            tmp_path / f"agent-{n}.log",
            env=env,
        )
        started.append(proc)
        return proc

    yield start
    for proc in reversed(started):
        proc.stop()
