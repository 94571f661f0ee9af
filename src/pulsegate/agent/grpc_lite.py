"""A minimal gRPC client for one bidirectional stream over HTTP/2, on an asyncio Protocol.

Why not grpc.aio: a gateway pinging 100 agents every 100 ms sends 1,000 pings and reads
1,000 pongs a second. Through grpc.aio each message is a completion-queue round trip (a
poller thread wakes the event loop through a socket), about 70 us of CPU per message on
the project's 2-core machine: 14 % of one core for 100 agents (bench/heartbeat_cost.py).
This client writes each ping as one HTTP/2 DATA frame straight to the transport and parses
pongs in `data_received`: about 4.5 % of a core for the same load (on uvloop, as the
gateway runs). The agent stays a standard grpc.aio server, so any gRPC client (grpcurl,
grpc_health_probe) can still talk to it.

What it implements, and what it deliberately does not (RFC 9113, gRPC over HTTP/2):
- one request stream (id 1) per connection, prior knowledge cleartext (h2c), or over TLS
  (`open_stream(tls=...)`: asyncio's TLS transport, the handshake within the connect
  timeout, ALPN h2 required, `agent.tls`), the request headers sent as HPACK literals
  without indexing or Huffman coding (valid for any peer);
- response headers and trailers are skipped, not decoded (no HPACK decoder): the stream
  ending, a RST_STREAM, a GOAWAY or the connection closing all mean "the stream is over",
  which is all the heartbeat needs to know;
- flow control both ways: a send that the peer's window or a full socket buffer cannot
  take right now is refused (`send` returns False: back-pressure, R3), never queued;
  our own receive windows start at 2^31-1 and are topped up;
- SETTINGS and PING frames are acknowledged; anything else is ignored. Acks are bounded:
  while the socket's write buffer is above `_WRITE_BUFFER_LIMIT` (the agent is not reading),
  at most `MAX_CONTROL_BACKLOG` more acks are written, then the stream is closed as a
  protocol error (a heartbeat miss saying "control-frame flood"). Without the bound a fake
  agent flooding PINGs without reading had 29 MiB of acks queued in the gateway; with it,
  at most 64 KiB + 1,000 x 17 bytes (~81 KiB) per stream.
- gRPC messages are uncompressed, length-prefixed (1 flag byte + 4-byte length).
"""

from __future__ import annotations

import asyncio
import ssl
import struct
from collections.abc import Callable
from typing import cast

from pulsegate.agent.tls import alpn_problem, describe

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types and flags
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, ACK, END_HEADERS, PADDED = 0x1, 0x1, 0x4, 0x8
# SETTINGS identifiers
SETTINGS_ENABLE_PUSH, SETTINGS_INITIAL_WINDOW_SIZE = 2, 4

