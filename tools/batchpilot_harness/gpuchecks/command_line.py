"""`make gpu-check` and `make gpu-wheels`: the command line, and what has to hold before a run.

`run` first looks for a GPU (NVML and nvidia-smi), then for what the run imports: the carried
distributions are installed from the wheel folder when this environment lacks them at the
carried versions, and the packages GPU machines are expected to have are only checked. Each
missing piece is named with the way to get it. Nothing beyond the standard library is imported
before that (the run's own modules come after), so the messages come out on a bare machine too.
"""

from __future__ import annotations

import argparse
import ctypes.util
import dataclasses
import importlib
import importlib.metadata
import os
import sys
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path

from batchpilot_harness.gpuchecks import devices, plans, wheels

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_GPU = 3
EXIT_MISSING = 4


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m batchpilot_harness.gpuchecks",
        description="The GPU check (make gpu-check) and the wheels it carries (make gpu-wheels).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="tritonserver with torch_mlp on a GPU, the sidecar on NVML, the runner switching "
        "profiles under load; prints what NVML, nvidia-smi and the run measured",
    )
    run.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu runs the same pipeline without CUDA or NVML (default %(default)s)",
    )
    run.add_argument("--gpu", type=int, default=0, help="NVML index of the GPU to use")
    run.add_argument("--rate", type=float, help="requests per second (cuda 800, cpu 100)")
    run.add_argument(
        "--segment-seconds", type=float, help="seconds per profile segment (cuda 30, cpu 8)"
    )
    run.add_argument("--cycles", type=int, help="interactive+bulk cycles (default 2)")
    run.add_argument("--hidden-width", type=int, help="torch_mlp's width (cuda 8192, cpu 1024)")
    run.add_argument("--hidden-layers", type=int, help="torch_mlp's depth (cuda 4, cpu 2)")
    run.add_argument(
        "--wheels",
        type=Path,
        default=Path(".gpu-wheels"),
        help="the carried wheels (make gpu-wheels)",
    )
    run.add_argument(
        "--model-repository",
        type=Path,
        default=plans.Plan.model_repository,
        help="a model repository holding torch_mlp (default: the project's, %(default)s)",
    )
    run.add_argument(
        "--site",
        type=Path,
        default=Path(".gpu-site"),
        help="where missing carried packages are installed (default %(default)s)",
    )
    run.add_argument(
        "--out",
        type=Path,
        default=Path(".bench/gpu-check"),
        help="logs, gpu-check.txt and gpu-check.json (default %(default)s)",
    )
    download = commands.add_parser(
        "wheels", help="download the wheels a GPU machine lacks into a folder, and size them"
    )
    download.add_argument("--dest", type=Path, default=Path(".gpu-wheels"))
    download.add_argument(
        "--python", default=wheels.DEFAULT_PYTHON, help="the GPU machine's Python (%(default)s)"
    )
    download.add_argument("--budget-mib", type=float, default=wheels.BUDGET_MIB)
    return parser


def plan_of(arguments: argparse.Namespace) -> plans.Plan:
    """The run the arguments ask for; what they leave out is the device's default."""
    defaults = plans.DEFAULTS[arguments.device]
    chosen = {
        field.name: getattr(arguments, field.name)
        for field in dataclasses.fields(plans.Defaults)
        if getattr(arguments, field.name) is not None
    }
    values = dataclasses.replace(defaults, **chosen)
    if values.rate <= 0 or values.segment_seconds <= 0 or values.cycles < 1:
        raise ValueError("--rate and --segment-seconds must be positive, --cycles at least 1")
    return plans.Plan(
        device=arguments.device,
        gpu=arguments.gpu,
        out=arguments.out,
        model_repository=arguments.model_repository,
        **dataclasses.asdict(values),
    )


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_line(detection: devices.Detection) -> str:
    """What the run will stand on: Python, NumPy (the Python backend is sensitive to its major
    version), torch, the driver and the GPUs, as found here."""
    driver = next((r.driver_version for r in detection.smi if r.driver_version), None)
    found = [
        f"Python {sys.version.split()[0]} ({sys.executable})",
        f"NumPy {_version('numpy')}",
        f"torch {_version('torch')}",
        f"driver {driver or 'unknown'}",
        f"GPUs: {', '.join(detection.nvml_gpus) or 'none through NVML'}",
    ]
    return "; ".join(found)


