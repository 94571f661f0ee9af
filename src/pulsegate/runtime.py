"""One process bootstrap for every gateway process (single, primary, proxy worker).

uvloop, logging, GC tuning, signal handling, the HTTP site's start and ordered graceful
shutdown, and `TaskSet`: background tasks kept by reference (never garbage-collected
mid-flight) whose crash is logged with its traceback instead of dying silently.

The client-facing site (`client_site`) is a `GuardedSite`: its listening socket makes each
connection's protocol through a `conn_guard.ConnGuard` (the connection cap, the header
timeout) around aiohttp's own. What that relies on in aiohttp, each checked by
`tests/test_conn_guard_unit.py` so an upgrade that breaks it fails loudly:
- `web.Server` is a protocol factory (its documented low-level use), and each
  `RequestHandler` it makes reads `Server.request_handler` when made: the wrapper that
  tells the guard a request's handler began and ended is put there (`_guard_requests`,
  which checks it took and otherwise leaves the header timeout off, logging an error);
- `BaseSite._server` holds the site's asyncio server (`BaseSite.stop` closes it;
  `bound_port` reads it).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import resource
import signal
import sys
from collections.abc import Coroutine
from typing import Any

import aiohttp
from aiohttp import web

from pulsegate.config.schema import GatewayConfig
from pulsegate.conn_guard import Conn, ConnGuard, fd_cap, sweep_period
from pulsegate.proxy.client_conn import LeanServer, Routes, lean_usable
from pulsegate.proxy.metrics import ProxyMetrics
from pulsegate.proxy.state import ProxyState

log = logging.getLogger("pulsegate")

# Every request allocates short-lived container objects (tasks, futures, header dicts): at
# the default gen-0 threshold (700) the collector runs every few requests. Startup's objects
# are frozen (collections skip them) and the young generation is collected 10x less often;
# reference counting frees almost all of it anyway.
GC_GEN0 = 7000
# The grace period is handled by `shutdown`; aiohttp's own wait is only for the last bytes.
SITE_SHUTDOWN_S = 1.0
BACKLOG = 1024
# After the drain, client connections still open get this long to go (see `_linger`).
LINGER_S = 1.0
LINGER_POLL_S = 0.02


def runner(app: web.Application, idle_timeout: float) -> web.AppRunner:
    """The HTTP server of every gateway process: handlers cancelled when their client
    leaves, no aiohttp access log (ours is `gateway.access_log`), and an idle keep-alive
    client closed after `idle_timeout` (`gateway.client_idle_timeout`; aiohttp's default of
    3,630 s let 300 idle sockets under a 256-fd limit lock new clients out). A connection
    busy with a request or a stream is never idle."""
    return web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=idle_timeout,
        shutdown_timeout=SITE_SHUTDOWN_S,
    )


def raise_fd_limit() -> int:
    """The soft open-file limit raised to the hard one (systemd's default soft limit is
    1,024: a gateway with 1,000 streams holds two sockets each). Returns the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:  # a container may forbid it: keep what we have
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, e)
            return soft
        return hard
    return soft


def install_uvloop() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        pass


def proxy_build() -> str:
    """How the proxy path runs here: "compiled (mypyc)" when its modules load from the C
    extensions `make compiled` builds (setup.py), else "pure Python"."""
    from pulsegate.proxy import relay

    return "compiled (mypyc)" if (relay.__file__ or "").endswith(".so") else "pure Python"


def setup_logging(tag: str = "") -> None:
    """Log lines to stderr; `tag` (say "[worker 123]") follows the logger's name."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s %(name)s{tag} %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def tune_gc() -> None:
    """Call once startup is done (modules, config, routes built)."""
    gc.freeze()
    gc.set_threshold(GC_GEN0, 10, 10)


def stop_on_signals(stop: asyncio.Event, signals: tuple[int, ...] = ()) -> None:
    """Set `stop` on SIGINT and SIGTERM (and `signals`)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, *signals):
        loop.add_signal_handler(sig, stop.set)


class TaskSet:
    """Background tasks of one component, referenced until done; a crash is logged."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "%s: task %s crashed", self._owner, task.get_name(), exc_info=task.exception()
            )

    def __len__(self) -> int:
        return len(self._tasks)

    async def cancel(self) -> None:
        """Cancel every task and wait for them to finish."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# Alerts go to webhooks across the internet (a TLS handshake away): `retry.connect_timeout`
# is tuned for engines on the LAN (250 ms), so this session connects within at least this.
SESSION_CONNECT_MIN_S = 5.0


