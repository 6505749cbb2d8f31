"""A replica: one Triton server a policy governs, as the apply path sees it.

The operator finds replicas in Pods (`batchpilot.kube.pods`), the standalone runner takes them
from its command line; the rollout treats both alike. Only a Pod can carry the readiness gate
that takes it out of its Services while it switches, so a runner's replicas are never gated.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchpilot_triton import servers


@dataclass(frozen=True, kw_only=True)
class ServingContainer:
    """The container of a Pod that serves Triton, as the Pod last reported it."""

    name: str
    run: str
    """Which run of it this is: the runtime's container ID, or its restart count and start time
    where the Pod gives no ID; "" while it is not running."""
    stopped: str = ""
    """Why it is not running (e.g. CrashLoopBackOff), when it is not."""


@dataclass(frozen=True, kw_only=True)
class Replica:
    name: str
    """The Pod's name, or the server's `host:port` for the runner."""
    http_url: str
    """Triton's HTTP endpoint."""
    sidecar_url: str | None = None
    """The batchpilot sidecar beside it, when known."""
    gated: bool = False
    """The Pod declares the `batchpilot.dev/config-applied` readiness gate."""
    gate: str | None = None
    """The gate condition's status ("True", "False"), None when unset."""
    kind: str = "server"
    """What the replica is, in messages: "pod" or "server"."""
    labels: tuple[tuple[str, str], ...] = ()
    """The Pod's labels, sorted (none for the runner's servers): which policies select it."""
    serving: ServingContainer | None = None
    """The Pod's container that serves Triton's port; None when the Pod does not say."""
    restarted: str | None = None
    """Why an open gate no longer vouches for the Pod's configuration: the container serving
    Triton restarted (or stopped) since batchpilot last saw it serve the profile with the gate
    open, so Triton came back with its repository's configuration. None when it has not."""
    node: str | None = None
    """The node the Pod runs on; None for the runner's servers."""

    @property
    def title(self) -> str:
        """How messages name it, e.g. `pod triton-0`."""
        return f"{self.kind} {self.name}"

    @property
    def host(self) -> str:
        """Where its server runs, the node or else the server's host: reloads on one host
        share its cores and GPUs."""
        return self.node or servers.host_port(self.http_url).rpartition(":")[0]

    @property
    def endpoint(self) -> str:
        """`host:port` of Triton's HTTP endpoint."""
        return servers.host_port(self.http_url)


def from_url(url: str) -> Replica:
    """A server given by URL (the runner's `--triton`), named by its `host:port`."""
    address = servers.host_port(url)
    return Replica(name=address, http_url=f"http://{address}")
