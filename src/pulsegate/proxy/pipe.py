"""One upstream's stream to the client, synchronously, in the upstream's own callback.

The relay (`relay.py`) used to be a coroutine per token: await the upstream's next read,
look at its events, await the client write. Each token paid a future, a task switch and two
coroutines. A `Pipe` is what that loop did, as plain calls: `take` is the upstream
response's sink (`Response.sink`), run in its connection's `data_received`; it parses what
the bytes complete (`sse.py`), lets the relay's framing decide the client's bytes (`relay`,
the pass-through, a continuation's rewrite, a typed dialect) and writes them at once
(`StreamOut.write`, `client_out.py`): one write per upstream read, as before. The relay's
coroutine sleeps until the pipe stops: `[DONE]` (`why` None), a broken upstream (`why` a
`Cut`), a client that is behind (`StreamOut.busy`: the coroutine waits for it), or a client
that went away (`error`, raised again by the coroutine: nothing may raise into the
upstream's callback).
"""

from __future__ import annotations

from collections.abc import Callable

from pulsegate.proxy.client_out import StreamOut
from pulsegate.proxy.cuts import MALFORMED, Cut, CutKind
from pulsegate.proxy.dialects.base import StreamState
from pulsegate.proxy.sse import Event, EventTooLarge, SSEParser
from pulsegate.proxy.watchdog import Watchdog

# `why` while the upstream may send more (compared by identity, never sent anywhere).
GO_ON = Cut(CutKind.FAILED, "")
# What reading an event of the wrong shape raises in the trackers: caught once per read, so
# the usual event pays no check (a `try` costs nothing until it raises).
MISSHAPEN = (AttributeError, TypeError, KeyError, IndexError)

# The relay's framing: appends the client's bytes of some events; GO_ON, None (the end) or
# a Cut (something broken: what came before it is still written).
Framing = Callable[[list[Event], list[bytes]], Cut | None]


class Pipe:
    __slots__ = ("_client", "_framing", "_parser", "_parts", "_state", "_watch", "error", "why")

    def __init__(
        self, client: StreamOut, watch: Watchdog, state: StreamState, framing: Framing
    ) -> None:
        self._client = client
        self._watch = watch
        self._state = state  # its `tokens`: what the watchdog is told after a write
        self._framing = framing
        self._parser = SSEParser()
        self._parts: list[bytes] = []
        self.why: Cut | None = GO_ON
        self.error: Exception | None = None

    def take(self, chunk: bytes) -> bool:
        """The upstream's sink: True to go on taking bytes. Never raises."""
        self._watch.beat()
        try:
            why = self.why = self.relay(chunk)
        except Exception as e:  # the client went away mid-write (or a bug): the coroutine's
            self.error = e
            return False
        return why is GO_ON and not self._client.busy

    def relay(self, chunk: bytes) -> Cut | None:
        """What `chunk` completes, to the client in one write."""
        try:
            events = self._parser.feed(chunk)
        except EventTooLarge:
            return MALFORMED
        parts = self._parts
        try:
            why = self._framing(events, parts)
        except MISSHAPEN:  # JSON of the wrong shape (`"choices": [1]`): broken too
            why = MALFORMED
        if parts:
            self._client.write(parts[0] if len(parts) == 1 else b"".join(parts))
            parts.clear()
            watch = self._watch
            # The write never waits here, so the beat just before it stands for the time
            # the engine's next silence starts: once armed, a token pays no second clock read.
            if not watch.armed:
                watch.touch(self._state.tokens)
        return why
