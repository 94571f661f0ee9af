"""Where the agent's GPU figures come from (R27: from the GPU itself, never made up).

``--gpu`` chooses: ``nvml`` (the driver's NVML through nvidia-ml-py), ``dcgm=URL`` (a
dcgm-exporter's /metrics), ``engine`` (the DCGM-style gauges some engines and pulsegate's
sim publish on their own /metrics), ``none``, or ``auto`` (default): NVML when it loads and
sees a GPU, else the engine's gauges when it has them, else unknown.

NVML calls block (tens of microseconds to a few ms per device), so the agent runs `Nvml.read`
in a worker thread. Devices: those named by ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) when
set, else every GPU on the node. Several GPUs are summed (memory), averaged (utilisation)
and maxed (temperature), the same way `engine_metrics.gpu_facts` combines DCGM series.

GPU faults (`GpuFaultWatcher`, judged by `health.gpu_faults`) come from the same place: NVML
(`NvmlFaults`: critical Xid events, volatile double-bit ECC errors, pending row remaps or
retired pages, clock-throttle reasons, NVLink CRC errors) when it is open, else the DCGM
exporter's fields (`dcgm_faults`) on ``dcgm=URL`` or the engine's ``/metrics``. Over several
GPUs the worst wins: a fatal Xid before any other, counts summed, throttle bits OR-ed.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from pulsegate.agent import periodic
from pulsegate.clock import Clock
from pulsegate.health.gpu_faults import FATAL_XIDS
from pulsegate.health.observations import EngineFacts, GpuFaults
from pulsegate.probers.engine_metrics import parse_prometheus
from pulsegate.probers.http import FETCH_ERRORS, PROBE_HEADER, fetch

log = logging.getLogger("pulsegate.agent")

MODES = ("auto", "nvml", "dcgm", "engine", "none")
_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class GpuChoice:
    """The parsed ``--gpu`` option."""

    mode: str  # one of MODES
    dcgm_url: str = ""


def parse_gpu_option(text: str) -> GpuChoice:
    """``auto | nvml | dcgm=URL | engine | none``; raises ValueError naming the problem."""
    t = text.strip()
    if t.startswith("dcgm="):
        url = t[len("dcgm=") :].strip()
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--gpu dcgm=URL: URL must start with http:// or https://: {url!r}")
        if "/" not in url.split("://", 1)[1]:
            url += "/metrics"  # dcgm-exporter's default path
        return GpuChoice("dcgm", url)
    if t in ("auto", "nvml", "engine", "none"):
        return GpuChoice(t)
    raise ValueError(f"--gpu must be auto, nvml, dcgm=URL, engine or none, not {text!r}")


class NvmlUnavailable(Exception):
    """NVML cannot be used here: no nvidia-ml-py, no driver, or no GPU."""


class Nvml:
    """GPU figures from NVML. `open` raises NvmlUnavailable; `read` and `close` block."""

    def __init__(self, nvml: Any, handles: list[Any]) -> None:
        self._nvml = nvml
        self._handles = handles

    @classmethod
    def open(cls) -> Nvml:
        return cls(*_open_nvml(None))

    @property
    def device_count(self) -> int:
        return len(self._handles)

    def read(self) -> EngineFacts:
        """Memory, temperature and utilisation of the devices; a figure a device does not
        support leaves that field unknown."""
        n = self._nvml
        free = used = total = 0.0
        mem_ok = True
        temps: list[float] = []
        utils: list[float] = []
        for h in self._handles:
            try:
                mem = n.nvmlDeviceGetMemoryInfo(h)
                free += mem.free / _MIB
                used += mem.used / _MIB
                total += mem.total / _MIB
            except n.NVMLError:
                mem_ok = False
            try:
                temps.append(float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)))
            except n.NVMLError:
                pass
            try:
                utils.append(n.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)
            except n.NVMLError:
                pass
        known_mem = mem_ok and total > 0
        return EngineFacts(
            gpu_free_ratio=free / total if known_mem else None,
            gpu_used_mb=used if known_mem else None,
            gpu_total_mb=total if known_mem else None,
            gpu_temp_c=max(temps) if temps else None,
            gpu_util=sum(utils) / len(utils) if utils else None,
            source="nvml",
        )

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


def _open_nvml(module: Any) -> tuple[Any, list[Any]]:
    """(pynvml, device handles) with NVML initialised; `module` stands in for pynvml (tests).
    Raises NvmlUnavailable."""
    if module is None:
        try:
            import pynvml  # from nvidia-ml-py (the `gpu` extra)
        except ImportError as e:
            raise NvmlUnavailable(
                "nvidia-ml-py is not installed (pip install 'pulsegate[gpu]')"
            ) from e
        module = pynvml
    try:
        module.nvmlInit()
    except module.NVMLError as e:
        raise NvmlUnavailable(f"NVML did not initialise: {e}") from e
    try:
        handles = _devices(module, os.environ.get("CUDA_VISIBLE_DEVICES"))
    except module.NVMLError as e:
        module.nvmlShutdown()
        raise NvmlUnavailable(f"NVML could not list GPUs: {e}") from e
    if not handles:
        module.nvmlShutdown()
        raise NvmlUnavailable("NVML sees no GPU")
    return module, handles


def _devices(nvml: Any, visible: str | None) -> list[Any]:
    if visible is None or not visible.strip():
        return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    handles = []
    for item in visible.split(","):
        item = item.strip()
        if not item:
            continue
        if item.isdigit():
            handles.append(nvml.nvmlDeviceGetHandleByIndex(int(item)))
        else:  # "GPU-8f3c..." or "MIG-..."
            handles.append(nvml.nvmlDeviceGetHandleByUUID(item))
    return handles


# -- GPU faults -------------------------------------------------------------------------------

# dcgm-exporter's names for the fault fields (DCGM 3.3+ renamed the throttle field).
DCGM_XID = "DCGM_FI_DEV_XID_ERRORS"  # the last Xid value
DCGM_ECC_DBE = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
DCGM_ROW_REMAP_PENDING = "DCGM_FI_DEV_ROW_REMAP_PENDING"
DCGM_RETIRED_PENDING = "DCGM_FI_DEV_RETIRED_PENDING"
DCGM_THROTTLE = "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"
DCGM_EVENT_REASONS = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"
DCGM_NVLINK_CRC = "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"
FAULT_NAMES = frozenset(
    {
        DCGM_XID,
        DCGM_ECC_DBE,
        DCGM_ROW_REMAP_PENDING,
        DCGM_RETIRED_PENDING,
        DCGM_THROTTLE,
        DCGM_EVENT_REASONS,
        DCGM_NVLINK_CRC,
    }
)
_MAX_EVENTS = 64  # Xid events drained per read: a storm cannot hold the worker thread


def worse_xid(a: int, b: int) -> int:
    """The Xid to report of two: a fatal one before any other, else the later (`b`) one."""
    if b == 0 or (a in FATAL_XIDS and b not in FATAL_XIDS):
        return a
    return b


def dcgm_faults(text: str) -> GpuFaults | None:
    """The fault fields of a dcgm-exporter page (or an engine's /metrics); None: it has none."""
    m = parse_prometheus(text, FAULT_NAMES)
    if not m:
        return None

    def values(*names: str) -> list[float]:
        return [s.value for n in names for s in m.get(n, ())]

    xid: int | None = None
    for v in values(DCGM_XID):
        xid = worse_xid(xid or 0, int(v))
    ecc = values(DCGM_ECC_DBE)
    pending = values(DCGM_ROW_REMAP_PENDING, DCGM_RETIRED_PENDING)
    throttle: int | None = None
    for v in values(DCGM_THROTTLE, DCGM_EVENT_REASONS):
        throttle = (throttle or 0) | int(v)
    nvlink = values(DCGM_NVLINK_CRC)
    return GpuFaults(
        xid=xid,
        ecc_dbe=sum(ecc) if ecc else None,
        remap_pending=any(v > 0 for v in pending) if pending else None,
        throttle=throttle,
        nvlink_errors=sum(nvlink) if nvlink else None,
    )


class NvmlFaults:
    """GPU fault counters from NVML. `open` raises NvmlUnavailable; `read`, `close` block.
    Critical Xid events are registered once and drained at each `read`; the last one seen
    is held (a fatal one until the agent restarts: the GPU needs a reset or reboot)."""

    def __init__(self, nvml: Any, handles: list[Any]) -> None:
        self._nvml = nvml
        self._handles = handles
        self._xid = 0
        self._events: Any = None
        try:
            events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as e:
            log.warning("agent: NVML Xid events unavailable: %s", e)
            return
        registered = 0
        for h in handles:
            try:
                nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, events)
                registered += 1
            except nvml.NVMLError as e:
                log.warning("agent: NVML Xid events not supported on a GPU: %s", e)
        if registered:
            self._events = events
        else:
            nvml.nvmlEventSetFree(events)

    @classmethod
    def open(cls, module: Any = None) -> NvmlFaults:
        return cls(*_open_nvml(module))

    def read(self) -> GpuFaults:
        n = self._nvml
        self._drain()
        ecc: float | None = None
        pending: bool | None = None
        throttle: int | None = None
        nvlink: float | None = None
        # nvidia-ml-py 12.535+ renamed the call; the old name stays as an alias there.
        reasons = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if reasons is None:
            reasons = n.nvmlDeviceGetCurrentClocksThrottleReasons
        for h in self._handles:
            try:
                throttle = (throttle or 0) | int(reasons(h))
            except n.NVMLError:
                pass
            try:
                count = n.nvmlDeviceGetTotalEccErrors(
                    h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC
                )
                ecc = (ecc or 0.0) + float(count)
            except n.NVMLError:
                pass  # ECC off or not supported
            p = self._pending(h)
            if p is not None:
                pending = bool(pending) or p
            links = self._nvlink(h)
            if links is not None:
                nvlink = (nvlink or 0.0) + links
        return GpuFaults(
            xid=self._xid if self._events is not None else None,
            ecc_dbe=ecc,
            remap_pending=pending,
            throttle=throttle,
            nvlink_errors=nvlink,
        )

    def _drain(self) -> None:
        n = self._nvml
        if self._events is None:
            return
        for _ in range(_MAX_EVENTS):
            try:
                data = n.nvmlEventSetWait(self._events, 0)
            except n.NVMLError:
                return  # NVML_ERROR_TIMEOUT: nothing waiting
            if data.eventType & n.nvmlEventTypeXidCriticalError:
                code = int(data.eventData)
                log.warning("agent: GPU reported Xid %d", code)
                self._xid = worse_xid(self._xid, code)

    def _pending(self, h: Any) -> bool | None:
        n = self._nvml
        try:  # Ampere and later: row remapping
            _corr, _unc, pending, failed = n.nvmlDeviceGetRemappedRows(h)
            return bool(pending) or bool(failed)
        except n.NVMLError:
            pass
        try:  # earlier cards: dynamic page retirement
            status = n.nvmlDeviceGetRetiredPagesPendingStatus(h)
            return bool(status == n.NVML_FEATURE_ENABLED)
        except n.NVMLError:
            return None

    def _nvlink(self, h: Any) -> float | None:
        n = self._nvml
        total: float | None = None
        for link in range(int(getattr(n, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                v = n.nvmlDeviceGetNvLinkErrorCounter(h, link, n.NVML_NVLINK_ERROR_DL_CRC_FLIT)
            except n.NVMLError:
                if link == 0:
                    break  # no NVLink on this card
                continue  # a link that is not there or not up
            total = (total or 0.0) + float(v)
        return total

    def close(self) -> None:
        n = self._nvml
        try:
            if self._events is not None:
                n.nvmlEventSetFree(self._events)
                self._events = None
            n.nvmlShutdown()
        except n.NVMLError:
            pass


class GpuFaultWatcher:
    """Keeps `faults` fresh every `refresh` s while running: NVML (in a worker thread) when
    it opens, else the DCGM page (``dcgm=URL``, or the engine's /metrics for ``auto`` and
    ``engine``). `version` moves whenever `faults` changes. None: unknown.

    `engine_page` (the engine watcher's last /metrics page) spares the engine a second
    scrape of the same page per refresh: the faults are read from it, at most one refresh
    old."""

    def __init__(
        self,
        choice: GpuChoice,
        engine_url: str,
        *,
        refresh: float,
        clock: Clock,
        session: aiohttp.ClientSession,
        nvml: Any = None,
        engine_page: Callable[[], str | None] | None = None,
    ) -> None:
        self._choice = choice
        self._engine_page = engine_page
        self._url = choice.dcgm_url or engine_url.rstrip("/") + "/metrics"
        self._refresh = refresh
        self._clock = clock
        self._session = session
        self._module = nvml
        self._nvml: NvmlFaults | None = None
        self._task: asyncio.Task[None] | None = None
        self.faults: GpuFaults | None = None
        self.version = 0

    async def start(self) -> None:
        mode = self._choice.mode
        if mode in ("auto", "nvml"):
            try:
                self._nvml = await asyncio.to_thread(NvmlFaults.open, self._module)
            except NvmlUnavailable:
                if mode == "nvml":
                    raise
        if mode == "none" or (mode == "nvml" and self._nvml is None):
            return
        await self.refresh_once()
        self._task = asyncio.create_task(self._run(), name="agent-gpu-faults")

    async def stop(self) -> None:
        await periodic.cancel(self._task)
        self._task = None
        if self._nvml is not None:
            await asyncio.to_thread(self._nvml.close)
            self._nvml = None

    async def _run(self) -> None:
        await periodic.every(
            self._refresh, self._clock.now, self.refresh_once, "reading GPU faults"
        )

    async def refresh_once(self) -> None:
        faults = await self._read()
        if faults != self.faults:
            self.faults = faults
            self.version += 1

    async def _read(self) -> GpuFaults | None:
        if self._nvml is not None:
            try:
                return await asyncio.to_thread(self._nvml.read)
            except Exception as e:  # NVML errors are per call: unknown now, try again
                log.warning("agent: NVML fault read failed: %s", e)
                return None
        if self._engine_page is not None and not self._choice.dcgm_url:
            page = self._engine_page()
            return None if page is None else dcgm_faults(page)
        try:
            reply = await fetch(
                self._session,
                "GET",
                self._url,
                headers={} if self._choice.dcgm_url else {PROBE_HEADER: "metrics"},
                timeout_s=1.0,
                clock=self._clock,
                cap=8 << 20,
            )
        except FETCH_ERRORS:
            return None
        if reply.status != 200:
            return None
        return dcgm_faults(reply.body.decode("utf-8", "replace"))
