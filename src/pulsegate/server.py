"""`pulsegate serve`: load the config, start the gateway, stop it gracefully on SIGTERM.

With `gateway.workers: 1` (the default) this is the whole gateway in one process; with more,
`serve` becomes the primary of a health process and N proxy workers (see cluster/).

Shutdown order (uvicorn's, `runtime.shutdown`): stop accepting, let in-flight requests
finish up to `streaming.shutdown_grace`, cancel the rest, then stop probers and close the
upstream pool.
"""

from __future__ import annotations

import asyncio
import sys

from aiohttp import web

from pulsegate import runtime
from pulsegate.app import build_app
from pulsegate.clock import SystemClock
from pulsegate.cluster.primary import run_cluster
from pulsegate.config import Config, ConfigError, load_config
from pulsegate.gateway import Gateway


async def run_gateway(cfg: Config, ready: asyncio.Event | None = None) -> None:
    clock = SystemClock(asyncio.get_running_loop())
    gw = Gateway(cfg, clock)
    fwd = await gw.start()
    app = build_app(cfg, proxy=(fwd, gw.verdicts), view=gw)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = runtime.tcp_site(runner, cfg.gateway.host, cfg.gateway.port, reuse_port=False)
    runtime.tune_gc()
    await site.start()
    port = runtime.bound_port(site, cfg.gateway.port)
    print(f"pulsegate listening on http://{cfg.gateway.host}:{port}", flush=True)
    stop = asyncio.Event()
    runtime.stop_on_signals(stop)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        await runtime.shutdown(gw.proxy, runner, site, cfg.streaming.shutdown_grace)
        await gw.close()
        clock.close()


def serve(config_path: str) -> int:
    runtime.setup_logging()
    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        for err in e.errors:
            print(f"error: {err}", file=sys.stderr)
        return 2
    runtime.install_uvloop()
    if cfg.gateway.workers > 1:
        asyncio.run(run_cluster(cfg))
    else:
        asyncio.run(run_gateway(cfg))
    return 0
