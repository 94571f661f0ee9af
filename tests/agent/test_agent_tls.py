"""TLS and mutual TLS between the gateway and its agents: a CA and certificates made at test
time, real `pulsegate agent` processes serving TLS, the gateway's own heartbeat client
(`grpc_lite` over asyncio TLS) and grpcio's standard client talking to them; every failure
(wrong CA, wrong name, no client certificate, plaintext against TLS and the reverse, no ALPN
h2, a silent handshake) is a prompt ``"tls"`` miss with a clear reason, never a pong, a hang
or a fallback to plaintext. Then the `agent_tls` config keys and the agent's flags, and one
gateway process keeping an mTLS agent's backend healthy."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import logging
import random
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from engine_stub import engine_stub
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pulsegate.agent import grpc_lite
from pulsegate.agent.server import Agent
from pulsegate.agent.tls import ServerFiles, client_context, read_server_files
from pulsegate.agent.wire import SERVICE_NAME, heartbeat_stub, pb
from pulsegate.clock import SystemClock
from pulsegate.config import (
    AgentTlsConfig,
    ConfigError,
    HeartbeatConfig,
    MicroInferenceConfig,
    parse_config,
)
from pulsegate.health.observations import Heartbeat, Observation
from pulsegate.probers.heartbeat import HeartbeatClient
from support import Gateway, Proc, Sim, fast_probes, wait_until

HB = HeartbeatConfig(interval=0.1, timeout=0.08, misses_to_dead=3)
NO_MICRO = MicroInferenceConfig(interval=3600.0, jitter=0.0, timeout=2.0)
STREAM = f"/{SERVICE_NAME}/Stream"


# -- certificates, made at test time ---------------------------------------------------------


@dataclass(frozen=True)
class Certs:
    ca: str  # signs the agent's and the gateway's certificates
    other_ca: str  # trusted by nobody here
    server: str  # the agent: SAN 127.0.0.1 and localhost
    server_key: str
    client: str  # the gateway, signed by `ca`
    client_key: str
    rogue: str  # a client certificate signed by `other_ca`
    rogue_key: str
    locked_key: str  # the gateway's key, encrypted with a passphrase


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> str:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(path)


def _write_locked_key(path: Path, key: ec.EllipticCurvePrivateKey) -> str:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    return str(path)


def _write_cert(path: Path, cert: x509.Certificate) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def _sign(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    sans: list[x509.GeneralName] | None = None,
    usage: x509.ObjectIdentifier | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer if issuer else (_name(subject), key)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usage is not None:
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """A CA, a second CA, the agent's certificate and two client certificates."""
    d = tmp_path_factory.mktemp("certs")
    ca_key, other_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    ca = _sign("pulsegate test CA", ca_key, None)
    other = _sign("someone else's CA", other_key, None)
    keys = {n: ec.generate_private_key(ec.SECP256R1()) for n in ("server", "client", "rogue")}
    sans: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    server = _sign(
        "agent",
        keys["server"],
        (ca.subject, ca_key),
        sans=sans,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
    )
    client = _sign(
        "gateway", keys["client"], (ca.subject, ca_key), usage=ExtendedKeyUsageOID.CLIENT_AUTH
    )
    rogue = _sign(
        "rogue", keys["rogue"], (other.subject, other_key), usage=ExtendedKeyUsageOID.CLIENT_AUTH
    )
    return Certs(
        ca=_write_cert(d / "ca.pem", ca),
        other_ca=_write_cert(d / "other-ca.pem", other),
        server=_write_cert(d / "agent.pem", server),
        server_key=_write_key(d / "agent.key", keys["server"]),
        client=_write_cert(d / "gateway.pem", client),
        client_key=_write_key(d / "gateway.key", keys["client"]),
        rogue=_write_cert(d / "rogue.pem", rogue),
        rogue_key=_write_key(d / "rogue.key", keys["rogue"]),
        locked_key=_write_locked_key(d / "locked.key", keys["client"]),
    )


def tls_args(c: Certs, *, mutual: bool = False) -> tuple[str, ...]:
    args = ("--tls-cert", c.server, "--tls-key", c.server_key, "--gpu", "none")
    return (*args, "--tls-client-ca", c.ca) if mutual else args


# -- the heartbeat client, run for a while ---------------------------------------------------


