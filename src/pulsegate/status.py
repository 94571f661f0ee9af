"""`pulsegate status`: the dashboard's facts as a terminal table.

One request each to `/admin/backends`, `/admin/events` and (when the gateway has it)
`/admin/summary`; `--watch` redraws every second until Ctrl-C. An unreachable gateway, or a
refused admin token, is one clear line on stderr and exit status 1. Unknown values print as
"-", never as 0. States are coloured when stdout is a terminal and NO_COLOR is not set.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import aiohttp
import orjson

from pulsegate import clock

DASH = "-"
TIMEOUT_S = 3.0
WATCH_INTERVAL_S = 1.0

_COLOURS = {
    "ready": "32",  # green
    "degraded": "33",  # yellow
    "probation": "36",  # cyan
    "ejected": "31;1",  # bold red
    "warming": "35",  # magenta
    "cold": "2",  # dim
    "drained": "2",
}


class StatusError(Exception):
    """The gateway could not be asked: unreachable, refused, or answered nonsense."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    backends: list[dict[str, Any]]
    events: list[dict[str, Any]]
    summary: dict[str, Any] | None
    panic: bool


# -- fetching -----------------------------------------------------------------------------


async def _get(session: aiohttp.ClientSession, base: str, path: str, optional: bool = False) -> Any:
    url = base + path
    try:
        async with session.get(url) as r:
            if r.status == 401:
                raise StatusError(f"{base} refused the admin token (HTTP 401)")
            if r.status == 404 and optional:
                return None
            if r.status != 200:
                raise StatusError(f"GET {url} answered HTTP {r.status}")
            return await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        raise StatusError(f"cannot reach the gateway at {base}: {_describe(e)}") from None
    except ValueError as e:
        raise StatusError(f"GET {url} did not answer JSON: {e}") from None


