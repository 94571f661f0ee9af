"""The node agent: a grpc.aio server for the heartbeat stream beside one engine (R1-R4, R27).

`pulsegate agent --engine URL --listen HOST:PORT [--gpu ...] [--model M] [--token-env VAR]
[--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]]` runs `run_agent`. Per stream, the
agent reads pings and answers each at once from the `EngineWatcher`'s snapshot (a copy of a
prebuilt `Pong`, three fields set: microseconds). A MICRO_INFERENCE ping starts a task that
runs a one-token completion on the local engine; its pong is written when the engine
answers, while pings keep being answered. Writes on one stream are serialised by a lock
(gRPC allows one outstanding write per call).

The door (what a stranger who can reach the port gets):
- with a token (`--token-env VAR`), a heartbeat stream whose metadata lacks
  ``authorization: Bearer <token>`` (compared in constant time) is refused UNAUTHENTICATED
  before anything is read or sent; the token is never logged nor shown in a repr;
- at most `max_streams` heartbeat streams at once (16: a gateway keeps one, replicas and
  a restart overlap a few); one more is refused RESOURCE_EXHAUSTED;
- at most one micro-inference in flight per stream: another while one runs is answered at
  once as busy (no queue, so a flood costs one pong each, not a task each), and its
  timeout is the caller's ``timeout_ms`` clipped to the agent's `micro_timeout` (2 s).
The standard health service stays open (it says SERVING or NOT_SERVING, no facts), so
``grpc_health_probe`` and Kubernetes probes need no token.

The wire (`agent.tls`): plaintext by default; with ``--tls-cert`` and ``--tls-key`` the port
speaks only TLS (grpcio's own TLS, ALPN h2), and with ``--tls-client-ca`` a client must also
present a certificate signed by that CA (mutual TLS), checked in the handshake, before
any gRPC call, the health service's included. The files are checked at start: a bad one
stops the agent (exit 2) naming its flag.

The standard ``grpc.health.v1.Health`` service (from grpcio-health-checking) reports ``""``
and ``pulsegate.agent.v1.Heartbeat`` SERVING while the agent runs, and ``engine`` SERVING
or NOT_SERVING from the engine's ``/health``. On SIGTERM or SIGINT the agent flips every
service to NOT_SERVING, stops accepting streams, lets open ones finish within a short grace
period, and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from pulsegate.agent.engine import EngineWatcher, MicroOutcome, Snapshot
from pulsegate.agent.gpu import GpuChoice, GpuFaultWatcher, NvmlUnavailable, parse_gpu_option
from pulsegate.agent.tls import ServerFiles, TlsSetupError, read_server_files
from pulsegate.agent.wire import (
    SERVICE_NAME,
    add_heartbeat_service,
    fill_facts,
    fill_faults,
    pb,
    pb_grpc,
)
from pulsegate.clock import SystemClock
from pulsegate.probers.http import new_probe_session
from pulsegate.probers.payload import Api

log = logging.getLogger("pulsegate.agent")

ENGINE_HEALTH_SERVICE = "engine"
DEFAULT_MICRO_TIMEOUT_S = 2.0
DEFAULT_MAX_STREAMS = 16
TOKEN_METADATA = "authorization"
_SHUTDOWN_GRACE_S = 0.5
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HeartbeatService(pb_grpc.HeartbeatServicer):
    """Answers pings from the watcher's snapshot; runs micro-inferences in tasks, one at a
    time per stream. `token` (None: no check) is what each stream must present."""

    def __init__(
        self,
        watcher: EngineWatcher,
        clock_s: Callable[[], float],
        *,
        token: str | None = None,
        micro_timeout: float = DEFAULT_MICRO_TIMEOUT_S,
        max_streams: int = DEFAULT_MAX_STREAMS,
        faults: GpuFaultWatcher | None = None,
    ) -> None:
        self._watcher = watcher
        self._faults = faults
        self._clock = clock_s
        self._expected = f"Bearer {token}".encode() if token else None
        self._micro_timeout = micro_timeout
        self._max_streams = max_streams
        self._streams = 0
        self._template = pb.Pong()
        self._template_version = -1
        self._tasks: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:  # never the token
        return f"HeartbeatService(token={'set' if self._expected else 'none'})"

    def _authorised(self, context: grpc.aio.ServicerContext) -> bool:
        if self._expected is None:
            return True
        presented = b""
        for key, value in context.invocation_metadata() or ():
            if key == TOKEN_METADATA:
                presented = value.encode() if isinstance(value, str) else bytes(value)
                break
        # Constant time: how much of a guess matched must not show in the answer's timing.
        return hmac.compare_digest(presented, self._expected)

    def _pong(self, ping: pb.Ping, snap: Snapshot) -> pb.Pong:
        fw = self._faults
        # Both versions only grow: their sum moves whenever either does.
        version = snap.version + (fw.version if fw is not None else 0)
        if version != self._template_version:
            t = pb.Pong()
            fill_facts(t, snap.facts)
            fill_faults(t, fw.faults if fw is not None else None)
            t.gpu_source = snap.gpu_source
            if snap.ready is not None:
                t.engine_ready = snap.ready
            t.engine_status = snap.status
            t.engine_unreachable = not snap.reachable and snap.ready is not None
            t.engine_dialect = snap.dialect
            t.facts_version = version
            self._template, self._template_version = t, version
        pong = pb.Pong()
        pong.CopyFrom(self._template)
        pong.seq = ping.seq
        pong.echo_send_ns = ping.send_ns
        pong.kind = ping.kind
        pong.facts_age_ms = min(0xFFFFFFFF, max(0, int((self._clock() - snap.taken_at) * 1e3)))
        return pong

    async def Stream(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        peer = context.peer()
        if not self._authorised(context):
            log.warning("agent: refused a heartbeat stream from %s: missing or wrong token", peer)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong agent token")
        if self._streams >= self._max_streams:
            log.warning(
                "agent: refused a heartbeat stream from %s: %d streams open already",
                peer,
                self._streams,
            )
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {self._max_streams} heartbeat streams at once",
            )
        self._streams += 1
        try:
            await self._serve_stream(context, peer)
        finally:
            self._streams -= 1

    async def _serve_stream(self, context: grpc.aio.ServicerContext, peer: str) -> None:
        lock = asyncio.Lock()
        mine: set[asyncio.Task[None]] = set()
        # One micro-inference in flight on this stream: set when it starts, cleared by it just
        # before its pong goes out (a task's done callback runs later than the pong arrives,
        # and a caller that answers at once must not find the stream still busy).
        running = [False]
        log.info("agent: heartbeat stream opened by %s", peer)
        try:
            while True:
                ping = await context.read()
                if ping is grpc.aio.EOF:
                    break
                t0 = time.perf_counter_ns()
                if ping.kind == pb.Ping.MICRO_INFERENCE:
                    if running[0]:  # one in flight already: busy now, never queued
                        pong = self._pong(ping, self._watcher.snapshot)
                        pong.ok, pong.busy = False, True
                        pong.error = "a micro-inference is already running on this stream"
                        pong.agent_processing_ns = time.perf_counter_ns() - t0
                        async with lock:
                            await context.write(pong)
                        continue
                    running[0] = True
                    task = asyncio.create_task(self._micro(ping, context, lock, running))
                    mine.add(task)
                    self._tasks.add(task)
                    task.add_done_callback(mine.discard)
                    task.add_done_callback(self._tasks.discard)
                    continue
                pong = self._pong(ping, self._watcher.snapshot)
                pong.agent_processing_ns = time.perf_counter_ns() - t0
                async with lock:
                    await context.write(pong)
        finally:
            for task in mine:
                task.cancel()
            log.info("agent: heartbeat stream from %s closed", peer)

    async def _micro(
        self,
        ping: pb.Ping,
        context: grpc.aio.ServicerContext,
        lock: asyncio.Lock,
        running: list[bool],
    ) -> None:
        t0 = time.perf_counter_ns()
        # The caller's timeout, never beyond ours: the engine's time is the node's to guard.
        asked = ping.timeout_ms / 1e3 if ping.timeout_ms else self._micro_timeout
        timeout = min(asked, self._micro_timeout)
        try:
            out = await self._watcher.micro(timeout)
        except Exception as e:  # our bug, not the engine's: say so rather than go silent
            log.exception("agent: micro-inference failed")
            out = MicroOutcome(False, None, f"agent error: {type(e).__name__}")
        pong = self._pong(ping, self._watcher.snapshot)
        pong.ok = out.ok
        pong.busy = out.busy
        pong.error = out.error
        if out.latency_s is not None:
            pong.latency_ms = out.latency_s * 1e3
        pong.agent_processing_ns = time.perf_counter_ns() - t0
        running[0] = False
        try:
            async with lock:
                await context.write(pong)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the stream ended while the engine answered: nobody to tell


class Agent:
    """The agent as a component: `await start()` binds and serves, `await stop()` shuts down
    gracefully. Usable in-process (tests, benchmarks) as well as from `run_agent`."""

    def __init__(
        self,
        engine: str,
        listen: str,
        gpu: str | GpuChoice = "auto",
        model: str | None = None,
        *,
        refresh: float = 0.15,
        token: str | None = None,
        micro_timeout: float = DEFAULT_MICRO_TIMEOUT_S,
        max_streams: int = DEFAULT_MAX_STREAMS,
        tls: ServerFiles | None = None,
        api: str = "completions",
    ) -> None:
        if not engine.startswith(("http://", "https://")):
            raise ValueError(f"--engine must start with http:// or https://: {engine!r}")
        if not 0 < micro_timeout <= 60:
            raise ValueError(f"--micro-timeout must be in (0, 60] seconds, got {micro_timeout}")
        if not 1 <= max_streams <= 1024:
            raise ValueError(f"--max-streams must be 1-1024, got {max_streams}")
        if token is not None and not token:
            raise ValueError("the agent token is empty")
        self.engine = engine.rstrip("/").removesuffix("/v1")
        self.listen = listen
        self.gpu = gpu if isinstance(gpu, GpuChoice) else parse_gpu_option(gpu)
        self.model = model
        self.refresh = refresh
        self.micro_timeout = micro_timeout
        self.max_streams = max_streams
        self._token = token
        self.tls = tls  # None: plaintext
        # The endpoint micro-inferences go to first (`--api`): an embedding model's engine
        # serves neither completions nor chat, so it is probed with a one-input embedding.
        if api not in MICRO_APIS:
            raise ValueError(f"--api must be one of {', '.join(MICRO_APIS)}, got {api!r}")
        self.api = MICRO_APIS[api]
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._health: HealthServicer | None = None
        self._watcher: EngineWatcher | None = None
        self._faults: GpuFaultWatcher | None = None
        self._session: aiohttp.ClientSession | None = None
        self._micro_session: aiohttp.ClientSession | None = None
        self._clock: SystemClock | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:  # never the token
        token = "set" if self._token else "none"
        tls = "none" if self.tls is None else "mtls" if self.tls.client_ca else "tls"
        return f"Agent(engine={self.engine!r}, listen={self.listen!r}, token={token}, tls={tls})"

    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0]

    @property
    def watcher(self) -> EngineWatcher:
        assert self._watcher is not None, "agent not started"
        return self._watcher

    async def start(self) -> int:
        """Take a first snapshot, bind, serve; returns the bound port."""
        # Two pools: /health and /metrics never wait for a connection behind micro-inferences
        # (up to one per stream, 16 streams, against 4 connections per pool).
        session = self._session = new_probe_session()
        micro_session = self._micro_session = new_probe_session()
        # The agent's own clock: its micro-inference deadlines count only time its loop ran.
        self._clock = SystemClock(asyncio.get_running_loop())
        self._watcher = EngineWatcher(
            self.engine,
            self.gpu,
            self.model,
            refresh=self.refresh,
            clock=self._clock,
            session=session,
            micro_session=micro_session,
            api=self.api,
        )
        self._health = HealthServicer()
        self._watcher.on_change(self._engine_changed)
        watcher = self._watcher
        self._faults = GpuFaultWatcher(
            self.gpu,
            self.engine,
            refresh=self.refresh,
            clock=self._clock,
            session=session,
            engine_page=lambda: watcher.metrics_page,
        )
        try:
            await self._watcher.start()
            await self._faults.start()
        except BaseException:
            await self._watcher.stop()
            await session.close()
            await micro_session.close()
            raise
        server = grpc.aio.server(
            options=[
                # One agent per port: a second one must fail to bind, not share it.
                ("grpc.so_reuseport", 0),
                # Gateways may send HTTP/2 keepalive pings on an idle-looking stream.
                ("grpc.http2.min_ping_interval_without_data_ms", 1000),
                ("grpc.keepalive_permit_without_calls", 1),
            ]
        )
        service = HeartbeatService(
            self._watcher,
            self._clock.now,
            token=self._token,
            micro_timeout=self.micro_timeout,
            max_streams=self.max_streams,
            faults=self._faults,
        )
        add_heartbeat_service(service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            port: int = self._bind(server)
        except RuntimeError as e:
            await self._close_sources()
            raise OSError(f"cannot listen on {self.listen}: {e}") from e
        if port == 0:
            await self._close_sources()
            raise OSError(f"cannot listen on {self.listen}")
        await server.start()
        self._server, self.port = server, port
        await self._health.set("", _SERVING)
        await self._health.set(SERVICE_NAME, _SERVING)
        await self._set_engine_health(self._watcher.snapshot)
        log.info(
            "agent: engine %s, GPU figures from %s", self.engine, self._watcher.gpu_description
        )
        return port

    def _bind(self, server: grpc.aio.Server) -> int:
        if self.tls is None:
            return server.add_insecure_port(self.listen)  # type: ignore[no-any-return]
        creds = grpc.ssl_server_credentials(
            [(self.tls.key, self.tls.cert_chain)],
            root_certificates=self.tls.client_ca,
            require_client_auth=self.tls.client_ca is not None,
        )
        return server.add_secure_port(self.listen, creds)  # type: ignore[no-any-return]

    def _engine_changed(self, snap: Snapshot) -> None:
        task = asyncio.create_task(self._set_engine_health(snap))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _set_engine_health(self, snap: Snapshot) -> None:
        if self._health is not None:
            await self._health.set(ENGINE_HEALTH_SERVICE, _SERVING if snap.ready else _NOT_SERVING)

    async def stop(self, grace: float = _SHUTDOWN_GRACE_S) -> None:
        """NOT_SERVING everywhere, refuse new streams, give open ones `grace` s, release all."""
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        await self._close_sources()

    async def _close_sources(self) -> None:
        if self._watcher is not None:
            await self._watcher.stop()
        if self._faults is not None:
            await self._faults.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._micro_session is not None:
            await self._micro_session.close()
            self._micro_session = None
        if self._clock is not None:
            self._clock.close()
            self._clock = None


MICRO_APIS = {"completions": Api.COMPLETIONS, "chat": Api.CHAT, "embeddings": Api.EMBEDDINGS}


def run_agent(
    engine: str,
    listen: str,
    gpu: str = "auto",
    model: str | None = None,
    *,
    token_env: str | None = None,
    micro_timeout: float = DEFAULT_MICRO_TIMEOUT_S,
    max_streams: int = DEFAULT_MAX_STREAMS,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_client_ca: str | None = None,
    api: str = "completions",
) -> int:
    """Serve until SIGINT or SIGTERM; prints ``agent listening on HOST:PORT`` once serving.
    Exit status 0 after a clean stop, 2 for bad options, 1 when it cannot start.
    `token_env` names the environment variable holding the shared token (read once here);
    `tls_*` are the PEM files of TLS (cert + key) and mutual TLS (client CA)."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    token = None
    if token_env is not None:
        token = os.environ.get(token_env)
        if not token:
            print(f"error: --token-env {token_env}: that variable is not set", file=sys.stderr)
            return 2
    try:
        tls = _server_tls(tls_cert, tls_key, tls_client_ca)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        agent = Agent(
            engine,
            listen,
            gpu,
            model,
            token=token,
            micro_timeout=micro_timeout,
            max_streams=max_streams,
            tls=tls,
            api=api,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        rc: int = asyncio.run(_serve(agent))
        return rc
    except (NvmlUnavailable, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _server_tls(cert: str | None, key: str | None, client_ca: str | None) -> ServerFiles | None:
    """The TLS files from the flags, checked; None for plaintext. ValueError names the flag."""
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
        return None
    if cert is None or key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    try:
        return read_server_files(cert, key, client_ca)
    except TlsSetupError as e:
        raise ValueError(f"--tls-{e.role.replace('_', '-')}: {e}") from e


async def _serve(agent: Agent) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    port = await agent.start()
    print(f"agent listening on {agent.host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        log.info("agent: shutting down")
        with contextlib.suppress(Exception):
            await agent.stop()
    return 0