async def beats(
    port: int, tls: AgentTlsConfig | None, seconds: float, want_ok: int = 5
) -> list[Heartbeat]:
    """Run the gateway's HeartbeatClient against 127.0.0.1:`port` until `want_ok` pongs or
    `seconds` pass; every heartbeat and miss it emitted."""
    seen: list[Heartbeat] = []
    enough = asyncio.Event()

    def emit(_: str, obs: Observation) -> None:
        if isinstance(obs, Heartbeat):
            seen.append(obs)
            if sum(hb.rtt_s is not None for hb in seen) >= want_ok:
                enough.set()

    clock = SystemClock(asyncio.get_running_loop())
    client = HeartbeatClient(
        "a", f"127.0.0.1:{port}", HB, NO_MICRO, emit, rng=random.Random(5), clock=clock, tls=tls
    )
    task = asyncio.create_task(client.run())
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(enough.wait(), timeout=seconds)
    await client.close()
    await task
    clock.close()
    return seen


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    """The engine every agent here watches (a stub: these tests are about the wire)."""
    async with engine_stub() as stub:
        yield stub.url


def ssl_context(c: Certs) -> ssl.SSLContext:
    """The gateway's client context trusting our CA, as `agent_tls: {ca}` builds it."""
    return client_context(c.ca)


def only_tls_misses(seen: list[Heartbeat]) -> bool:
    return bool(seen) and all(hb.rtt_s is None and hb.reason == "tls" for hb in seen)


@pytest.mark.parametrize("server_name", [None, "localhost"])
async def test_heartbeat_over_tls_gets_pongs(
    start_agent: Callable[..., Proc], engine: str, certs: Certs, server_name: str | None
) -> None:
    """The agent verified by our CA, by its IP SAN or by `server_name`: pongs in time."""
    agent = await asyncio.to_thread(start_agent, engine, *tls_args(certs))
    seen = await beats(agent.port, AgentTlsConfig(ca=certs.ca, server_name=server_name), 5.0)
    assert sum(hb.rtt_s is not None for hb in seen) >= 5, seen
    assert all(hb.reason in ("", "late") for hb in seen)  # no TLS or connect failure at all


@pytest.mark.parametrize(
    ("tls", "why"),
    [
        (lambda c: AgentTlsConfig(ca=c.other_ca), "certificate verify failed"),
        (lambda c: AgentTlsConfig(ca=c.ca, server_name="agent.example"), "Hostname mismatch"),
    ],
    ids=["wrong-ca", "wrong-name"],
)
async def test_agent_that_does_not_verify_gets_tls_misses_only(
    start_agent: Callable[..., Proc],
    engine: str,
    certs: Certs,
    caplog: pytest.LogCaptureFixture,
    tls: Callable[[Certs], AgentTlsConfig],
    why: str,
) -> None:
    """A wrong CA or a wrong name: misses with reason "tls", no pong, logged once."""
    agent = await asyncio.to_thread(start_agent, engine, *tls_args(certs))
    with caplog.at_level(logging.WARNING, logger="pulsegate.probers.heartbeat"):
        seen = await beats(agent.port, tls(certs), 1.0)
    assert only_tls_misses(seen) and len(seen) >= 5, seen
    lines = [r.getMessage() for r in caplog.records if "TLS with agent" in r.getMessage()]
    assert len(lines) == 1 and why in lines[0], lines  # once per change, not per retry


@pytest.mark.parametrize("client", ["none", "rogue"])
async def test_mtls_agent_refuses_a_client_without_a_good_certificate(
    start_agent: Callable[..., Proc], engine: str, certs: Certs, client: str
) -> None:
    """An agent requiring client certificates: none, or one from another CA, gets no pong."""
    agent = await asyncio.to_thread(start_agent, engine, *tls_args(certs, mutual=True))
    tls = AgentTlsConfig(ca=certs.ca)
    if client == "rogue":
        tls = AgentTlsConfig(ca=certs.ca, cert=certs.rogue, key=certs.rogue_key)
    seen = await beats(agent.port, tls, 1.0)
    assert only_tls_misses(seen), seen
    good = AgentTlsConfig(ca=certs.ca, cert=certs.client, key=certs.client_key)
    assert sum(hb.rtt_s is not None for hb in await beats(agent.port, good, 5.0)) >= 5


