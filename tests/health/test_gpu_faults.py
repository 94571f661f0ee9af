"""Gray GPU faults as evidence (`health.gpu_faults`): the Xid table, the throttle reasons,
the pure rule, and what the backend does with it on a fake clock (no sleeping)."""

from __future__ import annotations

import pytest

from pulsegate.health import gpu_faults as G
from pulsegate.health.machine import Event
from pulsegate.health.observations import EngineFacts, GpuFaults, Heartbeat
from pulsegate.health.rules import Fire
from pulsegate.health.verdict import State

from .harness import PONG, Harness


def _pong(**faults: object) -> Heartbeat:
    return Heartbeat(rtt_s=0.001, facts=EngineFacts(gpu_faults=GpuFaults(**faults)))  # type: ignore[arg-type]


# -- the table --------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [48, 62, 63, 64, 74, 79, 94, 95, 119, 120, 140])
def test_fatal_xids(code: int) -> None:
    assert G.XIDS[code].fatal and code in G.FATAL_XIDS
    assert G.XIDS[code].meaning


@pytest.mark.parametrize("code", [13, 31, 43, 45, 61, 92])
def test_application_xids_are_not_fatal(code: int) -> None:
    assert not G.XIDS[code].fatal and code not in G.FATAL_XIDS


def test_xid_words() -> None:
    assert G.xid_words(79) == "Xid 79 (GPU has fallen off the bus)"
    assert G.xid_words(48) == "Xid 48 (double-bit ECC error (DBE))"
    assert G.xid_words(9999) == "Xid 9999 (not in the table)"


def test_table_is_read_only_and_keyed_by_code() -> None:
    assert all(code == x.code for code, x in G.XIDS.items())
    with pytest.raises(TypeError):
        G.XIDS[1] = G.Xid(1, "x", True)  # type: ignore[index]


def test_throttle_words_and_the_degrading_bits() -> None:
    assert G.throttle_words(0x40 | 0x8) == "hw_slowdown, hw_thermal_slowdown"
    assert G.throttle_words(0) == "none"
    assert G.throttle_words(0x4 | 0x10000) == "sw_power_cap, 0x10000"
    # NVML's nvmlClocksThrottleReason* values.
    names = {v: k for k, v in G.THROTTLE_REASONS.items()}
    assert names["hw_slowdown"] == 0x8 and names["hw_power_brake_slowdown"] == 0x80
    assert G.DEGRADING == 0x8 | 0x20 | 0x40 | 0x80
    assert not G.DEGRADING & (0x1 | 0x2 | 0x4 | 0x10 | 0x100)


# -- the rule ---------------------------------------------------------------------------------


def test_judge_hard_evidence() -> None:
    xid = G.judge(GpuFaults(xid=79, ecc_dbe=2))
    assert xid is not None and xid.hard == Fire(
        "gpu_xid", "GPU reports Xid 79 (GPU has fallen off the bus)"
    )
    ecc = G.judge(GpuFaults(xid=0, ecc_dbe=2))
    assert ecc is not None and ecc.hard == Fire("gpu_ecc", "GPU reports 2 double-bit ECC errors")
    remap = G.judge(GpuFaults(remap_pending=True))
    assert remap is not None and remap.hard is not None and remap.hard.cause == "gpu_ecc"


def test_judge_nothing() -> None:
    assert G.judge(GpuFaults()) is None
    assert G.judge(GpuFaults(xid=0, ecc_dbe=0, remap_pending=False, throttle=0)) is None
    assert G.judge(GpuFaults(xid=13)) is None  # an application's error
    assert G.judge(GpuFaults(xid=4242)) is None  # unknown: carried, judged as nothing
    assert G.judge(GpuFaults(throttle=0x4 | 0x1)) is None  # power cap, idle: routine
    assert G.judge(GpuFaults(nvlink_errors=1e6)) is None  # replayed CRC errors: carried


def test_judge_throttle_degrades() -> None:
    f = G.judge(GpuFaults(throttle=0x80 | 0x8 | 0x4))
    assert f is not None and f.hard is None
    assert f.throttle == Fire(
        "gpu_throttle", "GPU clocks throttled: hw_slowdown, hw_power_brake_slowdown", Event.DEGRADE
    )


def test_fire_by_state() -> None:
    hard = G.judge(GpuFaults(xid=74, throttle=0x40))
    throttled = G.judge(GpuFaults(throttle=0x40))
    assert hard is not None and throttled is not None
    for state in State:
        assert G.fire(state, hard) is hard.hard  # `_apply` decides by state what it ejects
        expect = throttled.throttle if state is State.READY else None
        assert G.fire(state, throttled) is expect
    assert G.fire(State.READY, None) is None


