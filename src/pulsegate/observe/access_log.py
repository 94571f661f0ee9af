"""The access log: one JSON line per client request, written off the request path.

`gateway.access_log: stdout | PATH` (default off). `AccessLog.record` is a `Recorder`: when
a request ends it encodes the `Exchange` as one line (4-8 us of CPU on the 2-core test
box) and appends it to a list; the event loop never waits on the disk. A background task
takes the list every FLUSH_S and hands it to the log's own writer thread, which writes it
with one `write()` (so a slow disk, a full pipe or an NFS hiccup stalls that thread, not
the proxy). Lines recorded while
a write is still in progress wait in the list, up to MAX_PENDING; beyond that a line is
dropped and counted (`pulsegate_access_log_dropped_total`), as are the lines of a write
that failed (disk full). Whatever is pending is written at shutdown.

What a line holds (never a client key, a header or a body):

    {"time": "2026-12-01T14:26:36.123Z", "key": "team-a", "model": "demo-7b",
     "api": "chat", "path": "/v1/chat/completions", "stream": true, "status": 200,
     "error": null, "backend": "b", "attempts": [{"backend": "a", "status": 503,
     "outcome": "overloaded", "ms": 1.9}, {"backend": "b", "status": 200, "outcome": "ok",
     "ms": 812.4}], "retries": 1, "resumes": 0, "hedges": 0, "ttft_ms": 35.2,
     "tokens_in": 12, "tokens_out": 200, "duration_ms": 815.0}

`time` is the arrival (RFC 3339, UTC, milliseconds); `ms` and `duration_ms` are measured on
the gateway's monotonic clock; `key` is the client key's name (`auth:`), never the key;
`trace_id` is added when the request was traced (`observability.otlp_endpoint`).

Rotation: SIGUSR1 (nginx's convention: logrotate's `postrotate kill -USR1 PID`) and every
reload (SIGHUP) reopen PATH, so after `mv access.log access.log.1` the next lines go to a
new `access.log`. The file is opened O_APPEND: with `gateway.workers: N` every worker opens
it itself and appends its own lines, and since each write() is of whole lines and an
O_APPEND write to a local file is atomic (the kernel holds the file's lock for the whole
write and moves the offset to the end first), lines of two workers never interleave
mid-line. `stdout` is usually a pipe, where a write is atomic only up to PIPE_BUF (4096
bytes): there each write carries whole lines and at most 4096 bytes, so the same holds
for lines under 4 KiB (a line is ~400 bytes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import select
import time
from typing import Any

import orjson

from pulsegate.observe.metrics import Counter
from pulsegate.proxy.exchange import Exchange

log = logging.getLogger("pulsegate.access_log")

STDOUT = "stdout"
# How often the pending lines are written: at most 100 ms of lines are lost to a SIGKILL
# (a graceful stop writes them all), and at 5,000 requests/s one write carries ~200 KB.
FLUSH_S = 0.1
# Lines kept while the disk is slow (~4 MB at ~400 bytes a line: 2 s at 5,000 requests/s).
MAX_PENDING = 10_000
_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
_MODE = 0o640  # the log names clients' key names and models: not world-readable


class AccessLog:
    """One process's access log: `record` on the loop, writes in one writer thread."""

    def __init__(self, target: str, dropped: Counter, *, max_pending: int = MAX_PENDING) -> None:
        self.target = target
        self.dropped = dropped
        self.max_pending = max_pending
        self._pending: list[bytes] = []
        self._fd = 1 if target == STDOUT else os.open(target, _FLAGS, _MODE)
        # One thread: writes and reopens run in order, never two at once.
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "access-log")
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self._second = -1
        self._stamp = ""

    # -- the request path ------------------------------------------------------------------

    def record(self, ex: Exchange) -> None:
        pending = self._pending
        if len(pending) >= self.max_pending:
            self.dropped.inc()
            return
        pending.append(self.line(ex))

    def line(self, ex: Exchange) -> bytes:
        """The exchange as one JSON line (this runs on the loop for every request)."""
        end = ex.end
        attempts = []
        retries = -1
        for a in ex.attempts:
            d = {
                "backend": a.backend,
                "status": a.status,
                "outcome": a.outcome or None,
                "ms": int(((a.end or end) - a.start) * 10_000 + 0.5) / 10,
            }
            if a.resume:
                d["resume"] = True
            else:
                retries += 1
            attempts.append(d)
        ttft = ex.ttft
        doc: dict[str, Any] = {
            "time": self._time(ex.wall),
            "key": ex.key,
            "model": ex.model,
            "api": ex.api,
            "path": ex.path,
            "stream": ex.stream,
            "status": ex.status,
            "error": ex.error,
            "backend": ex.backends[-1] if ex.backends else None,
            "attempts": attempts,
            "retries": max(retries, 0),
            "resumes": ex.resumes,
            "hedges": ex.hedges,
            "ttft_ms": None if ttft is None else int(ttft * 10_000 + 0.5) / 10,
            "tokens_in": ex.tokens_in,
            "tokens_out": ex.tokens_out,
            "duration_ms": int((end - ex.start) * 10_000 + 0.5) / 10,
        }
        if ex.trace is not None:
            doc["trace_id"] = f"{getattr(ex.trace, 'trace_id', 0):032x}"
        return orjson.dumps(doc, option=orjson.OPT_APPEND_NEWLINE)

    def _time(self, wall: float) -> str:
        """RFC 3339 UTC with milliseconds; the part up to the second is made once a second."""
        sec = int(wall)
        if sec != self._second:
            self._second = sec
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
        return f"{self._stamp}.{int((wall - sec) * 1000):03d}Z"

    # -- the background side ---------------------------------------------------------------

    def start(self) -> None:
        """Start the flush task (on the running loop); the caller keeps `AccessLog`, which
        keeps the task."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="access-log")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(FLUSH_S)
            if self._pending:
                await self._flush(loop)

    async def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        lost = await loop.run_in_executor(self._writer, self._write, self._take())
        if lost:
            self.dropped.inc(amount=lost)  # on the loop: the registry has no locks

    def _take(self) -> list[bytes]:
        lines, self._pending = self._pending, []
        return lines

    def reopen(self, target: str | None = None) -> None:
        """Reopen PATH (after a rotation), or move to `target` (a reload changed it), in
        order with the writes: lines recorded before go to the old file."""
        if target is None and self.target == STDOUT:
            return
        self._writer.submit(self._reopen, target or self.target)

    def _reopen(self, target: str) -> None:
        """Writer thread: the new file first; on failure the old one stays in use."""
        try:
            fd = 1 if target == STDOUT else os.open(target, _FLAGS, _MODE)
        except OSError as e:
            log.warning(
                "cannot open access log %s: %s; still writing %s", target, e.strerror, self.target
            )
            return
        old, self._fd = self._fd, fd
        if self.target != STDOUT:
            os.close(old)
        self.target = target

    def _write(self, lines: list[bytes]) -> int:
        """Writer thread: `lines` in one write (a file) or in writes of whole lines of at
        most PIPE_BUF bytes (stdout, a pipe others may share); returns the lines lost."""
        chunks = [b"".join(lines)] if self.target != STDOUT else _pipe_chunks(lines)
        done = 0
        try:
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    n = os.write(self._fd, view)
                    view = view[n:]
                done += chunk.count(b"\n")
        except OSError as e:
            lost = len(lines) - done
            if not self._failing:
                log.warning(
                    "access log %s: write failed (%s): %d line(s) lost",
                    self.target,
                    e.strerror,
                    lost,
                )
            self._failing = True
            return lost
        if self._failing:
            log.info("access log %s: writing again", self.target)
            self._failing = False
        return 0

    async def close(self) -> None:
        """Stop the flush task, write what is pending, close the file."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        loop = asyncio.get_running_loop()
        if self._pending:
            await self._flush(loop)
        await loop.run_in_executor(self._writer, self._close)
        self._writer.shutdown(wait=False)

    def _close(self) -> None:
        if self.target != STDOUT:  # read here: a queued move may have changed it
            os.close(self._fd)


def _pipe_chunks(lines: list[bytes]) -> list[bytes]:
    """Whole lines, grouped into chunks of at most PIPE_BUF bytes (a longer line alone)."""
    out: list[bytes] = []
    group: list[bytes] = []
    size = 0
    for ln in lines:
        if size + len(ln) > select.PIPE_BUF and group:
            out.append(b"".join(group))
            group, size = [], 0
        group.append(ln)
        size += len(ln)
    if group:
        out.append(b"".join(group))
    return out


__all__ = ["FLUSH_S", "MAX_PENDING", "STDOUT", "AccessLog"]
