"""Frames between the primary and a worker: what is sent is what is received, in order."""

from __future__ import annotations

import asyncio

import pytest

from pulsegate.cluster.channel import (
    ChannelClosed,
    Ejected,
    Outcomes,
    encode,
    pack,
    receive,
    unpack,
)
from pulsegate.health.observations import FirstByteOverdue, Outcome, RequestResult


def test_observations_survive_packing() -> None:
    """Request results travel as plain tuples, anything else as itself; both come back equal."""
    items = [
        ("a", RequestResult(Outcome.OK, 0.12, 200)),
        ("b", RequestResult(Outcome.HTTP_5XX, None, 503)),
        ("a", FirstByteOverdue(2, 1.5)),
        ("c", RequestResult(Outcome.STREAM_BROKEN)),
    ]
    assert [unpack(pack(n, o)) for n, o in items] == items
    assert type(pack("a", items[0][1])[1]) is int


def test_frames_in_order_then_eof_closes_the_channel() -> None:
    """Two frames read back in order; a cut in the middle of a frame is ChannelClosed."""

    async def scenario() -> None:
        reader = asyncio.StreamReader()
        first = Outcomes([pack("a", RequestResult(Outcome.OK, 0.1, 200))])
        reader.feed_data(encode(first) + encode(Ejected("b", "canary")))
        reader.feed_data(encode(Ejected("c", "x"))[:-1])
        reader.feed_eof()
        assert await receive(reader) == first
        assert await receive(reader) == Ejected("b", "canary")
        with pytest.raises(ChannelClosed):
            await receive(reader)

    asyncio.run(scenario())