def test_gate() -> None:
    hard = G.judge(GpuFaults(xid=79))
    throttled = G.judge(GpuFaults(throttle=0x8))
    rejoin = Fire("rejoin", "...", Event.REJOIN_OK)
    ready = Fire("ready", "...", Event.READY_SEEN)
    recover = Fire("cleared", "...", Event.RECOVER)
    score = Fire("score", "...", Event.SCORE_LOW)
    assert G.gate(rejoin, hard) is None and G.gate(ready, hard) is None
    assert G.gate(score, hard) is score and G.gate(recover, hard) is recover
    assert G.gate(recover, throttled) is None and G.gate(rejoin, throttled) is rejoin
    assert G.gate(rejoin, None) is rejoin and G.gate(None, hard) is None


def test_watch_judges_again_only_on_new_facts() -> None:
    w = G.GpuWatch()
    facts = EngineFacts(gpu_faults=GpuFaults(xid=79))
    assert w.on_pong(State.READY, facts) is not None and w.hard
    first = w.finding
    assert w.on_pong(State.READY, facts) is not None and w.finding is first
    assert w.on_pong(State.READY, EngineFacts()) is None and not w.hard  # not reported: clear


# -- in the backend ---------------------------------------------------------------------------


def test_fatal_xid_ejects_at_once_and_blocks_rejoin(ready3: Harness) -> None:
    h = ready3
    t = h.obs("a", _pong(xid=79))
    assert [(x.to_state, x.cause) for x in t] == [(State.EJECTED, "gpu_xid")]
    assert "Xid 79 (GPU has fallen off the bus)" in t[0].reason
    assert h.fleet.backend("a").dead  # not even panic mode routes there
    # Healthy probes for a minute: still out while the Xid is reported.
    for _ in range(600):
        h.obs("a", _pong(xid=79))
        h.run(0.1, h.healthy_traffic())
    assert h.state("a") is State.EJECTED
    # The GPU is reset: the report clears, and the usual rejoin brings it back.
    h.run(30.0, lambda h: (h.obs("a", _pong(xid=0)), h.healthy_traffic()(h)))
    assert h.state("a") in (State.PROBATION, State.READY)
    assert not h.fleet.backend("a").dead


def test_ecc_on_probation_fails_it(ready3: Harness) -> None:
    h = ready3
    h.obs("a", _pong(ecc_dbe=1))
    assert h.state("a") is State.EJECTED
    # Pongs without facts (the gateway's cache reused nothing) leave the finding as it was.
    h.run(30.0, lambda h: (h.obs("a", PONG), h.healthy_traffic()(h)))
    assert h.state("a") is State.EJECTED
    h.obs("a", _pong(ecc_dbe=0))
    h.run(30.0, lambda h: (h.obs("a", _pong(ecc_dbe=0)), h.healthy_traffic()(h)))
    assert h.state("a") in (State.PROBATION, State.READY)
    h.obs("a", _pong(remap_pending=True))
    assert h.state("a") is State.EJECTED
    assert h.causes("a")[-1] == "gpu_ecc"


def test_throttle_degrades_and_holds_until_cleared(ready3: Harness) -> None:
    h = ready3
    t = h.obs("a", _pong(throttle=0x40 | 0x8))
    assert [(x.to_state, x.cause) for x in t] == [(State.DEGRADED, "gpu_throttle")]
    assert h.fleet.backend("a").weight > 0  # degraded is routable
    h.run(10.0, lambda h: (h.obs("a", _pong(throttle=0x40 | 0x8)), h.healthy_traffic()(h)))
    assert h.state("a") is State.DEGRADED  # no recovery while throttled
    h.run(5.0, lambda h: (h.obs("a", _pong(throttle=0x4)), h.healthy_traffic()(h)))
    assert h.state("a") is State.READY
    assert "gpu_xid" not in h.causes("a") and "gpu_ecc" not in h.causes("a")


def test_a_cold_backend_with_a_fatal_xid_never_turns_ready(make: type[Harness]) -> None:
    h = make(names=("a",))
    h.obs("a", _pong(xid=95))
    h.make_ready("a")
    assert h.state("a") is State.COLD
    h.obs("a", _pong(xid=0))
    h.make_ready("a")
    assert h.state("a") is State.READY