def client_session(connect_timeout: float) -> aiohttp.ClientSession:
    """The session for alerts and the baseline's poll loop (probers keep their own pools,
    the proxy path its own upstream client); connects within `connect_timeout`, at least
    `SESSION_CONNECT_MIN_S`."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30, ttl_dns_cache=60)
    sock_connect = max(connect_timeout, SESSION_CONNECT_MIN_S)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=sock_connect),
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
        read_bufsize=2**16,
    )


def tcp_site(runner: web.AppRunner, host: str, port: int, reuse_port: bool) -> web.TCPSite:
    """A plain site (the EPP's admin): no connection guard."""
    return web.TCPSite(runner, host, port, reuse_port=reuse_port, backlog=BACKLOG)


def client_site(
    runner: web.AppRunner,
    cfg: GatewayConfig,
    port: int,
    metrics: ProxyMetrics | None,
    lean: Routes | None = None,
) -> GuardedSite:
    """The clients' site on `cfg.host`:`port` (SO_REUSEPORT always: a replacement, or the
    other workers, listen beside it), its connections capped at
    `gateway.max_client_connections`, lowered to what the open-file limit leaves (one log
    line says so), and their heads bounded by `gateway.client_header_timeout`. With `lean`
    (the proxy side), its proxied POSTs are served by the lean server
    (`proxy/client_conn.py`), everything else by aiohttp."""
    server = runner.server
    assert server is not None, "runner.setup() first"
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    wanted = cfg.max_client_connections
    cap = wanted if nofile == resource.RLIM_INFINITY else fd_cap(wanted, nofile)
    if cap < wanted:
        log.info(
            "gateway.max_client_connections lowered from %d to %d: the open-file limit is "
            "%d (half of what the process does not need itself kept for upstream connections)",
            wanted,
            cap,
            nofile,
        )
    loop = asyncio.get_running_loop()
    lean_server = None
    if lean is not None:
        if lean_usable(server()):
            lean_server = LeanServer(lean, loop)
        else:
            log.error(
                "aiohttp's RequestHandler no longer has the idle timer the lean server holds "
                "off: every request is served by aiohttp (slower, nothing else changes)"
            )
    guard = ConnGuard(server, cap, cfg.client_header_timeout, loop.time, metrics, lean=lean_server)
    if not _guard_requests(server, guard):
        log.error(
            "aiohttp's web.Server no longer hands Server.request_handler to its protocols: "
            "gateway.client_header_timeout is off (client_idle_timeout still bounds a head)"
        )
        guard.header_timeout = float("inf")
    return GuardedSite(runner, cfg.host, port, guard)


def _guard_requests(server: web.Server, guard: ConnGuard) -> bool:
    """Tell `guard` when each request's handler begins and ends (its head is then whole):
    the wrapper goes where each new aiohttp protocol reads its handler from. Returns whether
    a protocol made now does use it (one private read, only to check)."""
    handler = server.request_handler

    async def guarded(request: web.BaseRequest) -> web.StreamResponse:
        t = request.transport
        conn = t.get_protocol() if t is not None else None
        if conn is None or conn.__class__ is not Conn:
            return await handler(request)
        guard.begin(conn)
        try:
            return await handler(request)
        finally:
            guard.end(conn, request.content)

    server.request_handler = guarded
    probe = server()
    return getattr(probe, "_request_handler", None) is guarded


class GuardedSite(web.BaseSite):
    """A TCP site whose listening socket makes its connections through a `ConnGuard`, and
    sweeps it (`ConnGuard.sweep`) every `sweep_period` while it listens."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, guard: ConnGuard) -> None:
        super().__init__(runner, backlog=BACKLOG)
        self.host, self.port, self.guard = host, port, guard
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.guard.factory, self.host, self.port, backlog=BACKLOG, reuse_port=True
        )
        self._sweeper = loop.create_task(self._sweep(), name="conn-guard-sweep")

    async def _sweep(self) -> None:
        guard = self.guard
        period = sweep_period(guard.header_timeout)
        while True:
            await asyncio.sleep(period)
            try:
                guard.sweep(guard.now())
            except Exception:  # never let one bad connection end the sweeping
                log.exception("connection guard sweep failed")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        self.guard.close_refusals()
        await super().stop()


def bound_port(site: web.BaseSite, default: int) -> int:
    """The port `site` listens on (resolves port 0)."""
    sockets = getattr(site._server, "sockets", None)
    return sockets[0].getsockname()[1] if sockets else default


async def shutdown(
    proxy: ProxyState, runner: web.AppRunner, site: web.BaseSite, grace: float
) -> None:
    """uvicorn's order: stop accepting, let in-flight requests finish within `grace`, then
    end the streams still open with a terminal error event (never a 200 without [DONE] or
    an error), then close the HTTP runner."""
    proxy.shutting_down = True  # from now on every answer says `Connection: close`
    await site.stop()
    inflight = sum(proxy.inflight.values())
    log.info("shutting down: %d request(s) in flight, grace %.1fs", inflight, grace)
    if not await proxy.wait_drained(grace):
        cut = proxy.end_streams()
        log.info("ended %d stream(s) still open after the grace period", cut)
        await proxy.wait_drained(1.0)
    await _linger(runner, min(LINGER_S, grace))
    lean = site.guard.lean if isinstance(site, GuardedSite) else None
    if lean is not None:  # what aiohttp's cleanup does for its own requests in progress
        left = await lean.wait_served(SITE_SHUTDOWN_S)
        if left:
            log.info("closing with %d request(s) still being answered", left)
    await runner.cleanup()


async def _linger(runner: web.AppRunner, seconds: float) -> None:
    """Give client connections still open up to `seconds` to be used once more (answered
    with `Connection: close`) or closed by their clients, then the runner closes the rest.
    Closing a keep-alive connection at once races with a client sending on it that very
    moment: its request is lost ("server disconnected"), and a replacement gateway beside
    this one would have served it."""
    server = runner.server
    for _ in range(int(seconds / LINGER_POLL_S)):
        if server is None or not server.connections:
            return
        await asyncio.sleep(LINGER_POLL_S)
    if server is not None and server.connections:
        log.info(
            "closing %d client connection(s) still open after the drain", len(server.connections)
        )
