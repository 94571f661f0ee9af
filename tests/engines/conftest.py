"""Real engines for the engine suite: vLLM and transformers serve, started once per session.

The suite runs only with ``PULSEGATE_ENGINES=1`` (``make test-engines``): without it nothing
here is collected, so the everyday ``pytest`` never needs the engines' venvs (4.6 GB) or
their start-up time. Venvs and the tiny model come from ``scripts/engines.py setup``.

Engines are shared by the whole session (a vLLM takes 30-50 s to start): `pool` starts
transformers serve and two vLLMs at once, in the background, and `pool.get(name)` waits for
one. A test that kills or stops an engine leaves it so; the next `get` starts it again on
the same port. Gateways are per test or per module (about a second each) and are stopped by
PID like every other process. Engine logs go to build/engine-logs/.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("PULSEGATE_ENGINES") != "1":
    collect_ignore_glob = ["test_*.py"]
else:
    from engine_kit import LOG_DIR, EnginePool, eng, write_figures

    @pytest.fixture(scope="session")
    def pool() -> Iterator[EnginePool]:
        for kind in ("hf", "vllm"):
            if not eng.venv_ready(kind):
                pytest.fail(f"{eng.venv_dir(kind)} missing: run `python scripts/engines.py setup`")
        shutil.rmtree(LOG_DIR, ignore_errors=True)
        p = EnginePool(LOG_DIR)

        def terminated(signum: int, frame: object) -> None:
            # CI bounds the run with `timeout`, which sends SIGTERM: engines run in sessions
            # of their own, so stop them here or they outlive the run (3 GB per vLLM).
            p.stop_all()
            raise KeyboardInterrupt("SIGTERM")

        previous = signal.signal(signal.SIGTERM, terminated)
        try:
            for name in ("hf", "vllm-a", "vllm-b"):
                p.spawn(name)
            yield p
        finally:
            p.stop_all()
            signal.signal(signal.SIGTERM, previous)

    @pytest.fixture
    def tmp_path(request: pytest.FixtureRequest, pool: EnginePool) -> Path:
        """Per-test files (gateway and agent logs) under build/engine-logs/, kept after the
        run: /tmp/pytest-of-* keeps only the last three runs of anyone on the machine."""
        d = LOG_DIR / re.sub(r"[^\w.-]+", "_", request.node.name)[:80]
        d.mkdir(parents=True, exist_ok=True)
        return d

    def pytest_terminal_summary(terminalreporter: Any) -> None:
        write_figures(terminalreporter)
