"""The gateway's minimal gRPC-over-HTTP/2 client: framing, flow control and endings, fed
byte by byte through a recording transport; and one call against a real grpc.aio server."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import grpc
import pytest

from pulsegate.agent import grpc_lite as g
from pulsegate.agent.wire import SERVICE_NAME, add_heartbeat_service, pb, pb_grpc


class Transport:
    """Records what the protocol writes; the socket side of asyncio's transport API."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.aborted = False
        self.buffered = 0

    def write(self, data: bytes) -> None:
        self.written += data

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, pos = [], 0
    while pos < len(data):
        n = int.from_bytes(data[pos : pos + 3])
        kind, flags = data[pos + 3], data[pos + 4]
        sid = int.from_bytes(data[pos + 5 : pos + 9])
        out.append((kind, flags, sid, bytes(data[pos + 9 : pos + 9 + n])))
        pos += 9 + n
    return out


def connected() -> tuple[g.GrpcStream, Transport, list[bytes], list[str]]:
    got: list[bytes] = []
    closed: list[str] = []
    s = g.GrpcStream("h:1", "/svc/M", got.append, lambda st: closed.append(st.closed.result()))
    t = Transport()
    s.connection_made(t)  # type: ignore[arg-type]
    return s, t, got, closed


async def test_opening_sends_preface_settings_window_and_request_headers() -> None:
    """The connection opens with the preface, SETTINGS, a window update and HEADERS."""
    _, t, _, _ = connected()
    assert bytes(t.written).startswith(g.PREFACE)
    kinds = [(k, sid) for k, _, sid, _ in frames(bytes(t.written[len(g.PREFACE) :]))]
    assert kinds == [(g.SETTINGS, 0), (g.WINDOW_UPDATE, 0), (g.HEADERS, 1)]
    block = frames(bytes(t.written[len(g.PREFACE) :]))[2][3]
    assert b"/svc/M" in block and b"application/grpc" in block and b"trailers" in block


async def test_messages_split_anywhere_arrive_whole_and_in_order() -> None:
    """Messages split across frames and reads, several per frame, padded: each arrives whole."""
    s, _, got, _ = connected()
    a, b, c = b"first", b"second-message" * 20, b""
    wire = g.message(a) + g.message(b) + g.message(c)
    padded = bytes((3,)) + wire[:10] + b"\0\0\0"
    data = g.frame(g.DATA, g.PADDED, 1, padded) + g.frame(g.DATA, 0, 1, wire[10:])
    for i in range(len(data)):  # one byte per read: the worst split there is
        s.data_received(data[i : i + 1])
    assert got == [a, b, c]


async def test_settings_and_pings_are_acknowledged() -> None:
    """A peer's SETTINGS and PING frames are acknowledged; ACKs are not answered."""
    s, t, _, _ = connected()
    t.written.clear()
    s.data_received(g.frame(g.SETTINGS, 0, 0, b"") + g.frame(g.PING, 0, 0, b"12345678"))
    s.data_received(g.frame(g.SETTINGS, g.ACK, 0) + g.frame(g.PING, g.ACK, 0, b"x" * 8))
    assert frames(bytes(t.written)) == [
        (g.SETTINGS, g.ACK, 0, b""),
        (g.PING, g.ACK, 0, b"12345678"),
    ]


async def test_send_respects_the_peers_flow_control_window() -> None:
    """Past the peer's window a send is refused (back-pressure) until it opens again."""
    s, t, _, _ = connected()
    small = struct.pack(">HI", g.SETTINGS_INITIAL_WINDOW_SIZE, 20)
    s.data_received(g.frame(g.SETTINGS, 0, 0, small))
    assert s.send(b"x" * 10)  # 15 bytes with the gRPC prefix
    assert not s.send(b"y" * 10)  # 5 left in the stream window
    s.data_received(g.frame(g.WINDOW_UPDATE, 0, 1, (100).to_bytes(4)))
    assert s.send(b"y" * 10)
    sent = [p for k, _, sid, p in frames(bytes(t.written[len(g.PREFACE) :])) if k == g.DATA]
    assert sent == [g.message(b"x" * 10), g.message(b"y" * 10)]


async def test_full_socket_buffer_refuses_sends() -> None:
    """A paused transport or a full write buffer refuses a send instead of queueing it."""
    s, t, _, _ = connected()
    s.pause_writing()
    assert not s.send(b"a")
    s.resume_writing()
    t.buffered = 1 << 20
    assert not s.send(b"a")
    t.buffered = 0
    assert s.send(b"a")


async def test_every_ending_closes_the_stream_once() -> None:
    """Trailers, RST_STREAM, GOAWAY and a lost connection each end the stream, once."""
    endings = [
        g.frame(g.HEADERS, g.END_HEADERS | g.END_STREAM, 1, b"\x88"),
        g.frame(g.RST_STREAM, 0, 1, (8).to_bytes(4)),
        g.frame(g.GOAWAY, 0, 0, bytes(8)),
        g.frame(g.DATA, g.END_STREAM, 1, b""),
    ]
    for ending in endings:
        s, t, _, closed = connected()
        s.data_received(ending)
        s.connection_lost(None)
        assert len(closed) == 1 and t.aborted
        assert not s.send(b"a")
    s, _, _, closed = connected()
    s.connection_lost(ConnectionResetError("reset"))
    assert closed == ["connection lost: reset"]


async def test_compressed_message_is_refused() -> None:
    """A compressed gRPC message (we never asked for one) ends the stream."""
    s, _, got, closed = connected()
    s.data_received(g.frame(g.DATA, 0, 1, b"\x01" + (1).to_bytes(4) + b"z"))
    assert got == [] and closed and "compressed" in closed[0]


class Echo(pb_grpc.HeartbeatServicer):  # type: ignore[misc]
    async def Stream(self, request_iterator: Any, context: Any) -> Any:
        async for ping in request_iterator:
            yield pb.Pong(seq=ping.seq, echo_send_ns=ping.send_ns)


async def test_talks_to_a_real_grpc_server() -> None:
    """Against grpcio's own server: pings go out, pongs come back, closing ends it."""
    server = grpc.aio.server()
    add_heartbeat_service(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        got: list[bytes] = []
        arrived = asyncio.Event()

        def on_message(b: bytes) -> None:
            got.append(b)
            if len(got) == 50:
                arrived.set()

        stream = await g.open_stream(
            "127.0.0.1", port, f"/{SERVICE_NAME}/Stream", on_message, connect_timeout=2
        )
        for i in range(50):
            assert stream.send(pb.Ping(seq=i, send_ns=i * 10).SerializeToString())
        await asyncio.wait_for(arrived.wait(), 5)
        pongs = [pb.Pong.FromString(b) for b in got]
        assert [(p.seq, p.echo_send_ns) for p in pongs] == [(i, i * 10) for i in range(50)]
        await server.stop(grace=None)
        assert await asyncio.wait_for(stream.closed, 5)  # a reason, whichever way it ended
    finally:
        await server.stop(grace=None)


def test_split_target() -> None:
    """HOST:PORT and [v6]:PORT parse."""
    assert g.split_target("10.0.0.1:50051") == ("10.0.0.1", 50051)
    assert g.split_target("[::1]:7") == ("::1", 7)


@pytest.mark.parametrize("bad", ["nohost", "h:", ":1", "h:x"])
def test_split_target_refuses_bad_addresses(bad: str) -> None:
    """An agent address without a host or a numeric port is refused."""
    with pytest.raises(ValueError, match="HOST:PORT"):
        g.split_target(bad)
