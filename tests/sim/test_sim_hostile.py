"""The hostile fault modes' bytes (`sim/hostile.py`, pure `plan`) and their decision rows."""

from __future__ import annotations

import pytest

from pulsegate.sim import faults as F
from pulsegate.sim import hostile as H
from pulsegate.sim.protocol import Framer, parse_chat


def _plan(mode: str, stream: bool, **params: object) -> H.Plan:
    req = parse_chat(
        b'{"messages":[{"role":"user","content":"x"}],"max_tokens":8,"stream":%s}'
        % (b"true" if stream else b"false")
    )
    fault = F.parse_fault({"mode": mode, **params})
    return H.plan(fault, req, Framer("chat", "demo-7b", 0), seed=0)


def _head_and_body(data: bytes) -> tuple[bytes, bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


@pytest.mark.parametrize("mode", sorted(m.value for m in F.HOSTILE))
def test_every_hostile_mode_parses_and_plans(mode: str) -> None:
    """Each hostile mode is accepted by /sim/fault and, where it applies, starts an answer."""
    stream = F.Mode(mode) not in F.HOSTILE_WHOLE_ONLY
    p = _plan(mode, stream)
    assert p.data.startswith(b"HTTP/1.1 200 OK\r\n")
    assert p.then in ("hold", "close", "reset")


def test_stream_only_and_whole_only_modes_serve_the_other_kind_normally() -> None:
    """`non_sse` etc. leave non-streamed answers alone; `not_json` leaves streams alone."""
    for mode in F.HOSTILE_STREAM_ONLY:
        assert F.on_admit(F.Fault(mode=mode), stream=False, draw=0.0) is F.Action.PROCEED
        assert F.on_admit(F.Fault(mode=mode), stream=True, draw=0.0) is F.Action.HOSTILE
    fault = F.Fault(mode=F.Mode.NOT_JSON)
    assert F.on_admit(fault, stream=True, draw=0.0) is F.Action.PROCEED
    assert F.on_admit(fault, stream=False, draw=0.0) is F.Action.HOSTILE


def test_lengths_lie_in_both_directions() -> None:
    """long_length declares 64 KiB more than it sends; short_length half, then a forgery."""
    head, body = _head_and_body(_plan("long_length", False).data)
    assert int(head.split(b"content-length: ")[1].split(b"\r\n")[0]) == len(body) + 65536
    head, body = _head_and_body(_plan("short_length", False).data)
    declared = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
    assert declared < len(body) and H.SMUGGLED in body[declared:]


def test_stream_faults_send_valid_events_first() -> None:
    """after_tokens events of the healthy answer precede the hostile bytes (a resume splices)."""
    _, body = _head_and_body(_plan("non_sse", True, after_tokens=2).data)
    assert body.count(b"data: ") == 3 and H.HTML_PAGE in body  # role chunk + 2 tokens
    assert b"[DONE]" not in body


def test_trickle_interval_and_bounds() -> None:
    """trickle takes `interval_s`; an interval outside (0, 60] is refused."""
    assert _plan("trickle", False, interval_s=0.5).interval_s == 0.5
    with pytest.raises(F.FaultError, match="interval_s"):
        F.parse_fault({"mode": "trickle", "interval_s": 0})
