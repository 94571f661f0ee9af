"""`pulsegate epp -c FILE [--listen HOST:PORT]`: the endpoint picker as a process.

The same parts as `pulsegate serve` without the proxy: the health service (probers,
heartbeat clients, the health tick, events and alerts) judges the configured backends, and
the same `BalancedRouter` and `Balancer` pick among its verdicts; Envoy's ext_proc filter
asks and carries the request (`service.py`). gRPC serves `envoy.service.ext_proc.v3.
ExternalProcessor` and `grpc.health.v1.Health` on one port; the health service answers
SERVING for "", `liveness`, `readiness` and the ext_proc service's name (the protocol's
three checks), and NOT_SERVING from the start of a shutdown.

Shutdown (SIGTERM, SIGINT): health flips to NOT_SERVING, the server stops taking streams
and gives open ones `GRACE_S` to finish (an open stream is one HTTP request: its response
headers still report its outcome), then the probers stop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys

import aiohttp
import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from pulsegate import runtime
from pulsegate.balancer import Balancer
from pulsegate.clock import SystemClock
from pulsegate.config import Config, ConfigError, load_config
from pulsegate.control.service import HealthService
from pulsegate.epp.endpoints import Endpoints
from pulsegate.epp.picker import Picker
from pulsegate.epp.service import PickerService
from pulsegate.observe.metrics import Registry
from pulsegate.proxy.route import BalancedRouter

log = logging.getLogger("pulsegate.epp")

DEFAULT_LISTEN = "127.0.0.1:9002"
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", SERVICE_NAME)
GRACE_S = 5.0


class EndpointPicker:
    """The composed process: health service, router, picker, gRPC server."""

    def __init__(self, config: Config, clock: SystemClock, rng: random.Random) -> None:
        self.config = config
        self.clock = clock
        self.health = HealthService(config, clock, rng, Registry())
        self.load: dict[str, int] = dict.fromkeys((b.name for b in config.backends), 0)
        router = BalancedRouter(self.health.fleet, Balancer(config.routing, rng), self.load)
        self.endpoints = Endpoints(config.backends)
        self.picker = Picker(config, router, self.health.fleet, self.endpoints)
        self.service = PickerService(
            self.picker, self.health.fleet, self.health, self.endpoints, self.load, clock.now
        )
        self.grpc_health = HealthServicer()
        self.tasks = runtime.TaskSet("epp")
        self.server: grpc.aio.Server | None = None
        self._session: aiohttp.ClientSession | None = None

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

    async def close(self) -> None:
        await self.grpc_health.enter_graceful_shutdown()
        if self.server is not None:
            await self.server.stop(GRACE_S)
        await self.health.close()
        await self.tasks.cancel()
        if self._session is not None:
            await self._session.close()


async def _serve(cfg: Config, listen: str) -> None:
    clock = SystemClock(asyncio.get_running_loop())
    epp = EndpointPicker(cfg, clock, random.Random())
    port = await epp.start(listen)
    host = listen.rsplit(":", 1)[0]
    print(f"pulsegate epp listening on {host}:{port}", flush=True)
    stop = asyncio.Event()
    runtime.stop_on_signals(stop)
    try:
        await stop.wait()
    finally:
        await epp.close()
        clock.close()


def run_epp(config_path: str, listen: str = DEFAULT_LISTEN) -> int:
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
        asyncio.run(_serve(cfg, listen))
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
