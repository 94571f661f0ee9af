"""The chaos lab's CI subset: real namespaces, real faults, as root; skipped cleanly elsewhere.

Everything here needs root and `ip netns` (network namespaces, iptables in a namespace); on a
machine without them every test is skipped with the reason. On a fresh Debian machine run as
root, iptables and nftables are installed with apt when missing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import chaos.netlab as netlab  # noqa: E402
from chaos.lab import Lab  # noqa: E402


def lab_unavailable() -> str | None:
    """Why these tests cannot run here (None: they can); installs missing tools as root."""
    try:
        netlab.ensure_tools()
    except Exception as e:  # apt itself failed: say so instead of erroring
        return f"cannot install iptables/nftables: {e}"
    return netlab.why_unavailable()


@pytest.fixture(scope="session")
def chaos_ready() -> None:
    """Skip (with the reason) where the lab cannot run."""
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def lab(chaos_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """Three backends (engine + agent, each in its own namespace) behind the router."""
    lab = Lab(3, tmp_path_factory.mktemp("chaos"))
    try:
        lab.open()
    except netlab.LabError as e:
        lab.close()
        if "another chaos lab" in str(e):
            pytest.skip(str(e))
        raise
    yield lab
    lab.close()