STREAM_ID = 1
_MAX_WINDOW = 2**31 - 1
_DEFAULT_WINDOW = 65_535
_TOP_UP_AFTER = 1 << 30  # received bytes before we re-open our receive windows
_MAX_MESSAGE = 4 << 20  # gRPC's default receive limit
_WRITE_BUFFER_LIMIT = 64 * 1024
# Acks (PING 17 bytes, SETTINGS 9) written while the write buffer is above its limit, before
# the agent is judged a flood: Envoy's `max_outbound_control_frames` default (1,000). A real
# agent sends one SETTINGS and no PINGs; a peer that stops reading for a while (a GC pause)
# has its acks queued up to this, then is cut like any other protocol error.
MAX_CONTROL_BACKLOG = 1000


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame: 24-bit length, type, flags, 31-bit stream id, payload."""
    n = len(payload)
    return bytes((n >> 16, (n >> 8) & 0xFF, n & 0xFF, kind, flags)) + stream.to_bytes(4) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """HPACK 'literal header field without indexing - new name', no Huffman coding."""
    return b"\x00" + _hpack_string(name) + _hpack_string(value)


def _never_indexed(name: bytes, value: bytes) -> bytes:
    """HPACK 'literal header field never indexed' (RFC 7541 6.2.3): for secrets, which no
    intermediary may put in a compression table."""
    return b"\x10" + _hpack_string(name) + _hpack_string(value)


def _hpack_string(s: bytes) -> bytes:
    n = len(s)
    if n < 127:
        return bytes((n,)) + s
    out = bytearray((127,))  # 7-bit prefix integer, then continuation bytes
    n -= 127
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out) + s


class TlsFailure(ConnectionError):
    """The TLS handshake failed or agreed on no h2: the message says why (one line)."""


def request_headers(
    authority: str, path: str, metadata: tuple[tuple[str, str], ...] = (), *, tls: bool = False
) -> bytes:
    """The header block of a gRPC call: POST, http(s), path, authority, grpc content type,
    then `metadata` (lower-case ASCII names; sent never-indexed, since it may carry a token)."""
    extra = b"".join(_never_indexed(k.encode(), v.encode()) for k, v in metadata)
    return (
        b"\x83"  # :method POST (static table index 3)
        + (b"\x87" if tls else b"\x86")  # :scheme https (index 7) or http (index 6)
        + _literal(b":path", path.encode())
        + _literal(b":authority", authority.encode())
        + _literal(b"content-type", b"application/grpc")
        + _literal(b"te", b"trailers")
        + _literal(b"user-agent", b"pulsegate-heartbeat/0.1")
        + extra
    )


def message(payload: bytes) -> bytes:
    """A gRPC length-prefixed message (uncompressed)."""
    return b"\x00" + len(payload).to_bytes(4) + payload


class GrpcStream(asyncio.Protocol):
    """One gRPC bidirectional call on its own connection.

    `on_message(bytes)` gets each response message; once the stream is over for any
    reason, `closed` resolves with a short reason and `on_closed(self)` is called (once,
    synchronously, before anything else can use the stream). `send(bytes)` frames and
    writes one request message at once, or returns False when flow control or the socket
    cannot take it now. `tls_failure` says why when TLS ended the stream, or its absence
    did: a handshake that agreed on no h2, an SSL error, or the agent closing before its
    first byte (`_tls_cause`). `tls` says the transport is TLS (set by `open_stream`).
    """

    def __init__(
        self,
        authority: str,
        path: str,
        on_message: Callable[[bytes], None],
        on_closed: Callable[[GrpcStream], None] | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
        *,
        tls: bool = False,
    ) -> None:
        self._authority = authority
        self._path = path
        self._metadata = metadata
        self._on_message = on_message
        self._on_closed = on_closed
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._msg = bytearray()
        self._paused = False
        self._send_conn = _DEFAULT_WINDOW
        self._send_stream = _DEFAULT_WINDOW
        self._peer_initial = _DEFAULT_WINDOW
        self._received = 0
        self._backlog = 0  # acks written over the write buffer's limit, in a row
        self.tls_failure: str | None = None
        self._tls = tls  # the transport is TLS (its handshake done before connection_made)
        self._heard = False  # the agent has sent a byte (its SETTINGS come first)
        self.closed: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's and uvloop's TCP transports (uvloop's is no asyncio.Transport subclass)
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        if self._tls and (problem := alpn_problem(transport.get_extra_info("ssl_object"))):
            self.tls_failure = problem  # never speak h2 where it was not agreed
            self._finish(f"tls: {problem}")
            return
        transport.set_write_buffer_limits(high=_WRITE_BUFFER_LIMIT)
        settings = struct.pack(
            ">HIHI", SETTINGS_ENABLE_PUSH, 0, SETTINGS_INITIAL_WINDOW_SIZE, _MAX_WINDOW
        )
        headers = request_headers(self._authority, self._path, self._metadata, tls=self._tls)
        transport.write(
            PREFACE
            + frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, (_MAX_WINDOW - _DEFAULT_WINDOW).to_bytes(4))
            + frame(HEADERS, END_HEADERS, STREAM_ID, headers)
        )

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.tls_failure = self._tls_cause(exc)
            if self.tls_failure is not None:
                self._finish(f"tls: {self.tls_failure}")
                return
        self._finish(f"connection lost: {exc}" if exc else "connection closed")

    def _tls_cause(self, exc: Exception | None) -> str | None:
        """Why TLS (or its absence) ended the connection, if it did. An HTTP/2 server's first
        frame is its SETTINGS (RFC 9113 3.4), sent at once: a peer that closes before sending
        a byte did not take the connection at all. Over TLS that is the agent refusing our
        client certificate (a TLS 1.3 server decides after the client's handshake is done,
        and grpcio's closes without an alert); in cleartext, a TLS-only agent."""
        if isinstance(exc, ssl.SSLError):
            return describe(exc)
        if self._heard:
            return None
        if self._tls and (exc is None or isinstance(exc, ConnectionResetError)):
            return (
                "the agent closed the connection after the TLS handshake: it requires a client "
                "certificate (agent_tls.cert, agent_tls.key) and refused ours or its absence"
            )
        if not self._tls and exc is None:  # an orderly close, not a crash (that resets)
            return (
                "the agent closed the connection before HTTP/2 began: it may serve TLS only "
                "(set agent_tls for this backend)"
            )
        return None

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False

    def data_received(self, data: bytes) -> None:
        self._heard = True
        buf = self._buf
        buf += data
        pos = 0
        n_buf = len(buf)
        while n_buf - pos >= 9:
            length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
            end = pos + 9 + length
            if end > n_buf:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            stream = int.from_bytes(buf[pos + 5 : pos + 9]) & 0x7FFFFFFF
            payload = bytes(buf[pos + 9 : end])
            pos = end
            self._frame(kind, flags, stream, payload)
            if self.closed.done():
                return
        del buf[:pos]

    # -- frames ---------------------------------------------------------------------------

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == DATA:
            self._data(flags, stream, payload)
        elif kind == HEADERS:
            if stream == STREAM_ID and flags & END_STREAM:
                self._finish("stream ended by the agent")
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
        elif kind == PING:
            if not flags & ACK:
                self._ack(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            if len(payload) == 4:
                inc = int.from_bytes(payload) & 0x7FFFFFFF
                if stream == 0:
                    self._send_conn += inc
                elif stream == STREAM_ID:
                    self._send_stream += inc
        elif kind == RST_STREAM:
            if stream == STREAM_ID:
                self._finish("stream reset by the agent")
        elif kind == GOAWAY:
            self._finish("agent sent GOAWAY")
        # PRIORITY, PUSH_PROMISE (disabled), CONTINUATION, unknown: nothing to do

    def _data(self, flags: int, stream: int, payload: bytes) -> None:
        self._received += len(payload)
        if self._received >= _TOP_UP_AFTER and self._transport is not None:
            inc = self._received.to_bytes(4)
            self._transport.write(
                frame(WINDOW_UPDATE, 0, 0, inc) + frame(WINDOW_UPDATE, 0, STREAM_ID, inc)
            )
            self._received = 0
        if stream != STREAM_ID:
            return
        if flags & PADDED and payload:
            pad = payload[0]
            payload = payload[1 : len(payload) - pad]
        msg = self._msg
        msg += payload
        pos = 0
        n = len(msg)
        while n - pos >= 5:
            length = int.from_bytes(msg[pos + 1 : pos + 5])
            if msg[pos] != 0 or length > _MAX_MESSAGE:
                self._finish("bad gRPC message from the agent (compressed or oversized)")
                return
            if n - pos - 5 < length:
                break
            body = bytes(msg[pos + 5 : pos + 5 + length])
            pos += 5 + length
            self._on_message(body)
            if self.closed.done():
                return
        del msg[:pos]
        if flags & END_STREAM:
            self._finish("stream ended by the agent")

    def _settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) - len(payload) % 6, 6):
            ident, value = struct.unpack_from(">HI", payload, i)
            if ident == SETTINGS_INITIAL_WINDOW_SIZE:
                self._send_stream += value - self._peer_initial
                self._peer_initial = value
        self._ack(frame(SETTINGS, ACK, 0))

    def _ack(self, data: bytes) -> None:
        """Write a control frame's ack, or close the stream when the agent floods them
        (more than MAX_CONTROL_BACKLOG while our write buffer is above its limit)."""
        t = self._transport
        if t is None:
            return
        if t.get_write_buffer_size() <= _WRITE_BUFFER_LIMIT:
            self._backlog = 0
        else:
            self._backlog += 1
            if self._backlog > MAX_CONTROL_BACKLOG:
                self._finish(
                    f"protocol error: control-frame flood ({MAX_CONTROL_BACKLOG} PING/SETTINGS "
                    "acks unread by the agent)"
                )
                return
        t.write(data)

    # -- sending and closing ----------------------------------------------------------------

    def send(self, payload: bytes) -> bool:
        """Write one request message now; False (nothing written) under back-pressure."""
        t = self._transport
        if t is None or self.closed.done() or self._paused:
            return False
        data = message(payload)
        n = len(data)
        if n > self._send_conn or n > self._send_stream:
            return False
        if t.get_write_buffer_size() > _WRITE_BUFFER_LIMIT:
            return False
        self._send_conn -= n
        self._send_stream -= n
        t.write(frame(DATA, 0, STREAM_ID, data))
        return True

    def abort(self, reason: str) -> None:
        """Drop the connection at once (no goodbye: the peer may be frozen)."""
        self._finish(reason)

    def _finish(self, reason: str) -> None:
        if self._transport is not None:
            self._transport.abort()
        if not self.closed.done():
            self.closed.set_result(reason)
            if self._on_closed is not None:
                self._on_closed(self)


