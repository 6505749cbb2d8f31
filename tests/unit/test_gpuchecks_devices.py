"""The GPU check's view of the GPUs without one: detection and its message, nvidia-smi's CSV, and
the sidecar's NVML readings (through the fake library) next to nvidia-smi's."""

from __future__ import annotations

from typing import Any

import pytest

from batchpilot_harness.gpuchecks import devices
from batchpilot_sidecar import status_document
from fake_nvml import GIB, FakeGpu, FakeNvml
from fake_triton import FakeTriton
from sidecar_builders import Clock, make_collector, one_gpu

HEADER = (
    "index, uuid, name, driver_version, utilization.gpu [%], memory.used [MiB], "
    "memory.total [MiB], power.draw [W], power.limit [W], clocks.sm [MHz], temperature.gpu"
)
L4_ROW = "0, GPU-0000, NVIDIA L4, 550.54.15, 37, 6144, 24576, 41.50, 72.00, 2040, 55"


def smi_says(text: str) -> Any:
    return lambda: text


def smi_fails(reason: str) -> Any:
    def run() -> str:
        raise devices.SmiUnavailable(reason)

    return run


def test_nvidia_smi_csv_is_read_by_its_header() -> None:
    (reading,) = devices.parse_smi_csv(f"{HEADER}\n{L4_ROW}\n")
    assert reading == devices.SmiReading(
        index=0,
        uuid="GPU-0000",
        name="NVIDIA L4",
        driver_version="550.54.15",
        utilization_percent=37,
        memory_used_mib=6144,
        memory_total_mib=24576,
        power_watts=41.5,
        power_limit_watts=72,
        sm_clock_mhz=2040,
        temperature_celsius=55,
    )


def test_nvidia_smi_csv_with_units_in_the_cells_and_columns_in_another_order() -> None:
    text = (
        "name, index, uuid, temperature.gpu, driver_version, utilization.gpu [%], "
        "memory.used [MiB], memory.total [MiB], power.draw [W], power.limit [W], clocks.sm [MHz]\n"
        "NVIDIA H100 80GB HBM3, 1, GPU-1111, 41, 550.54.15, 87 %, 12001 MiB, 81559 MiB, "
        "305.40 W, 700.00 W, 1980 MHz\n"
    )
    (reading,) = devices.parse_smi_csv(text)
    assert (reading.index, reading.name, reading.utilization_percent) == (
        1,
        "NVIDIA H100 80GB HBM3",
        87,
    )
    assert (reading.memory_used_mib, reading.power_watts, reading.sm_clock_mhz) == (
        12001,
        305.4,
        1980,
    )


def test_nvidia_smi_answering_with_the_long_names_of_the_fields_is_read_the_same() -> None:
    # Asked for clocks.sm, the driver of the lent H200 (580.159) answered clocks.current.sm, and
    # every comparison column came out empty.
    long_header = (
        HEADER.replace("clocks.sm", "clocks.current.sm")
        .replace("name,", "gpu_name,")
        .replace("power.limit", "enforced.power.limit")
    )
    assert "clocks.current.sm [MHz]" in long_header
    assert devices.parse_smi_csv(f"{long_header}\n{L4_ROW}\n") == devices.parse_smi_csv(
        f"{HEADER}\n{L4_ROW}\n"
    )


def test_a_row_that_does_not_match_the_header_is_refused() -> None:
    with pytest.raises(ValueError, match="10 cells for 11 columns"):
        devices.parse_smi_csv(f"{HEADER}\n{L4_ROW.rsplit(',', 1)[0]}\n")


def test_what_nvidia_smi_cannot_read_is_none() -> None:
    row = "0, GPU-0000, NVIDIA L4, 550.54.15, 37, 6144, 24576, [N/A], [Not Supported], 2040, 55"
    (reading,) = devices.parse_smi_csv(f"{HEADER}\n{row}\n")
    assert reading.power_watts is None
    assert reading.power_limit_watts is None
    assert reading.temperature_celsius == 55


def test_a_csv_without_a_queried_field_is_refused() -> None:
    with pytest.raises(ValueError, match=r"lacks memory\.used, memory\.total, power\.draw"):
        devices.parse_smi_csv("index, uuid, name, driver_version, utilization.gpu [%]\n")


def test_the_command_queries_every_field_it_parses() -> None:
    command = list(devices.SMI_COMMAND)
    assert command[0] == "nvidia-smi"
    assert command[1] == "--query-gpu=" + ",".join(devices.SMI_FIELDS)
    assert command[2] == "--format=csv,nounits"


def test_without_nvidia_smi_on_the_path_it_says_so() -> None:
    with pytest.raises(devices.SmiUnavailable, match="nvidia-smi-nowhere not found on PATH"):
        devices.run_smi(("nvidia-smi-nowhere", "--query-gpu=index"))


def test_a_machine_without_a_driver_is_not_found_and_the_message_says_why_and_what_to_do() -> None:
    detection = devices.detect(
        load_nvml=lambda: FakeNvml(init_error="NVML Shared Library Not Found"),
        smi=smi_fails("nvidia-smi not found on PATH"),
    )
    assert not detection.found
    message = devices.no_gpu_message(detection)
    assert message.startswith(
        "no NVIDIA GPU here: NVML: NVML could not be initialised: NVML Shared Library Not Found; "
        "nvidia-smi: nvidia-smi not found on PATH."
    )
    assert "make gpu-check needs a machine with an NVIDIA GPU" in message
    assert "GPU_CHECK_ARGS=--device=cpu" in message


