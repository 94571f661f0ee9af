"""The channel's messages: compact JSON in, the same facts out; junk is None (pure)."""

from __future__ import annotations

from pulsegate.health.events import Transition
from pulsegate.health.machine import Event
from pulsegate.health.observations import ProbeKind, ProbeResult
from pulsegate.health.verdict import State
from pulsegate.replicas import codec


def _t(to: State, cause: str, frm: State = State.READY) -> Transition:
    return Transition("n1", frm, to, Event.HARD_FAILURE, cause, "why", 1.0, None, {})


def test_a_probe_result_survives_the_trip() -> None:
    """Kind, ok, latency and reason come back as they went."""
    r = ProbeResult(ProbeKind.CANARY, False, 0.35, "timeout after 350ms")
    m = codec.probe_message("r1", "n1", r, 1700000000.5)
    assert m is not None
    back = codec.decode(codec.encode(m))
    assert back == m
    assert codec.probe_result(back) == r


def test_readiness_is_not_shared() -> None:
    """Every replica runs its own readiness probes."""
    r = ProbeResult(ProbeKind.READINESS, True, 0.01, ready=True)
    assert codec.probe_message("r1", "n1", r, 1.0) is None


def test_messages_are_compact() -> None:
    """A probe message fits in well under 200 bytes."""
    m = codec.probe_message(
        "gw-a-1234", "node-1", ProbeResult(ProbeKind.MICRO, True, 0.0123), 1.7e9
    )
    assert m is not None and len(codec.encode(m)) < 200


def test_junk_decodes_to_none() -> None:
    """Not JSON, another version, an unknown kind or wrong types: None, never an exception."""
    good = codec.encode(codec.Message("r", "b", "drain", 1.0))
    assert codec.decode(good) is not None
    for junk in (b"", b"{", b"[]", b'{"v":2,"r":"r","b":"b","k":"drain","t":1}',
                 b'{"v":1,"r":"r","b":"b","k":"reboot","t":1}',
                 b'{"v":1,"r":1,"b":"b","k":"drain","t":1}',
                 b'{"v":1,"r":"r","b":"b","k":"drain","t":true}'):  # fmt: skip
        assert codec.decode(junk) is None, junk


def test_a_malformed_probe_is_not_folded() -> None:
    """A probe message without a valid kind or ok flag gives no observation."""
    assert (
        codec.probe_result(codec.Message("r", "b", "probe", 1.0, {"kind": "x", "ok": True})) is None
    )
    assert (
        codec.probe_result(codec.Message("r", "b", "probe", 1.0, {"kind": "micro", "ok": 1}))
        is None
    )
    bad_lat = {"kind": "micro", "ok": True, "lat": "fast"}
    assert codec.probe_result(codec.Message("r", "b", "probe", 1.0, bad_lat)) is None


def test_which_transitions_are_shared() -> None:
    """Ejections, drains, undrains and recoveries go out; the moves each replica makes on its
    own evidence (ready, degraded, rejoin) do not."""
    eject = codec.transition_message("r1", _t(State.EJECTED, "canary"), 1.0)
    assert eject is not None and eject.kind == "eject" and eject.fields["cause"] == "canary"
    drain = codec.transition_message("r1", _t(State.DRAINED, "drain"), 1.0)
    assert drain is not None and drain.kind == "drain"
    undrain = codec.transition_message("r1", _t(State.COLD, "undrain", State.DRAINED), 1.0)
    assert undrain is not None and undrain.kind == "undrain"
    recovered = codec.transition_message("r1", _t(State.READY, "recovered", State.PROBATION), 1.0)
    assert recovered is not None and recovered.kind == "recovered"
    assert codec.transition_message("r1", _t(State.DEGRADED, "degraded"), 1.0) is None
    assert codec.transition_message("r1", _t(State.PROBATION, "rejoin", State.EJECTED), 1.0) is None
