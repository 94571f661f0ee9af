"""A fake agent that floods PING or SETTINGS frames and never reads (issue #22): the heartbeat
client's acks are bounded (`grpc_lite.MAX_CONTROL_BACKLOG` past the write buffer's limit),
then the stream closes as a protocol error. On the landed code 29 MiB of acks queued.

The agent is a raw asyncio server on loopback that stops reading at once, so the client's
acks fill the kernel buffers and then its transport's; socket buffers are shrunk to 4 KiB
on both ends to reach that in a few hundred KiB of flood instead of several MiB.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from pulsegate.agent import grpc_lite as g

FLOOD_BYTES = 64 * 1024 * 1024  # the fake agent gives up here: every loop bounded
_PIECE = 1024  # frames per write


class FloodingAgent(asyncio.Protocol):
    """Sends its SETTINGS, then control frames as fast as the client takes them; reads
    nothing (the client's acks pile up on the client's side)."""

    def __init__(self, control: bytes) -> None:
        self.control = control
        self.sent = 0
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.pause_reading()
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        transport.write(g.frame(g.SETTINGS, 0, 0))
        self.task = asyncio.get_running_loop().create_task(self._flood())

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self._can_write.set()

    async def _flood(self) -> None:
        t = self.transport
        assert t is not None
        burst = self.control * _PIECE
        while self.sent < FLOOD_BYTES and not t.is_closing():
            await self._can_write.wait()
            t.write(burst)
            self.sent += len(burst)
            await asyncio.sleep(0)


@pytest.mark.parametrize(
    ("kind", "control"),
    [
        ("ping", g.frame(g.PING, 0, 0, b"12345678")),
        ("settings", g.frame(g.SETTINGS, 0, 0)),
    ],
)
async def test_a_control_frame_flood_closes_the_stream(kind: str, control: bytes) -> None:
    """A flood the agent never reads the acks of ends the stream as a protocol error, with
    the client's write buffer bounded by the limit plus MAX_CONTROL_BACKLOG acks."""
    loop = asyncio.get_running_loop()
    agents: list[FloodingAgent] = []

    def make() -> FloodingAgent:
        agents.append(FloodingAgent(control))
        return agents[-1]

    server = await loop.create_server(make, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        stream = await g.open_stream(
            "127.0.0.1", port, "/svc/M", lambda _m: None, connect_timeout=2.0
        )
        t = stream._transport
        assert t is not None
        t.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        worst = 0
        async with asyncio.timeout(20):
            while not stream.closed.done():
                worst = max(worst, t.get_write_buffer_size())
                await asyncio.sleep(0.001)
        reason = stream.closed.result()
        ack = 17 if kind == "ping" else 9
        print(f"\n{kind} flood: closed after {agents[0].sent} B, worst buffer {worst} B")
        assert "control-frame flood" in reason, reason
        assert worst <= g._WRITE_BUFFER_LIMIT + (g.MAX_CONTROL_BACKLOG + 1) * ack + ack
        assert agents[0].sent < FLOOD_BYTES  # the client gave up, not the flood
    finally:
        server.close()
        for a in agents:
            if a.transport is not None:
                a.transport.abort()
            if a.task is not None:
                a.task.cancel()
        await server.wait_closed()


async def test_a_reading_agent_gets_every_ack() -> None:
    """Acks below the write buffer's limit are all written: the bound never touches a
    peer that reads."""
    from test_grpc_lite import connected, frames

    s, t, _, closed = connected()
    start = len(t.written)
    s.data_received(g.frame(g.PING, 0, 0, b"abcdefgh") * (g.MAX_CONTROL_BACKLOG * 3))
    acks = [f for f in frames(bytes(t.written[start:])) if f[0] == g.PING]
    assert len(acks) == g.MAX_CONTROL_BACKLOG * 3 and not closed
    t.buffered = g._WRITE_BUFFER_LIMIT + 1  # the agent stopped reading
    s.data_received(g.frame(g.PING, 0, 0, b"abcdefgh") * (g.MAX_CONTROL_BACKLOG + 1))
    assert closed and "control-frame flood" in closed[0]