def test_without_the_nvml_bindings_the_reason_names_the_package() -> None:
    def missing() -> Any:
        raise ModuleNotFoundError("No module named 'pynvml'")

    detection = devices.detect(load_nvml=missing, smi=smi_fails("nvidia-smi not found on PATH"))
    assert detection.nvml_problem is not None
    assert "nvidia-ml-py" in detection.nvml_problem


def test_nvml_without_gpus_is_not_found() -> None:
    detection = devices.detect(load_nvml=lambda: FakeNvml(), smi=smi_says(HEADER + "\n"))
    assert not detection.found
    assert detection.nvml_problem == "NVML sees no GPU"
    assert detection.smi_problem == "nvidia-smi lists no GPU"


def test_a_gpu_is_found_through_nvml_and_nvml_is_shut_down_again() -> None:
    library = FakeNvml(FakeGpu(name="NVIDIA H100 80GB HBM3"))
    detection = devices.detect(load_nvml=lambda: library, smi=smi_says(f"{HEADER}\n{L4_ROW}\n"))
    assert detection.found
    assert detection.nvml_gpus == ("NVIDIA H100 80GB HBM3",)
    assert (library.init_calls, library.shutdown_calls) == (1, 1)
    assert detection.describe() == (
        "NVML: 1 GPU(s): NVIDIA H100 80GB HBM3; nvidia-smi: 1 GPU(s), driver 550.54.15"
    )


def test_nvidia_smi_alone_does_not_make_the_check_runnable() -> None:
    detection = devices.detect(
        load_nvml=lambda: FakeNvml(init_error="Driver/library version mismatch"),
        smi=smi_says(f"{HEADER}\n{L4_ROW}\n"),
    )
    assert not detection.found
    assert "Driver/library version mismatch" in devices.no_gpu_message(detection)


async def sidecar_devices(*gpus: FakeGpu) -> Any:
    """The devices of the sidecar's own /status document, read through the fake NVML."""
    clock = Clock()
    collector = make_collector(FakeTriton(), clock, monitor=one_gpu(*gpus[:1]))
    await collector.collect()
    return status_document.document(collector, None).gpu.devices


async def test_the_sidecar_and_nvidia_smi_agree_on_one_gpu_in_each_others_units() -> None:
    found = await sidecar_devices(FakeGpu())
    (gpu,) = devices.compare(found, devices.parse_smi_csv(f"{HEADER}\n{L4_ROW}\n"))
    assert (gpu.index, gpu.name, gpu.uuid, gpu.driver_version) == (
        0,
        "NVIDIA L4",
        "GPU-0000",
        "550.54.15",
    )
    rows = {row.reading: (row.sidecar, row.smi, row.difference) for row in gpu.rows}
    assert rows == {
        "utilization %": (37.0, 37.0, 0.0),
        "memory used MiB": (6144.0, 6144.0, 0.0),
        "memory reserved MiB": (0.0, None, None),  # nvidia-smi's query leaves it out
        "memory total MiB": (24576.0, 24576.0, 0.0),
        "power W": (41.5, 41.5, 0.0),
        "power limit W": (72.0, 72.0, 0.0),
        "SM clock MHz": (2040.0, 2040.0, 0.0),
        "temperature C": (55.0, 55.0, 0.0),
    }


async def test_differences_are_shown_signed_and_what_one_side_lacks_as_a_dash() -> None:
    found = await sidecar_devices(
        FakeGpu(memory_used=6 * GIB + 512 * 1024 * 1024, failing={"power": "Not Supported"})
    )
    row = "0, GPU-0000, NVIDIA L4, 550.54.15, 35, 6144, 24576, 41.50, 72.00, 2040, 55"
    text = devices.render(devices.compare(found, devices.parse_smi_csv(f"{HEADER}\n{row}\n")))
    lines = text.splitlines()
    assert lines[0] == "  GPU 0: NVIDIA L4 (GPU-0000, driver 550.54.15)"
    assert lines[1].split() == ["reading", "sidecar", "(NVML)", "nvidia-smi", "difference"]
    assert lines[2].split() == ["utilization", "%", "37.0", "35.0", "+2.0"]
    assert lines[3].split() == ["memory", "used", "MiB", "6656.0", "6144.0", "+512.0"]
    assert lines[5].split() == ["power", "W", "-", "41.5", "-"]
    assert lines[-1] == "    sidecar could not read: power: Not Supported"


async def test_a_gpu_only_nvidia_smi_lists_keeps_an_empty_sidecar_column() -> None:
    other = "1, GPU-1111, NVIDIA L4, 550.54.15, 0, 0, 24576, 16.00, 72.00, 210, 30"
    found = await sidecar_devices(FakeGpu())
    comparisons = devices.compare(found, devices.parse_smi_csv(f"{HEADER}\n{L4_ROW}\n{other}\n"))
    assert [gpu.index for gpu in comparisons] == [0, 1]
    assert {row.sidecar for row in comparisons[1].rows} == {None}
