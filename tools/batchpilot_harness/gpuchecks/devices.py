"""Is there an NVIDIA GPU here, and what do NVML and nvidia-smi say about it.

The check needs NVML: the sidecar's real path reads the GPUs through it. `nvidia-smi` reads the
same driver through its own code, so its CSV next to the sidecar's `/status` shows what the
sidecar gets wrong (units, which memory counts as used, instant or averaged power). Detection
runs before anything else is imported or installed, so it uses nothing outside the standard
library but the NVML bindings, loaded when asked for; both the bindings and `nvidia-smi` are
injectable, so every path here runs on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import io
import re
import shutil
import subprocess
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchpilot_triton import reports

SMI_OTHER_NAMES: Mapping[str, tuple[str, ...]] = {
    "index": (),
    "uuid": ("gpu_uuid",),
    "name": ("gpu_name",),
    "driver_version": (),
    "utilization.gpu": (),
    "memory.used": (),
    "memory.total": (),
    "power.draw": ("power.draw.average", "power.draw.instant"),
    "power.limit": ("enforced.power.limit",),
    "clocks.sm": ("clocks.current.sm",),
    "temperature.gpu": (),
}
"""Each field nvidia-smi is asked for, in order, with the other header names it may answer it
with: asked for `clocks.sm`, the driver on the lent H200 (580.159) wrote `clocks.current.sm
[MHz]`, the long form of the name."""
SMI_FIELDS = tuple(SMI_OTHER_NAMES)
SMI_COMMAND = ("nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,nounits")
_SMI_TIMEOUT_SECONDS = 20.0
# What nvidia-smi writes where a field has no value: [N/A], [Not Supported], [Unknown Error].
_NO_VALUE = re.compile(r"^\[.*\]$|^N/A$|^$")
_MIB = 1024.0 * 1024.0


class SmiUnavailable(Exception):
    """nvidia-smi is not installed, or did not answer."""


@dataclass(frozen=True, kw_only=True)
class SmiReading:
    """One GPU as `nvidia-smi --query-gpu` reports it, in its units; None where it has no value."""

    index: int
    uuid: str | None = None
    name: str | None = None
    driver_version: str | None = None
    utilization_percent: float | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    sm_clock_mhz: float | None = None
    temperature_celsius: float | None = None


def _number(text: str) -> float | None:
    return None if _NO_VALUE.match(text) else float(text.split(" ")[0])


def _text(text: str) -> str | None:
    return None if _NO_VALUE.match(text) else text


def _columns(header: Sequence[str]) -> dict[str, int]:
    """Each queried field's column, found by any of its names."""
    names = [re.sub(r"\s*\[.*\]$", "", cell.strip()) for cell in header]
    columns = {}
    for field, others in SMI_OTHER_NAMES.items():
        found = [position for position, name in enumerate(names) if name in {field, *others}]
        if found:
            columns[field] = found[0]
    absent = [field for field in SMI_FIELDS if field not in columns]
    if absent:
        raise ValueError(f"nvidia-smi's CSV lacks {', '.join(absent)} (header: {list(header)})")
    return columns


def parse_smi_csv(text: str) -> tuple[SmiReading, ...]:
    """`nvidia-smi --query-gpu=... --format=csv[,nounits]`: columns found by their header, under
    the short or the long name of each field, so their order, names and units (`memory.used
    [MiB]`, or `6144 MiB` without nounits) do not matter."""
    rows = [row for row in csv.reader(io.StringIO(text), skipinitialspace=True) if row]
    if not rows:
        raise ValueError("nvidia-smi printed nothing")
    columns = _columns(rows[0])
    readings = []
    for row in rows[1:]:
        if len(row) != len(rows[0]):
            raise ValueError(f"nvidia-smi's row has {len(row)} cells for {len(rows[0])} columns")
        # Without nounits every number carries its unit after a space.
        cells = {field: row[column].strip() for field, column in columns.items()}

        def value(field: str, cells: Mapping[str, str] = cells) -> float | None:
            return _number(cells[field])

        readings.append(
            SmiReading(
                index=int(cells["index"]),
                uuid=_text(cells["uuid"]),
                name=_text(cells["name"]),
                driver_version=_text(cells["driver_version"]),
                utilization_percent=value("utilization.gpu"),
                memory_used_mib=value("memory.used"),
                memory_total_mib=value("memory.total"),
                power_watts=value("power.draw"),
                power_limit_watts=value("power.limit"),
                sm_clock_mhz=value("clocks.sm"),
                temperature_celsius=value("temperature.gpu"),
            )
        )
    return tuple(readings)


