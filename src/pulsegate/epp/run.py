"""`pulsegate epp -c FILE [--listen HOST:PORT] [--admin] [--xds HOST:PORT]`: the endpoint
picker as a process.

The same parts as `pulsegate serve` without the proxy: the health service (probers,
heartbeat clients, the health tick, events and alerts) judges the configured backends, and
the same `BalancedRouter` and `Balancer` pick among its verdicts; Envoy's ext_proc filter
asks and carries the request (`service.py`). gRPC serves `envoy.service.ext_proc.v3.
ExternalProcessor` and `grpc.health.v1.Health` on one port; the health service answers
SERVING for "", `liveness`, `readiness` and the ext_proc service's name (the protocol's
three checks), and NOT_SERVING from the start of a shutdown.

With `--admin`, the HTTP side of `serve` without the OpenAI routes listens on the config's
`gateway.listen`: `/healthz`, `/metrics`, the admin API (`/admin/backends`, `/admin/events`,
`/admin/cluster` with `cluster.redis`, drain / undrain / eject, `POST /admin/reload`) and the
dashboard, under the same token and loopback rules (`admin.py`). SIGHUP (and `POST
/admin/reload`) re-reads the config in place as `serve` does (`reload.py`): the health service
takes the backends, the picker a new router and endpoint map; an exchange in flight keeps its
in-flight slot and reports its outcome; `--listen` and `gateway.listen` stay as they were.

With `--xds`, the same verdicts also go to Envoy as its EDS server on that port (`xds.py`):
one `ClusterLoadAssignment` per model, pushed when a host's health or weight changes, no
per-request call. The ext_proc service stays up beside it (one brain, either data path).

Shutdown (SIGTERM, SIGINT): health flips to NOT_SERVING, the server stops taking streams
and gives open ones `GRACE_S` to finish (an open stream is one HTTP request: its response
headers still report its outcome), then the probers stop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import grpc
from aiohttp import web
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from pulsegate import runtime
from pulsegate.app import build_app
from pulsegate.balancer import Balancer
from pulsegate.clock import SystemClock
from pulsegate.config import Config, ConfigError, load_config
from pulsegate.control.service import HealthService
from pulsegate.epp.assignment import plan_of
from pulsegate.epp.endpoints import Endpoints
from pulsegate.epp.picker import Picker
from pulsegate.epp.service import PickerService
from pulsegate.epp.xds import EdsService, Publisher
from pulsegate.health.fleet import Reconfigured
from pulsegate.health.verdict import State
from pulsegate.observe.metrics import Registry
from pulsegate.proxy.metrics import ProxyMetrics
from pulsegate.proxy.route import BalancedRouter
from pulsegate.reload import Reloader, admin_route

log = logging.getLogger("pulsegate.epp")

DEFAULT_LISTEN = "127.0.0.1:9002"
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", SERVICE_NAME)
GRACE_S = 5.0


class EndpointPicker:
    """The composed process: health service, router, picker, gRPC server; what the admin
    API and the dashboard read (`observe.view.GatewayView`)."""

    def __init__(self, config: Config, clock: SystemClock, rng: random.Random) -> None:
        self.config = config
        self.clock = clock
        self._rng = rng
        self.registry = Registry()
        self.proxy_metrics = ProxyMetrics(self.registry)  # no proxy here: the view wants them
        self.health = HealthService(config, clock, rng, self.registry)
        self.load: dict[str, int] = dict.fromkeys((b.name for b in config.backends), 0)
        self.endpoints = Endpoints(config.backends)
        self.picker = self._picker(config)
        self.service = PickerService(
            self.picker, self.health.fleet, self.health, self.endpoints, self.load, clock.now
        )
        self.grpc_health = HealthServicer()
        self.tasks = runtime.TaskSet("epp")
        self.server: grpc.aio.Server | None = None
        self.xds_server: grpc.aio.Server | None = None  # --xds: Envoy's EDS (xds.py)
        self._session: aiohttp.ClientSession | None = None

    def _picker(self, config: Config) -> Picker:
        router = BalancedRouter(self.health.fleet, Balancer(config.routing, self._rng), self.load)
        return Picker(config, router, self.health.fleet, self.endpoints)

    # -- what the admin API reads (GatewayView) ---------------------------------------------

    @property
    def inflight(self) -> Mapping[str, int]:
        return self.load

    def names(self) -> Sequence[str]:
        return tuple(b.name for b in self.config.backends)

    def backend_view(self, name: str) -> dict[str, Any]:
        return self.health.backend_view(name, self.load.get(name, 0))

    def apply(self, cfg: Config) -> Reconfigured:
        """A reload: the health service takes `cfg`; new picks use a new router and endpoint
        map. A removed backend's in-flight count stays until its exchanges end."""
        self.config = cfg
        change = self.health.apply(cfg)
        for b in cfg.backends:
            self.load.setdefault(b.name, 0)
        self.endpoints = Endpoints(cfg.backends)
        self.picker = self._picker(cfg)
        self.service.reconfigure(self.picker, self.endpoints)
        return change

    async def start(self, listen: str) -> int:
        """Start judging the backends and serve on `listen`; returns the bound port."""
        # One picker per port: a second one must fail to bind, not share the port.
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ExternalProcessorServicer_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.grpc_health, server)
        try:
            port: int = server.add_insecure_port(listen)
        except RuntimeError as e:  # bound before anything starts: nothing to undo
            raise OSError(f"cannot listen on {listen}: {e}") from e
        self.server = server
        self._session = runtime.client_session(self.config.retry.connect_timeout)
        self.health.start(self._session, self.tasks)
        await server.start()
        for name in HEALTH_SERVICES:
            await self.grpc_health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return port

    async def start_xds(self, listen: str) -> int:
        """Also serve Envoy's EDS on `listen` (after `start`): verdicts pushed as
        `ClusterLoadAssignment`s, one cluster per model; returns the bound port."""
        publisher = Publisher(
            lambda: plan_of(self.health.fleet, self.endpoints.endpoint),
            lambda: self.health.fleet.version,
            lambda: all(v.state is not State.COLD for v in self.health.fleet.verdicts()),
            self.clock.now,
        )
        self.health.on_change.append(publisher.poke)
        self.health.on_transitions.append(publisher.poke)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(EdsService(publisher), server)
        try:
            port: int = server.add_insecure_port(listen)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {listen}: {e}") from e
        self.xds_server = server
        self.tasks.spawn(publisher.run(), "xds-publisher")
        await server.start()
        return port

    async def close(self) -> None:
        await self.grpc_health.enter_graceful_shutdown()
        if self.xds_server is not None:  # Envoy keeps the last assignment it was sent
            await self.xds_server.stop(0)
        if self.server is not None:
            await self.server.stop(GRACE_S)
        await self.health.close()
        await self.tasks.cancel()
        if self._session is not None:
            await self._session.close()


