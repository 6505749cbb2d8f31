"""A switch that meets the unexpected, against a real tritonserver: a malformed batchpilot
parameter on the served configuration, and a load Triton rejects after the model was unloaded
first. The Pod ends serving a known configuration with its readiness gate open (the unit matrix
in tests/unit/test_switch_failures.py covers every step and exception with a scripted Triton)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import actuators, fleets, rollouts
from batchpilot.applying.replicas import Replica
from batchpilot.policy import rendering
from batchpilot_harness import demo_models
from batchpilot_triton import modelconfigs, servers
from triton_fixtures import TritonFactory

pytestmark = pytest.mark.integration

MODEL = demo_models.GPU_SIM
BULK = rendering.render(
    specs.Profile.model_validate(
        {"maxQueueDelayMicroseconds": 20000, "preferredBatchSizes": [32, 64]}
    )
)


class Gates:
    """The readiness gate's writes, as the Kubernetes side would get them."""

    def __init__(self) -> None:
        self.changes: list[tuple[str, bool, str]] = []

    async def set_gate(
        self, namespace: str, pod: str, *, applied: bool, reason: str, message: str
    ) -> None:
        self.changes.append((pod, applied, reason))

    async def wait_ready(self, namespace: str, pods: Sequence[str], *, within: float) -> list[str]:
        return []  # the kubelet's part: these Pods are Ready once their gate opens


@pytest.mark.timeout(120)
async def test_a_malformed_baseline_is_replaced_by_one_reload_not_raised_every_pass(
    triton_server: TritonFactory,
) -> None:
    server = triton_server(MODEL)
    async with servers.TritonServer(server.http_url) as triton:
        config = await triton.model_config(MODEL)
        own = config["max_batch_size"]
        # What an edit by hand, or another tool, leaves on the served configuration.
        config["parameters"][modelconfigs.BASELINE_PARAMETER] = {"string_value": "lots"}
        config["parameters"][modelconfigs.PROFILE_PARAMETER] = {"string_value": "bulk"}
        await triton.load(MODEL, config)

        applied = await actuators.apply_profile(
            triton, MODEL, BULK, profile="bulk", verify_timeout=30
        )
        again = await actuators.apply_profile(
            triton, MODEL, BULK, profile="bulk", verify_timeout=30
        )
        served = await triton.model_config(MODEL)

    assert applied.reloaded
    assert applied.notes == (
        "ignored its malformed config parameter batchpilot.dev/baseline-max-batch-size "
        "('lots' is not a count)",
    )
    assert modelconfigs.parameter(served, modelconfigs.BASELINE_PARAMETER) == str(own)
    assert served["dynamic_batching"]["max_queue_delay_microseconds"] == 20000
    assert (again.reloaded, again.notes) == (False, ())


@pytest.mark.timeout(120)
async def test_a_load_rejected_after_an_unload_reopens_the_gate_on_the_restored_model(
    triton_server: TritonFactory,
) -> None:
    server = triton_server(MODEL)
    replica = Replica(name="triton-0", http_url=server.http_url, gated=True, gate="True")
    async with servers.TritonServer(server.http_url) as triton:
        before = await triton.model_config(MODEL)
    # Triton refuses priority levels without a valid default level; the API never renders
    # this, so it stands for any configuration a server rejects.
    rejected = rendering.Settings(
        dynamic_batching={**BULK.dynamic_batching, "priority_levels": 2}, max_batch_size=None
    )
    plan = rollouts.Plan(
        namespace="ns",
        profile="broken",
        settings=rejected,
        rollout=specs.Rollout.model_validate(
            {"unloadBeforeLoad": True, "verifyTimeoutSeconds": 20}
        ),
        settle_seconds=0.1,
    )
    fleet, gates = fleets.TritonFleet(), Gates()
    fleet.adopt(servers.TritonServer(server.http_url, metrics_url=server.metrics_url))
    try:
        found = await rollouts.survey([replica], [MODEL], fleet)
        result = await rollouts.roll_out([replica], found, plan, fleet, gates)
        async with servers.TritonServer(server.http_url) as triton:
            ready = await triton.model_ready(MODEL)
            after = await triton.model_config(MODEL)
    finally:
        await fleet.close()

    assert result.outcomes[0].error == "rejected", result.outcomes[0].message
    assert gates.changes == [("triton-0", False, "Switching"), ("triton-0", True, "RolledBack")]
    assert ready
    assert after == before