def run_smi(command: Sequence[str] = SMI_COMMAND) -> str:
    """nvidia-smi's output; raises SmiUnavailable with the reason."""
    if shutil.which(command[0]) is None:
        raise SmiUnavailable(f"{command[0]} not found on PATH")
    try:
        done = subprocess.run(  # noqa: S603 -- a fixed command
            list(command), capture_output=True, text=True, timeout=_SMI_TIMEOUT_SECONDS
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SmiUnavailable(f"{command[0]}: {error}") from None
    if done.returncode != 0:
        said = " ".join((done.stdout + done.stderr).split())
        raise SmiUnavailable(f"{command[0]} exited with {done.returncode}: {said[:300]}")
    return done.stdout


def import_nvml() -> Any:
    """NVIDIA's NVML bindings (`pynvml`, from nvidia-ml-py), as the sidecar loads them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
        return importlib.import_module("pynvml")


@dataclass(frozen=True, kw_only=True)
class Detection:
    """What NVML and nvidia-smi found."""

    nvml_gpus: tuple[str, ...] = ()
    """The names of the GPUs NVML enumerates."""
    nvml_problem: str | None = None
    smi: tuple[SmiReading, ...] = ()
    smi_problem: str | None = None

    @property
    def found(self) -> bool:
        """The check can run: NVML, the sidecar's path, sees a GPU."""
        return bool(self.nvml_gpus)

    def describe(self) -> str:
        nvml = self.nvml_problem or f"{len(self.nvml_gpus)} GPU(s): {', '.join(self.nvml_gpus)}"
        smi = self.smi_problem or f"{len(self.smi)} GPU(s)" + (
            f", driver {self.smi[0].driver_version}" if self.smi else ""
        )
        return f"NVML: {nvml}; nvidia-smi: {smi}"


def detect(
    *,
    load_nvml: Callable[[], Any] = import_nvml,
    smi: Callable[[], str] = run_smi,
) -> Detection:
    nvml_gpus: tuple[str, ...] = ()
    nvml_problem = None
    try:
        nvml_gpus = _nvml_gpus(load_nvml)
        if not nvml_gpus:
            nvml_problem = "NVML sees no GPU"
    except _NvmlProblem as problem:
        nvml_problem = str(problem)
    readings: tuple[SmiReading, ...] = ()
    smi_problem = None
    try:
        readings = parse_smi_csv(smi())
        if not readings:
            smi_problem = "nvidia-smi lists no GPU"
    except SmiUnavailable as error:
        smi_problem = str(error)
    except ValueError as error:
        smi_problem = f"nvidia-smi's output could not be read: {error}"
    return Detection(
        nvml_gpus=nvml_gpus, nvml_problem=nvml_problem, smi=readings, smi_problem=smi_problem
    )


class _NvmlProblem(Exception):
    pass


def _nvml_gpus(load_nvml: Callable[[], Any]) -> tuple[str, ...]:
    try:
        nvml = load_nvml()
    except ImportError as error:
        raise _NvmlProblem(f"the NVML bindings (nvidia-ml-py) are not installed: {error}") from None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        raise _NvmlProblem(f"NVML could not be initialised: {error}") from None
    try:
        names = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            name = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(index))
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        return tuple(names)
    except nvml.NVMLError as error:
        raise _NvmlProblem(f"NVML could not list the GPUs: {error}") from None
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


def no_gpu_message(detection: Detection) -> str:
    return (
        "no NVIDIA GPU here: "
        f"NVML: {detection.nvml_problem or 'no GPU'}; "
        f"nvidia-smi: {detection.smi_problem or 'no GPU'}.\n"
        "make gpu-check needs a machine with an NVIDIA GPU and its driver (NVML is what the "
        "sidecar reads). The same pipeline runs on the CPU, without NVML: "
        "make gpu-check GPU_CHECK_ARGS=--device=cpu"
    )


