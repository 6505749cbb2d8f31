"""The GPU check's command line: its plan from the arguments, the exit without a GPU, and what it
says is missing before a run; `make test` does not run it."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from batchpilot_harness.gpuchecks import command_line, devices, plans, wheels

REPO = Path(__file__).resolve().parents[2]


def run_arguments(*argv: str) -> argparse.Namespace:
    return command_line.parser().parse_args(["run", *argv])


def test_the_plan_takes_the_devices_defaults_where_the_arguments_are_silent() -> None:
    plan = command_line.plan_of(run_arguments())
    assert plan == plans.Plan(
        device="cuda",
        gpu=0,
        rate=800.0,
        segment_seconds=30.0,
        cycles=2,
        hidden_width=8192,
        hidden_layers=4,
        out=Path(".bench/gpu-check"),
    )
    assert plan.profiles == ["interactive", "bulk", "interactive", "bulk"]
    assert plan.load_seconds == 120.0
    on_cpu = command_line.plan_of(run_arguments("--device=cpu", "--rate=50", "--out=/tmp/x"))
    assert (on_cpu.device, on_cpu.rate, on_cpu.segment_seconds, on_cpu.hidden_width) == (
        "cpu",
        50.0,
        8.0,
        1024,
    )
    assert on_cpu.out == Path("/tmp/x")


def test_explicit_arguments_win() -> None:
    plan = command_line.plan_of(
        run_arguments(
            "--gpu=1",
            "--segment-seconds=45",
            "--cycles=3",
            "--hidden-width=4096",
            "--hidden-layers=6",
        )
    )
    assert (plan.gpu, plan.segment_seconds, plan.cycles) == (1, 45.0, 3)
    assert (plan.hidden_width, plan.hidden_layers) == (4096, 6)
    assert "hidden 4096 x 6) on cuda (GPU 1)" in plan.describe()


def test_the_wheels_command_defaults_to_the_folder_python_and_budget() -> None:
    arguments = command_line.parser().parse_args(["wheels"])
    assert (arguments.dest, arguments.python, arguments.budget_mib) == (
        Path(".gpu-wheels"),
        "3.12",  # the lent GPU machines' Python
        60.0,
    )


def no_gpu() -> devices.Detection:
    return devices.Detection(
        nvml_problem="NVML could not be initialised: NVML Shared Library Not Found",
        smi_problem="nvidia-smi not found on PATH",
    )


def test_without_a_gpu_it_exits_3_and_says_what_it_needs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert command_line.main(["run"], detect=no_gpu) == command_line.EXIT_NO_GPU
    out, err = capsys.readouterr()
    assert "NVML: NVML could not be initialised: NVML Shared Library Not Found" in out
    assert err.startswith("gpu-check: no NVIDIA GPU here: NVML: NVML could not be initialised")
    assert "nvidia-smi: nvidia-smi not found on PATH." in err
    assert "make gpu-check needs a machine with an NVIDIA GPU" in err


def test_its_first_line_says_what_it_stands_on(capsys: pytest.CaptureFixture[str]) -> None:
    def h200() -> devices.Detection:
        reading = devices.SmiReading(index=0, name="NVIDIA H200", driver_version="580.159")
        return devices.Detection(nvml_gpus=("NVIDIA H200",), smi=(reading,))

    assert command_line.main(["run", "--gpu=1"], detect=h200) == command_line.EXIT_USAGE
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"gpu-check: Python {sys.version.split()[0]} ({sys.executable}); ")
    assert f"; NumPy {np.__version__}; torch " in first
    assert first.endswith("; driver 580.159; GPUs: NVIDIA H200")


def test_a_gpu_index_it_does_not_have_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def one_gpu() -> devices.Detection:
        return devices.Detection(nvml_gpus=("NVIDIA H100 80GB HBM3",))

    assert command_line.main(["run", "--gpu=1"], detect=one_gpu) == command_line.EXIT_USAGE
    assert "there is no GPU 1" in capsys.readouterr().err


def test_nonsense_numbers_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert command_line.main(["run", "--cycles=0"], detect=no_gpu) == command_line.EXIT_USAGE
    assert "--cycles at least 1" in capsys.readouterr().err


def test_what_gpu_machines_have_and_this_one_lacks_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(wheels, "missing_on_the_device", lambda: ["torch", "nvidia-ml-py"])
    problem = command_line.prepare(tmp_path / "wheels", tmp_path / "site")
    assert problem is not None
    assert ": torch, nvidia-ml-py. GPU machines are expected to have them" in problem


def test_carried_packages_missing_without_wheels_say_to_run_make_gpu_wheels(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(wheels, "missing_on_the_device", lambda: [])
    monkeypatch.setattr(
        wheels, "installed_version", lambda name: None if name == "tritonclient" else "1.0"
    )
    problem = command_line.prepare(tmp_path / "wheels", tmp_path / "site")
    assert problem is not None
    assert f": tritonclient, and there is no {tmp_path / 'wheels'}." in problem
    assert "Run `make gpu-wheels` on a machine that reaches PyPI" in problem


def test_wheels_for_another_python_are_refused_with_the_command_that_makes_the_right_ones(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(wheels, "missing_on_the_device", lambda: [])
    (tmp_path / "pydantic-2.14.3-py3-none-any.whl").write_bytes(b"")
    wheels.write_manifest(tmp_path, python="3.9", found=wheels.inventory(tmp_path))
    monkeypatch.setattr(wheels, "installed_version", lambda name: None)
    problem = command_line.prepare(tmp_path, tmp_path / "site")
    assert problem is not None
    here = wheels.python_version()
    assert f"are for Python 3.9, and this is {here}" in problem
    assert f"make gpu-wheels GPU_WHEELS_PYTHON={here}" in problem


def test_an_environment_that_has_everything_needs_no_wheels(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # This virtualenv has every carried distribution, as a developer's does.
    monkeypatch.setattr(command_line, "stub_library_problem", lambda: None)
    assert command_line.prepare(tmp_path / "absent", tmp_path / "site") is None
    assert not (tmp_path / "site").exists()


def test_a_python_without_a_shared_libpython_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(command_line.sysconfig, "get_config_var", lambda name: None)
    monkeypatch.setattr(command_line.ctypes.util, "find_library", lambda name: None)
    problem = command_line.stub_library_problem()
    assert problem is not None
    here = wheels.python_version()
    assert problem.startswith(f"libpython{here}.so.1.0 is not found: Triton's Python backend")
    assert f"apt-get install libpython{here}" in problem


def test_make_test_does_not_run_the_gpu_check() -> None:
    done = subprocess.run(
        ["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, check=True, timeout=30
    )
    assert "gpuchecks" not in done.stdout
    makefile = (REPO / "Makefile").read_text()
    assert "gpuchecks run" in makefile
