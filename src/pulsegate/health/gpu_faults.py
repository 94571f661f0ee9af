"""Gray GPU faults as evidence: the Xid table, the clock-throttle reasons, and the rule.

An agent beside the engine reads the GPU's fault counters (NVML, else a DCGM exporter:
`agent.gpu`) and sends them in every pong (`observations.GpuFaults`). A GPU that reports
them is judged before inference fails on it:

- a fatal Xid (`XIDS`, `fatal=True`: the GPU or its memory is broken until a reset) is hard
  evidence with cause ``gpu_xid``; volatile double-bit ECC errors, or a row remap / page
  retirement waiting for a reset, are hard evidence with cause ``gpu_ecc``. Hard evidence
  ejects at once from ready or degraded and fails a probation (`machine.FAILURE_EVENTS`),
  and while it is reported the backend is never routed (not even in panic), never rejoins
  and never turns ready (`gate`);
- clocks throttled for a reason that means the card is in trouble (`DEGRADING`: hardware
  slowdown, thermal slowdown, the power brake) degrade a ready backend with cause
  ``gpu_throttle``, and keep it from recovering while they last. The software power cap, an
  idle GPU and the application clock settings are routine and judged as nothing;
- an Xid not fatal in the table (13, 31, 43, 45: usually the application's fault, and the
  engine's own failures show those), the NVLink CRC error count and an unknown Xid code are
  carried but judge nothing.

The counters are levels, not events: evidence lasts while the agent reports it (dcgm-exporter's
`DCGM_FI_DEV_XID_ERRORS` is the last Xid value; the agent's NVML path holds the last critical
Xid it saw), and clears when a report comes without it. Pure: `GpuWatch` is the one
per-backend memory, and it keeps the last judgement while the same facts come again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pulsegate.health.machine import Event
from pulsegate.health.observations import EngineFacts, GpuFaults
from pulsegate.health.rules import Fire
from pulsegate.health.verdict import State


@dataclass(frozen=True, slots=True)
class Xid:
    """One Xid code: what NVIDIA's Xid catalogue says it means, and whether it ejects."""

    code: int
    meaning: str
    fatal: bool


_TABLE = (
    Xid(13, "graphics engine exception (usually an application error)", False),
    Xid(31, "GPU memory page fault (usually an application error)", False),
    Xid(43, "GPU stopped processing (usually an application error)", False),
    Xid(45, "preemptive cleanup after a previous error", False),
    Xid(48, "double-bit ECC error (DBE)", True),
    Xid(61, "internal micro-controller breakpoint/warning", False),
    Xid(62, "internal micro-controller halt", True),
    Xid(63, "ECC page retirement or row remapping recorded (reset to apply)", True),
    Xid(64, "ECC page retirement or row remapping failed", True),
    Xid(74, "NVLink error", True),
    Xid(79, "GPU has fallen off the bus", True),
    Xid(92, "high single-bit ECC error rate", False),
    Xid(94, "contained uncorrectable ECC error (reset needed)", True),
    Xid(95, "uncontained uncorrectable ECC error", True),
    Xid(119, "GSP RPC timeout", True),
    Xid(120, "GSP error", True),
    Xid(140, "unrecovered ECC error", True),
)
XIDS: Mapping[int, Xid] = MappingProxyType({x.code: x for x in _TABLE})
"""The Xid codes pulsegate knows; any other code is reported but judges nothing."""

FATAL_XIDS = frozenset(x.code for x in _TABLE if x.fatal)

# NVML's clocksThrottleReasons bits (nvml.h nvmlClocksThrottleReason*; DCGM's
# DCGM_FI_DEV_CLOCK_THROTTLE_REASONS carries the same bitmask).
THROTTLE_REASONS: Mapping[int, str] = MappingProxyType(
    {
        0x1: "gpu_idle",
        0x2: "applications_clocks_setting",
        0x4: "sw_power_cap",
        0x8: "hw_slowdown",
        0x10: "sync_boost",
        0x20: "sw_thermal_slowdown",
        0x40: "hw_thermal_slowdown",
        0x80: "hw_power_brake_slowdown",
        0x100: "display_clock_setting",
    }
)
DEGRADING = 0x8 | 0x20 | 0x40 | 0x80
"""Throttle bits that degrade: hardware slowdown, software and hardware thermal slowdown, the
power brake. The software power cap is what a busy card does every day: not evidence."""


