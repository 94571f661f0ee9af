"""A crashed lab leaves namespaces, a root link, a guard route and processes behind;
`python -m chaos.cleanup` (which every lab runs first) removes exactly those."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import chaos.netlab as netlab
import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _leftovers() -> list[str]:
    out = []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    out += [n.split()[0] for n in names.splitlines() if n.startswith(f"{netlab.PREFIX}-")]
    link = subprocess.run(["ip", "link", "show", netlab.ROOT_LINK], capture_output=True)
    if link.returncode == 0:
        out.append(netlab.ROOT_LINK)
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    out += [r for r in routes.splitlines() if "10.200.1" in r]
    return out


def test_cleanup_removes_a_crashed_lab(chaos_ready: None) -> None:
    """Namespaces, the uplink, per-backend routes and a process inside a namespace all go."""
    lock = netlab.Lock()
    if not lock.acquire(wait=30):
        pytest.skip("another chaos lab is running")
    sleeper = None
    try:
        netlab.cleanup()
        guard_before = "blackhole" in netlab.sh("ip", "route", "show", netlab.GUARD).stdout
        netlab.build(2)  # and then "crash": no cleanup
        sleeper = subprocess.Popen(["ip", "netns", "exec", netlab.backend_ns(0), "sleep", "300"])
        assert _leftovers(), "the lab was not built"
    finally:
        lock.release()
    r = subprocess.run([sys.executable, "-m", "chaos.cleanup"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert sleeper.wait(timeout=10) != 0  # killed
    assert _leftovers() == []
    guard_after = "blackhole" in netlab.sh("ip", "route", "show", netlab.GUARD).stdout
    assert guard_after == guard_before  # ours removed, someone else's kept
    again = subprocess.run([sys.executable, "-m", "chaos.cleanup"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert "nothing to clean up" in again.stdout