async def open_stream(
    host: str,
    port: int,
    path: str,
    on_message: Callable[[bytes], None],
    on_closed: Callable[[GrpcStream], None] | None = None,
    *,
    connect_timeout: float,
    metadata: tuple[tuple[str, str], ...] = (),
    tls: ssl.SSLContext | None = None,
    server_name: str | None = None,
) -> GrpcStream:
    """Connect and, with `tls`, shake hands (both within `connect_timeout` s), then start the
    call with `metadata` (e.g. the agent token). `server_name` is the name the agent's
    certificate must carry (default: `host`). Raises `TlsFailure` for a failed handshake or
    no ALPN h2, else OSError or TimeoutError. The handshake runs on the loop's TLS transport
    (memory BIOs): it never blocks the loop."""
    loop = asyncio.get_running_loop()
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        async with asyncio.timeout(connect_timeout):
            _, proto = await loop.create_connection(
                lambda: GrpcStream(
                    authority, path, on_message, on_closed, metadata, tls=tls is not None
                ),
                host,
                port,
                ssl=tls,
                server_hostname=(server_name or host) if tls is not None else None,
                ssl_handshake_timeout=connect_timeout if tls is not None else None,
            )
    except ssl.SSLError as e:
        raise TlsFailure(describe(e)) from e
    if proto.tls_failure is not None:
        raise TlsFailure(proto.tls_failure)
    return proto


def split_target(target: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port); raises ValueError."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"agent address must be HOST:PORT, not {target!r}")
    return host.strip("[]"), int(port)
