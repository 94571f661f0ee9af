"""The SSE parser: right under any chunking, line ending, comment and multi-line data."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pulsegate.proxy.sse import SSEParser

_text = st.text(
    alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=30
)
_event = st.tuples(
    st.lists(_text, min_size=1, max_size=3),  # data lines
    st.lists(_text, max_size=2),  # comments before the data
)


def _serialise(events: list[tuple[list[str], list[str]]], eol: bytes) -> bytes:
    out = b""
    for data_lines, comments in events:
        for c in comments:
            out += b":" + c.encode() + eol
        for d in data_lines:
            out += b"data: " + d.encode() + eol
        out += eol
    return out


def _feed_in_chunks(raw: bytes, cuts: list[int]) -> list:
    p = SSEParser()
    events = []
    prev = 0
    for c in sorted({min(len(raw), x) for x in cuts}):
        events += p.feed(raw[prev:c])
        prev = c
    events += p.feed(raw[prev:])
    events += p.close()
    return events


@given(
    st.lists(_event, max_size=6),
    st.sampled_from([b"\n", b"\r\n", b"\r"]),
    st.lists(st.integers(0, 400), max_size=12),
)
def test_any_chunking_yields_the_same_events(events, eol, cuts) -> None:
    """Events, their data and their raw bytes survive every chunking and line ending."""
    raw = _serialise(events, eol)
    got = _feed_in_chunks(raw, cuts)
    assert [e.data.decode() for e in got] == ["\n".join(d) for d, _ in events]
    assert b"".join(e.raw for e in got) == raw


def test_cr_at_chunk_end_waits_for_lf() -> None:
    """A CR ending a chunk may be half of CRLF: it must not make a spurious blank line."""
    p = SSEParser()
    assert p.feed(b"data: a\r") == []
    assert p.feed(b"\n\r") == []
    (ev,) = p.feed(b"\ndata: b\r\n")
    assert ev.data == b"a" and ev.raw == b"data: a\r\n\r\n"
    assert p.pending() == b"data: b\r\n"


def test_comment_only_event_and_event_name() -> None:
    """Keep-alive comments form a data-less event; `event:` names are kept."""
    p = SSEParser()
    evs = p.feed(b": ping\n\nevent: error\ndata: {}\n\n")
    assert [(e.data, e.name) for e in evs] == [(None, None), (b"{}", b"error")]


def test_data_without_space_and_done() -> None:
    """`data:x` keeps x whole; one leading space only is dropped."""
    p = SSEParser()
    evs = p.feed(b"data:x\n\ndata:  y\n\ndata: [DONE]\n\n")
    assert [e.data for e in evs] == [b"x", b" y", b"[DONE]"]


def test_close_flushes_an_unterminated_event() -> None:
    """A final event cut before its blank line is still returned at close()."""
    p = SSEParser()
    assert p.feed(b"data: last") == []
    (ev,) = p.close()
    assert ev.data == b"last"