def stub_library_problem() -> str | None:
    """Triton's Python-backend stub links this Python's libpython3.X.so.1.0."""
    version = wheels.python_version()
    name = f"libpython{version}.so.1.0"
    libdir = sysconfig.get_config_var("LIBDIR")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir and (Path(libdir) / name).exists():
        return None
    if ctypes.util.find_library(f"python{version}"):
        return None
    return (
        f"{name} is not found: Triton's Python backend runs models in a stub that links it. Use "
        f"a Python built with --enable-shared (GPU_PYTHON=...), or install libpython{version} "
        f"(Debian/Ubuntu: apt-get install libpython{version})"
    )


def prepare(folder: Path, site: Path) -> str | None:
    """Make the run's imports available; None when they are, else what is missing and how to get
    it."""
    lacking = wheels.missing_on_the_device()
    if lacking:
        return (
            f"missing for {sys.executable}: {', '.join(lacking)}. GPU machines are expected to "
            "have them, so the wheel folder does not carry them; install them, or run with a "
            "Python that has them (GPU_PYTHON=...)"
        )
    manifest = wheels.Manifest.read(folder) if (folder / wheels.MANIFEST).is_file() else None
    if manifest is None:
        names = [c.name for c in wheels.CARRIED if wheels.installed_version(c.name) is None]
        if names:
            return (
                f"missing for {sys.executable}: {', '.join(names)}, and there is no {folder}. "
                "Run `make gpu-wheels` on a machine that reaches PyPI and bring the folder along "
                "with the working tree (it is ignored by git)"
            )
        return stub_library_problem()
    names = wheels.to_install(manifest)
    if names:
        if manifest.python != wheels.python_version():
            return (
                f"the wheels in {folder} are for Python {manifest.python}, and this is "
                f"{wheels.python_version()} ({sys.executable}): run `make gpu-wheels "
                f"GPU_WHEELS_PYTHON={wheels.python_version()}` where PyPI can be reached"
            )
        print(f"Installing from {folder} into {site}: {', '.join(names)}")
        try:
            wheels.install(folder, site, names, manifest)
        except wheels.WheelsError as error:
            return str(error)
        use_site(site)
    return stub_library_problem()


def use_site(site: Path) -> None:
    """The installed packages first on this process's path and on its children's."""
    sys.path.insert(0, str(site.resolve()))
    importlib.invalidate_caches()
    parts = [str(site.resolve()), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)


def _run(arguments: argparse.Namespace, detect: Callable[[], devices.Detection]) -> int:
    try:
        plan = plan_of(arguments)
    except ValueError as error:
        print(f"gpu-check: {error}", file=sys.stderr)
        return EXIT_USAGE
    detection = detect()
    print(f"gpu-check: {environment_line(detection)}")
    print(f"gpu-check: {detection.describe()}")
    if plan.device == "cuda":
        if not detection.found:
            print(f"gpu-check: {devices.no_gpu_message(detection)}", file=sys.stderr)
            return EXIT_NO_GPU
        if plan.gpu >= len(detection.nvml_gpus):
            print(f"gpu-check: there is no GPU {plan.gpu}", file=sys.stderr)
            return EXIT_USAGE
    problem = prepare(arguments.wheels, arguments.site)
    if problem is not None:
        print(f"gpu-check: {problem}", file=sys.stderr)
        return EXIT_MISSING
    print(f"gpu-check: with the wheels and site in place: {environment_line(detection)}")
    # Imports what prepare() made available.
    from batchpilot_harness.gpuchecks import runs, verdicts

    try:
        findings = runs.run(plan)
    except RuntimeError as error:
        print(f"gpu-check: FAILED: the run failed: {error}", flush=True)
        return EXIT_FAILED
    print()
    print(runs.render(findings))
    runs.write(findings, plan.out)
    print(f"\nWritten: {plan.out / 'gpu-check.txt'}, {plan.out / 'gpu-check.json'}")
    problems = verdicts.problems(findings)
    # The reason is the last line, on the same stream as the report, so it cannot be lost.
    if problems:
        print("gpu-check: FAILED: " + "; ".join(problems), flush=True)
        return EXIT_FAILED
    print("gpu-check: OK", flush=True)
    return 0


def _wheels(arguments: argparse.Namespace) -> int:
    try:
        found = wheels.download(
            dest=arguments.dest, python=arguments.python, budget_mib=arguments.budget_mib
        )
    except wheels.WheelsError as error:
        print(f"gpu-wheels: {error}", file=sys.stderr)
        return EXIT_FAILED
    print(f"Wheels for Python {arguments.python} in {arguments.dest}:")
    print(wheels.size_report(found, budget_mib=arguments.budget_mib))
    return 0


def main(
    argv: Sequence[str] | None = None,
    *,
    detect: Callable[[], devices.Detection] = devices.detect,
) -> int:
    arguments = parser().parse_args(argv)
    if arguments.command == "wheels":
        return _wheels(arguments)
    return _run(arguments, detect)
