"""One process bootstrap for every gateway process (single, primary, proxy worker).

uvloop, logging, GC tuning, signal handling, the HTTP site's start and ordered graceful
shutdown, and `TaskSet`: background tasks kept by reference (never garbage-collected
mid-flight) whose crash is logged with its traceback instead of dying silently.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import resource
import signal
import sys
from collections.abc import Coroutine
from typing import Any

import aiohttp
from aiohttp import web

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
        app, handler_cancellation=True, access_log=None, keepalive_timeout=idle_timeout
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
    return web.TCPSite(
        runner,
        host,
        port,
        shutdown_timeout=SITE_SHUTDOWN_S,
        reuse_port=reuse_port,
        backlog=BACKLOG,
    )


def bound_port(site: web.TCPSite, default: int) -> int:
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
