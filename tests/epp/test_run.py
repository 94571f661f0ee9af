"""`pulsegate epp` as a process: exit codes for a bad config and a taken port."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import yaml


def _epp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pulsegate", "epp", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_invalid_config_exits_2(tmp_path: Path) -> None:
    """A config that does not load: exit 2, the error named on stderr."""
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"backends": [{"name": "a"}]}))
    r = _epp("-c", str(path))
    assert r.returncode == 2
    assert "error:" in r.stderr and "url" in r.stderr


def test_taken_port_exits_1(tmp_path: Path) -> None:
    """The listen address already bound: exit 1, never a second picker on the port."""
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump({"backends": [{"name": "a", "url": "http://127.0.0.1:9"}]}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _epp("-c", str(path), "--listen", f"127.0.0.1:{port}")
    assert r.returncode == 1, r.stderr
    assert "cannot listen" in r.stderr