def _describe(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return f"no answer within {TIMEOUT_S:g}s"
    if isinstance(e, aiohttp.ClientConnectorError):
        if isinstance(e.os_error, ConnectionRefusedError):
            return "connection refused (is `pulsegate serve` running there?)"
        return e.os_error.strerror or str(e.os_error)
    return str(e) or type(e).__name__


async def fetch(session: aiohttp.ClientSession, base: str) -> Snapshot:
    """Ask the gateway for backends, recent events and (if it has one) its summary."""
    backends, events, summary = await asyncio.gather(
        _get(session, base, "/admin/backends"),
        _get(session, base, "/admin/events?limit=500"),
        _get(session, base, "/admin/summary", optional=True),
    )
    if not isinstance(backends, dict) or not isinstance(backends.get("backends"), list):
        raise StatusError(f"{base}/admin/backends is not a pulsegate admin answer")
    return Snapshot(
        backends=backends["backends"],
        events=list(events.get("events", [])) if isinstance(events, dict) else [],
        summary=summary if isinstance(summary, dict) else None,
        panic=bool(backends.get("panic")) or bool(summary and summary.get("panic")),
    )


# -- formatting ---------------------------------------------------------------------------


def _num(v: object) -> float | None:
    """A finite number, or None for unknown (null, NaN, or not a number at all)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if f == f else None


def fmt_num(v: object, digits: int = 0) -> str:
    f = _num(v)
    return DASH if f is None else f"{f:.{digits}f}"


def fmt_ms(v: object) -> str:
    f = _num(v)
    if f is None:
        return DASH
    if f >= 1000.0:
        return f"{f / 1000.0:.2f}s"
    return f"{f:.1f}ms" if f < 10.0 else f"{f:.0f}ms"


def fmt_pct(v: object) -> str:
    f = _num(v)
    return DASH if f is None else f"{f * 100.0:.0f}%"


def fmt_vram(sig: dict[str, Any]) -> str:
    free = _num(sig.get("gpu_free"))
    if free is None:
        return DASH
    total = _num(sig.get("gpu_total_mb"))
    if total is not None:
        return f"{free * 100.0:.0f}% {free * total / 1024.0:.1f}G"
    return fmt_pct(free)


def fmt_queue(sig: dict[str, Any]) -> str:
    q, running = sig.get("queue"), sig.get("running")
    if _num(q) is None:
        return DASH
    return fmt_num(q) if _num(running) is None else f"{fmt_num(q)}/{fmt_num(running)}"


def fmt_event(ev: dict[str, Any] | None, now: float) -> str:
    if ev is None:
        return DASH
    ts = _num(ev.get("ts"))
    age = max(0.0, now - (now if ts is None else ts))
    text = f"{ev.get('from', '?')}->{ev.get('to', '?')}"
    if ev.get("reason"):
        text += f": {ev['reason']}"
    return f"{_ago(age)} ago {text}"


def _ago(sec: float) -> str:
    if sec < 60:
        return f"{sec:.0f}s"
    if sec < 3600:
        return f"{sec // 60:.0f}m{sec % 60:02.0f}s"
    return f"{sec // 3600:.0f}h{(sec % 3600) // 60:02.0f}m"


COLUMNS = (
    "NAME",
    "ZONE",
    "STATE",
    "SCORE",
    "WEIGHT",
    "RTT",
    "QUEUE",
    "VRAM FREE",
    "KV",
    "INFL",
    "LAST EVENT",
)


def rows(snap: Snapshot, now: float) -> list[list[str]]:
    """One row of cells per backend, in the gateway's order."""
    last: dict[str, dict[str, Any]] = {}
    for ev in snap.events:
        name = ev.get("backend")
        if isinstance(name, str):
            last[name] = ev  # events come oldest first
    out = []
    for b in snap.backends:
        sig = b.get("signals") or {}
        rtt = sig.get("rtt_ms") if _num(sig.get("rtt_ms")) is not None else sig.get("latency_ms")
        out.append(
            [
                str(b.get("name", "?")),
                str(b.get("zone") or DASH),
                str(b.get("state", "?")),
                fmt_num(b.get("score") if b.get("score_known", True) else None),
                fmt_num(b.get("weight"), 2),
                fmt_ms(rtt),
                fmt_queue(sig),
                fmt_vram(sig),
                fmt_pct(sig.get("kv_cache_usage")),
                fmt_num(b.get("inflight")),
                fmt_event(last.get(str(b.get("name"))), now),
            ]
        )
    return out


def header(url: str, snap: Snapshot) -> str:
    s = snap.summary
    parts = [f"pulsegate {url}", f"{len(snap.backends)} backend(s)"]
    if s is not None:
        rps = s.get("requests_per_s")
        parts.append(f"{fmt_num(rps, 1)} req/s")
        parts.append(f"errors {fmt_pct(s.get('error_rate'))}")
        parts.append(f"retries {fmt_num(s.get('retries_total'))}")
        parts.append(f"resumes {fmt_num(s.get('resumes_total'))}")
    return "  ".join(parts)


def render(url: str, snap: Snapshot, now: float, colour: bool, width: int) -> str:
    """The whole screen: a header line, a PANIC line when in panic mode, the table."""
    table = [list(COLUMNS), *rows(snap, now)]
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS) - 1)]
    lines = [header(url, snap)]
    if snap.panic:
        lines.append(
            _paint("PANIC MODE: routing to every backend that is not dead", "31;1", colour)
        )
    for i, r in enumerate(table):
        cells = [
            c.ljust(w) if j < 3 else c.rjust(w)
            for j, (c, w) in enumerate(zip(r, widths, strict=False))
        ]
        line = "  ".join(cells) + "  " + r[-1]
        if len(line) > width:
            line = line[: max(0, width - 1)] + "…"
        if i > 0 and colour:
            state = r[2]
            start = sum(w + 2 for w in widths[:2])
            line = (
                line[:start]
                + _paint(state.ljust(widths[2]), _COLOURS.get(state), True)
                + (line[start + widths[2] :])
            )
        lines.append(line)
    if not snap.backends:
        lines.append("(no backends configured)")
    return "\n".join(lines)


def _paint(text: str, code: str | None, colour: bool) -> str:
    return f"\x1b[{code}m{text}\x1b[0m" if colour and code else text


