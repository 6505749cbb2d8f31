"""`make e2e-kind`: the e2e tests that matter on kind, with Docker or with Podman.

    python -m batchpilot_testbed.kind up     # the cluster, the project's images, the chart, routes
    python -m batchpilot_testbed.kind test   # the kind selection of e2e/ against it (extra
                                             # arguments go to pytest)
    python -m batchpilot_testbed.kind smoke  # up, then the install test alone (one switch)
    python -m batchpilot_testbed.kind down   # the cluster, its network and the routes

The engine is Docker where a Docker engine answers, else Podman (engines.py). Nothing is pulled:

- kind is built with the machine's Go (``go install``), cached beside the other binaries;
- the node image is built here (nodeimages.py) from the locally built Kubernetes, containerd and
  pause, and loaded into the engine as an archive; ``BATCHPILOT_KIND_NODE_IMAGE`` names another
  (``kindest/node:...``, for a machine whose engine can pull it) instead;
- the operator, sidecar and CPU-Triton images, and the demo models' image for image volumes, are
  the archives ``make images`` builds from this checkout, loaded with ``kind load image-archive``;
- the chart is installed with the operator image that was loaded (``pullPolicy: Never``),
  watching its own namespace only, so the operators the tests start act alone on theirs;
- the host routes kind's Pod and Service networks through the node: the tests, like the
  operator, talk to Triton at Pod IPs, and their load goes through Services.

Every command is a fixed argument list; nothing is built from user input or run through a shell.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from batchpilot_cluster import building, images, locations
from batchpilot_testbed import fleet
from batchpilot_testbed.kind import clusters, engines, nodeimages

CLUSTER = clusters.CLUSTER
NODE = clusters.NODE
NAMESPACE = "batchpilot-system"
NODE_IMAGE_ENV = "BATCHPILOT_KIND_NODE_IMAGE"
NETWORKS = clusters.NETWORKS
WAIT = "3m"
CLIENT_BINARIES = ("helm", "kubectl")
NODE_BINARIES = (*CLIENT_BINARIES, *nodeimages.NODE_BINARIES)

TESTS = ("e2e/test_kind.py", "e2e/test_canary.py", "e2e/test_faults.py")
"""The kind selection: the Helm install path (operator in the cluster, a fleet switched under
load through a Service), the faults, the canary. The rest of e2e/ is the API, chart and
isolation checks the local control plane already runs, or reaches into the local cluster's own
processes; each test kind cannot do skips with its reason."""
SMOKE = ("e2e/test_kind.py",)


class KindError(Exception):
    """A step of the kind path failed; the message says which and why."""


def state_dir() -> Path:
    return locations.state_dir().parent / "kind"


def kubeconfig() -> Path:
    return state_dir() / "kubeconfig"


def run(argv: Sequence[str], *, env: dict[str, str] | None = None, capture: bool = False) -> str:
    print("+", " ".join(argv), flush=True)
    try:
        done = subprocess.run(
            argv,
            cwd=locations.REPO_ROOT,
            env=env,
            check=True,
            text=True,
            capture_output=capture,
        )
    except FileNotFoundError:
        raise KindError(f"{argv[0]}: not installed") from None
    except subprocess.CalledProcessError as error:
        raise KindError(
            f"{' '.join(argv)} failed ({error.returncode}): {error.stderr or ''}"
        ) from None
    return done.stdout if capture else ""


def as_root(argv: Sequence[str]) -> list[str]:
    return list(argv) if os.geteuid() == 0 else ["sudo", *argv]


def cluster_config(*, local_node: bool) -> dict[str, Any]:
    """kind's cluster config: its own Pod and Service networks; with the node image built
    here, its image repository, its CNI in place of kindnetd, and a kubelet that runs on a
    cgroup v1 host (Kubernetes 1.35+ refuse it unless told, KEP-5573)."""
    config: dict[str, Any] = {
        "kind": "Cluster",
        "apiVersion": "kind.x-k8s.io/v1alpha4",
        "name": CLUSTER,
        "nodes": [
            {
                "role": "control-plane",
                "extraMounts": [
                    {
                        "hostPath": str(clusters.MODEL_REPOSITORY),
                        "containerPath": clusters.MODEL_PATH,
                        "readOnly": True,
                    }
                ],
            }
        ],
        "networking": {
            "podSubnet": clusters.POD_SUBNET,
            "serviceSubnet": clusters.SERVICE_SUBNET,
            "kubeProxyMode": "nftables",
        },
    }
    if local_node:
        config["networking"]["disableDefaultCNI"] = True
        config["kubeadmConfigPatches"] = [
            yaml.safe_dump(
                {
                    "kind": "ClusterConfiguration",
                    "imageRepository": nodeimages.IMAGE_REPOSITORY,
                    "etcd": {"local": {"imageTag": nodeimages.ETCD_TAG}},
                    # CoreDNS's image would come from a registry; nothing here resolves names.
                    "dns": {"disabled": True},
                }
            ),
            yaml.safe_dump({"kind": "KubeletConfiguration", "failCgroupV1": False}),
        ]
    return config


def project_images() -> dict[str, images.BuiltImage]:
    """The operator, sidecar and Triton images of this checkout (built if their inputs are new)."""
    return {built.name: built for built in images.build()}


def node_image(engine: engines.Engine) -> tuple[str, bool]:
    """The node image's reference, loaded into the engine; and whether it was built here."""
    named = os.environ.get(NODE_IMAGE_ENV)
    if named:
        return named, False
    built = nodeimages.build()
    if not engine.has_image(built.reference):
        engine.load(built.archive)
    return built.reference, True