async def test_plaintext_client_against_a_tls_agent_fails_at_once(
    start_agent: Callable[..., Proc], engine: str, certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    """No `agent_tls` against a TLS-only agent: "tls" misses from the first tick, and a log
    line that says the agent may serve TLS only."""
    agent = await asyncio.to_thread(start_agent, engine, *tls_args(certs))
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pulsegate.probers.heartbeat"):
        seen = await beats(agent.port, None, 1.0)
    assert only_tls_misses(seen), seen
    assert any("may serve TLS only" in r.getMessage() for r in caplog.records)
    assert time.monotonic() - t0 < 3.0


async def test_tls_client_against_a_plaintext_agent_fails_at_once(
    start_agent: Callable[..., Proc], engine: str, certs: Certs
) -> None:
    """`agent_tls` against a plaintext agent: the handshake fails at once, "does not speak
    TLS", and no stream is opened (no pong, only "tls" misses)."""
    agent = await asyncio.to_thread(start_agent, engine, "--gpu", "none")
    seen = await beats(agent.port, AgentTlsConfig(ca=certs.ca), 1.0)
    assert only_tls_misses(seen), seen
    with pytest.raises(grpc_lite.TlsFailure, match="does not speak TLS"):
        await grpc_lite.open_stream(
            "127.0.0.1",
            agent.port,
            STREAM,
            lambda _: None,
            connect_timeout=1.0,
            tls=ssl_context(certs),
        )


async def test_tls_server_that_selects_no_alpn_h2_is_refused(certs: Certs) -> None:
    """A TLS peer that agrees on no ALPN protocol is not an h2 server: refused before the
    HTTP/2 preface is written (it receives not one byte of our request)."""
    received = bytearray()

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            received.extend(await reader.read(1024))
        writer.close()

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # no set_alpn_protocols: selects none
    ctx.load_cert_chain(certs.server, certs.server_key)
    server = await asyncio.start_server(peer, "127.0.0.1", 0, ssl=ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(grpc_lite.TlsFailure, match="did not select ALPN h2"):
            await grpc_lite.open_stream(
                "127.0.0.1",
                port,
                STREAM,
                lambda _: None,
                connect_timeout=1.0,
                tls=ssl_context(certs),
            )
        await asyncio.sleep(0)  # let the peer's read see our close
        assert b"PRI * HTTP/2.0" not in received
    finally:
        server.close()
        await server.wait_closed()


async def test_silent_handshake_is_bounded_by_the_connect_timeout(certs: Certs) -> None:
    """A port that accepts and never answers the ClientHello: TimeoutError within the
    connect timeout (0.3 s here), not a hang."""
    held: list[asyncio.StreamWriter] = []

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # keep it open, say nothing

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            await grpc_lite.open_stream(
                "127.0.0.1",
                port,
                STREAM,
                lambda _: None,
                connect_timeout=0.3,
                tls=ssl_context(certs),
            )
        assert time.monotonic() - t0 < 1.5
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()


def channel_credentials(c: Certs) -> grpc.ChannelCredentials:
    """grpcio's TLS credentials: trust our CA, present the gateway's certificate."""
    return grpc.ssl_channel_credentials(
        root_certificates=Path(c.ca).read_bytes(),
        private_key=Path(c.client_key).read_bytes(),
        certificate_chain=Path(c.client).read_bytes(),
    )


async def test_grpcio_client_with_ssl_channel_credentials(
    start_agent: Callable[..., Proc], engine: str, certs: Certs
) -> None:
    """Standard gRPC interop: grpcio's own TLS client (mutual) gets a pong and the health
    service's SERVING from the mTLS agent."""
    agent = await asyncio.to_thread(start_agent, engine, *tls_args(certs, mutual=True))
    creds = channel_credentials(certs)
    async with grpc.aio.secure_channel(f"127.0.0.1:{agent.port}", creds) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        call = heartbeat_stub(channel).Stream()
        await call.write(pb.Ping(seq=7, send_ns=time.monotonic_ns()))
        pong = await asyncio.wait_for(call.read(), timeout=5)
        assert pong.seq == 7
        call.cancel()


class TlsTransport:
    """The socket side of a finished TLS connection that agreed on h2 (for `GrpcStream`)."""

    def __init__(self) -> None:
        self.aborted = False

    def get_extra_info(self, name: str) -> Any:
        return self if name == "ssl_object" else None

    def selected_alpn_protocol(self) -> str:
        return "h2"

    def write(self, data: bytes) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0  # everything written went out

    def abort(self) -> None:
        self.aborted = True

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass


@pytest.mark.parametrize(
    ("tls", "heard", "exc", "tls_failure"),
    [
        (True, False, None, "requires a client certificate"),
        (True, True, None, None),  # a TLS stream that was up and then closed: not TLS's fault
        (False, False, None, "may serve TLS only"),
        (False, False, ConnectionResetError("reset"), None),  # a crash, as before
        (True, True, ssl.SSLError(1, "bad record mac"), "bad record mac"),
    ],
    ids=["tls-silent", "tls-up", "plain-silent", "plain-reset", "tls-alert"],
)
async def test_which_endings_are_blamed_on_tls(
    tls: bool, heard: bool, exc: Exception | None, tls_failure: str | None
) -> None:
    """Only a close before the agent's first byte, or an SSL error, is a TLS failure."""
    closed: list[str] = []
    s = grpc_lite.GrpcStream("h:1", STREAM, lambda _: None, lambda st: closed.append("x"), tls=tls)
    s.connection_made(TlsTransport())  # type: ignore[arg-type]
    if heard:
        s.data_received(grpc_lite.frame(grpc_lite.SETTINGS, 0, 0))
    s.connection_lost(exc)
    assert closed == ["x"]
    if tls_failure is None:
        assert s.tls_failure is None
    else:
        assert s.tls_failure is not None and tls_failure in s.tls_failure


# -- the agent's flags -------------------------------------------------------------------------


def run_agent_cli(*args: str) -> subprocess.CompletedProcess[str]:
    argv = ["agent", "--engine", "http://127.0.0.1:9", "--listen", "127.0.0.1:0", *args]
    return subprocess.run(
        [sys.executable, "-m", "pulsegate", *argv], capture_output=True, text=True, timeout=30
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (lambda c: ("--tls-cert", "/nonexistent.pem", "--tls-key", c.server_key), "--tls-cert"),
        (lambda c: ("--tls-cert", c.server, "--tls-key", c.client_key), "not the private key"),
        (lambda c: ("--tls-cert", c.server_key, "--tls-key", c.server_key), "no PEM certificate"),
        (lambda c: ("--tls-cert", c.server), "go together"),
        (lambda c: ("--tls-client-ca", c.ca), "--tls-client-ca needs"),
        (
            lambda c: (
                "--tls-cert",
                c.server,
                "--tls-key",
                c.server_key,
                "--tls-client-ca",
                c.server_key,
            ),
            "--tls-client-ca",
        ),
    ],
    ids=["unreadable", "wrong-key", "key-as-cert", "no-key", "ca-alone", "bad-ca"],
)
def test_bad_tls_flags_stop_the_agent_naming_the_flag(
    certs: Certs, args: Callable[[Certs], tuple[str, ...]], says: str
) -> None:
    """A TLS file that cannot be used, or a half-given pair: exit 2 with one clear line."""
    r = run_agent_cli(*args(certs))
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and "PRIVATE KEY" not in r.stderr, r.stderr


def test_the_private_key_stays_out_of_reprs(certs: Certs) -> None:
    """The agent's key bytes never show in a repr (ServerFiles, Agent)."""
    files = read_server_files(certs.server, certs.server_key, certs.ca)
    assert isinstance(files, ServerFiles) and b"PRIVATE KEY" in files.key
    agent = Agent("http://127.0.0.1:9", "127.0.0.1:0", "none", tls=files)
    for text in (repr(files), repr(agent)):
        assert "PRIVATE KEY" not in text, text
    assert "tls=mtls" in repr(agent)


# -- the config keys --------------------------------------------------------------------------

BACKEND = {"name": "a", "url": "http://127.0.0.1:9001", "agent": "10.0.0.7:50051"}


def test_agent_tls_is_read_per_backend(certs: Certs) -> None:
    """`agent_tls` with its four keys becomes the backend's AgentTlsConfig; absent: None."""
    tls = {"ca": certs.ca, "cert": certs.client, "key": certs.client_key, "server_name": "node-7"}
    cfg = parse_config({"backends": [{**BACKEND, "agent_tls": tls}]})
    assert cfg.backends[0].agent_tls == AgentTlsConfig(**tls)
    assert parse_config({"backends": [BACKEND]}).backends[0].agent_tls is None


@pytest.mark.parametrize(
    ("tls", "error"),
    [
        (lambda c: {"ca": "/nonexistent.pem"}, "backends[0].agent_tls.ca: cannot read"),
        (lambda c: {"ca": c.ca, "cert": c.client}, "backends[0].agent_tls.key: is required"),
        (
            lambda c: {"ca": c.ca, "cert": c.client, "key": c.server_key},
            "backends[0].agent_tls.key: ",
        ),
        (lambda c: {"ca": c.client_key}, "backends[0].agent_tls.ca: "),
        (
            lambda c: {"ca": c.ca, "cert": c.client, "key": c.locked_key},
            "backends[0].agent_tls.key: is an encrypted private key",
        ),
        (lambda c: {"ca": c.ca, "cafile": c.ca}, "backends[0].agent_tls.cafile: unknown key"),
        (lambda c: {"ca": c.ca, "server_name": ""}, "backends[0].agent_tls.server_name: "),
    ],
    ids=["unreadable", "cert-alone", "wrong-key", "key-as-ca", "encrypted", "typo", "empty-name"],
)
def test_bad_agent_tls_is_refused_at_load_by_key_path(
    certs: Certs, tls: Callable[[Certs], dict[str, str]], error: str
) -> None:
    """Each bad `agent_tls` is one error naming its key path (and never a key's contents)."""
    with pytest.raises(ConfigError) as ei:
        parse_config({"backends": [{**BACKEND, "agent_tls": tls(certs)}]})
    assert len(ei.value.errors) == 1 and ei.value.errors[0].startswith(error), ei.value.errors
    assert "PRIVATE KEY" not in ei.value.errors[0]


def test_agent_tls_needs_an_agent(certs: Certs) -> None:
    """`agent_tls` on a backend without `agent` is a contradiction, named."""
    no_agent = {"name": "a", "url": "http://127.0.0.1:9001", "agent_tls": {"ca": certs.ca}}
    with pytest.raises(ConfigError) as ei:
        parse_config({"backends": [no_agent]})
    assert ei.value.errors == [
        "backends[0].agent_tls: needs an agent (this backend has no `agent` key)"
    ]


# -- end to end: a gateway process and an mTLS agent ----------------------------------------------


@pytest.fixture
def fleet(tmp_path: Path, certs: Certs) -> Iterator[tuple[Sim, Proc, list[Proc]]]:
    """A sim, its agent serving mutual TLS, and a list the test adds its gateway to."""
    sim = Sim(tmp_path, "node-7")
    procs: list[Proc] = [sim]
    try:
        agent = Proc(
            [
                "agent",
                "--engine",
                sim.url,
                "--listen",
                "127.0.0.1:0",
                *tls_args(certs, mutual=True),
            ],
            tmp_path / "agent.log",
        )
        procs.append(agent)
        yield sim, agent, procs
    finally:
        for p in reversed(procs):
            p.stop()


def metric(gw: Gateway, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in httpx.get(f"{gw.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}{{{want}}} in /metrics")


def test_gateway_keeps_an_mtls_agents_backend_healthy(
    fleet: tuple[Sim, Proc, list[Proc]], certs: Certs, tmp_path: Path
) -> None:
    """A gateway with `agent_tls` (CA, client cert and key) keeps the backend ready on
    heartbeats over mutual TLS: RTTs arrive, and no heartbeat is missed for TLS."""
    sim, agent, procs = fleet
    tls = {"ca": certs.ca, "cert": certs.client, "key": certs.client_key}
    cfg: dict[str, Any] = {
        "backends": [
            {
                "name": sim.name,
                "url": sim.url,
                "models": ["demo-7b"],
                "agent": f"127.0.0.1:{agent.port}",
                "agent_tls": tls,
            }
        ],
        "probes": fast_probes(),
    }
    gw = Gateway(tmp_path, cfg)
    procs.append(gw)
    gw.wait_all_ready()
    view = wait_until(
        lambda: (b := gw.backends()[sim.name])["signals"]["rtt_ms"] is not None and b,
        timeout=10,
        what="heartbeat RTTs over mTLS",
    )
    assert view["state"] == "ready" and view["signals"]["heartbeat_misses"] == 0
    rtts = metric(gw, "pulsegate_heartbeat_rtt_seconds_count", backend=sim.name)
    wait_until(
        lambda: metric(gw, "pulsegate_heartbeat_rtt_seconds_count", backend=sim.name) >= rtts + 10,
        timeout=10,
        what="ten more pongs",
    )
    assert gw.backends()[sim.name]["state"] == "ready"
    assert 'reason="tls"' not in httpx.get(f"{gw.url}/metrics", timeout=5).text
    # A reload to a CA that did not sign the agent restarts the stream: TLS misses, ejected.
    gw.write_config(
        {**cfg, "backends": [{**cfg["backends"][0], "agent_tls": {"ca": certs.other_ca}}]}
    )
    assert gw.reload().status_code == 200
    view = gw.wait_state(sim.name, "ejected", timeout=10)
    assert view["last_cause"] == "heartbeat" and "tls" in view["last_reason"], view
    assert metric(gw, "pulsegate_heartbeat_misses_total", backend=sim.name, reason="tls") >= 3