def xid_words(code: int) -> str:
    """'Xid 79 (GPU has fallen off the bus)'; an unknown code says so."""
    x = XIDS.get(code)
    return f"Xid {code} ({x.meaning if x else 'not in the table'})"


def throttle_words(mask: int) -> str:
    """The names of the bits set in `mask`, comma separated ('hw_slowdown, ...')."""
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    unknown = mask & ~sum(THROTTLE_REASONS)
    if unknown:
        names.append(f"0x{unknown:x}")
    return ", ".join(names) or "none"


@dataclass(frozen=True, slots=True)
class GpuFinding:
    """What one report of GPU faults proves: `hard` ejects (gpu_xid / gpu_ecc), `throttle`
    degrades (gpu_throttle). Either may be None."""

    hard: Fire | None
    throttle: Fire | None


def judge(f: GpuFaults) -> GpuFinding | None:
    """The evidence in one report; None when it proves nothing."""
    hard: Fire | None = None
    if f.xid is not None and f.xid in FATAL_XIDS:
        hard = Fire("gpu_xid", f"GPU reports {xid_words(f.xid)}")
    elif f.ecc_dbe is not None and f.ecc_dbe > 0:
        hard = Fire("gpu_ecc", f"GPU reports {f.ecc_dbe:g} double-bit ECC errors")
    elif f.remap_pending:
        hard = Fire("gpu_ecc", "GPU has a row remap / page retirement pending (reset needed)")
    throttle: Fire | None = None
    if f.throttle is not None and f.throttle & DEGRADING:
        why = f"GPU clocks throttled: {throttle_words(f.throttle & DEGRADING)}"
        throttle = Fire("gpu_throttle", why, Event.DEGRADE)
    if hard is None and throttle is None:
        return None
    return GpuFinding(hard, throttle)


def fire(state: State, finding: GpuFinding | None) -> Fire | None:
    """What a pong with this finding fires in `state`: hard evidence (ejects from ready or
    degraded, fails probation, nothing elsewhere), else a ready backend throttled degrades."""
    if finding is None:
        return None
    if finding.hard is not None:
        return finding.hard
    if finding.throttle is not None and state is State.READY:
        return finding.throttle
    return None


_BLOCKED_BY_HARD = frozenset({Event.REJOIN_OK, Event.READY_SEEN})


def gate(f: Fire | None, finding: GpuFinding | None) -> Fire | None:
    """`f` (another rule's move), or None when the GPU's evidence forbids it: no rejoin and
    no ready while hard evidence lasts (a probation fails on the first pong that brings it),
    no recovery while throttled."""
    if f is None or finding is None:
        return f
    if finding.hard is not None and f.event in _BLOCKED_BY_HARD:
        return None
    if finding.throttle is not None and f.event is Event.RECOVER:
        return None
    return f


class GpuWatch:
    """One backend's latest GPU finding, judged again only when new facts come."""

    __slots__ = ("_seen", "finding")

    def __init__(self) -> None:
        self._seen: GpuFaults | None = None
        self.finding: GpuFinding | None = None

    @property
    def hard(self) -> bool:
        """Hard evidence is reported now: never route here."""
        return self.finding is not None and self.finding.hard is not None

    def on_pong(self, state: State, facts: EngineFacts | None) -> Fire | None:
        """A pong in time, with its facts (None: none decoded, the finding stands). The
        gateway reuses one facts object while they do not change: judged once."""
        if facts is not None and facts.gpu_faults is not self._seen:
            faults = self._seen = facts.gpu_faults
            self.finding = judge(faults) if faults is not None else None
        return fire(state, self.finding)

    def gate(self, f: Fire | None) -> Fire | None:
        """`gate(f, finding)` with the latest finding."""
        return gate(f, self.finding)
