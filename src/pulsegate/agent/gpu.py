"""Where the agent's GPU figures come from (R27: from the GPU itself, never made up).

``--gpu`` chooses: ``nvml`` (the driver's NVML through nvidia-ml-py), ``dcgm=URL`` (a
dcgm-exporter's /metrics), ``engine`` (the DCGM-style gauges some engines and pulsegate's
sim publish on their own /metrics), ``none``, or ``auto`` (default): NVML when it loads and
sees a GPU, else the engine's gauges when it has them, else unknown.

NVML calls block (tens of microseconds to a few ms per device), so the agent runs `Nvml.read`
in a worker thread. Devices: those named by ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) when
set, else every GPU on the node. Several GPUs are summed (memory), averaged (utilisation)
and maxed (temperature), the same way `engine_metrics.gpu_facts` combines DCGM series.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pulsegate.health.observations import EngineFacts

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
        try:
            import pynvml  # from nvidia-ml-py (the `gpu` extra)
        except ImportError as e:
            raise NvmlUnavailable(
                "nvidia-ml-py is not installed (pip install 'pulsegate[gpu]')"
            ) from e
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML did not initialise: {e}") from e
        try:
            handles = _devices(pynvml, os.environ.get("CUDA_VISIBLE_DEVICES"))
        except pynvml.NVMLError as e:
            pynvml.nvmlShutdown()
            raise NvmlUnavailable(f"NVML could not list GPUs: {e}") from e
        if not handles:
            pynvml.nvmlShutdown()
            raise NvmlUnavailable("NVML sees no GPU")
        return cls(pynvml, handles)

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
