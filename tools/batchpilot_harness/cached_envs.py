"""Virtualenvs the tests need beside the project's own, built once into the cache.

`llm_env` (vLLM's engine) and `numpy2_env` (NumPy 2 over the project's packages) differ in what
they install and share how: a lock keeps two builds of one environment apart, a marker written
last says it is complete (a build that fails removes what it made), each step is a command whose
output is kept for the error, and `make` runs each as a module that prints the environment's
path.
"""

from __future__ import annotations

import argparse
import fcntl
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

Say = Callable[[str], None]


class EnvironmentBuildError(RuntimeError):
    """A step of building an environment failed; the message ends with its output."""


def run_step(
    argv: Sequence[str], say: Say, *, error: type[EnvironmentBuildError] = EnvironmentBuildError
) -> str:
    """Run one step, say it, and return its standard output; `error` with the output's tail."""
    say("  $ " + " ".join(argv[:6]) + (" ..." if len(argv) > 6 else ""))
    completed = subprocess.run(argv, capture_output=True, text=True, check=False)  # noqa: S603
    if completed.returncode != 0:
        raise error(
            f"{argv[0]} {' '.join(argv[1:4])} failed ({completed.returncode}):\n"
            f"{(completed.stdout + completed.stderr)[-3000:]}"
        )
    return completed.stdout


def build_once(
    target: Path,
    *,
    is_built: Callable[[Path], bool],
    build: Callable[[Path, Say], None],
    say: Say,
) -> Path:
    """`target`, built by `build` first unless it is complete; one build at a time."""
    if is_built(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_built(target):
            build(target, say)
    return target


def command(build: Callable[[], Path], description: str | None, argv: Sequence[str] | None) -> int:
    """`python -m <environment module>`: build it if needed and print its path."""
    parser = argparse.ArgumentParser(description=description)
    parser.parse_args(argv)
    try:
        print(build())
    except EnvironmentBuildError as failure:
        print(failure, file=sys.stderr)
        return 1
    return 0
