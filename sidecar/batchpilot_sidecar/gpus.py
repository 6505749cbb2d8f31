"""GPU telemetry: NVML for the GPUs this container sees, a DCGM exporter where one is configured.

NVML (through NVIDIA's `pynvml` bindings, the `nvidia-ml-py` distribution) enumerates the GPUs
mounted into the container, which in a Kubernetes pod are the GPUs it was given. Every reading
is taken field by field: a GPU that does not support one query (power on some boards, clocks
under virtualisation) still reports the others, and the failure is named. Where NVML cannot be
loaded — no library, no driver, no GPU — the sidecar keeps working and reports the GPU as
unavailable with the reason; it never reports a number it did not read. Initialisation is
retried now and then, since a driver may come up after the container.

Memory is read as nvidia-smi and DCGM report it: NVML's v2 memory info, whose `used` leaves out
the memory the driver reserves for itself, with the reserved memory reported apart. NVML's v1
answer counts reserved memory as used (614 MiB more than nvidia-smi on the lent H200, idle and
under load); it is the fallback where the driver or bindings lack v2, and then says so.

A container that requests no GPU sees none through NVML, and in a Kubernetes Pod that is the
sidecar's case: the GPUs belong to the Triton container beside it. There the node's DCGM exporter
is the source (NVIDIA's GPU Operator runs one on every GPU node, labelling each GPU's series with
the namespace, Pod and container it is allocated to); its page is used when NVML gives nothing,
and only the series of this Pod (namespace and name: names repeat across namespaces). The page is
read with a deadline and a size cap, as every outbound read is.

The NVML module is injectable, so that tests can pass a fake one: every code path here runs on
machines without a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from batchpilot_sidecar import threads
from batchpilot_triton import responses

Source = Literal["nvml", "dcgm"]
NVML_RETRY_SECONDS = 60.0
DCGM_RETRY_SECONDS = 30.0
"""After a failed read of the DCGM exporter, the next is this much later: a cluster without one
costs a lookup every half minute, not every reading."""

_MIB = 1024.0 * 1024.0
# DCGM exporter fields (its default counters) and how to turn them into our units.
_DCGM_FIELDS: Mapping[str, tuple[str, Callable[[float], float]]] = {
    "DCGM_FI_DEV_GPU_UTIL": ("utilization", lambda percent: percent / 100.0),
    "DCGM_FI_DEV_FB_USED": ("memory_used_bytes", lambda mib: mib * _MIB),
    "DCGM_FI_DEV_FB_FREE": ("memory_free_bytes", lambda mib: mib * _MIB),
    "DCGM_FI_DEV_FB_RESERVED": ("memory_reserved_bytes", lambda mib: mib * _MIB),
    "DCGM_FI_DEV_POWER_USAGE": ("power_watts", float),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": ("power_limit_watts", float),
    "DCGM_FI_DEV_SM_CLOCK": ("sm_clock_mhz", float),
    "DCGM_FI_DEV_GPU_TEMP": ("temperature_celsius", float),
}


@dataclass(frozen=True, kw_only=True)
class GpuReading:
    """One GPU at one instant; a value that could not be read is None, and `problems` says why."""

    index: int
    uuid: str | None = None
    name: str | None = None
    utilization: float | None = None
    """Fraction of the last sample period during which a kernel ran, 0 to 1."""
    memory_used_bytes: float | None = None
    """Memory in use, without what the driver reserves (as nvidia-smi and DCGM count it)."""
    memory_reserved_bytes: float | None = None
    """Memory the driver reserves for itself; None where the source does not say."""
    memory_total_bytes: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    sm_clock_mhz: float | None = None
    temperature_celsius: float | None = None
    problems: tuple[str, ...] = ()

    @property
    def memory_free_bytes(self) -> float | None:
        if self.memory_used_bytes is None or self.memory_total_bytes is None:
            return None
        return self.memory_total_bytes - self.memory_used_bytes - (self.memory_reserved_bytes or 0)


@dataclass(frozen=True, kw_only=True)
class GpuTelemetry:
    source: Source | None
    gpus: tuple[GpuReading, ...] = ()
    reason: str | None = None
    """Why there are no readings, when there are none."""

    @property
    def available(self) -> bool:
        return self.source is not None and bool(self.gpus)

    def least_free_memory(self) -> float | None:
        """Free memory of the fullest GPU, where every GPU's is known."""
        free = [gpu.memory_free_bytes for gpu in self.gpus]
        known = [value for value in free if value is not None]
        return min(known) if known and len(known) == len(free) else None


