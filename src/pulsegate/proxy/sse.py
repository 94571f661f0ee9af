"""Incremental server-sent-events parser, correct under arbitrary chunk boundaries.

Follows the WHATWG event-stream rules that matter for a proxy: lines end with CRLF, LF or
CR (a CR at the end of a chunk may be the first half of a CRLF, so it waits for the next
byte); a blank line ends an event; `data:` lines are joined with LF, one leading space is
dropped; lines starting with ':' are comments. Each complete event keeps its raw bytes, so
the proxy forwards exactly what the backend sent, one whole event at a time, and never a
half event that a resumed stream could not complete.

Every engine we relay sends LF line ends and one `data: ` line per event; such events are cut
out by a fast path (one `find` per event) and anything else goes through the line-by-line
rules. The relay parses ~13k events/s per 64 streams: the per-line path cost ~3 µs an event.

One event is at most `MAX_EVENT_BYTES`: an event that never ends (a backend that forgot its
blank line, or sends a body that is not SSE at all) raises `EventTooLarge` instead of growing
the buffer and rescanning it on every read (128 MiB without a blank line cost 41.7 s of CPU
before the bound). 1 MiB is ~50x the largest event seen from vLLM (a chunk with top-20
logprobs for a merged batch of tokens is ~20 KiB).
"""

from __future__ import annotations

MAX_EVENT_BYTES = 1024 * 1024


class EventTooLarge(ValueError):
    """An event grew past `MAX_EVENT_BYTES` without its blank line."""


class Event:
    """One event, made per token: a plain class, which mypyc compiles to a native one (a
    NamedTuple's constructor stays an interpreted call there; a frozen dataclass costs a
    setattr call per field). Never changed after it is made."""

    __slots__ = ("data", "name", "raw")

    def __init__(self, raw: bytes, data: bytes | None, name: bytes | None = None) -> None:
        self.raw = raw  # the event's bytes as received, including its terminating blank line
        self.data = data  # joined data lines; None when the event had no data field
        self.name = name  # the `event:` field, if any

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Event):
            return NotImplemented
        return self.raw == other.raw and self.data == other.data and self.name == other.name

    def __hash__(self) -> int:
        return hash((self.raw, self.data, self.name))

    def __repr__(self) -> str:
        return f"Event(raw={self.raw!r}, data={self.data!r}, name={self.name!r})"


class SSEParser:
    __slots__ = ("_buf", "_data", "_limit", "_name", "_pos", "_start")

    def __init__(self, limit: int = MAX_EVENT_BYTES) -> None:
        self._limit = limit
        self._buf = b""
        self._start = 0  # where the event being read starts in _buf
        self._pos = 0  # where the next unread line starts in _buf
        self._data: list[bytes] = []
        self._name: bytes | None = None

    def feed(self, chunk: bytes, eof: bool = False) -> list[Event]:
        """Add bytes; return the events they complete (possibly none)."""
        if not self._buf and not eof and not self._data and self._name is None:
            # The usual read: one whole one-line `data: X\n\n` event, nothing held.
            n = len(chunk) - 2
            if (
                chunk.startswith(b"data: ")
                and chunk.endswith(b"\n\n")
                and chunk.find(b"\n", 6, n) < 0
                and b"\r" not in chunk
            ):
                return [Event(chunk, chunk[6:n])]
        buf = self._buf[self._start :] + chunk if self._start else self._buf + chunk
        self._pos -= self._start
        self._start = 0
        self._buf = buf
        events: list[Event] = []
        pos = self._pos
        fresh = pos == self._start and not self._data and self._name is None
        if fresh and not eof and b"\r" not in buf:
            pos = self._start = _simple_events(buf, pos, events)
        n = len(buf)
        while pos < n:
            lf = buf.find(b"\n", pos)
            cr = buf.find(b"\r", pos, lf if lf >= 0 else n)
            if cr >= 0:
                if cr + 1 == n and not eof:
                    break  # a CR at the very end: wait to see whether LF follows
                end = cr
                nxt = cr + 2 if cr + 1 < n and buf[cr + 1] == 0x0A else cr + 1
            elif lf >= 0:
                end, nxt = lf, lf + 1
            else:
                break
            if end == pos:  # blank line: the event is complete
                if self._data or self._name is not None or pos > self._start:
                    data = b"\n".join(self._data) if self._data else None
                    events.append(Event(buf[self._start : nxt], data, self._name))
                self._data = []
                self._name = None
                self._start = nxt
            else:
                self._field(buf[pos:end])
            pos = nxt
        self._pos = pos
        if self._start == len(buf):
            self._buf = b""
            self._pos = self._start = 0
        elif len(buf) - self._start > self._limit:
            raise EventTooLarge(f"an event grew past {self._limit} bytes without ending")
        return events

    def _field(self, line: bytes) -> None:
        if line[:1] == b":":
            return  # comment
        name, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value)
        elif name == b"event":
            self._name = value

    def pending(self) -> bytes:
        """Bytes of an event not yet complete (what a broken stream left half-sent)."""
        return self._buf[self._start :]

    def close(self) -> list[Event]:
        """End of stream: a final event without its blank line is still an event."""
        events = self.feed(b"", eof=True)
        rest = self.pending()
        if self._pos < len(self._buf):  # a last line without its line ending
            self._field(self._buf[self._pos :])
        if rest and (self._data or self._name is not None):
            data = b"\n".join(self._data) if self._data else None
            events.append(Event(rest, data, self._name))
        self._buf = b""
        self._pos = self._start = 0
        self._data = []
        self._name = None
        return events


_FIELDS = (b":", b"event:", b"id:", b"retry:")


def plain_sse(raw: bytes) -> bool:
    """`raw`, an event without data, is what a stream may carry: comments (keep-alives) and
    `event:`/`id:`/`retry:` fields only, valid UTF-8. Anything else is not SSE (an HTML error
    page or binary written into the stream) and must not reach the client."""
    for line in raw.splitlines():
        if line and not line.startswith(_FIELDS):
            return False
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def _simple_events(buf: bytes, pos: int, events: list[Event]) -> int:
    """Cut `data: X\n\n` events from `buf` at `pos` (an event's start, LF-only bytes) into
    `events`; returns where the first other thing (or an incomplete event) starts."""
    n = len(buf)
    while pos < n:
        if buf[pos] == 0x0A:  # a blank line between events: nothing to dispatch
            pos += 1
            continue
        end = buf.find(b"\n\n", pos)
        if end < 0 or not buf.startswith(b"data: ", pos) or buf.find(b"\n", pos, end) >= 0:
            return pos
        events.append(Event(buf[pos : end + 2], buf[pos + 6 : end]))
        pos = end + 2
    return pos
