"""The pipe (`pipe.py`) on its failure paths: nothing may raise into the upstream's callback.

A real `ClientOut` that was never started is a client that went away; a real `Watchdog` on
a `ManualClock`. The happy path runs in every stream test through a real gateway.
"""

from __future__ import annotations

from aiohttp import ClientConnectionResetError

from pulsegate.clock import ManualClock
from pulsegate.proxy.client_out import ClientOut
from pulsegate.proxy.cuts import MALFORMED, Cut
from pulsegate.proxy.dialects.base import StreamState
from pulsegate.proxy.pipe import GO_ON, Pipe
from pulsegate.proxy.sse import MAX_EVENT_BYTES, Event
from pulsegate.proxy.watchdog import Watchdog


class _Upstream:
    def close(self) -> None:
        pass


def _pipe(framing: object = None) -> tuple[Pipe, list[list[Event]]]:
    seen: list[list[Event]] = []

    def frame(events: list[Event], parts: list[bytes]) -> Cut | None:
        seen.append(events)
        if framing == "misshapen" and events:
            raise KeyError("choices")  # `obj["choices"]` of a chunk without
        parts.extend(e.raw for e in events)
        return GO_ON

    watch = Watchdog(ManualClock(), _Upstream(), 1.0)
    return Pipe(ClientOut(), watch, StreamState(), frame), seen


def test_a_client_gone_mid_write_stops_the_pipe_and_is_kept_for_the_coroutine() -> None:
    pipe, seen = _pipe()
    assert pipe.take(b"data: {}\n\n") is False  # never raised
    assert isinstance(pipe.error, ClientConnectionResetError)
    assert [e.data for e in seen[0]] == [b"{}"]


def test_bytes_completing_no_event_write_nothing_and_go_on() -> None:
    pipe, seen = _pipe()
    assert pipe.take(b"data: {") is True  # nothing to write: the gone client is not noticed
    assert pipe.why is GO_ON and pipe.error is None and seen == [[]]


def test_an_event_past_the_limit_and_a_misshapen_one_are_malformed() -> None:
    pipe, _ = _pipe()
    assert pipe.take(b"data: " + b"x" * (MAX_EVENT_BYTES + 1)) is False
    assert pipe.why is MALFORMED and pipe.error is None
    pipe, _ = _pipe("misshapen")
    assert pipe.relay(b"data: {}\n\n") is MALFORMED
