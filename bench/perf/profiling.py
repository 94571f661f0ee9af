"""Where pulsegate's CPU per request goes: perf(1) for the split, py-spy for the Python part.

Two samplers, each under its own load window, because neither alone is right here:

- **py-spy** (`record --format raw`: one `root;...;leaf count` line per stack) names the
  Python code, but samples a thread whenever it is not sleeping: on a 2-core box running
  wrk, engines and the proxy, a thread that is runnable but has lost its CPU (typically just
  after a send() woke its peer, or just after epoll returned) counts too. Measured: py-spy
  saw the gateway "busy" 78% of a window in which /proc charged it 43% of a core.
- **perf** `-e cpu-clock` samples only while the process is on a CPU, so its split by
  shared object is the true CPU split: kernel (syscalls, loopback TCP), uvloop's C loop,
  and everything else (the CPython interpreter plus the C extensions it calls: aiohttp's
  parser and writer, multidict, yarl, orjson), which is what py-spy can break down.

So py-spy samples are split in two: those whose leaf is the line handing bytes to the
transport, or the event loop itself (no request frame below `Runner.run`), are the kernel and
uvloop part and are dropped; the rest, the Python part, are given to ONE category each by
walking from the leaf towards the root to the first frame that decides (a pulsegate module,
an aiohttp client or server module; `http_writer`, `streams`, `helpers`, multidict, yarl and
asyncio decide nothing, so their work is charged to whoever called them); a leaf on a line
that calls orjson is JSON. Each category's microseconds = its share of the Python samples x
the Python share of CPU (perf) x the CPU per request (/proc).
"""

from __future__ import annotations

import linecache
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?):(?P<line>\d+)\)$")
_CLIENT = ("client.py", "client_reqrep.py", "connector.py", "client_proto.py")
_SERVER = (
    "web_protocol.py",
    "web_request.py",
    "web_response.py",
    "web_app.py",
    "web_urldispatcher.py",
    "web_server.py",
    "web_middlewares.py",
)
_LOOP_ENTRY = ("Runner.run", "run_until_complete", "run_forever", "BaseEventLoop._run_once")

KERNEL = "kernel: syscalls, loopback TCP, scheduler (perf)"
UVLOOP = "uvloop C event loop (perf)"


# ---------------------------------------------------------------------------------- samplers


def _binary(name: str) -> str | None:
    venv = Path(sys.executable).parent / name
    return str(venv) if venv.exists() else shutil.which(name)


def have_perf() -> bool:
    return _binary("perf") is not None