def import_nvml() -> Any:
    """NVIDIA's NVML bindings. The deprecated `pynvml` wrapper distribution, where it is still
    installed next to them, warns on every import; the module itself is the same."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
        return importlib.import_module("pynvml")


class NvmlReader:
    """Reads every GPU NVML enumerates. Blocking: run `read` in a worker thread."""

    def __init__(
        self,
        *,
        load: Callable[[], Any] = import_nvml,
        retry_seconds: float = NVML_RETRY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._load = load
        self._retry_seconds = retry_seconds
        self._clock = clock
        self._nvml: Any = None
        self._failure: str | None = None
        self._retry_at = float("-inf")

    def read(self) -> GpuTelemetry:
        nvml = self._initialised()
        if nvml is None:
            return GpuTelemetry(source=None, reason=self._failure)
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as error:
            return GpuTelemetry(source=None, reason=f"NVML could not count GPUs: {error}")
        if count == 0:
            return GpuTelemetry(source=None, reason="NVML sees no GPU in this container")
        return GpuTelemetry(source="nvml", gpus=tuple(self._device(nvml, i) for i in range(count)))

    def close(self) -> None:
        if self._nvml is not None:
            # Nothing is left to release if the driver went away.
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()
            self._nvml = None

    def _initialised(self) -> Any:
        if self._nvml is not None:
            return self._nvml
        if self._clock() < self._retry_at:
            return None
        self._retry_at = self._clock() + self._retry_seconds
        try:
            nvml = self._load()
        except ImportError as error:
            self._failure = f"the NVML bindings (nvidia-ml-py) are not installed: {error}"
            return None
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as error:
            self._failure = f"NVML could not be initialised: {error}"
            return None
        self._nvml = nvml
        self._failure = None
        return nvml

    @staticmethod
    def _device(nvml: Any, index: int) -> GpuReading:
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as error:
            return GpuReading(index=index, problems=(f"handle: {error}",))
        problems: list[str] = []

        def query(what: str, call: Callable[[], Any]) -> Any:
            try:
                return call()
            except nvml.NVMLError as error:
                problems.append(f"{what}: {error}")
                return None

        name = query("name", lambda: nvml.nvmlDeviceGetName(handle))
        uuid = query("uuid", lambda: nvml.nvmlDeviceGetUUID(handle))
        rates = query("utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        memory = query("memory", lambda: _memory_info(nvml, handle, problems))
        power = query("power", lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        limit = query("power limit", lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
        clock = query("SM clock", lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
        temperature = query(
            "temperature",
            lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
        )
        return GpuReading(
            index=index,
            uuid=_text(uuid),
            name=_text(name),
            utilization=float(rates.gpu) / 100.0 if rates is not None else None,
            memory_used_bytes=float(memory.used) if memory is not None else None,
            memory_reserved_bytes=_reserved(memory),
            memory_total_bytes=float(memory.total) if memory is not None else None,
            power_watts=float(power) / 1000.0 if power is not None else None,  # milliwatts
            power_limit_watts=float(limit) / 1000.0 if limit is not None else None,
            sm_clock_mhz=float(clock) if clock is not None else None,
            temperature_celsius=float(temperature) if temperature is not None else None,
            problems=tuple(problems),
        )


def _memory_info(nvml: Any, handle: Any, problems: list[str]) -> Any:
    """NVML's v2 memory info where the bindings and the driver have it, else v1 (whose `used`
    counts reserved memory), with the reason in `problems`."""
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is None:
        problems.append(
            "memory reserved: these NVML bindings have no v2 memory info; used counts it"
        )
    else:
        try:
            return nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
        except nvml.NVMLError as error:
            problems.append(
                f"memory reserved: NVML's v2 memory info failed ({error}); used counts it"
            )
    return nvml.nvmlDeviceGetMemoryInfo(handle)


def _reserved(memory: Any) -> float | None:
    reserved = getattr(memory, "reserved", None) if memory is not None else None
    return float(reserved) if reserved is not None else None


def _text(value: Any) -> str | None:
    # Older bindings return bytes.
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class PodRef:
    """The Pod this sidecar runs in, as a DCGM exporter's Kubernetes mapping labels its GPUs."""

    name: str
    namespace: str | None = None
    """None matches the name in any namespace (a sidecar not told its namespace)."""

    def owns(self, labels: Mapping[str, str]) -> bool:
        if labels.get("pod") != self.name:
            return False
        return self.namespace is None or labels.get("namespace") == self.namespace


