"""Gray GPU faults end to end: a real sim serving DCGM fault fields, a real agent reading
them (`--gpu dcgm=<sim>/metrics`), a real gateway judging its pongs.

`POST /sim/fault {"mode": "xid", "code": 79}` must eject the backend with cause gpu_xid
while /health, /metrics and inference all stay fine (the gray part), and throttling must
degrade it, not eject it. The time from the fault to the ejection is the gateway's own
event time (`ts`, wall clock to the ms, the same clock this test reads) minus the moment
the fault was posted; the issue's target is 500 ms.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from support import Gateway, Proc, Sim, backend_entry, fast_probes, wait_until

FAST_SIM = ("--ttft-ms", "5", "--itl-ms", "1")
HEALTH = {"evaluate_interval": "250ms", "ejection_base": "500ms", "rejoin_after": 3}
TARGET_S = 0.5  # issue #21: "Xid 79 in the sim ejected within 500 ms"
# What the test asserts: functional on a loaded 2-core box; the figure is reported.
DEADLINE_S = 3.0


@pytest.fixture
def node(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway], tmp_path: Path
) -> Iterator[tuple[Gateway, dict[str, Sim]]]:
    """Sims `a` (with an agent reading its DCGM fields) and `b`, behind one gateway."""
    sims = {n: start_sim(n, *FAST_SIM) for n in "ab"}
    a = sims["a"]
    agent = Proc(
        [
            "agent",
            "--engine",
            a.url,
            "--listen",
            "127.0.0.1:0",
            "--gpu",
            f"dcgm={a.url}/metrics",
        ],
        tmp_path / "agent.log",
    )
    try:
        entries = [
            backend_entry(a, agent=f"127.0.0.1:{agent.port}"),
            backend_entry(sims["b"]),
        ]
        gw = start_gateway({"backends": entries, "probes": fast_probes(), "health": HEALTH})
        gw.wait_all_ready()
        yield gw, sims
    finally:
        agent.stop()


def _ejected_after(gw: Gateway, name: str, t0: float) -> tuple[dict[str, Any], float]:
    """Wait for `name`'s ejection after wall time `t0`: (its event, seconds from t0)."""

    def found() -> dict[str, Any] | None:
        for e in gw.events():
            if e["backend"] == name and e["to"] == "ejected" and e["ts"] >= t0:
                return e
        return None

    event: dict[str, Any] = wait_until(found, timeout=10, what=f"{name} ejected")
    return event, event["ts"] - t0