# -- the command --------------------------------------------------------------------------


def _use_colour(out: TextIO) -> bool:
    return out.isatty() and "NO_COLOR" not in os.environ


async def _run(
    url: str,
    watch: bool,
    token: str | None,
    out: TextIO,
    err: TextIO,
    stop_after: int | None,
    wall: Callable[[], float],
) -> int:
    base = url.rstrip("/")
    headers = {"authorization": f"Bearer {token}"} if token else {}
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    colour = _use_colour(out)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        try:
            snap = await fetch(session, base)
        except StatusError as e:
            print(f"pulsegate status: {e}", file=err)
            return 1
        width = shutil.get_terminal_size((160, 24)).columns if out.isatty() else 10_000
        screen = render(base, snap, wall(), colour, width)
        if not watch:
            print(screen, file=out)
            return 0
        # Ctrl-C / SIGTERM end the watch quietly with status 0: handled on the loop itself
        # rather than through KeyboardInterrupt, which can land mid-request.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
        shown = 0
        while not stop.is_set():
            width = shutil.get_terminal_size((160, 24)).columns if out.isatty() else 10_000
            clear = "\x1b[H\x1b[2J" if out.isatty() else ""
            stamp = time.strftime("%H:%M:%S", time.localtime(wall()))
            out.write(f"{clear}{screen}\n(refreshing every second, Ctrl-C quits; {stamp})\n")
            out.flush()
            shown += 1
            if stop_after is not None and shown >= stop_after:
                return 0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WATCH_INTERVAL_S):
                    await stop.wait()
            if stop.is_set():
                break
            try:
                snap = await fetch(session, base)
                screen = render(base, snap, wall(), colour, width)
            except StatusError as e:
                # Keep the last table on screen and say the gateway stopped answering.
                screen = render(base, snap, wall(), colour, width) + f"\n!! {e}; retrying"
        out.write("\n")
        return 0


def run_status(
    url: str,
    watch: bool = False,
    token_env: str | None = "PULSEGATE_ADMIN_TOKEN",
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    stop_after: int | None = None,
) -> int:
    """Print the backends table (once, or every second with `watch`); 1 if unreachable."""
    token = os.environ.get(token_env) if token_env else None
    try:
        return asyncio.run(
            _run(
                url,
                watch,
                token or None,
                out or sys.stdout,
                err or sys.stderr,
                stop_after,
                clock.wall,
            )
        )
    except KeyboardInterrupt:
        with contextlib.suppress(Exception):
            (out or sys.stdout).write("\n")
        return 0


async def _reload(url: str, token: str | None, out: TextIO, err: TextIO) -> int:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    target = url.rstrip("/") + "/admin/reload"
    try:
        async with (
            aiohttp.ClientSession(headers=headers, timeout=timeout) as session,
            session.post(target) as r,
        ):
            body = await r.read()
            status = r.status
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        print(f"pulsegate reload: {target}: {type(e).__name__}: {e}", file=err)
        return 1
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict) or "ok" not in doc:
        print(f"pulsegate reload: {target} answered {status}: {body[:200]!r}", file=err)
        return 1
    if not doc["ok"]:
        for problem in doc.get("errors", []):
            print(f"error: {problem}", file=err)
        print("pulsegate reload: refused; the running config stays in force", file=err)
        return 2
    parts = [f"{k}: {', '.join(doc[k])}" for k in ("added", "removed", "restarted") if doc[k]]
    if doc.get("needs_replace"):
        parts.append(f"needs serve --replace: {', '.join(doc['needs_replace'])}")
    what = f" ({'; '.join(parts)})" if parts else ""
    print(f"reloaded in {doc['pause_ms']} ms{what}", file=out)
    return 0


def run_reload(
    url: str,
    token_env: str | None = "PULSEGATE_ADMIN_TOKEN",
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """`pulsegate reload`: POST /admin/reload. 0 applied, 2 refused (errors printed), 1 the
    gateway did not answer."""
    token = os.environ.get(token_env) if token_env else None
    return asyncio.run(_reload(url, token or None, out or sys.stdout, err or sys.stderr))
