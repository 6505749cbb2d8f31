"""A switch under load through a Service, and what makes it hitless.

Clients open a new connection for each request, so kube-proxy picks a Ready Pod for each; a
watch records every Pod's Ready condition and readiness gate meanwhile (`fleet.Readiness`).
Used by the e2e tests that switch a gated fleet behind a Service: one node or two, Pods made
by the test or by the admission webhook.
"""

import dataclasses
from collections.abc import Callable, Mapping

from batchpilot_cluster import podnetwork
from batchpilot_harness import loadgen
from batchpilot_testbed import clients, fleet, waiting
from batchpilot_testbed.kubes import Kube
from batchpilot_triton import endpoints


@dataclasses.dataclass(frozen=True)
class Switch:
    """The requests sent through the Service while the fleet switched, and its Pods' readiness."""

    records: list[loadgen.RequestRecord]
    readiness: fleet.Readiness

    def assert_hitless(self, pods: Mapping[str, str], *, rate: float) -> None:
        """Requests flowed the whole time and none failed; every Pod left its Services for its
        reload, and never while no other Pod was Ready and staying."""
        failed = [record for record in self.records if not record.succeeded]
        print(
            f"{len(self.records)} requests through the Service, {len(failed)} failed; "
            f"gates closed on {sorted(self.readiness.left())}"
        )
        assert len(self.records) > rate * 3
        assert not failed, [record.error for record in failed[:5]]
        assert self.readiness.left() == set(pods)
        # A Pod's gate closes only once the one let back in is Ready (in the API server's
        # order, which the endpoint controller follows): always one Pod Ready and staying.
        assert self.readiness.fewest_serving() == 1, self.readiness.snapshots


def switch_to_interactive(
    kube: Kube,
    namespace: str,
    ips: dict[str, str],
    *,
    switch: Callable[[], object],
    client_host: podnetwork.Host,
    service_ip: str,
    selector: str,
    rate: float,
    seed: int,
) -> Switch:
    """Load through the Service at `service_ip` from `client_host`, `switch()` (which asks for
    `interactive`) once it flows, until every Pod of `ips` serves interactive with its gate
    open again; the Pods `selector` picks are watched the whole time."""
    load = clients.ClientProcess(
        client_host,
        style="new-connection",
        address=f"{service_ip}:{endpoints.TRITON_HTTP_PORT}",
        rate=rate,
        seed=seed,
    )
    with load, fleet.readiness_watched(kube, namespace, selector) as readiness:
        load.start()
        switch()
        waiting.wait_for(
            "interactive everywhere", fleet.everyone_serves(ips, "interactive"), timeout=90
        )
        waiting.wait_for("every gate back", fleet.all_gates_open(kube, namespace, ips), timeout=30)
        records = load.stop()
    return Switch(records, readiness)
