"""The primary of a multi-worker gateway: the health core, once, and its proxy workers.

`pulsegate serve` with `gateway.workers: N > 1` runs this process: config, the Fleet,
probers, heartbeat clients, events, alerts, admin actions and the metrics registry, as a
single-process gateway has them, but no client traffic. It reserves the gateway's port (a
bound, non-listening SO_REUSEPORT socket, which also resolves port 0), starts N workers
that listen on it, and serves admin, metrics and the dashboard on a private Unix socket
the workers relay to.

Per worker slot a task spawns the worker, sends it `Hello`, then reads its channel:
outcomes are fed to the health core exactly as the proxy would in one process, stats are
summed into the registry. Every change of the fleet's verdicts is exported and sent to
every worker on the loop's next turn (coalesced), ejections also as an `Ejected` notice
right after. A worker that exits unasked is logged, recorded as an event and replaced;
its in-flight row is cleared and its counts stay in the totals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from pulsegate import replace, runtime
from pulsegate.app import build_app
from pulsegate.clock import Clock, SystemClock
from pulsegate.cluster.channel import (
    ChannelClosed,
    Ejected,
    Hello,
    Outcomes,
    Ready,
    Reload,
    Stats,
    Stop,
    ViewUpdate,
    encode,
    receive,
    send,
    send_frame,
    unpack,
)
from pulsegate.cluster.metrics import MetricsMerge
from pulsegate.cluster.mirror import export
from pulsegate.cluster.shared import InflightTable, Totals
from pulsegate.config import Config
from pulsegate.control.service import HealthService
from pulsegate.health.events import Transition
from pulsegate.health.fleet import Reconfigured
from pulsegate.observe.metrics import Registry
from pulsegate.proxy.metrics import ProxyMetrics, proxy_gauges
from pulsegate.reload import Reloader, admin_route
from pulsegate.runtime import TaskSet

log = logging.getLogger("pulsegate.primary")

# How often the fleet's version is checked for changes not caused by an observation or an
# admin action (the health tick's evaluations), and how often a view is sent regardless
# (the usual TTFT drifts without moving the version).
PUBLISH_POLL_S = 0.05
PUBLISH_EVERY_S = 1.0
START_TIMEOUT_S = 30.0
# A worker that dies within this long of starting is restarted after a growing pause
# (0.1 s doubling to 5 s) rather than at once: a crash loop must not spin.
STABLE_AFTER_S = 10.0
RESTART_MIN_S = 0.1
RESTART_MAX_S = 5.0
KILL_AFTER_S = 5.0  # past the shutdown grace, a worker still running is killed


@dataclass
class Slot:
    index: int
    proc: asyncio.subprocess.Process | None = None
    writer: asyncio.StreamWriter | None = None
    pid: int = 0
    started: float = 0.0
    restarts: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    requests: int = 0
    queue_depth: int = 0
    view_lag_s: float = 0.0


class Primary:
    """The health side of a multi-process gateway: the health service, the workers' summed
    proxy metrics and their in-flight totals; what the admin API and dashboard read."""

    def __init__(self, config: Config, clock: Clock, table: InflightTable) -> None:
        self.config = config
        self.clock = clock
        self.registry = Registry()
        self.proxy_metrics = ProxyMetrics(self.registry)
        self.health = HealthService(config, clock, random.Random(), self.registry)
        self.inflight: Mapping[str, int] = Totals(table)
        self._names = tuple(b.name for b in config.backends)
        self.cluster: Supervisor | None = None
        proxy_gauges(self.registry, self.inflight, self._queue_depth)
        self.tasks = TaskSet("primary")

    def _queue_depth(self) -> int:
        return sum(s.queue_depth for s in self.cluster.slots) if self.cluster else 0

    def names(self) -> Sequence[str]:
        return self._names

    def backend_view(self, name: str) -> dict[str, Any]:
        return self.health.backend_view(name, self.inflight.get(name, 0))

    def apply(self, cfg: Config) -> Reconfigured:
        """A reload: the in-flight table gets columns for new backends, the health service
        takes `cfg`, and every worker is told (`Reload`), then sent the new verdicts."""
        if self.cluster is None:
            raise ValueError("the workers are not started yet")
        cols = self.cluster.table.assign([b.name for b in cfg.backends])  # TableFull: refused
        self.config = cfg
        change = self.health.apply(cfg)
        self._names = tuple(b.name for b in cfg.backends)  # `inflight` follows the table
        # Columns and config first: a worker must have a backend's cell before a view
        # lets it pick that backend (frames arrive in order).
        self.cluster.reload(cfg, cols)
        self.cluster.publish(force=True)
        return change

    def connect(self, sup: Supervisor) -> None:
        """Every change of the verdicts goes to the workers: the new verdicts first, so cut
        attempts pick again right, then each ejection."""
        self.cluster = sup
        self.health.on_change.append(sup.changed)
        self.health.on_transitions.append(sup.on_transitions)


class Supervisor:
    """Starts, feeds, listens to and replaces the proxy workers."""

    def __init__(self, gw: Primary, table: InflightTable, port: int, admin_socket: str) -> None:
        self.gw = gw
        self.table = table
        self.port = port
        self.admin_socket = admin_socket
        self.slots = [Slot(i) for i in range(table.rows)]
        self.merge = MetricsMerge(gw.proxy_metrics)
        self.stopping = False
        self._sent_version = -1
        self._sent_at = -1e9
        self._scheduled = False
        self._tasks = TaskSet("supervisor")

    # -- verdicts to the workers --------------------------------------------------------------

    def changed(self) -> None:
        """Something may have moved the fleet's verdicts: publish on the loop's next turn."""
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._publish_soon)

    def _publish_soon(self) -> None:
        self._scheduled = False
        self.publish()

    def publish(self, force: bool = False) -> None:
        fleet = self.gw.health.fleet
        if fleet.version == self._sent_version and not force:
            return
        now = self.gw.clock.now()
        frame = encode(ViewUpdate(export(fleet, now)))
        self._sent_version = fleet.version
        self._sent_at = now
        for s in self.slots:
            if s.writer is not None:
                send_frame(s.writer, frame)

    def on_transitions(self, transitions: Sequence[Transition]) -> None:
        self.publish()  # the new verdicts first, so cut attempts pick again right
        for t in transitions:
            if t.is_ejection:
                self.ejected(t.backend, t.cause)

    def reload(self, cfg: Config, cols: dict[str, int]) -> None:
        frame = encode(Reload(cfg, cols))
        for s in self.slots:
            if s.writer is not None:
                send_frame(s.writer, frame)

    def ejected(self, backend: str, cause: str) -> None:
        frame = encode(Ejected(backend, cause))
        for s in self.slots:
            if s.writer is not None:
                send_frame(s.writer, frame)

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(PUBLISH_POLL_S)
            self.publish(force=self.gw.clock.now() - self._sent_at >= PUBLISH_EVERY_S)

    # -- lifecycle ----------------------------------------------------------------------------

    def reopen_logs(self) -> None:
        """SIGUSR1 (the access log was rotated): each worker writes its own lines, so each
        reopens the file; only workers that said `Ready` have their handler set."""
        for s in self.slots:
            if s.ready.is_set() and s.proc is not None and s.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(s.pid, signal.SIGUSR1)

    async def start(self) -> None:
        """Start every worker; return once all listen (or raise after START_TIMEOUT_S)."""
        self._tasks.spawn(self._publish_loop(), "publish")
        for s in self.slots:
            self._tasks.spawn(self._keep(s), f"worker-{s.index}")
        async with asyncio.timeout(START_TIMEOUT_S):
            for s in self.slots:
                await s.ready.wait()

    async def _keep(self, s: Slot) -> None:
        """Run worker slot `s` until shutdown, replacing it whenever it exits unasked."""
        pause = RESTART_MIN_S
        while not self.stopping:
            try:
                await self._run(s)
            except Exception:
                log.exception("worker %d: could not run", s.index)
            s.writer = None
            s.ready.clear()  # set again by the replacement's Ready
            self.table.clear_row(s.index)
            self.merge.retire(s.index)
            s.requests = s.queue_depth = 0
            if self.stopping:
                return
            code = s.proc.returncode if s.proc is not None else None
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            self.gw.health.events.record(
                f"worker-{s.index}", "running", "restarting",
                f"proxy worker {s.index} (pid {s.pid}) exited unasked ({how}); starting another",
                {"pid": s.pid, "returncode": code}, "worker",
            )  # fmt: skip
            s.restarts += 1
            if self.gw.clock.now() - s.started >= STABLE_AFTER_S:
                pause = RESTART_MIN_S
            await asyncio.sleep(pause)
            pause = min(RESTART_MAX_S, pause * 2)

    async def _run(self, s: Slot) -> None:
        parent, child = socket.socketpair()
        # `gateway.access_log: stdout`: the workers write their lines to ours.
        out = None if self.gw.config.gateway.access_log == "stdout" else subprocess.DEVNULL
        try:
            s.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "pulsegate.cluster.worker",
                "--channel-fd", str(child.fileno()), "--inflight-fd", str(self.table.fd),
                "--parent", str(os.getpid()),
                pass_fds=(child.fileno(), self.table.fd),
                stdin=subprocess.DEVNULL, stdout=out,
            )  # fmt: skip
        finally:
            child.close()
        s.started = self.gw.clock.now()
        s.pid = s.proc.pid
        reader, writer = await asyncio.open_unix_connection(sock=parent)
        cfg = self.gw.config  # the config in force: reloads included
        hello = Hello(
            config=cfg,
            slot=s.index,
            port=self.port,
            admin_socket=self.admin_socket,
            rows=self.table.rows,
            columns=dict(self.table.cols),
            capacity=self.table.capacity,
            view=export(self.gw.health.fleet, self.gw.clock.now()),
        )
        send(writer, hello)
        s.writer = writer  # from here on it gets every view and ejection
        try:
            await self._serve(s, reader)
        finally:
            s.writer = None
            writer.close()
            await s.proc.wait()
            log.info("worker %d (pid %d) exited with %s", s.index, s.pid, s.proc.returncode)

    async def _serve(self, s: Slot, reader: asyncio.StreamReader) -> None:
        report = self.gw.health.report
        while True:
            try:
                msg = await receive(reader)
            except ChannelClosed:
                return
            if isinstance(msg, Outcomes):
                for item in msg.items:
                    name, obs = unpack(item)
                    report(name, obs)  # an overdue first byte also pokes the probers
                # Frames already buffered are read without suspending: let the probers and
                # the admin API run between batches, however far behind the workers are.
                await asyncio.sleep(0)
            elif isinstance(msg, Stats):
                self.merge.update(s.index, msg.metrics)
                hist = msg.metrics.get("pulsegate_request_seconds", {})
                s.requests = sum(sum(c) for c, _ in hist.values())
                s.queue_depth = msg.queue_depth
                s.view_lag_s = msg.view_lag_s
            elif isinstance(msg, Ready):
                s.pid = msg.pid
                s.ready.set()
                log.info("worker %d (pid %d) listening", s.index, s.pid)

    async def stop(self, grace: float) -> None:
        """Every worker drains (up to `grace`) and exits; stragglers are killed."""
        self.stopping = True
        for s in self.slots:
            if s.writer is not None:
                send(s.writer, Stop())
        procs = [s.proc for s in self.slots if s.proc is not None]
        waits = [asyncio.ensure_future(p.wait()) for p in procs]
        if waits:
            _, late = await asyncio.wait(waits, timeout=grace + KILL_AFTER_S)
            for p in procs:
                if p.returncode is None:
                    log.warning("worker pid %d still running after the grace; killing", p.pid)
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            if late:
                await asyncio.wait(late, timeout=KILL_AFTER_S)
        await self._tasks.cancel()

    # -- admin --------------------------------------------------------------------------------

    async def workers_view(self, request: web.Request) -> web.StreamResponse:
        """`GET /admin/workers`: one row per proxy worker."""
        rows = [
            {
                "slot": s.index,
                "pid": s.pid,
                "ready": s.ready.is_set(),
                "restarts": s.restarts,
                "requests": s.requests,
                "queue_depth": s.queue_depth,
                "view_lag_ms": round(s.view_lag_s * 1000, 3),
                "inflight": dict(zip(self.table.names, self._row(s.index), strict=True)),
            }
            for s in self.slots
        ]
        body = orjson.dumps({"pid": os.getpid(), "workers": rows})
        return web.Response(body=body, content_type="application/json")

    def _row(self, index: int) -> list[int]:
        return self.table.row(index)


def _reserve_port(host: str, port: int) -> socket.socket:
    """Bind (never listen on) the gateway's address with SO_REUSEPORT: the workers' listening
    sockets join it, a restarted worker finds the port still ours, and port 0 is resolved."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(addr)
    return sock


