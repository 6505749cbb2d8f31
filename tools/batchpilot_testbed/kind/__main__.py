"""`make e2e-kind`: the e2e suite against a kind cluster, for machines with a Docker engine.

    python -m batchpilot_testbed.kind up    # kind, the cluster, the three images, the chart,
                                            # a pod route
    python -m batchpilot_testbed.kind test  # pytest e2e --e2e against it (extra arguments go
                                            # to pytest)
    python -m batchpilot_testbed.kind down  # deletes the cluster and the route

This project's own CI machines have no Docker engine, so this path is not run there; it is kept
in step with the chart and the suite by using only what they use. What `up` does:

- builds kind with the machine's Go (`go install`, cached next to the other binaries);
- creates the cluster `batchpilot` from `tools/batchpilot_testbed/kind/kind-config.yaml` (context
`kind-batchpilot`, which the suite accepts as a test cluster);
- builds the operator, sidecar and CPU-Triton images and loads them into the cluster;
- installs the chart from `charts/batchpilot` with those images, limited to its own namespace so
  that the operators the tests start act alone on the tests' namespaces (`--wait`: the
  Deployment must become Available);
- routes the cluster's Pod CIDR through the node (`sudo ip route replace`), because the tests,
  like the operator, talk to Triton at Pod IPs.

Every command is a fixed argument list; nothing is built from user input or run through a shell.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from batchpilot_cluster import building, images, locations
from batchpilot_testbed import fleet

KIND_VERSION = "v0.33.0"  # its default node image is Kubernetes v1.37.0
CLUSTER = "batchpilot"
CONTEXT = f"kind-{CLUSTER}"
CONFIG = Path(__file__).with_name("kind-config.yaml")
POD_SUBNET = "10.244.0.0/16"  # as in kind-config.yaml
NAMESPACE = "batchpilot-system"
TAG = "e2e"


class KindError(Exception):
    """A step of the kind path failed; the message says which and why."""


def run(argv: Sequence[str], *, capture: bool = False) -> str:
    print("+", " ".join(argv), flush=True)
    try:
        done = subprocess.run(
            argv, cwd=locations.REPO_ROOT, check=True, text=True, capture_output=capture
        )
    except FileNotFoundError:
        raise KindError(f"{argv[0]}: not installed") from None
    except subprocess.CalledProcessError as error:
        raise KindError(
            f"{' '.join(argv)} failed ({error.returncode}): {error.stderr or ''}"
        ) from None
    return done.stdout if capture else ""


def kind_binary() -> Path:
    """kind, built once with the machine's Go into the binary cache."""
    directory = locations.cache_root() / "kind" / KIND_VERSION
    binary = directory / "kind"
    if not binary.exists():
        environment = {**building.go_environment(), "GOBIN": str(directory)}
        subprocess.run(
            ["go", "install", f"sigs.k8s.io/kind@{KIND_VERSION}"], check=True, env=environment
        )
    return binary


def kubeconfig() -> Path:
    return locations.state_dir().parent / "kind" / "kubeconfig"


def node_address() -> str:
    address = run(
        [
            "docker",
            "inspect",
            "--format",
            "{{.NetworkSettings.Networks.kind.IPAddress}}",
            f"{CLUSTER}-control-plane",
        ],
        capture=True,
    ).strip()
    if not address:
        raise KindError(f"no address of {CLUSTER}-control-plane on the docker network `kind`")
    return address


def up() -> None:
    if shutil.which("docker") is None:
        raise KindError("no docker command: the kind path needs a Docker engine")
    engine = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False)
    if engine.returncode != 0:
        raise KindError(f"no Docker engine answers: {engine.stderr.strip()}")
    kind = str(kind_binary())
    bins = building.require_binaries()
    clusters = run([kind, "get", "clusters"], capture=True).split()
    config = kubeconfig()
    config.parent.mkdir(parents=True, exist_ok=True)
    if CLUSTER not in clusters:
        run([kind, "create", "cluster", "--name", CLUSTER, "--config", str(CONFIG), "--wait", "2m"])
    run([kind, "export", "kubeconfig", "--name", CLUSTER, "--kubeconfig", str(config)])
    # The images `make images` builds without Docker, from the same Dockerfiles and base default.
    for recipe in images.IMAGES:
        run(["docker", "build", "-f", recipe.dockerfile, "-t", f"{recipe.name}:{TAG}", "."])
        run([kind, "load", "docker-image", "--name", CLUSTER, f"{recipe.name}:{TAG}"])
    run(
        [
            str(bins / "helm"),
            "upgrade",
            "--install",
            "batchpilot",
            "charts/batchpilot",
            "--kubeconfig",
            str(config),
            "--namespace",
            NAMESPACE,
            "--create-namespace",
            "--set",
            "image.repository=batchpilot-operator",
            "--set",
            f"image.tag={TAG}",
            "--set",
            "image.pullPolicy=Never",
            "--set",
            f"operator.namespaces[0]={NAMESPACE}",
            "--wait",
            "--timeout",
            "3m",
        ]
    )
    run(["sudo", "ip", "route", "replace", POD_SUBNET, "via", node_address()])
    print(f"KUBECONFIG={config}")


def test(pytest_arguments: Sequence[str]) -> int:
    environment = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig()),
        fleet.TRITON_IMAGE_ENV: f"batchpilot-triton:{TAG}",
        fleet.SIDECAR_IMAGE_ENV: f"batchpilot-sidecar:{TAG}",
    }
    argv = [sys.executable, "-m", "pytest", "e2e", "--e2e", *pytest_arguments]
    return subprocess.run(argv, cwd=locations.REPO_ROOT, env=environment, check=False).returncode


def down() -> None:
    subprocess.run(["sudo", "ip", "route", "del", POD_SUBNET], check=False)
    run([str(kind_binary()), "delete", "cluster", "--name", CLUSTER])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m batchpilot_testbed.kind", description="the e2e suite against a kind cluster"
    )
    parser.add_argument("command", choices=["up", "test", "down"])
    arguments, rest = parser.parse_known_args(argv)
    try:
        if arguments.command == "up":
            up()
        elif arguments.command == "test":
            return test(rest)
        else:
            down()
    except KindError as error:
        print(f"batchpilot_testbed.kind: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
