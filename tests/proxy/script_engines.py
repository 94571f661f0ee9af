"""Third-party engine stand-ins (hf_like_engine.py, vllm_like_engine.py, stale_engine.py)
as processes.

Each serves with `serve` below, which prints `... listening on 127.0.0.1:PORT` once it
listens; `ScriptEngine` starts one and stops it by its PID.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

from aiohttp import web

HERE = Path(__file__).parent
HF_LIKE = HERE / "hf_like_engine.py"
VLLM_LIKE = HERE / "vllm_like_engine.py"
STALE = HERE / "stale_engine.py"


def serve(app: web.Application, label: str) -> None:
    """In a stand-in's process: serve `app` on a free loopback port until signalled."""

    async def run() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print(f"{label} listening on 127.0.0.1:{port}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        sys.exit(0)


class ScriptEngine:
    def __init__(self, script: Path, *args: str) -> None:
        self.popen = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE)
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline().decode()
        if "listening on" not in line:
            self.stop()
            raise RuntimeError(f"{script.name} did not start: {line!r}")
        self.url = "http://" + line.rsplit(" ", 1)[-1].strip()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(timeout=10)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.popen.stdout is not None:
            self.popen.stdout.close()
