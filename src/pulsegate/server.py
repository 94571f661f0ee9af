"""`pulsegate serve`: load the config, start the gateway, stop it gracefully on SIGTERM.

With `gateway.workers: 1` (the default) this is the whole gateway in one process; with more,
`serve` becomes the primary of a health process and N proxy workers (see cluster/).

Shutdown order (uvicorn's): stop accepting, let in-flight requests finish up to
`streaming.shutdown_grace`, cancel the rest, then stop probers and close the upstream pool.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys

from aiohttp import web

from pulsegate.app import build_app
from pulsegate.config import Config, ConfigError, load_config
from pulsegate.gateway import Gateway

log = logging.getLogger("pulsegate")
GC_GEN0 = 7000


def _install_uvloop() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        pass


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


async def run_gateway(cfg: Config, ready: asyncio.Event | None = None) -> None:
    gw = Gateway(cfg)
    app = build_app(gw)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(
        runner,
        cfg.gateway.host,
        cfg.gateway.port,
        shutdown_timeout=1.0,  # the grace period is handled by shutdown() below
        reuse_port=False,  # gateway.workers > 1 runs cluster/ instead
        backlog=1024,
    )
    await gw.start()
    # Every request allocates short-lived container objects (tasks, futures, header dicts):
    # at the default gen-0 threshold (700) the collector runs every few requests. Freeze
    # what startup built (modules, config, routes) so collections skip it, and collect the
    # young generation 10x less often; reference counting frees almost all of it anyway.
    gc.freeze()
    gc.set_threshold(GC_GEN0, 10, 10)
    await site.start()
    port = cfg.gateway.port
    sockets = getattr(site._server, "sockets", None)
    if sockets:
        port = sockets[0].getsockname()[1]
    print(f"pulsegate listening on http://{cfg.gateway.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        await shutdown(gw, runner, site, cfg.streaming.shutdown_grace)


async def shutdown(gw: Gateway, runner: web.AppRunner, site: web.TCPSite, grace: float) -> None:
    """Stop accepting, let in-flight requests finish within `grace`, then end the streams
    still open with a terminal error event (never a 200 without [DONE] or an error)."""
    gw.shutting_down = True
    await site.stop()
    inflight = sum(gw.inflight.values())
    log.info("shutting down: %d request(s) in flight, grace %.1fs", inflight, grace)
    if not await gw.wait_drained(grace):
        cut = gw.end_streams("the gateway is shutting down")
        log.info("ended %d stream(s) still open after the grace period", cut)
        await gw.wait_drained(1.0)
    await runner.cleanup()
    await gw.close()


def serve(config_path: str) -> int:
    setup_logging()
    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        for err in e.errors:
            print(f"error: {err}", file=sys.stderr)
        return 2
    _install_uvloop()
    if cfg.gateway.workers > 1:
        from pulsegate.cluster.primary import run_cluster

        asyncio.run(run_cluster(cfg))
    else:
        asyncio.run(run_gateway(cfg))
    return 0