def _ok(sim: Sim) -> None:
    """The engine itself looks healthy: /health 200 and a completion answered."""
    assert httpx.get(f"{sim.url}/health", timeout=5).status_code == 200
    body = {"model": "demo-7b", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{sim.url}/v1/completions", json=body, timeout=5).status_code == 200


def test_xid_79_ejects_at_once_with_cause_gpu_xid(node: tuple[Gateway, dict[str, Sim]]) -> None:
    gw, sims = node
    t0 = time.time()
    sims["a"].fault("xid", code=79)
    event, took = _ejected_after(gw, "a", t0)
    print(f"\nXid 79 -> ejected in {took * 1e3:.0f} ms (target {TARGET_S * 1e3:.0f} ms)")
    assert event["cause"] == "gpu_xid", event
    assert "Xid 79 (GPU has fallen off the bus)" in event["reason"]
    assert took <= DEADLINE_S, f"ejected {took:.3f}s after the fault"
    _ok(sims["a"])  # gray: nothing but the GPU's own counters says so
    assert gw.backends()["b"]["state"] == "ready"
    # While the Xid is reported the backend stays out, whatever its score says.
    view = gw.backends()["a"]
    assert view["state"] == "ejected" and view["dead"] is True, view
    # The fault lifted (the GPU reset): it comes back through the usual rejoin.
    sims["a"].fault("none")
    gw.wait_state("a", "probation", "ready", timeout=15)


def test_non_fatal_xid_is_no_ejection(node: tuple[Gateway, dict[str, Sim]]) -> None:
    """Xid 13 (an application's graphics exception) is carried, judged as nothing; a later
    Xid 48 (double-bit ECC) ejects, showing the first one did reach the gateway's rule."""
    gw, sims = node
    sims["a"].fault("xid", code=13)
    t0 = time.time()
    sims["a"].fault("xid", code=48)
    event, _ = _ejected_after(gw, "a", t0)
    assert event["cause"] == "gpu_xid" and "Xid 48" in event["reason"], event
    assert not [e for e in gw.events() if "Xid 13" in e["reason"]]


def test_ecc_ejects_with_cause_gpu_ecc(node: tuple[Gateway, dict[str, Sim]]) -> None:
    gw, sims = node
    t0 = time.time()
    sims["a"].fault("ecc")
    event, took = _ejected_after(gw, "a", t0)
    print(f"\nECC DBE -> ejected in {took * 1e3:.0f} ms")
    assert event["cause"] == "gpu_ecc", event
    assert took <= DEADLINE_S


def test_thermal_throttle_degrades_and_recovers(node: tuple[Gateway, dict[str, Sim]]) -> None:
    gw, sims = node
    sims["a"].fault("throttle", reason="thermal")
    view = gw.wait_state("a", "degraded", timeout=10)
    assert view["last_cause"] == "gpu_throttle", view
    assert "hw_thermal_slowdown" in view["last_reason"]
    # Still routable, never ejected for it; it stays degraded while the clocks are held.
    assert not [e for e in gw.events() if e["backend"] == "a" and e["to"] == "ejected"]
    sims["a"].fault("none")
    gw.wait_state("a", "ready", timeout=10)


def test_power_cap_is_routine(node: tuple[Gateway, dict[str, Sim]]) -> None:
    """The software power cap throttles a busy card every day: no evidence. The sim's own
    /metrics shows the bit, and a hardware slowdown after it does degrade."""
    gw, sims = node
    sims["a"].fault("throttle", reason="sw_power_cap")
    text = httpx.get(f"{sims['a'].url}/metrics", timeout=5).text
    assert 'DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu="0"' in text and "} 4" in text
    sims["a"].fault("throttle", reason="hw_slowdown")
    view = gw.wait_state("a", "degraded", timeout=10)
    assert view["last_reason"] == "GPU clocks throttled: hw_slowdown", view
    assert not [e for e in gw.events() if "sw_power_cap" in e["reason"]]


# ---------------------------------------------------------------------------------------------
# The agent's readers and the wire, without processes. NVML is stood in for by a small fake
# of pynvml's API passed in (this machine has no GPU; see docs/gpu-faults.md for what was
# verified where).


class FakeNvml:
    """The slice of pynvml `NvmlFaults` calls, over devices described by dicts."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18
    NVML_NVLINK_ERROR_DL_CRC_FLIT = 3
    nvmlEventTypeXidCriticalError = 0x8

    class NVMLError(Exception):
        pass

    def __init__(self, devices: list[dict[str, Any]], events: bool = True) -> None:
        self.devices = devices
        self.pending_events: list[tuple[int, int]] = []  # (event type, Xid)
        self.events_ok = events
        self.registered: list[int] = []
        self.freed = self.shutdowns = 0

    def _get(self, h: int, key: str) -> Any:
        v = self.devices[h].get(key)
        if v is None:
            raise self.NVMLError(f"{key}: not supported")
        return v

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlEventSetCreate(self) -> str:
        if not self.events_ok:
            raise self.NVMLError("events not supported")
        return "set"

    def nvmlEventSetFree(self, es: str) -> None:
        self.freed += 1

    def nvmlDeviceRegisterEvents(self, h: int, types: int, es: str) -> None:
        assert types == self.nvmlEventTypeXidCriticalError and es == "set"
        self._get(h, "events")
        self.registered.append(h)

    def nvmlEventSetWait(self, es: str, timeout_ms: int) -> Any:
        assert timeout_ms == 0  # never blocks the worker thread
        if not self.pending_events:
            raise self.NVMLError("Timeout")
        kind, xid = self.pending_events.pop(0)
        return SimpleNamespace(eventType=kind, eventData=xid, device=0)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: int) -> int:
        return int(self._get(h, "throttle"))

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        assert (kind, counter) == (1, 0)  # uncorrected, volatile
        return int(self._get(h, "dbe"))

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        return self._get(h, "remap")  # type: ignore[no-any-return]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:
        return int(self._get(h, "retired_pending"))

    def nvmlDeviceGetNvLinkErrorCounter(self, h: int, link: int, counter: int) -> int:
        assert counter == self.NVML_NVLINK_ERROR_DL_CRC_FLIT
        links = self._get(h, "nvlink")
        if link >= len(links):
            raise self.NVMLError("invalid link")
        return int(links[link])


def test_nvml_faults_read_and_combine() -> None:
    from pulsegate.agent.gpu import NvmlFaults

    nvml = FakeNvml(
        [
            {"events": 1, "throttle": 0x4, "dbe": 0, "remap": (3, 0, 0, 0), "nvlink": [1, 2]},
            {"events": 1, "throttle": 0x40 | 0x8, "dbe": 1, "remap": (0, 1, 1, 0)},
        ]
    )
    f = NvmlFaults.open(nvml)
    assert nvml.registered == [0, 1]
    got = f.read()
    assert got.xid == 0 and got.throttle == 0x4 | 0x40 | 0x8
    assert got.ecc_dbe == 1 and got.remap_pending is True and got.nvlink_errors == 3
    # A fatal Xid is held; a later application Xid does not hide it.
    nvml.pending_events = [(0x8, 79), (0x8, 13)]
    assert f.read().xid == 79
    assert f.read().xid == 79
    f.close()
    assert nvml.freed == 1 and nvml.shutdowns == 1


def test_nvml_faults_unknown_where_unsupported() -> None:
    """No events, no ECC, pre-Ampere retirement instead of remapping, no NVLink."""
    from pulsegate.agent.gpu import NvmlFaults

    nvml = FakeNvml([{"throttle": 0, "retired_pending": 1}], events=False)
    got = NvmlFaults.open(nvml).read()
    assert got.xid is None and got.ecc_dbe is None and got.nvlink_errors is None
    assert got.remap_pending is True and got.throttle == 0
    bare = NvmlFaults.open(FakeNvml([{}])).read()  # registration fails: events unknown too
    assert bare == type(bare)()


def test_nvml_unavailable_without_gpus() -> None:
    from pulsegate.agent.gpu import NvmlFaults, NvmlUnavailable

    with pytest.raises(NvmlUnavailable, match="no GPU"):
        NvmlFaults.open(FakeNvml([]))


def test_dcgm_faults_from_the_sims_page() -> None:
    """The sim's /metrics text (rendered in-process) parses back into the same faults."""
    from pulsegate.agent.gpu import dcgm_faults
    from pulsegate.sim import faults as F
    from pulsegate.sim.gpu import read_gpu
    from pulsegate.sim.metrics import EngineReading, render

    def page(body: dict[str, Any]) -> str:
        gpu = read_gpu(total_mb=81920, running=0, max_batch=8, kv_tokens=0, oom=False)
        return render(
            EngineReading("m", 8, 0, 0, 0, 0, 0, 0, 0), F.gpu_gauges(gpu, F.parse_fault(body))
        )

    healthy = dcgm_faults(page({"mode": "none"}))
    assert healthy is not None and healthy.xid == 0 and healthy.ecc_dbe == 0
    assert healthy.remap_pending is False and healthy.throttle == 0
    assert healthy.nvlink_errors == 0
    assert dcgm_faults(page({"mode": "xid", "code": 94})).xid == 94  # type: ignore[union-attr]
    ecc = dcgm_faults(page({"mode": "ecc"}))
    assert ecc is not None and ecc.ecc_dbe == 1 and ecc.remap_pending is True
    power = dcgm_faults(page({"mode": "throttle", "reason": "power"}))
    assert power is not None and power.throttle == 0x80 | 0x8
    assert dcgm_faults("vllm:num_requests_running 1\n") is None  # no fault fields: unknown


def test_dcgm_faults_over_several_gpus() -> None:
    from pulsegate.agent.gpu import dcgm_faults

    text = "\n".join(
        [
            'DCGM_FI_DEV_XID_ERRORS{gpu="0"} 79',
            'DCGM_FI_DEV_XID_ERRORS{gpu="1"} 13',
            'DCGM_FI_DEV_CLOCKS_EVENT_REASONS{gpu="0"} 8',
            'DCGM_FI_DEV_CLOCKS_EVENT_REASONS{gpu="1"} 64',
            'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="0"} 2',
            'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="1"} 1',
        ]
    )
    f = dcgm_faults(text)
    assert f is not None and f.xid == 79 and f.throttle == 0x48 and f.ecc_dbe == 3
    assert f.remap_pending is None and f.nvlink_errors is None  # not exported: unknown


def test_sim_fault_validation() -> None:
    from pulsegate.sim import faults as F

    assert F.parse_fault({"mode": "xid"}).params() == {"code": 79}
    assert F.parse_fault({"mode": "throttle"}).params() == {"reason": "thermal"}
    with pytest.raises(F.FaultError, match="'reason' must be one of thermal"):
        F.parse_fault({"mode": "throttle", "reason": "hot"})
    with pytest.raises(F.FaultError, match="'code' must be"):
        F.parse_fault({"mode": "xid", "code": "79"})
    with pytest.raises(F.FaultError, match="unknown parameter"):
        F.parse_fault({"mode": "ecc", "code": 1})


def test_pong_carries_the_faults() -> None:
    from pulsegate.agent.wire import facts_from_pong, fill_faults, pb
    from pulsegate.health.observations import GpuFaults

    pong = pb.Pong()
    fill_faults(pong, GpuFaults(xid=79, ecc_dbe=0, remap_pending=False, throttle=0x48))
    back = facts_from_pong(pb.Pong.FromString(pong.SerializeToString())).gpu_faults
    assert back == GpuFaults(xid=79, ecc_dbe=0.0, remap_pending=False, throttle=0x48)
    fill_faults(pong, None)
    assert facts_from_pong(pong).gpu_faults is None  # unknown stays unknown, never 0