class DcgmUnreadable(Exception):
    """The exporter's page could not be had; the message says why in words safe to show."""


class DcgmPageError(ValueError):
    """The page cannot say which GPUs are this Pod's."""


def parse_dcgm(text: str, *, pod: PodRef | None = None) -> tuple[GpuReading, ...]:
    """GPU readings from a DCGM exporter page. With `pod`, only the GPUs the exporter's
    Kubernetes mapping labels with that Pod; a page without any Pod labels then says nothing of
    this Pod (it lists every GPU of the node) and is refused with DcgmPageError."""
    values: dict[str, dict[str, float]] = {}
    identities: dict[str, tuple[str | None, str | None]] = {}
    mine: set[str] = set()
    labelled = False
    for family in text_string_to_metric_families(text):
        target = _DCGM_FIELDS.get(family.name)
        if target is None:
            continue
        for sample in family.samples:
            key = sample.labels.get("gpu")
            if key is None:
                continue
            field_name, convert = target
            values.setdefault(key, {})[field_name] = convert(sample.value)
            identities[key] = (sample.labels.get("UUID"), sample.labels.get("modelName"))
            labelled = labelled or bool(sample.labels.get("pod"))
            if pod is not None and pod.owns(sample.labels):
                mine.add(key)
    if pod is not None:
        if values and not labelled:
            raise DcgmPageError(
                "its series carry no Pod labels, so which GPUs are this Pod's is unknown (the "
                "exporter's Kubernetes mapping is off: DCGM_EXPORTER_KUBERNETES=true)"
            )
        values = {key: fields for key, fields in values.items() if key in mine}
    readings = []
    for key, fields in sorted(values.items(), key=lambda item: _index(item[0])):
        used, free = fields.get("memory_used_bytes"), fields.get("memory_free_bytes")
        reserved = fields.get("memory_reserved_bytes")
        uuid, name = identities[key]
        total = None
        if used is not None and free is not None:
            total = used + free + (reserved or 0.0)
        readings.append(
            GpuReading(
                index=_index(key),
                uuid=uuid,
                name=name,
                utilization=fields.get("utilization"),
                memory_used_bytes=used,
                memory_reserved_bytes=reserved,
                memory_total_bytes=total,
                power_watts=fields.get("power_watts"),
                power_limit_watts=fields.get("power_limit_watts"),
                sm_clock_mhz=fields.get("sm_clock_mhz"),
                temperature_celsius=fields.get("temperature_celsius"),
            )
        )
    return tuple(readings)


def _index(text: str) -> int:
    return int(text) if text.isdigit() else -1


