"""Faults to inject into the local cluster, for the fault tests and the chaos soak.

Each fault breaks one thing as it breaks in production, and `heal()` ends what does not end by
itself: a Pod's network cut off (its link down, traffic dropped without an answer), Triton
killed (the kubelet starts its container again), a sidecar hung (SIGSTOP: alive
and silent), kube-apiserver or etcd restarted, the operator killed (SIGKILL, then started
again), and the policy edited (an override to the other profile, for a while).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from batchpilot_cluster import controlplane, podsandboxes
from batchpilot_testbed import fleet, operators
from batchpilot_testbed.kubes import Kube

KINDS = (
    "network-cut",
    "triton-kill",
    "sidecar-hang",
    "apiserver-restart",
    "etcd-restart",
    "operator-kill",
    "policy-edit",
)
POD_KINDS = frozenset({"network-cut", "triton-kill", "sidecar-hang"})
"""The faults that hit one Pod: requests to it may fail while it lasts."""


@dataclasses.dataclass(kw_only=True)
class Fault:
    kind: str
    pod: str | None
    """The Pod it hits; None for the control plane, the operator and the policy."""
    injected: float = 0.0
    """time.monotonic() when it began."""
    healed: float | None = None
    """When it ended (for those that end by themselves: when it was injected)."""
    heal_action: Callable[[], None] | None = None
    override: tuple[str, datetime.datetime] | None = None
    """A policy edit's override: the profile, and until when it holds."""

    def heal(self) -> None:
        if self.heal_action is not None:
            self.heal_action()
        self.healed = time.monotonic()

    def describe(self) -> str:
        return f"{self.kind} on {self.pod}" if self.pod else self.kind


@dataclasses.dataclass(kw_only=True)
class Target:
    """What the faults act on."""

    kube: Kube
    cluster: controlplane.Cluster
    namespace: str
    ips: dict[str, str]
    """Pod name -> IP of the Triton Pods."""
    restart_operator: Callable[[bool], None]
    """Kill (True) or start (False) the operator."""
    edit_policy: Callable[[dict[str, Any] | None], None]
    """Apply the policy with this override, or none."""


def inject(kind: str, target: Target, *, pod: str | None, hold_seconds: float) -> Fault:
    """Begin the fault; `hold_seconds` is how long the ones that need healing are meant to last
    (the caller heals them)."""
    if kind in POD_KINDS and pod is None:
        raise ValueError(f"{kind} needs a Pod")
    fault = Fault(kind=kind, pod=pod if kind in POD_KINDS else None, injected=time.monotonic())
    if kind == "network-cut":
        assert pod is not None
        link = podsandboxes.cut(target.ips[pod])
        fault.heal_action = lambda: podsandboxes.restore(link)
    elif kind == "triton-kill":
        assert pod is not None
        os.kill(fleet.process_in_pod(target.ips[pod], "tritonserver"), signal.SIGKILL)
    elif kind == "sidecar-hang":
        assert pod is not None
        sidecar = fleet.process_in_pod(target.ips[pod], "batchpilot_sidecar")
        os.kill(sidecar, signal.SIGSTOP)
        fault.heal_action = lambda: os.kill(sidecar, signal.SIGCONT)
    elif kind in ("apiserver-restart", "etcd-restart"):
        component = "kube-apiserver" if kind == "apiserver-restart" else "etcd"
        controlplane.restart(target.cluster, component, down_seconds=min(hold_seconds, 5.0))
    elif kind == "operator-kill":
        target.restart_operator(True)
        fault.heal_action = lambda: target.restart_operator(False)
    elif kind == "policy-edit":
        status = operators.policy_status(target.kube, target.namespace, "fleet")
        other = "bulk" if status.get("activeProfile") == "interactive" else "interactive"
        until = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
        until += datetime.timedelta(seconds=max(hold_seconds, 1.0))
        override = {
            "profile": other,
            "until": until.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "reason": "chaos: a policy edit",
        }
        target.edit_policy(override)
        fault.override = (other, until)
        fault.heal_action = lambda: target.edit_policy(None)
    else:
        raise ValueError(f"unknown fault {kind!r}; one of {KINDS}")
    if fault.heal_action is None:
        fault.healed = fault.injected
    return fault
