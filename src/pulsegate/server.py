"""`pulsegate serve`: load the config, start the gateway, stop it gracefully on SIGTERM.

With `gateway.workers: 1` (the default) this is the whole gateway in one process; with more,
`serve` becomes the primary of a health process and N proxy workers (see cluster/).

Shutdown order (uvicorn's, `runtime.shutdown`): stop accepting, let in-flight requests
finish up to `streaming.shutdown_grace`, cancel the rest, then stop probers and close the
upstream pool.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from pulsegate import replace, runtime
from pulsegate.app import build_app, set_max_body
from pulsegate.clock import SystemClock
from pulsegate.cluster.primary import run_cluster
from pulsegate.config import Config, ConfigError, load_config
from pulsegate.gateway import Gateway
from pulsegate.health.fleet import Reconfigured
from pulsegate.reload import Reloader, admin_route

log = logging.getLogger("pulsegate")


async def run_gateway(
    cfg: Config, path: str, replace_pid: int | None = None, ready: asyncio.Event | None = None
) -> None:
    clock = SystemClock(asyncio.get_running_loop())
    gw = Gateway(cfg, clock)
    await gw.start()

    def apply(new: Config) -> Reconfigured:
        change = gw.apply(new)
        set_max_body(app, new)
        return change

    reloader = Reloader(path, lambda: gw.config, apply, gw.health)
    app = build_app(cfg, proxy=gw.side, view=gw, admin_extra=[admin_route(reloader)])
    runner = runtime.runner(app, cfg.gateway.client_idle_timeout)
    await runner.setup()
    # SO_REUSEPORT always: a replacement (`serve --replace PID`) listens beside this one.
    site = runtime.client_site(runner, cfg.gateway, cfg.gateway.port, gw.proxy_metrics, gw.side)
    runtime.tune_gc()
    if replace_pid is not None:
        cold = await replace.warm(gw.health)
        log.info("replacing pid %d: every backend judged but %d still cold", replace_pid, cold)
    await site.start()
    port = runtime.bound_port(site, cfg.gateway.port)
    print(f"pulsegate listening on http://{cfg.gateway.host}:{port}", flush=True)
    log.info("proxy path: %s", runtime.proxy_build())
    if replace_pid is not None:
        sockets = getattr(site._server, "sockets", None) or []
        if sockets and replace.steer_to_self(sockets[0], port):
            # What the old listener queued before the steering is accepted by the old
            # process within a loop turn; give it that before it closes the listener.
            await asyncio.sleep(replace.STEERED_S)
        else:
            log.info("replacing pid %d: new connections not steered (kernel hash)", replace_pid)
        replace.retire(replace_pid)
    stop = asyncio.Event()
    runtime.stop_on_signals(stop)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reloader.request)
    # nginx's convention for "the log was rotated" (logrotate: `postrotate kill -USR1 PID`).
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, gw.side.reopen_logs)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        await runtime.shutdown(gw.side.proxy, runner, site, cfg.streaming.shutdown_grace)
        await gw.close()
        clock.close()


def serve(config_path: str, replace_pid: int | None = None) -> int:
    """Exit 2: the config is invalid; 1: it cannot start (the address is taken, the
    process to replace is not a gateway). Either way a gateway being replaced is untouched."""
    runtime.setup_logging()
    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        for err in e.errors:
            print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        if replace_pid is not None:
            replace.check_target(replace_pid)
        replace.check_address(cfg.gateway.host, cfg.gateway.port, replace_pid)
    except replace.ReplaceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    runtime.install_uvloop()
    runtime.raise_fd_limit()  # workers inherit it
    if cfg.gateway.workers > 1:
        asyncio.run(run_cluster(cfg, config_path, replace_pid))
    else:
        asyncio.run(run_gateway(cfg, config_path, replace_pid))
    return 0