async def _admin_site(epp: EndpointPicker, reloader: Reloader) -> web.TCPSite:
    cfg = epp.config
    app = build_app(cfg, view=epp, admin_extra=[admin_route(reloader)])
    runner = runtime.runner(app, cfg.gateway.client_idle_timeout)
    await runner.setup()
    site = runtime.tcp_site(runner, cfg.gateway.host, cfg.gateway.port, reuse_port=False)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise OSError(f"cannot listen on {cfg.gateway.host}:{cfg.gateway.port}: {e}") from e
    port = runtime.bound_port(site, cfg.gateway.port)
    # After the gRPC line, so a reader of the first `listening on` line gets the gRPC port.
    print(f"pulsegate epp admin listening on http://{cfg.gateway.host}:{port}", flush=True)
    return site


async def _serve(cfg: Config, path: str, listen: str, admin: bool, xds: str | None) -> None:
    clock = SystemClock(asyncio.get_running_loop())
    epp = EndpointPicker(cfg, clock, random.Random())
    reloader = Reloader(path, lambda: epp.config, epp.apply, epp.health)
    port = await epp.start(listen)
    site = None
    try:
        host = listen.rsplit(":", 1)[0]
        print(f"pulsegate epp listening on {host}:{port}", flush=True)
        if xds is not None:
            xds_port = await epp.start_xds(xds)
            print(f"pulsegate epp xds listening on {xds.rsplit(':', 1)[0]}:{xds_port}", flush=True)
        if admin:
            site = await _admin_site(epp, reloader)
        stop = asyncio.Event()
        runtime.stop_on_signals(stop)
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reloader.request)
        await stop.wait()
    finally:
        if site is not None:
            await site.stop()
            await site._runner.cleanup()
        await epp.close()
        clock.close()


def run_epp(
    config_path: str, listen: str = DEFAULT_LISTEN, admin: bool = False, xds: str | None = None
) -> int:
    """Exit 2: the config is invalid; 1: it cannot listen; 0 after a clean stop."""
    runtime.setup_logging()
    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        for err in e.errors:
            print(f"error: {err}", file=sys.stderr)
        return 2
    # Plain asyncio, as the agent: grpc.aio runs on the default loop.
    try:
        asyncio.run(_serve(cfg, config_path, listen, admin, xds))
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