async def run_cluster(cfg: Config, path: str, replace_pid: int | None = None) -> None:
    """`pulsegate serve` with `gateway.workers` > 1; returns after a graceful shutdown."""
    n = cfg.gateway.workers
    clock = SystemClock(asyncio.get_running_loop())
    table = InflightTable.create(n, [b.name for b in cfg.backends])
    placeholder = _reserve_port(cfg.gateway.host, cfg.gateway.port)
    port = placeholder.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="pulsegate-")
    admin_socket = os.path.join(tmp, "primary.sock")
    gw = Primary(cfg, clock, table)
    sup = Supervisor(gw, table, port, admin_socket)
    gw.connect(sup)
    reloader = Reloader(path, lambda: gw.config, gw.apply, gw.health)
    extra = [("GET", "/admin/workers", sup.workers_view), admin_route(reloader)]
    app = build_app(cfg, view=gw, admin_extra=extra)
    runner = runtime.runner(app, cfg.gateway.client_idle_timeout)
    await runner.setup()
    site = web.UnixSite(runner, admin_socket, shutdown_timeout=runtime.SITE_SHUTDOWN_S)
    stop = asyncio.Event()
    runtime.stop_on_signals(stop)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reloader.request)
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, sup.reopen_logs)
    session = runtime.client_session(cfg.retry.connect_timeout)
    try:
        await site.start()
        gw.health.start(session, gw.tasks)
        runtime.tune_gc()
        if replace_pid is not None:
            cold = await replace.warm(gw.health)
            log.info("replacing pid %d: every backend judged but %d still cold", replace_pid, cold)
        await sup.start()
        print(f"pulsegate listening on http://{cfg.gateway.host}:{port} ({n} workers)", flush=True)
        if replace_pid is not None:
            replace.retire(replace_pid)
        await stop.wait()
    finally:
        log.info("shutting down %d worker(s), grace %.1fs", n, cfg.streaming.shutdown_grace)
        await sup.stop(cfg.streaming.shutdown_grace)
        await runner.cleanup()
        await gw.health.close()
        await gw.tasks.cancel()
        await session.close()
        placeholder.close()
        table.close()
        clock.close()
        shutil.rmtree(tmp, ignore_errors=True)
