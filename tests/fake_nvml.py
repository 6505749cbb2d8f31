"""A fake NVML library object: the slice of the `pynvml` module the sidecar uses, with GPUs
described in Python, so that every NVML code path runs on machines without a GPU."""

from __future__ import annotations

import dataclasses
from typing import Any

GIB = 1024**3


class FakeNvmlError(Exception):
    """Like pynvml.NVMLError: its text is NVML's own error string."""


@dataclasses.dataclass
class FakeGpu:
    name: str = "NVIDIA L4"
    uuid: str = "GPU-0000"
    utilization_percent: int = 37
    memory_used: int = 6 * GIB
    """In use, as nvidia-smi and NVML's v2 memory info count it (without reserved memory)."""
    memory_reserved: int = 0
    """Reserved by the driver: NVML's v1 memory info counts it as used."""
    memory_total: int = 24 * GIB
    memory_info_v2: bool = True
    """Whether the driver answers NVML's v2 memory info (nvmlDeviceGetMemoryInfo_v2)."""
    power_milliwatts: int = 41_500
    power_limit_milliwatts: int = 72_000
    sm_clock_mhz: int = 2040
    temperature_celsius: int = 55
    failing: dict[str, str] = dataclasses.field(default_factory=dict)
    """Query name -> the NVML error it raises."""


class FakeNvml:
    """The slice of the pynvml module the sidecar uses, with GPUs described in Python."""

    NVMLError = FakeNvmlError
    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0
    nvmlMemory_v2 = 0x02000028

    def __init__(self, *devices: FakeGpu, init_error: str | None = None) -> None:
        self.devices = list(devices)
        self.init_error = init_error
        self.init_calls = 0
        self.shutdown_calls = 0

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise FakeNvmlError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        device = self.devices[index]
        if "handle" in device.failing:
            raise FakeNvmlError(device.failing["handle"])
        return device

    @staticmethod
    def _query(device: FakeGpu, what: str, value: Any) -> Any:
        if what in device.failing:
            raise FakeNvmlError(device.failing[what])
        return value

    def nvmlDeviceGetName(self, device: FakeGpu) -> str:
        return self._query(device, "name", device.name)  # type: ignore[no-any-return]

    def nvmlDeviceGetUUID(self, device: FakeGpu) -> bytes:
        # Older bindings answer in bytes.
        return self._query(device, "uuid", device.uuid.encode())  # type: ignore[no-any-return]

    def nvmlDeviceGetUtilizationRates(self, device: FakeGpu) -> Any:
        rates = type("Rates", (), {"gpu": device.utilization_percent, "memory": 10})
        return self._query(device, "utilization", rates)

    def nvmlDeviceGetMemoryInfo(self, device: FakeGpu, version: int | None = None) -> Any:
        """v1 (no version) counts reserved memory as used, as the real library does; v2 reports
        it apart."""
        free = device.memory_total - device.memory_used - device.memory_reserved
        if version is None:
            used = device.memory_used + device.memory_reserved
            info = type("Memory", (), {"used": used, "total": device.memory_total, "free": free})
            return self._query(device, "memory", info)
        assert version == self.nvmlMemory_v2
        if not device.memory_info_v2:
            raise FakeNvmlError("Function Not Found")
        fields = {
            "version": version,
            "used": device.memory_used,
            "reserved": device.memory_reserved,
            "total": device.memory_total,
            "free": free,
        }
        return self._query(device, "memory", type("Memory_v2", (), fields))

    def nvmlDeviceGetPowerUsage(self, device: FakeGpu) -> int:
        return self._query(device, "power", device.power_milliwatts)  # type: ignore[no-any-return]

    def nvmlDeviceGetEnforcedPowerLimit(self, device: FakeGpu) -> int:
        limit = device.power_limit_milliwatts
        return self._query(device, "power limit", limit)  # type: ignore[no-any-return]

    def nvmlDeviceGetClockInfo(self, device: FakeGpu, clock: int) -> int:
        assert clock == self.NVML_CLOCK_SM
        return self._query(device, "clock", device.sm_clock_mhz)  # type: ignore[no-any-return]

    def nvmlDeviceGetTemperature(self, device: FakeGpu, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._query(device, "temperature", device.temperature_celsius)  # type: ignore[no-any-return]
