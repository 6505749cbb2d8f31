"""The container engine kind runs its nodes in: Docker where a Docker engine answers, else Podman.

kind speaks to both (``KIND_EXPERIMENTAL_PROVIDER``); what differs is around it:
- the network: kind's default ``kind`` network would take whatever subnet the engine picks
  (Podman's own default is 10.88.0.0/16, the local e2e cluster's pod network), so the cluster
  gets a network of its own with a subnet that collides with neither that cluster's pod network
  (10.88.0.0/16) nor its Services (10.96.0.0/16), passed by ``KIND_EXPERIMENTAL_*_NETWORK``;
- Podman here runs without CAP_SYS_RESOURCE under a hard nofile limit of 20000, and refuses its
  default ulimits ("error setting rlimit type 7: operation not permitted"): a containers.conf
  with limits it may set, through ``CONTAINERS_CONF``;
- kind always bind-mounts ``/lib/modules``, which a host without modules lacks.

Images reach the engine as archives (``load -i``), never by a pull.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Final, Literal

NETWORK: Final = "batchpilot-kind"
NETWORK_SUBNET: Final = "172.29.44.0/24"
"""Off every range the project's clusters use (10.88/16 pods, 10.96/16 Services, and kind's own
10.244/16 pods, 10.97/16 Services), and off Docker's (172.17/16) and Podman's (10.88/16, 10.89.x)
defaults."""
PODMAN_LIMITS: Final = (
    'default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]\n'
    # Podman caps a container at 2048 processes, Docker not at all: the node (its kubelet,
    # containerd and every Pod's threads) reached 1,753 with six Tritons and two operators.
    "pids_limit = 0"
)
COMMAND_TIMEOUT_SECONDS: Final = 900


class EngineError(Exception):
    """No usable engine, or an engine command failed; the message says which and why."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Engine:
    name: Literal["docker", "podman"]
    state: Path
    """Where this engine's own files for the run go (Podman's containers.conf)."""

    @property
    def containers_conf(self) -> Path:
        return self.state / "containers.conf"

    def environment(self) -> dict[str, str]:
        """What kind and the engine's commands run with."""
        environment = dict(os.environ)
        if self.name == "podman":
            environment["KIND_EXPERIMENTAL_PROVIDER"] = "podman"
            environment["KIND_EXPERIMENTAL_PODMAN_NETWORK"] = NETWORK
            environment["CONTAINERS_CONF"] = str(self._written_containers_conf())
        else:
            environment["KIND_EXPERIMENTAL_PROVIDER"] = "docker"
            environment["KIND_EXPERIMENTAL_DOCKER_NETWORK"] = NETWORK
        return environment

    def run(self, *arguments: str, capture: bool = True) -> str:
        argv = [self.name, *arguments]
        print("+", " ".join(argv), flush=True)
        try:
            done = subprocess.run(
                argv,
                env=self.environment(),
                capture_output=capture,
                text=True,
                timeout=COMMAND_TIMEOUT_SECONDS,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise EngineError(
                f"{' '.join(argv)}: no answer in {COMMAND_TIMEOUT_SECONDS} s"
            ) from None
        if done.returncode != 0:
            raise EngineError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr or ''}")
        return done.stdout or ""

    def succeeds(self, *arguments: str) -> bool:
        return self._tried(*arguments).returncode == 0

    def _tried(self, *arguments: str) -> subprocess.CompletedProcess[str]:
        """An engine command whose failure is an answer, not an error."""
        return subprocess.run(
            [self.name, *arguments],
            env=self.environment(),
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_SECONDS,
            check=False,
        )

    def _written_containers_conf(self) -> Path:
        """Podman's containers.conf for every command of the run, from the first (loading the
        node image) to `down`: Podman refuses to start when CONTAINERS_CONF names no file."""
        wanted = f"# batchpilot_testbed.kind: limits for Podman\n[containers]\n{PODMAN_LIMITS}\n"
        if not self.containers_conf.is_file() or self.containers_conf.read_text() != wanted:
            self.state.mkdir(parents=True, exist_ok=True)
            self.containers_conf.write_text(wanted)
        return self.containers_conf

    def prepare(self) -> None:
        """What kind needs of the host and the engine before it creates a node."""
        Path("/lib/modules").mkdir(exist_ok=True)
        if not self.succeeds("network", "inspect", NETWORK):
            self.run("network", "create", "--subnet", NETWORK_SUBNET, NETWORK)
        subnets = self.network_subnets()
        if NETWORK_SUBNET not in subnets:
            raise EngineError(
                f"the {self.name} network {NETWORK} has subnets {subnets}, not {NETWORK_SUBNET}: "
                f"remove it (`{self.name} network rm {NETWORK}`) and run again"
            )

    def network_subnets(self) -> list[str]:
        inspected = json.loads(self.run("network", "inspect", NETWORK))
        found: list[str] = []
        for network in inspected:
            # Docker: IPAM.Config[].Subnet; Podman 4 (CNI or netavark): subnets[].subnet;
            # Podman with CNI also: plugins[].ipam.ranges[][].subnet.
            for config in (network.get("IPAM") or {}).get("Config") or []:
                found.append(str(config.get("Subnet")))
            for subnet in network.get("subnets") or []:
                found.append(str(subnet.get("subnet")))
            for plugin in network.get("plugins") or []:
                for ranges in (plugin.get("ipam") or {}).get("ranges") or []:
                    found.extend(str(entry.get("subnet")) for entry in ranges)
        return found

    def remove_network(self) -> None:
        if self.succeeds("network", "inspect", NETWORK):
            self.run("network", "rm", NETWORK)

    def is_running(self, container: str) -> bool:
        """Whether the container exists and runs: a node left by a run on a machine that was
        stopped since (a snapshot, a reboot) exists, stopped, and answers no command."""
        done = self._tried(
            "inspect", "--type", "container", "--format", "{{.State.Running}}", container
        )
        return done.returncode == 0 and done.stdout.strip() == "true"

    def has_image(self, reference: str) -> bool:
        return self.succeeds("image", "inspect", reference)

    def load(self, archive: Path) -> None:
        self.run("load", "--input", str(archive))

    def address(self, container: str) -> str:
        """The container's IPv4 address on NETWORK."""
        inspected = json.loads(self.run("inspect", "--type", "container", container))
        networks = inspected[0].get("NetworkSettings", {}).get("Networks", {}) if inspected else {}
        address = str((networks.get(NETWORK) or {}).get("IPAddress") or "")
        if not address:
            raise EngineError(f"{container} has no address on the {self.name} network {NETWORK}")
        return address


def detect(state: Path, *, preferred: Sequence[str] = ("docker", "podman")) -> Engine:
    """Docker if its engine answers, else Podman if installed (rootful: kind's nodes need it)."""
    reasons = []
    for name in preferred:
        if shutil.which(name) is None:
            reasons.append(f"no {name} command")
            continue
        if name == "docker":
            done = subprocess.run(
                ["docker", "info"], capture_output=True, text=True, timeout=60, check=False
            )
            if done.returncode != 0:
                reasons.append(f"no Docker engine answers ({done.stderr.strip()[-200:]})")
                continue
            return Engine(name="docker", state=state)
        if os.geteuid() != 0:
            reasons.append("podman runs kind's nodes only as root here (rootful)")
            continue
        return Engine(name="podman", state=state)
    raise EngineError(
        "no container engine for kind: "
        + "; ".join(reasons)
        + " (`make kind-deps` installs Podman)"
    )