class GpuMonitor:
    """NVML first; the DCGM exporter when NVML gives nothing and one is configured."""

    def __init__(
        self,
        nvml: NvmlReader,
        *,
        dcgm_url: str | None = None,
        pod: PodRef | None = None,
        timeout: float = 2.0,
        dcgm_retry_seconds: float = DCGM_RETRY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nvml = nvml
        self.dcgm_url = dcgm_url
        self.pod = pod
        self.timeout = timeout
        self.dcgm_retry_seconds = dcgm_retry_seconds
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._resolver: responses.OwnThreadResolver | None = None
        self._nvml = threads.OneAtATime()
        self._dcgm_failed: tuple[float, str] | None = None
        """When the exporter last failed, and why: asked again only after the retry period."""

    async def read(self) -> GpuTelemetry:
        telemetry = await self._read_nvml()
        if telemetry.available or self.dcgm_url is None:
            return telemetry
        if self._dcgm_failed is not None:
            failed_at, why = self._dcgm_failed
            if self._clock() < failed_at + self.dcgm_retry_seconds:
                return GpuTelemetry(source=None, reason=f"{telemetry.reason}; {why}")
        try:
            readings = parse_dcgm(await self._dcgm_page(self.dcgm_url), pod=self.pod)
        except (DcgmUnreadable, DcgmPageError) as error:
            return self._dcgm_failure(telemetry, str(error))
        except ValueError:
            # The parser's message quotes the page's own lines: said by kind only.
            return self._dcgm_failure(telemetry, "its page is not Prometheus' text format")
        self._dcgm_failed = None
        if not readings:
            whose = f" of Pod {self.pod.namespace or '*'}/{self.pod.name}" if self.pod else ""
            return GpuTelemetry(
                source=None,
                reason=f"{telemetry.reason}; DCGM exporter {self.dcgm_url} reports no GPU{whose}",
            )
        return GpuTelemetry(source="dcgm", gpus=readings)

    def _dcgm_failure(self, telemetry: GpuTelemetry, said: str) -> GpuTelemetry:
        """NVML's reason and the exporter's, remembered until the next try is due."""
        why = f"DCGM exporter {self.dcgm_url}: {said}"
        self._dcgm_failed = (self._clock(), why)
        return GpuTelemetry(source=None, reason=f"{telemetry.reason}; {why}")

    async def _read_nvml(self) -> GpuTelemetry:
        """NVML's reading, or why there is none within `timeout` (a driver that hangs holds one
        thread, not one per read)."""
        try:
            return await self._nvml.call("read", self.timeout, self.nvml.read)
        except TimeoutError:
            return GpuTelemetry(
                source=None, reason=f"NVML did not answer within {self.timeout:g} s"
            )

    async def close(self) -> None:
        # The process is ending: a driver that hangs must not hold it (a daemon thread: nothing
        # joins it at exit).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(threads.in_a_daemon_thread(self.nvml.close), self.timeout)
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._resolver is not None:
            await self._resolver.close()
            self._resolver = None

    async def _dcgm_page(self, url: str) -> str:
        if self._session is None:
            # One name lookup at a time on a thread of its own: where the exporter's Service
            # name does not resolve (a cluster without the GPU Operator), lookups cannot pile up.
            self._resolver = responses.OwnThreadResolver()
            connector = aiohttp.TCPConnector(resolver=self._resolver, limit=1)
            # A redirect is an error, as for every client of a server someone else names.
            self._session = responses.client_session(
                connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout)
            )
        try:
            async with self._session.get(url) as response:
                if response.status != 200:
                    raise DcgmUnreadable(responses.refusal(response.status))
                page = await responses.read_capped(response, responses.METRICS_PAGE_BYTES)
        except aiohttp.ClientError as error:
            raise DcgmUnreadable(responses.client_error_text(error)) from None
        except TimeoutError:
            raise DcgmUnreadable(f"no answer within {self.timeout:g} s") from None
        except OSError as error:  # the resolver's refusal while a lookup hangs
            raise DcgmUnreadable(responses.excerpt(str(error))) from None
        return page.decode(errors="replace")
