"""`pulsegate status`: the backends table, against a real gateway and against nothing."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable

import httpx
import pytest

from pulsegate.status import Snapshot, render, run_status
from support import Gateway, Sim, backend_entry, fast_probes, wait_until

TOKEN_ENV = "PULSEGATE_TEST_STATUS_TOKEN"
TOKEN = "status-test-token"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pulsegate", "status", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
    )


def test_unreachable_gateway_is_one_line_and_exit_1() -> None:
    """Nothing listening: a clear message on stderr, nothing on stdout, exit status 1."""
    r = _cli("--url", f"http://127.0.0.1:{_closed_port()}")
    assert r.returncode == 1
    assert r.stdout == ""
    assert "cannot reach the gateway at http://127.0.0.1:" in r.stderr
    assert "Traceback" not in r.stderr


def test_render_unknowns_and_panic() -> None:
    """Unknown numbers print as '-', never 0; panic mode is said above the table."""
    snap = Snapshot(
        backends=[
            {
                "name": "a",
                "zone": "z1",
                "state": "ejected",
                "score": 12.4,
                "weight": 0.0,
                "inflight": 0,
                "signals": {"rtt_ms": None, "latency_ms": 41.0, "gpu_free": None},
            }
        ],
        events=[
            {"id": 1, "ts": 990.0, "backend": "a", "from": "ready", "to": "ejected", "reason": "x"}
        ],
        summary=None,
        panic=True,
    )
    text = render("http://gw", snap, 1000.0, colour=False, width=200)
    lines = text.splitlines()
    assert lines[1].startswith("PANIC MODE")
    assert lines[2].split()[:3] == ["NAME", "ZONE", "STATE"]
    row = lines[3].split()
    assert row[:6] == ["a", "z1", "ejected", "12", "0.00", "41ms"]
    assert row[6:9] == ["-", "-", "-"]  # queue, VRAM, KV unknown
    assert lines[3].endswith("10s ago ready->ejected: x")


@pytest.mark.slow
def test_status_against_a_real_gateway(
    start_sim: Callable[..., Sim],
    start_gateway: Callable[..., Gateway],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Token refused -> exit 1; with it, every backend and its last event; --watch redraws."""
    sims = [start_sim("east-a"), start_sim("west-a")]
    gw = start_gateway(
        {
            "gateway": {"admin_token_env": TOKEN_ENV},
            "backends": [backend_entry(s, zone=f"{s.name}-z") for s in sims],
            "probes": fast_probes(),
        },
        env={TOKEN_ENV: TOKEN},
    )
    wait_until(
        lambda: all(b["state"] == "ready" for b in gw.backends(TOKEN).values()),
        timeout=20,
        what="all backends ready",
    )

    refused = _cli("--url", gw.url, "--token-env", "PULSEGATE_TEST_UNSET_TOKEN")
    assert refused.returncode == 1
    assert "admin token" in refused.stderr

    ok = _cli("--url", gw.url, "--token-env", TOKEN_ENV, env={TOKEN_ENV: TOKEN})
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert lines[0].startswith(f"pulsegate {gw.url}")
    assert lines[1].split()[:4] == ["NAME", "ZONE", "STATE", "SCORE"]
    rows = {ln.split()[0]: ln for ln in lines[2:]}
    assert set(rows) == {"east-a", "west-a"}
    assert rows["east-a"].split()[1:3] == ["east-a-z", "ready"]

    r = httpx.post(
        f"{gw.url}/admin/backends/west-a/eject",
        headers={"authorization": f"Bearer {TOKEN}"},
        timeout=5,
    )
    assert r.status_code == 200
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    out, err = io.StringIO(), io.StringIO()
    assert run_status(gw.url, watch=True, token_env=TOKEN_ENV, out=out, err=err, stop_after=2) == 0
    text = out.getvalue()
    assert text.count("refreshing every second") == 2
    west = [ln for ln in text.splitlines() if ln.startswith("west-a")][-1]
    assert " ejected " in west
    ev = httpx.get(
        f"{gw.url}/admin/events?backend=west-a",
        headers={"authorization": f"Bearer {TOKEN}"},
        timeout=5,
    ).json()["events"][-1]
    assert f"ready->ejected: {ev['reason']}" in west

    # --watch runs until Ctrl-C, which ends it quietly with status 0.
    args = ["status", "--url", gw.url, "--watch", "--token-env", TOKEN_ENV]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pulsegate", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, TOKEN_ENV: TOKEN},
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith(b"pulsegate ")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
