"""The agent's GPU sources: the --gpu option, and NVML figures combined over devices (NVML
itself is stood in for by a small fake of pynvml's API: this machine has no GPU)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pulsegate.agent.gpu import GpuChoice, Nvml, _devices, parse_gpu_option

MIB = 1024 * 1024


class FakeNvml:
    """The slice of pynvml the agent calls, over a list of devices described by dicts."""

    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    def __init__(self, devices: list[dict[str, Any]]) -> None:
        self.devices = devices
        self.shutdowns = 0

    def _get(self, h: int, key: str) -> Any:
        v = self.devices[h].get(key)
        if v is None:
            raise self.NVMLError(f"{key} not supported")
        return v

    def nvmlDeviceGetCount(self) -> int:  # pynvml's method names
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if i >= len(self.devices):
            raise self.NVMLError("invalid index")
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        for i, d in enumerate(self.devices):
            if d.get("uuid") == uuid:
                return i
        raise self.NVMLError("not found")

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        total, used = self._get(h, "total_mb"), self._get(h, "used_mb")
        return SimpleNamespace(total=total * MIB, used=used * MIB, free=(total - used) * MIB)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return int(self._get(h, "temp"))

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=self._get(h, "util"), memory=0)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1


def test_gpu_option_forms() -> None:
    """auto, nvml, engine, none and dcgm=URL (path defaulting to /metrics) parse."""
    assert parse_gpu_option("auto") == GpuChoice("auto")
    assert parse_gpu_option(" none ") == GpuChoice("none")
    assert parse_gpu_option("dcgm=http://n1:9400") == GpuChoice("dcgm", "http://n1:9400/metrics")
    assert parse_gpu_option("dcgm=http://n1:9400/m") == GpuChoice("dcgm", "http://n1:9400/m")
    for bad in ("nvidia", "dcgm=", "dcgm=n1:9400", ""):
        with pytest.raises(ValueError, match="--gpu"):
            parse_gpu_option(bad)


def test_nvml_figures_combine_over_devices() -> None:
    """Two GPUs: memory adds up, temperature is the hotter, utilisation the mean."""
    nvml = FakeNvml(
        [
            {"total_mb": 81920, "used_mb": 61440, "temp": 70, "util": 90},
            {"total_mb": 81920, "used_mb": 20480, "temp": 55, "util": 30},
        ]
    )
    f = Nvml(nvml, [0, 1]).read()
    assert (f.gpu_total_mb, f.gpu_used_mb) == (163840, 81920)
    assert f.gpu_free_ratio == 0.5
    assert (f.gpu_temp_c, f.gpu_util) == (70, 0.6)
    assert f.source == "nvml"


def test_nvml_unsupported_figure_is_unknown() -> None:
    """A figure NVML cannot give (MIG, old boards) is None, never a guess."""
    nvml = FakeNvml([{"total_mb": 40960, "used_mb": 1024}])
    f = Nvml(nvml, [0]).read()
    assert f.gpu_total_mb == 40960 and f.gpu_temp_c is None and f.gpu_util is None
    nvml.devices[0]["used_mb"] = None
    f = Nvml(nvml, [0]).read()
    assert f.gpu_total_mb is None and f.gpu_free_ratio is None and f.gpu_used_mb is None


def test_cuda_visible_devices_selects_gpus() -> None:
    """CUDA_VISIBLE_DEVICES by index or UUID picks the engine's GPUs; unset means all."""
    nvml = FakeNvml([{"uuid": "GPU-a"}, {"uuid": "GPU-b"}, {"uuid": "GPU-c"}])
    assert _devices(nvml, None) == [0, 1, 2]
    assert _devices(nvml, "2,0") == [2, 0]
    assert _devices(nvml, "GPU-b") == [1]
    with pytest.raises(FakeNvml.NVMLError):
        _devices(nvml, "7")
