"""`pulsegate demo --replicas 3`: three replicas sharing one redis-server, through a fault."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from replicas.redis_server import REDIS


@pytest.mark.slow
@pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (.ci/run installs it)")
def test_replicas_demo_serves_through_a_fault() -> None:
    """A fault injected and lifted within the run: every replica together, serving, none failed,
    and a peer's ejection seen on a replica that did not probe the backend itself."""
    r = subprocess.run(
        [sys.executable, "-m", "pulsegate", "demo", "--replicas", "3", "--port", "0",
         "--duration", "12", "--fault-after", "3", "--fault-hold", "5", "--no-agents"],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-2000:]
    assert "--- injecting fault into east-b" in out
    for rid in ("r0", "r1", "r2"):
        assert f"[{rid}] together with r0, r1, r2" in out, out[-3000:]
        m = re.search(rf"pulsegate demo: \[{rid}\] (\d+) requests ok, (\d+) failed", out)
        assert m and int(m.group(1)) > 0 and m.group(2) == "0", out[-3000:]
    # east-b answers 500 to everything: its prober's replica ejects it, the others hear it.
    assert re.search(r"\[r\d\] heard from r\d: east-b ", out), out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("pulsegate demo: ") and last.endswith(" 0 failed"), last


def test_replicas_demo_says_when_redis_server_is_missing() -> None:
    """Without redis-server on PATH: exit 2 and a sentence naming it, nothing started."""
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}
    r = subprocess.run(
        [sys.executable, "-m", "pulsegate", "demo", "--replicas", "3", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "redis-server is not on PATH" in r.stdout
