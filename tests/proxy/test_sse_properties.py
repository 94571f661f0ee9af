"""Properties of the SSE parser (`proxy/sse.py`) on any bytes, not just well-formed streams.

`test_sse.py` checks well-formed event streams in any chunking; here the input is drawn from
an alphabet of the bytes that matter to the parser (CR, LF, ':', field names, a NUL, invalid
UTF-8), so the fast path, the line-by-line path and the CR-at-a-chunk-end wait all meet
arbitrary neighbours. What must hold (issue #22): any split gives the events of the whole
input; nothing but `EventTooLarge` is ever raised; each event's raw bytes are the input's own,
in order, with only blank lines between them, and what is left is the pending tail.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pulsegate.proxy.sse import MAX_EVENT_BYTES, Event, EventTooLarge, SSEParser

_PIECES = [b"\n", b"\r", b"\r\n", b"data", b"data: ", b"event: ", b"id: 1", b":", b" ", b"x"]
_PIECES += [b"[DONE]", b'{"a":1}', b"\x00", b"\xff\xfe", b"\xc3", b"<html>", b"retry: 5"]
_stream = st.lists(st.sampled_from(_PIECES), max_size=40).map(b"".join)
_any_bytes = st.one_of(_stream, st.binary(max_size=200))
_cuts = st.lists(st.integers(0, 300), max_size=10)


def _split(raw: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(len(raw), c) for c in cuts})
    chunks, prev = [], 0
    for c in points:
        chunks.append(raw[prev:c])
        prev = c
    chunks.append(raw[prev:])
    return chunks


def _parse(chunks: list[bytes], limit: int = MAX_EVENT_BYTES) -> tuple[list[Event], bytes]:
    """Events of `chunks` before close, and the pending tail they leave."""
    p = SSEParser(limit)
    events: list[Event] = []
    for c in chunks:
        events += p.feed(c)
    return events, p.pending()


@settings(max_examples=400, deadline=None)
@given(_any_bytes, _cuts)
def test_any_split_of_any_bytes_gives_the_events_of_the_whole(raw: bytes, cuts: list[int]) -> None:
    """Chunk boundaries never change the events, the pending tail or the final flush."""
    whole, whole_tail = _parse([raw])
    split, split_tail = _parse(_split(raw, cuts))
    assert split == whole
    assert split_tail == whole_tail
    a, b = SSEParser(), SSEParser()
    a.feed(raw)
    for c in _split(raw, cuts):
        b.feed(c)
    assert a.close() == b.close()


@settings(max_examples=400, deadline=None)
@given(_any_bytes, _cuts, st.integers(1, 64))
def test_arbitrary_bytes_raise_nothing_but_event_too_large(
    raw: bytes, cuts: list[int], limit: int
) -> None:
    """Under a small event bound, any bytes either parse or raise `EventTooLarge`, and the
    bound is what it says: no event longer than `limit` plus one read is ever pending."""
    p = SSEParser(limit)
    refused: EventTooLarge | None = None
    try:
        for c in _split(raw, cuts):
            p.feed(c)
            assert len(p.pending()) <= limit
        p.close()
    except EventTooLarge as e:
        refused = e
    assert refused is None or str(limit) in str(refused)


@settings(max_examples=400, deadline=None)
@given(_any_bytes, _cuts)
def test_raw_bytes_of_the_events_are_the_input_up_to_the_pending_tail(
    raw: bytes, cuts: list[int]
) -> None:
    """The events' raw bytes are slices of the input, in order, separated only by blank
    lines, and the rest of the input is the pending tail (the proxy forwards exactly what
    the backend sent, one whole event at a time)."""
    events, tail = _parse(_split(raw, cuts))
    pos = 0
    for e in events:
        while pos < len(raw) and raw[pos] in b"\r\n":
            pos += 1  # a blank line between events dispatches nothing
        assert raw.startswith(e.raw, pos), (raw, e.raw, pos)
        assert e.raw.endswith((b"\n", b"\r"))
        pos += len(e.raw)
    rest = raw[pos:]
    assert rest.endswith(tail)
    assert rest.lstrip(b"\r\n") == tail.lstrip(b"\r\n")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=30), min_size=1, max_size=8), _cuts)
def test_data_events_carry_their_payload_in_any_split(
    payloads: list[bytes], cuts: list[int]
) -> None:
    """`data: X` events (X any bytes without a line end) come back with X as their data."""
    clean = [p.replace(b"\r", b"").replace(b"\n", b"") for p in payloads]
    raw = b"".join(b"data: " + p + b"\n\n" for p in clean)
    events, tail = _parse(_split(raw, cuts))
    assert [e.data for e in events] == clean
    assert tail == b""
