"""A proxy worker: one of `gateway.workers` processes serving client traffic on the shared port.

Started by the primary (`python -m pulsegate.cluster.worker`), never by hand. It gets its
config, its slot and the current verdicts in the channel's first frame, binds the
gateway's port with SO_REUSEPORT, and runs the ordinary proxy path (Forwarder, Relay,
Balancer) against a `FleetMirror`, composed in `Worker`. Observations go back to the
primary instead of into a local health core; an `Ejected` notice does here what an
ejection does in one process.

It exits when the primary says `Stop`, on SIGTERM/SIGINT, and when the primary is gone
(channel EOF, or PR_SET_PDEATHSIG): always through the same graceful shutdown as
`pulsegate serve` (stop accepting, drain within `streaming.shutdown_grace`, end the rest).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import signal
import socket

import aiohttp
from aiohttp import web

from pulsegate import runtime
from pulsegate.app import build_app
from pulsegate.balancer import Balancer
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
    pack,
    receive,
    send,
)
from pulsegate.cluster.metrics import STATS_INTERVAL_S, snapshot
from pulsegate.cluster.mirror import FleetMirror, View
from pulsegate.cluster.shared import InflightTable, RowCounts, Totals
from pulsegate.config import Config
from pulsegate.health.observations import Observation, Outcome, RequestResult
from pulsegate.observe.metrics import Registry
from pulsegate.proxy.errors import error_response
from pulsegate.proxy.forward import Forwarder
from pulsegate.proxy.metrics import ProxyMetrics
from pulsegate.proxy.route import BalancedRouter
from pulsegate.proxy.side import ProxySide
from pulsegate.proxy.state import ProxyState
from pulsegate.runtime import TaskSet

log = logging.getLogger("pulsegate.worker")

# Successful outcomes wait at most this long to travel in a batch; anything else (a
# failure, an overdue first byte, a broken stream) leaves on the loop's next turn, so
# ejection by consecutive client failures is as quick as in one process.
FLUSH_S = 0.01
# While requests wait for capacity, how often to look for slots freed by other workers
# (their releases wake only their own waiters); otherwise how often to look at all.
RELEASE_POLL_S = 0.005
IDLE_POLL_S = 0.05
PRIMARY_TIMEOUT_S = 10.0
# Request headers passed on to the primary for admin, metrics and dashboard requests.
_TO_PRIMARY = ("authorization", "content-type", "accept")
_FROM_PRIMARY = ("content-type", "retry-after", "cache-control")


class ChannelOutcomes:
    """The worker's `Outcomes`: observations go to the primary's health core, in order.
    Successes wait at most FLUSH_S to travel in a batch; anything else leaves on the loop's
    next turn."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._outbox: list[tuple[str, Observation]] = []
        self._flush_at: asyncio.Handle | None = None

    def report(self, name: str, obs: Observation) -> None:
        self._outbox.append((name, obs))
        if type(obs) is RequestResult and obs.outcome is Outcome.OK:
            if self._flush_at is None:
                self._flush_at = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)
        else:
            if self._flush_at is not None:
                self._flush_at.cancel()
            self._flush_at = asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._flush_at = None
        if self._outbox:
            send(self._writer, Outcomes([pack(name, obs) for name, obs in self._outbox]))
            self._outbox = []