# -- NVML (the sidecar's /status) next to nvidia-smi -------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Row:
    reading: str
    sidecar: float | None
    """From the sidecar's /status, in the row's unit."""
    smi: float | None

    @property
    def difference(self) -> float | None:
        if self.sidecar is None or self.smi is None:
            return None
        return self.sidecar - self.smi


@dataclass(frozen=True, kw_only=True)
class GpuComparison:
    index: int
    name: str | None
    uuid: str | None
    driver_version: str | None
    rows: tuple[Row, ...]
    problems: tuple[str, ...] = ()
    """What the sidecar says it could not read on this GPU."""


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def compare(
    sidecar: Sequence[reports.DeviceReport], smi: Sequence[SmiReading]
) -> tuple[GpuComparison, ...]:
    """Each GPU of the sidecar's /status next to nvidia-smi's, matched by UUID (else index); a GPU
    only one of them lists has its other column empty."""
    by_uuid = {reading.uuid: reading for reading in smi if reading.uuid}
    by_index = {reading.index: reading for reading in smi}
    matched: set[int] = set()
    comparisons = []
    for device in sidecar:
        index = device.index if device.index is not None else -1
        other = by_uuid.get(device.uuid or "") or by_index.get(index)
        if other is not None:
            matched.add(other.index)
        comparisons.append(_comparison(index, device, other))
    comparisons += [_comparison(r.index, None, r) for r in smi if r.index not in matched]
    return tuple(comparisons)


def _comparison(
    index: int, device: reports.DeviceReport | None, smi: SmiReading | None
) -> GpuComparison:
    def row(reading: str, sidecar_value: float | None, smi_value: float | None) -> Row:
        return Row(reading=reading, sidecar=sidecar_value, smi=smi_value)

    d, s = device, smi
    return GpuComparison(
        index=index,
        name=(d.name if d else None) or (s.name if s else None),
        uuid=(d.uuid if d else None) or (s.uuid if s else None),
        driver_version=s.driver_version if s else None,
        rows=(
            row(
                "utilization %",
                _scaled(d.utilization, 100.0) if d else None,
                s.utilization_percent if s else None,
            ),
            row(
                "memory used MiB",
                _scaled(d.memory_used_bytes, 1 / _MIB) if d else None,
                s.memory_used_mib if s else None,
            ),
            row(
                "memory total MiB",
                _scaled(d.memory_total_bytes, 1 / _MIB) if d else None,
                s.memory_total_mib if s else None,
            ),
            row("power W", d.power_watts if d else None, s.power_watts if s else None),
            row(
                "power limit W",
                d.power_limit_watts if d else None,
                s.power_limit_watts if s else None,
            ),
            row("SM clock MHz", d.sm_clock_mhz if d else None, s.sm_clock_mhz if s else None),
            row(
                "temperature C",
                d.temperature_celsius if d else None,
                s.temperature_celsius if s else None,
            ),
            # Reported apart by NVML's v2 memory info; not among nvidia-smi's queried fields.
            row(
                "memory reserved MiB",
                _scaled(d.memory_reserved_bytes, 1 / _MIB) if d else None,
                None,
            ),
        ),
        problems=tuple(d.problems) if d else (),
    )


def _cell(value: float | None, *, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.1f}" if signed else f"{value:.1f}"


def render(comparisons: Sequence[GpuComparison]) -> str:
    if not comparisons:
        return "  (no GPU in either reading)"
    lines = []
    for gpu in comparisons:
        driver = f", driver {gpu.driver_version}" if gpu.driver_version else ""
        lines.append(f"  GPU {gpu.index}: {gpu.name or '?'} ({gpu.uuid or 'no UUID'}{driver})")
        lines.append(
            f"    {'reading':<18}{'sidecar (NVML)':>16}{'nvidia-smi':>12}{'difference':>12}"
        )
        for row in gpu.rows:
            lines.append(
                f"    {row.reading:<18}{_cell(row.sidecar):>16}{_cell(row.smi):>12}"
                f"{_cell(row.difference, signed=True):>12}"
            )
        lines += [f"    sidecar could not read: {problem}" for problem in gpu.problems]
    return "\n".join(lines)
