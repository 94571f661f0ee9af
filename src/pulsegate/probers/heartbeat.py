"""The gateway's side of the agent heartbeat stream (R1-R4): pings out, observations in.

One `HeartbeatClient` per backend with an agent keeps one long-lived bidirectional gRPC
stream to it and reports, through ``emit(name, observation)``:

- `Heartbeat(rtt_s, facts)` for every pong back within ``cfg.timeout`` of its ping, with
  RTT = receive time - the echoed send time (both this process's monotonic clock) and the
  pong's GPU and engine facts;
- `Heartbeat(None, reason=...)` for every miss, the moment it is one: ``"late"`` (no pong
  within the timeout: emitted when the deadline passes, not when a pong finally comes),
  ``"backpressure"`` (the ping could not be written at its tick: the agent's flow-control
  window or our socket buffer is full), ``"stream_broken"`` (the stream failed: each ping
  it swallowed, or the break itself when none was outstanding), ``"disconnected"`` (one
  per interval while there is no stream), ``"tls"`` (the same, when TLS is why: see below);
- `ProbeResult(MICRO, ...)` for the micro-inference the agent runs on its local engine
  every ``micro.interval`` + U(0, ``micro.jitter``) seconds (3-5 s by default), requested
  inside the stream; nothing when the engine was merely busy (429) or the stream was down
  (the heartbeat misses already say that);
- `ProbeResult(READINESS, ok, ready=...)` whenever the agent's view of the engine's
  ``/health`` changes (and on each new stream): R27 readiness from the node itself.

The health core counts consecutive misses (``misses_to_dead``); this client only makes each
miss prompt. Timeline for a frozen agent with the defaults (100 ms interval, 80 ms timeout,
3 misses) - the first ping after the fault leaves at t0, 0-100 ms after it:

    t0        ping 1 (regular)
    t0 + 80   miss 1 ("late") -> suspicion: confirm at once instead of waiting 100 ms
    t0 + 80   ping 2 (confirmation)       t0 + 100  ping 3 (regular tick)
    t0 + 160  miss 2                      t0 + 180  miss 3 -> the core ejects

so detection is 180-280 ms after the fault (230 ms on average) instead of 280-380 ms with
pings at the plain cadence, and still needs 180 ms of silence: a 100 ms hiccup never
ejects. Confirmation pings are sent `timeout / 4` apart and only while fewer pings are
outstanding than misses still needed, so a sick agent gets at most two extra pings.

A broken stream (agent killed: the kernel resets the connection at once) counts as one
miss right away, then one per interval while reconnecting, with jittered exponential
backoff (50 ms doubling to 2 s, each delay drawn from [d/2, d]). A reconnect within the
miss budget is therefore no ejection. A stream with no pong for `stale_after` seconds
(a half-open TCP connection) is abandoned and re-dialled.

TLS (`agent_tls`): each dial builds the client context from the files (`agent.tls`: so a
rotated certificate is used from the next stream on) and shakes hands within the connect
timeout. A failure there - a certificate that does not verify or name the agent, no ALPN
h2, an agent that drops the connection right after the handshake (it refused our client
certificate: TLS 1.3 says so only after the client's side is done) or before HTTP/2
began (a plaintext client at a TLS-only agent), a file gone unreadable - is reported as
``"tls"`` misses instead of ``"stream_broken"`` / ``"disconnected"``, so the metric says
what to fix. It is logged when it starts or its text changes, not at every retry, and
never falls back to plaintext.

If the gateway's own event loop stalls (`pulsegate.stall`), the deadline is pushed back by
the stall, and a deadline that fires late is re-checked 2 ms later, after pongs already
received have been read: a gateway pause must not eject every backend.

One `Clock`, passed in, times everything here: the tick, the deadlines, the backoff, and
the RTT stamps (only the 1 s connect timeout is `agent.grpc_lite`'s own, on the loop). The
pings' deadline bookkeeping and confirmation pings are `heartbeat_pings`, the
micro-inference rounds `heartbeat_micro`; this module keeps the stream up and turns pongs
into observations.

Cost: the stream is `agent.grpc_lite.GrpcStream` (gRPC framing written straight to the
socket) rather than grpc.aio, whose per-message overhead cost 14 % of a core for 100
agents against about 4.5 % here (bench/heartbeat_cost.py, on uvloop). Ticks are timer
callbacks, not tasks; per ping: one timer, one socket write, one pong parse; the decoded
`EngineFacts` is reused while the agent's facts have not changed. Over mutual TLS each
ping and pong is also one TLS record: about 1.9x the plaintext CPU (`--tls` of the bench).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import Callable

from pulsegate.agent.grpc_lite import GrpcStream, TlsFailure, open_stream, split_target
from pulsegate.agent.tls import TlsSetupError, client_context
from pulsegate.agent.wire import SERVICE_NAME, facts_from_pong, pb
from pulsegate.clock import Clock, Handle
from pulsegate.config import AgentTlsConfig, HeartbeatConfig, MicroInferenceConfig
from pulsegate.health.observations import (
    EngineFacts,
    Heartbeat,
    Observation,
    ProbeKind,
    ProbeResult,
)
from pulsegate.probers.heartbeat_micro import MICRO, StreamMicro
from pulsegate.probers.heartbeat_pings import Pings
from pulsegate.probers.waits import wait_future

log = logging.getLogger("pulsegate.probers.heartbeat")

STREAM_PATH = f"/{SERVICE_NAME}/Stream"
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
CONNECT_TIMEOUT_S = 1.0


class HeartbeatClient:
    """Pings one agent over one long-lived stream and emits what it learns.

    `token`, when given, is presented on every stream (``authorization: Bearer ...``); an
    agent that refuses it ends each stream at once, which reads as misses. `tls`, when
    given, is the backend's `agent_tls`: every stream is TLS, never plaintext.
    `run()` returns only after `close()`; it never raises for anything the agent or the
    network does. `clock` is the one time source: it stamps pings and pongs and times the
    cadence, the deadlines and the backoff. `rng` draws the micro-inference jitter and the
    backoff.
    """

    def __init__(
        self,
        name: str,
        target: str,
        cfg: HeartbeatConfig,
        micro: MicroInferenceConfig,
        emit: Callable[[str, Observation], None],
        rng: random.Random | None = None,
        *,
        clock: Clock,
        stale_after: float | None = None,
        token: str | None = None,
        tls: AgentTlsConfig | None = None,
        owns: Callable[[], bool] = lambda: True,
    ) -> None:
        self.name = name
        # The agent's shared token (`agent_token_env`), sent as metadata on every stream;
        # kept out of reprs and logs.
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self.target = target
        self._host, self._port = split_target(target)
        self.tls = tls
        self._down_reason = "disconnected"  # or "tls": the reason of each miss while down
        self._failure: str | None = None  # the last dial failure logged (logged on change)
        self.cfg = cfg
        self.micro = micro
        self._emit_cb = emit
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._stale_after = stale_after if stale_after is not None else max(2.0, 20 * cfg.interval)
        next_seq = itertools.count(1).__next__  # one numbering for every message sent
        self._pings = Pings(cfg, clock, next_seq, self._emit)
        # Among gateway replicas only the backend's owner sends the micro-inference (`owns`);
        # a round that is not ours is skipped like one without a stream.
        self._micro = StreamMicro(
            micro, clock, self._rng, next_seq, self._emit,
            lambda: self._stream is not None and owns(),
        )  # fmt: skip

        self._loop: asyncio.AbstractEventLoop | None = None
        self._stream: GrpcStream | None = None
        self._stream_good = False  # this stream has delivered a pong in time
        self._last_stream_good = False
        self._stream_started = 0.0
        self._next_tick = 0.0
        self._tick_handle: Handle | None = None
        self._facts_version = -1
        self._facts: EngineFacts | None = None
        self._readiness: tuple[bool, bool, str] | None = None
        self._last_pong_at = 0.0
        self._closing = False
        self._stop: asyncio.Future[None] | None = None
        self._done: asyncio.Future[None] | None = None

    def __repr__(self) -> str:  # never the token
        token = "set" if self._metadata else "none"
        tls = "none" if self.tls is None else "mtls" if self.tls.cert else "tls"
        return f"HeartbeatClient({self.name!r}, {self.target!r}, token={token}, tls={tls})"

    # -- lifecycle ------------------------------------------------------------------------

    async def run(self) -> None:
        """Keep the stream up and the pings flowing until `close()`."""
        if self._closing or self._loop is not None:
            return
        loop = self._loop = asyncio.get_running_loop()
        self._stop = loop.create_future()
        self._done = loop.create_future()
        self._micro.start()
        try:
            await self._connect_loop()
        finally:
            self._shutdown()
            self._done.set_result(None)

    async def close(self) -> None:
        """Stop pinging, drop the stream, and wait until `run()` has returned."""
        self._closing = True
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(None)
        if self._done is not None:
            await asyncio.shield(self._done)

    async def _connect_loop(self) -> None:
        assert self._stop is not None
        attempt = 0
        while not self._stop.done():
            stream = await self._dial()
            if self._tick_handle is None:  # the cadence starts once the first dial is decided
                self._next_tick = self._clock.now()
                self._tick_handle = self._clock.call_later(0, self._tick)
            if stream is not None:
                self._begin(stream)
                await asyncio.wait((stream.closed, self._stop), return_when=asyncio.FIRST_COMPLETED)
                stream.abort("closing")  # no-op when it is over already
                if self._stop.done():
                    return
                if stream.tls_failure is not None:
                    self._failed("tls", f"TLS with agent {self.target}: {stream.tls_failure}")
                elif self._last_stream_good:
                    log.warning(
                        "heartbeat %s: stream lost (%s), reconnecting",
                        self.name,
                        stream.closed.result(),
                    )
                    attempt = 0
            attempt += 1
            d = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** min(attempt - 1, 16))
            await wait_future(self._clock, self._stop, d * (0.5 + 0.5 * self._rng.random()))

    async def _dial(self) -> GrpcStream | None:
        """One connection attempt (TCP, then TLS when configured); None when it failed, the
        reason and the log line decided here."""
        ctx, name = None, None
        if self.tls is not None:
            try:  # read at each dial: rotated files are picked up (a few KB, once a stream)
                ctx = client_context(self.tls.ca, self.tls.cert, self.tls.key)
            except TlsSetupError as e:
                self._failed("tls", f"agent_tls.{e.role}: {e}")
                return None
            name = self.tls.server_name
        try:
            return await open_stream(
                self._host,
                self._port,
                STREAM_PATH,
                self._on_message,
                self._on_closed,
                connect_timeout=CONNECT_TIMEOUT_S,
                metadata=self._metadata,
                tls=ctx,
                server_name=name,
            )
        except TlsFailure as e:
            self._failed("tls", f"TLS with agent {self.target} failed: {e}")
        except TimeoutError:
            what = "connect or TLS handshake" if ctx is not None else "connect"
            self._failed("disconnected", f"cannot reach agent {self.target}: {what} timed out")
        except OSError as e:
            self._failed("disconnected", f"cannot reach agent {self.target}: {e}")
        return None

    def _failed(self, reason: str, message: str) -> None:
        """The agent cannot be talked to: misses say `reason` until a stream answers; the
        message is logged when it differs from the last one (not at every retry)."""
        self._down_reason = reason
        if message != self._failure:
            self._failure = message
            log.warning("heartbeat %s: %s", self.name, message)

    @property
    def connected(self) -> bool:
        """The stream is up and has answered: micro-inference travels inside it."""
        return self._stream is not None and self._stream_good

    def _begin(self, stream: GrpcStream) -> None:
        self._last_stream_good = False
        if stream.closed.done():
            return  # lost between connecting and here: `_on_closed` had nothing to do
        self._stream, self._stream_good, self._stream_started = stream, False, self._clock.now()
        self._facts_version, self._facts, self._readiness = -1, None, None
        self._pings.attach(stream)

    def _on_closed(self, stream: GrpcStream) -> None:
        """The stream is gone: every ping it swallowed is a miss now (the break itself is one
        when none was outstanding); micro-inferences in flight are dropped silently."""
        if stream is not self._stream:
            return
        self._stream = None
        was_good = self._last_stream_good = self._stream_good
        n = self._pings.detach()
        self._micro.drop()
        reason = "stream_broken" if stream.tls_failure is None else "tls"
        if stream.tls_failure is not None:
            self._down_reason = "tls"
        if not self._closing:
            for _ in range(max(n, 1 if was_good else 0)):
                self._emit(Heartbeat(None, reason=reason))

    def _shutdown(self) -> None:
        if self._stream is not None:
            self._stream.abort("closing")
            self._stream = None
        self._pings.detach()
        self._micro.close()
        if self._tick_handle is not None:
            self._tick_handle.cancel()
            self._tick_handle = None

    # -- emitting -------------------------------------------------------------------------

    def _emit(self, obs: Observation) -> None:
        try:
            self._emit_cb(self.name, obs)
        except Exception:  # the consumer's bug must not stop the heartbeat
            log.exception("heartbeat %s: emit failed", self.name)

    # -- the cadence ----------------------------------------------------------------------

    def _tick(self) -> None:
        """The regular cadence: one ping (or one miss) per interval, then the micro."""
        clock = self._clock
        now = clock.now()
        self._next_tick += self.cfg.interval
        if self._next_tick <= now:  # the loop was stalled: do not fire a burst
            self._next_tick = now + self.cfg.interval
        self._tick_handle = clock.call_at(self._next_tick, self._tick)
        stream = self._stream
        if stream is None:
            self._emit(Heartbeat(None, reason=self._down_reason))
            return
        if now - max(self._last_pong_at, self._stream_started) > self._stale_after:
            log.warning(
                "heartbeat %s: no pong for %.1fs, re-dialling", self.name, self._stale_after
            )
            stream.abort("stale: no pong")
            return
        if not self._pings.send(now):
            # Flow control or a full socket buffer: the ping cannot even leave (R3).
            self._emit(Heartbeat(None, reason="backpressure"))
            return
        if self._micro.due:
            self._micro.send(stream)

    # -- pongs ----------------------------------------------------------------------------

    def _on_message(self, data: bytes) -> None:
        try:
            pong = pb.Pong.FromString(data)
        except Exception:  # DecodeError: not our agent, or a broken one
            if self._stream is not None:
                self._stream.abort("undecodable pong")
            return
        self._on_pong(pong)

    def _on_pong(self, pong: pb.Pong) -> None:
        now = self._last_pong_at = self._clock.now()
        if pong.kind == MICRO:
            self._micro.on_pong(pong)
            return
        sent_at = self._pings.answered(pong.seq)
        if sent_at is None:
            return  # already counted as a miss (late)
        if not self._stream_good:  # answered: whatever failed before is over
            self._stream_good, self._down_reason, self._failure = True, "disconnected", None
        rtt = now - pong.echo_send_ns / 1e9
        if rtt < 0:  # an agent that does not echo faithfully: trust our own record
            rtt = now - sent_at
        self._emit(Heartbeat(rtt, self._facts_of(pong)))
        self._note_readiness(pong)

    def _facts_of(self, pong: pb.Pong) -> EngineFacts:
        if pong.facts_version != self._facts_version or self._facts is None:
            self._facts = facts_from_pong(pong)
            self._facts_version = pong.facts_version
        return self._facts

    def _note_readiness(self, pong: pb.Pong) -> None:
        if not pong.HasField("engine_ready"):
            return
        answered = not pong.engine_unreachable
        seen = (answered, pong.engine_ready, pong.engine_status)
        if seen == self._readiness:
            return
        self._readiness = seen
        reason = f"agent: {pong.engine_status}" if pong.engine_status else "agent"
        ready = pong.engine_ready if answered else None
        # The agent on the engine's own node could not connect to its loopback port.
        refused = not answered and pong.engine_status.endswith("connection refused")
        self._emit(
            ProbeResult(ProbeKind.READINESS, answered, None, reason, ready=ready, refused=refused)
        )