class Worker:
    """The proxy half of a gateway: verdicts from the primary, outcomes back to it, the
    in-flight counts in the shared table (its own row; routing reads the totals)."""

    def __init__(
        self,
        config: Config,
        clock: Clock,
        table: InflightTable,
        slot: int,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.config = config
        self.clock = clock
        self.slot = slot
        self.table = table
        self.registry = Registry()
        self.metrics = ProxyMetrics(self.registry)
        self.mirror = FleetMirror()
        self.outcomes = ChannelOutcomes(writer)
        self.own = RowCounts(table, slot)
        self.load = Totals(table)
        state = ProxyState(
            table.names,
            clock,
            self._router(config),
            self.mirror,
            self.outcomes,
            config.routing.queue_max,
            inflight=self.own,
            load=self.load,
        )
        self.side = ProxySide(config, clock, state, self.mirror, self.outcomes, self.metrics)
        self.proxy = state
        self._writer = writer
        self.view_lag_s = 0.0
        self.tasks = TaskSet(f"worker {slot}")

    def _router(self, cfg: Config) -> BalancedRouter:
        balancer = Balancer(cfg.routing, random.Random())
        return BalancedRouter(self.mirror, balancer, self.load, claim=self.own.reserve)

    def apply(self, view: View) -> None:
        self.mirror.apply(view)
        self.view_lag_s = max(0.0, self.clock.now() - view.sent)

    def reload(self, cfg: Config, columns: dict[str, int]) -> None:
        """The primary reloaded: the table's columns first (new backends' cells must exist
        before the proxy counts them), then the proxy side, as in one process."""
        self.table.adopt(columns)
        self.config = cfg
        self.side.reconfigure(cfg, self._router(cfg))

    def send_stats(self) -> None:
        send(self._writer, Stats(snapshot(self.metrics), self.proxy.queue.depth, self.view_lag_s))

    def start(self) -> Forwarder:
        # No probers, alerts or health tick here: the primary runs them once for all workers.
        self.tasks.spawn(self.proxy.watch_first_bytes(), "first-byte-watch")
        self.tasks.spawn(self._stats_loop(), "worker-stats")
        self.tasks.spawn(self._remote_release_loop(), "remote-releases")
        return self.side.start()

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            self.send_stats()

    async def _remote_release_loop(self) -> None:
        """Wake a waiter for capacity when another worker frees a slot: a release wakes only
        the waiters of the process that released."""
        queue = self.proxy.queue
        last: list[int] | None = None
        names = self.table.names
        while True:
            await asyncio.sleep(RELEASE_POLL_S if queue.depth else IDLE_POLL_S)
            if not queue.depth or names is not self.table.names:  # a reload moved columns
                last = None
                names = self.table.names
                continue
            now = self.table.others(self.slot)
            for i, name in enumerate(names):
                if last is None or now[i] < last[i]:
                    queue.wake_for(self.mirror.backend_models(name))
            last = now

    async def close(self) -> None:
        await self.tasks.cancel()
        await self.side.close()
        self.outcomes.flush()
        self.send_stats()


class PrimaryRelay:
    """Hands admin, metrics and dashboard requests to the primary's private Unix socket, so
    they answer the same whichever worker the kernel gave the connection to."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self._path),
            timeout=aiohttp.ClientTimeout(total=PRIMARY_TIMEOUT_S),
            auto_decompress=False,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body = await request.read()
        headers = {k: v for k in _TO_PRIMARY if (v := request.headers.get(k)) is not None}
        try:
            async with self._session.request(
                request.method, "http://primary" + request.raw_path, data=body, headers=headers
            ) as r:
                data = await r.read()
                out = {k: v for k in _FROM_PRIMARY if (v := r.headers.get(k)) is not None}
                return web.Response(status=r.status, body=data, headers=out)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            log.warning("primary did not answer %s %s: %s", request.method, request.path, e)
            return error_response(
                503, "the gateway's health process is not answering", "primary_unavailable"
            )


async def run_worker(channel_fd: int, inflight_fd: int) -> None:
    sock = socket.socket(fileno=channel_fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    hello = await receive(reader)
    if not isinstance(hello, Hello):
        raise RuntimeError(f"expected Hello, got {type(hello).__name__}")
    cfg = hello.config
    clock = SystemClock(asyncio.get_running_loop())
    table = InflightTable(inflight_fd, hello.rows, hello.columns, hello.capacity)
    w = Worker(cfg, clock, table, hello.slot, writer)
    w.mirror.apply(hello.view)  # not `apply`: its delay includes this process's start-up
    relay = PrimaryRelay(hello.admin_socket)
    w.start()
    # The primary passes SIGUSR1 on (the access log was rotated); set before `Ready`, since
    # the signal's default action would end this process.
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, w.side.reopen_logs)
    app = build_app(cfg, proxy=w.side, to_primary=relay.handle)
    runner = runtime.runner(app, cfg.gateway.client_idle_timeout)
    await runner.setup()
    site = runtime.client_site(runner, cfg.gateway, hello.port, w.metrics, w.side)
    await relay.start()
    runtime.tune_gc()
    await site.start()
    send(writer, Ready(os.getpid()))
    stop = asyncio.Event()
    runtime.stop_on_signals(stop)
    listener = w.tasks.spawn(_listen(w, reader, stop), "from-primary")
    try:
        await stop.wait()
    finally:
        try:
            await runtime.shutdown(w.proxy, runner, site, cfg.streaming.shutdown_grace)
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
            await w.close()
            await relay.close()
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            writer.close()
            table.close()
            clock.close()


async def _listen(w: Worker, reader: asyncio.StreamReader, stop: asyncio.Event) -> None:
    try:
        while True:
            msg = await receive(reader)
            if isinstance(msg, ViewUpdate):
                w.apply(msg.view)
            elif isinstance(msg, Ejected):
                w.proxy.cut_ejected(msg.backend, msg.cause)
            elif isinstance(msg, Reload):
                w.reload(msg.config, msg.columns)
            elif isinstance(msg, Stop):
                break
    except ChannelClosed:
        log.warning("worker %d: the primary is gone; shutting down", w.slot)
    stop.set()


def _die_with_parent(parent: int) -> None:
    """SIGTERM when the primary dies, even by SIGKILL (Linux); the channel's EOF is the
    portable fallback."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the primary died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pulsegate.cluster.worker", description=__doc__)
    ap.add_argument("--channel-fd", type=int, required=True)
    ap.add_argument("--inflight-fd", type=int, required=True)
    ap.add_argument("--parent", type=int, required=True, help="the primary's PID")
    args = ap.parse_args(argv)
    runtime.setup_logging(f"[worker {os.getpid()}]")
    _die_with_parent(args.parent)
    runtime.install_uvloop()
    asyncio.run(run_worker(args.channel_fd, args.inflight_fd))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