def existing_clusters(kind: Path, engine: engines.Engine) -> list[str]:
    return run([str(kind), "get", "clusters"], env=engine.environment(), capture=True).split()


def remove_if_stopped(kind: Path, engine: engines.Engine) -> bool:
    """Delete the cluster if its node is stopped; return whether it was.

    kind lists a cluster by its node container, running or not. One left by a run on a machine
    that stopped since (a reboot, a snapshot CI starts from) answers no command ("cannot exec in
    a stopped container"), and kind cannot restart it whole: it is made again."""
    if CLUSTER not in existing_clusters(kind, engine) or engine.is_running(NODE):
        return False
    print(f"the kind cluster {CLUSTER} exists but its node {NODE} is stopped: making it again")
    run([str(kind), "delete", "cluster", "--name", CLUSTER], env=engine.environment())
    return True


def up() -> dict[str, float]:
    """Everything `test` needs; returns the seconds each step took."""
    timings: dict[str, float] = {}
    started = time.monotonic()

    def lap(step: str) -> None:
        nonlocal started
        now = time.monotonic()
        timings[step] = round(now - started, 1)
        started = now
        print(f"-- {step}: {timings[step]} s", flush=True)

    engine = engines.detect(state_dir())
    print(f"engine: {engine.name}", flush=True)
    kind = nodeimages.kind_binary()
    # helm and kubectl always; the node's binaries only for a node image built here.
    building.build(only=CLIENT_BINARIES if os.environ.get(NODE_IMAGE_ENV) else NODE_BINARIES)
    lap("kind and binaries")
    reference, local_node = node_image(engine)
    lap("node image")
    built = project_images()
    lap("project images")
    config = kubeconfig()
    config.parent.mkdir(parents=True, exist_ok=True)
    environment = engine.environment()
    remove_if_stopped(kind, engine)
    if CLUSTER not in existing_clusters(kind, engine):
        engine.prepare()
        config_file = state_dir() / "kind-config.yaml"
        config_file.write_text(yaml.safe_dump(cluster_config(local_node=local_node)))
        run(
            [str(kind), "create", "cluster", "--name", CLUSTER, "--image", reference,
             "--config", str(config_file), "--wait", WAIT],
            env=environment,
        )  # fmt: skip
    run(
        [str(kind), "export", "kubeconfig", "--name", CLUSTER, "--kubeconfig", str(config)],
        env=environment,
    )
    lap("cluster")
    for image in built.values():
        run(
            [str(kind), "load", "image-archive", "--name", CLUSTER, str(image.archive)],
            env=environment,
        )
    lap("images loaded")
    address = engine.address(NODE)
    for network in NETWORKS:
        run(as_root(["ip", "route", "replace", network, "via", address]))
    operator = built["batchpilot-operator"].reference
    repository, _, tag = operator.rpartition(":")
    helm = building.require_binaries(("helm",)) / "helm"
    run(
        [str(helm), "upgrade", "--install", "batchpilot", "charts/batchpilot",
         "--kubeconfig", str(config), "--namespace", NAMESPACE, "--create-namespace",
         "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
         "--set", "image.pullPolicy=Never", "--set", f"operator.namespaces[0]={NAMESPACE}",
         "--wait", "--timeout", WAIT],
    )  # fmt: skip
    lap("chart installed")
    (state_dir() / "images.json").write_text(
        json.dumps({name: image.reference for name, image in built.items()}, indent=2) + "\n"
    )
    print(f"KUBECONFIG={config}")
    return timings


def test_environment() -> dict[str, str]:
    try:
        references = json.loads((state_dir() / "images.json").read_text())
    except (OSError, ValueError):
        raise KindError("no kind cluster of this checkout: run `up` first") from None
    return {
        **os.environ,
        "KUBECONFIG": str(kubeconfig()),
        fleet.TRITON_IMAGE_ENV: references["batchpilot-triton"],
        fleet.SIDECAR_IMAGE_ENV: references["batchpilot-sidecar"],
        fleet.MODEL_REPOSITORY_IMAGE_ENV: references.get(fleet.MODEL_REPOSITORY_IMAGE, ""),
        "BATCHPILOT_E2E_OPERATOR_IMAGE": references["batchpilot-operator"],
    }


def test(selection: Sequence[str], pytest_arguments: Sequence[str]) -> int:
    argv = [sys.executable, "-m", "pytest", *selection, "--e2e", "-rs", *pytest_arguments]
    print("+", " ".join(argv), flush=True)
    done = subprocess.run(argv, cwd=locations.REPO_ROOT, env=test_environment(), check=False)
    return done.returncode


def down() -> None:
    try:
        engine = engines.detect(state_dir())
    except engines.EngineError as error:
        print(f"nothing to take down: {error}", flush=True)
        return
    for network in NETWORKS:
        subprocess.run(as_root(["ip", "route", "del", network]), check=False)
    kind = nodeimages.kind_binary()
    run([str(kind), "delete", "cluster", "--name", CLUSTER], env=engine.environment())
    engine.remove_network()
    (state_dir() / "images.json").unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m batchpilot_testbed.kind", description="the e2e tests on a kind cluster"
    )
    parser.add_argument("command", choices=["up", "test", "smoke", "down"])
    arguments, rest = parser.parse_known_args(argv)
    try:
        if arguments.command == "up":
            up()
        elif arguments.command == "test":
            return test(TESTS, rest)
        elif arguments.command == "smoke":
            up()
            return test(SMOKE, rest)
        else:
            down()
    except (
        KindError,
        engines.EngineError,
        nodeimages.NodeImageError,
        building.BuildError,
        images.ImageError,
    ) as error:
        print(f"batchpilot_testbed.kind: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