def start_pyspy(pid: int, seconds: float, out: Path, rate: int) -> subprocess.Popen[bytes]:
    binary = _binary("py-spy")
    if binary is None:
        raise RuntimeError("py-spy not found: .venv/bin/pip install py-spy")
    cmd = [binary, "record", "--pid", str(pid), "-d", str(int(seconds)), "-r", str(rate)]
    cmd += ["--format", "raw", "-o", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def start_perf(pid: int, seconds: float, out: Path, rate: int) -> subprocess.Popen[bytes]:
    binary = _binary("perf")
    if binary is None:
        raise RuntimeError("perf not found (Debian: linux-perf)")
    cmd = [binary, "record", "-e", "cpu-clock", "-F", str(rate), "-p", str(pid)]
    cmd += ["-o", str(out), "--", "sleep", str(seconds)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def perf_split(data: Path) -> dict[str, Any]:
    """Share of on-CPU samples (0..1): kernel, uvloop, and the rest (Python + C extensions)."""
    binary = _binary("perf") or "perf"
    cmd = [binary, "report", "-i", str(data), "--no-children", "--sort", "dso", "-g", "none"]
    out = subprocess.run([*cmd, "--stdio"], capture_output=True, text=True, timeout=120).stdout
    split: dict[str, Any] = {"kernel": 0.0, "uvloop": 0.0, "python": 0.0}
    dsos: dict[str, float] = {}
    for line in out.splitlines():
        m = re.match(r"^\s+([\d.]+)%\s+(\S+)", line)
        if not m:
            continue
        share, dso = float(m[1]) / 100.0, m[2]
        dsos[dso] = share
        if dso.startswith("[kernel") or dso == "[vdso]":
            split["kernel"] += share
        elif dso.startswith("loop.cpython"):
            split["uvloop"] += share
        else:
            split["python"] += share
    split["dsos"] = dsos
    return split


# ---------------------------------------------------------------------------------- py-spy


def _frames(stack: str) -> list[tuple[str, str, int]]:
    out = []
    for raw in stack.split(";"):
        m = _FRAME.match(raw)
        out.append((m["func"], m["file"], int(m["line"])) if m else (raw, "", 0))
    # Frames from the entry point down to the event loop are not the request's.
    for i in range(len(out) - 1, -1, -1):
        if out[i][0] in _LOOP_ENTRY:
            return out[i + 1 :]
    return out


# A transport's write: the send() syscall (perf's kernel share), not Python.
_SEND = re.compile(r"\b(?:transport|t)\.write(?:lines)?\(")


def _source(file: str, line: int, roots: list[Path]) -> str:
    for root in roots:
        text = linecache.getline(str(root / file), line)
        if text:
            return text
    return ""


def _decide(func: str, file: str) -> str | None:
    if "pulsegate/" in file:
        if "/health/" in file or func == "HealthService.report":
            return "health core: observe/score (per request)"
        if file.endswith(("balancer.py", "proxy/route.py")):
            return "balancer pick"
        if file.endswith("observe/metrics.py"):
            return "metrics (counters, histograms)"
        if "/probers/" in file or "/observe/" in file:
            return "probers, scrape, alerts (background)"
        if file.endswith(("proxy/client_conn.py", "/conn_guard.py")):
            return "HTTP server (lean: proxy/client_conn.py, conn_guard.py)"
        if file.endswith(("proxy/upstream.py", "proxy/upstream_conn.py")):
            return "upstream client (proxy/upstream.py, httptools)"
        if file.endswith(("proxy/sse.py", "proxy/resume.py")):
            return "SSE parse and usage tracking"
        if func in ("HealthService._tick_loop", "ProxyState.watch_first_bytes"):
            return "health tick / first-byte watch (background)"
        return "pulsegate handler (proxy/*)"
    base = file.rsplit("/", 1)[-1]
    if file.startswith("aiohttp") or "aiohttp/" in file:
        if base in _CLIENT:
            return "upstream client (aiohttp ClientSession)"
        if base in _SERVER:
            return "HTTP server (aiohttp web: parse, dispatch, respond)"
    return None


def categorize(path: Path, roots: list[Path]) -> dict[str, Any]:
    """Python-part categories (shares of the Python samples), inclusive top functions."""
    cats: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = python = 0
    for row in path.read_text().splitlines():
        stack, _, count = row.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = _frames(stack)
        for name in {f"{func} ({file.rsplit('/', 1)[-1]})" for func, file, _ in frames}:
            incl[name] += n
        if not frames:
            continue  # the event loop itself
        func, file, line = frames[-1]
        leaves[f"{func} ({file}:{line})"] += n
        src = _source(file, line, roots)
        if _SEND.search(src):
            continue  # the send() syscall
        python += n
        if "orjson." in src:
            cats["JSON (orjson loads/dumps)"] += n
            continue
        for func, file, _ in reversed(frames):
            cat = _decide(func, file)
            if cat is not None:
                cats[cat] += n
                break
        else:
            cats["other Python (asyncio, helpers)"] += n
    return {
        "samples": total,
        "python_samples": python,
        "categories": {k: v / max(1, python) for k, v in cats.most_common()},
        "inclusive": [(k, v / max(1, total)) for k, v in incl.most_common(20)],
        "leaves": [(k, v / max(1, total)) for k, v in leaves.most_common(15)],
    }


def breakdown(spy: dict[str, Any], split: dict[str, Any] | None) -> list[tuple[str, float]]:
    """(where, share of CPU): perf's kernel and uvloop shares, py-spy's Python categories
    scaled to perf's Python share. Without perf, py-spy's own ratio of Python samples."""
    if split is not None:
        python = split["python"]
        rows = [(KERNEL, split["kernel"]), (UVLOOP, split["uvloop"])]
    else:
        python = spy["python_samples"] / max(1, spy["samples"])
        rows = [("send() + event loop (py-spy, includes time waiting for a CPU)", 1 - python)]
    rows += [(k, v * python) for k, v in spy["categories"].items()]
    return sorted(rows, key=lambda r: -r[1])


def render(kind: str, prof: dict[str, Any]) -> str:
    per, unit = prof["cpu_us_per_unit"], prof["unit"]
    src = "perf + py-spy" if prof.get("perf") else "py-spy only (perf missing)"
    lines = [
        f"Profile ({kind}, {src}): {per:.0f} µs CPU per {unit} (/proc), {prof['load_desc']}",
        "",
        f"| where | share of CPU | µs per {unit} |",
        "|---|---:|---:|",
    ]
    for where, share in prof["breakdown"]:
        lines.append(f"| {where} | {share:.1%} | {share * per:.1f} |")
    lines += ["", "| function (inclusive, py-spy) | share of samples |", "|---|---:|"]
    for k, v in prof["pyspy"]["inclusive"][:12]:
        lines.append(f"| `{k}` | {v:.1%} |")
    return "\n".join(lines)
