"""Whatever raises during a Pod's switch, the Pod ends serving a known configuration with its
readiness gate open, or with its gate closed and a reason and message that say why: never out
of its Services silently, and never a policy whose every pass raises.

Every exception type is injected at every step of a switch (the survey, the check, the drain,
reading the served configuration, reading a vLLM model's model.json, the unload, the wait for
it, the load, a load whose answer is lost, the verification), once or for good, through the
real rollout, fleet and actuator down to a scripted Triton; and at the boundaries the rollout
owns (the fleet's apply, the gate writes) with the fakes of the Kubernetes side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable

import pytest
from aiohttp import web
from operator_fakes import (
    LLM_SWITCH_STEPS,
    SWITCH_STEPS,
    FakeFleet,
    FakeGates,
    FakeServer,
    ScriptedTriton,
    target,
)

import web_apps
from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import actuators, engines, fleets, overrides, rollouts
from batchpilot.applying.replicas import Replica
from batchpilot.policy import rendering
from batchpilot_triton import modelconfigs, servers

URL = "http://10.88.0.1:8000"
PROFILES = {
    "python": specs.Profile.model_validate({"maxQueueDelayMicroseconds": 2000}),
    "vllm": specs.Profile.model_validate({"llm": {"maxNumSeqs": 4}}),
    "tensorrtllm": specs.Profile.model_validate(
        {"llm": {"batchSchedulerPolicy": "maxUtilization"}}
    ),
}
"""The profile for a model of each backend: dynamic batching, vLLM engine arguments in
model.json, TensorRT-LLM config parameters."""
STEPS = [
    *(pytest.param("python", step, id=step) for step in SWITCH_STEPS),
    *(pytest.param("vllm", step, id=f"vllm-{step}") for step in LLM_SWITCH_STEPS),
    *(pytest.param("tensorrtllm", step, id=f"tensorrtllm-{step}") for step in SWITCH_STEPS),
]
FAULTS: dict[str, Callable[[], BaseException]] = {
    "ValueError": lambda: ValueError("injected"),
    "AttributeError": lambda: AttributeError("injected"),
    "KeyError": lambda: KeyError("injected"),
    "TypeError": lambda: TypeError("injected"),
    "TimeoutError": lambda: TimeoutError("injected"),
    "RuntimeError": lambda: RuntimeError("injected"),
    "Unreachable": lambda: servers.Unreachable(URL, "injected"),
    "TritonError": lambda: servers.TritonError(URL, "injected"),
    "LoadRejected": lambda: servers.LoadRejected(URL, "injected"),
    "ModelUnavailable": lambda: servers.ModelUnavailable(URL, "injected"),
    "ExplicitModeRequired": lambda: servers.ExplicitModeRequired(URL, "injected"),
    "ProfileRefused": lambda: overrides.ProfileRefused("injected"),
}


def plan(*, backend: str = "python") -> rollouts.Plan:
    return rollouts.Plan(
        namespace="ns",
        profile="interactive",
        settings=rendering.render(PROFILES[backend]),
        rollout=specs.Rollout.model_validate({"unloadBeforeLoad": True, "verifyTimeoutSeconds": 5}),
        settle_seconds=0.5,
    )


def pod(gates: FakeGates) -> Replica:
    """The Pod, its gate as the last write left it."""
    gate = "True" if not gates.changes or gates.changes[-1][1] else "False"
    return target("triton-0", gated=True, gate=gate)


async def roll_out(
    fleet: rollouts.Fleet, gates: FakeGates, *, backend: str = "python"
) -> rollouts.Result:
    replicas = [pod(gates)]
    found = await rollouts.survey(replicas, ["gpu_sim"], fleet)
    return await rollouts.roll_out(replicas, found, plan(backend=backend), fleet, gates)


def triton_fleet(server: ScriptedTriton) -> fleets.TritonFleet:
    """The real fleet, its one server scripted (which serves the model.json too)."""
    fleet = fleets.TritonFleet(clock=asyncio.get_running_loop().time, engine_arguments=server)
    fleet.adopt(server)
    return fleet


def runs_the_profile(server: ScriptedTriton) -> bool:
    """Whether the server serves what the profile asks, every part of it."""
    if server.served is None or server.profile != "interactive":
        return False
    backend = server.served.get("backend")
    if backend == "tensorrtllm":
        policy = modelconfigs.parameter(server.served, "batch_scheduler_policy")
        return policy == "max_utilization" and not server.loaded_files
    if backend != "vllm":
        return bool(server.served["dynamic_batching"]["max_queue_delay_microseconds"] == 2000)
    (model_json,) = server.loaded_files.values()
    return engines.applied_arguments(server.served) == {"max_num_seqs": 4} and json.loads(
        model_json
    ) == {**server.model_json, "max_num_seqs": 4}


def assert_known_or_said(server: ScriptedTriton, gates: FakeGates, result: rollouts.Result) -> None:
    """The guarantee: back in its Services serving a known configuration, or out of them with
    a gate that says why."""
    outcome = result.outcomes[0]
    if not gates.changes or gates.changes[-1][1]:
        assert server.served is not None, "in its Services with the model unloaded"
        if server.profile == "interactive":
            assert runs_the_profile(server)
            assert outcome.state == "Updated"
        else:
            assert server.served == server.repository_config
            assert outcome.state != "Updated"
    else:
        _, _, reason = gates.changes[-1]
        assert reason != "Switching", "out of its Services, the gate saying nothing of why"
        # It names the fault, or what the fault led to (a model that never came back).
        named = "injected" if reason != "RollbackFailed" else "ROLLBACK FAILED"
        assert named in gates.messages[-1]
        assert outcome.state != "Updated"
        assert named in outcome.message


@pytest.mark.looptime
@pytest.mark.parametrize("sticky", [False, True], ids=["once", "for-good"])
@pytest.mark.parametrize("fault", list(FAULTS), ids=list(FAULTS))
@pytest.mark.parametrize(("backend", "step"), STEPS)
async def test_a_fault_at_any_step_leaves_the_pod_serving_a_known_config_or_saying_why(
    backend: str, step: str, fault: str, sticky: bool
) -> None:
    server = ScriptedTriton(
        URL, fault_at=step, fault=FAULTS[fault](), sticky=sticky, backend=backend
    )
    fleet, gates = triton_fleet(server), FakeGates()

    result = await roll_out(fleet, gates, backend=backend)

    assert_known_or_said(server, gates, result)
    if not sticky and gates.changes and not gates.changes[-1][1]:
        # A fault that passed leaves a Pod out only when the model could not even be read: a
        # change that broke was rolled back, so the previous configuration serves.
        assert step in ("read-config", "engine-arguments"), gates.messages[-1]
        assert fault in ("Unreachable", "ModelUnavailable"), gates.messages[-1]
    if not sticky:
        # Level-based: once the fault has passed, the next passes bring the Pod to the profile
        # and back into its Services.
        for _ in range(3):
            await asyncio.sleep(120)  # past the fleet's backoff of an unreachable server
            result = await roll_out(fleet, gates, backend=backend)
        assert result.outcomes[0].state == "Updated", result.outcomes[0].message
        assert runs_the_profile(server)
        assert gates.changes[-1][1:] in ((True, "ConfigApplied"),)


@pytest.mark.looptime
@pytest.mark.parametrize(("backend", "step"), STEPS)
async def test_a_switch_cancelled_at_any_step_leaves_the_pod_out_saying_so(
    backend: str, step: str
) -> None:
    server = ScriptedTriton(URL, fault_at=step, fault=asyncio.CancelledError(), backend=backend)
    gates = FakeGates()

    with pytest.raises(asyncio.CancelledError):
        await roll_out(triton_fleet(server), gates, backend=backend)

    if gates.changes and not gates.changes[-1][1]:
        assert gates.changes[-1][2] == "Interrupted"
        assert "interrupted" in gates.messages[-1]
    else:  # cancelled before the gate closed: nothing was changed
        assert server.served == server.repository_config


@pytest.mark.looptime
@pytest.mark.parametrize("fault", list(FAULTS), ids=list(FAULTS))
async def test_whatever_the_fleet_raises_the_gate_opens_on_a_known_config_or_says_why(
    fault: str,
) -> None:
    replica = target("triton-0", gated=True, gate="True")
    fleet = FakeFleet({replica.http_url: FakeServer(fail_with=FAULTS[fault]())})
    gates = FakeGates()

    result = await rollouts.roll_out(
        [replica], await rollouts.survey([replica], ["gpu_sim"], fleet), plan(), fleet, gates
    )

    outcome = result.outcomes[0]
    assert outcome.state in ("Failed", "Unreachable")
    _, opened, reason = gates.changes[-1]
    if opened:
        # Only a failure that says the previous configuration serves lets it back in.
        assert reason in ("Refused", "NotApplied")
        assert fault in ("ProfileRefused", "ExplicitModeRequired")
    else:
        assert reason != "Switching"
        assert "injected" in gates.messages[-1]
        assert outcome.left_out


@pytest.mark.looptime
@pytest.mark.parametrize("rolled_back", [True, False])
async def test_the_actuators_word_decides_whether_the_pod_goes_back(rolled_back: bool) -> None:
    replica = target("triton-0", gated=True, gate="True")
    failure = actuators.ApplyFailed(replica.http_url, "injected", rolled_back=rolled_back)
    fleet = FakeFleet({replica.http_url: FakeServer(fail_with=failure)})
    gates = FakeGates()

    await rollouts.roll_out(
        [replica], await rollouts.survey([replica], ["gpu_sim"], fleet), plan(), fleet, gates
    )

    expected = (True, "RolledBack") if rolled_back else (False, "RollbackFailed")
    assert gates.changes[-1][1:] == expected


@pytest.mark.looptime
@pytest.mark.parametrize("applied", [False, True], ids=["closing", "opening"])
async def test_a_gate_that_cannot_be_written_is_a_failure_not_a_crash(applied: bool) -> None:
    replica = target("triton-0", gated=True, gate="True")
    fleet = FakeFleet({replica.http_url: FakeServer()})
    gates = FakeGates()
    gates.fail[applied] = RuntimeError("injected API outage")

    result = await rollouts.roll_out(
        [replica], await rollouts.survey([replica], ["gpu_sim"], fleet), plan(), fleet, gates
    )

    outcome = result.outcomes[0]
    assert outcome.state == "Failed"
    assert "readiness gate: RuntimeError: injected API outage" in outcome.message
    # Never closed: nothing applied. Closed but not reopened: out of service, counted so.
    assert (("apply", URL) in fleet.calls) == applied
    assert outcome.left_out == applied


@pytest.mark.looptime
async def test_a_malformed_baseline_is_reported_and_replaced_not_raised_every_pass() -> None:
    server = ScriptedTriton(URL)
    assert server.served is not None
    server.served["parameters"] = {
        modelconfigs.PROFILE_PARAMETER: {"string_value": "interactive"},
        modelconfigs.BASELINE_PARAMETER: {"string_value": "thirty-two"},
    }
    fleet, gates = triton_fleet(server), FakeGates()

    first = await roll_out(fleet, gates)
    server.config_reads = 0
    second = await roll_out(fleet, gates)

    assert first.outcomes[0].state == "Updated"
    assert first.reloads == 1
    assert "batchpilot.dev/baseline-max-batch-size ('thirty-two' is not a count)" in (
        first.outcomes[0].message
    )
    assert modelconfigs.baseline_max_batch_size(server.served) == 32
    assert server.served["parameters"][modelconfigs.BASELINE_PARAMETER] == {"string_value": "32"}
    assert (second.outcomes[0].state, second.reloads, second.outcomes[0].message) == (
        "Updated",
        0,
        "",
    )


@pytest.mark.parametrize("answer", ['["no", "dict"]', '"a string"', "42", "null", "{}", "not json"])
async def test_a_refused_load_with_any_body_is_a_rejection(
    serve_app: web_apps.ServeApp, answer: str
) -> None:
    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=400, text=answer, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v2/repository/models/{model}/load", refuse)
    async with servers.TritonServer(await serve_app(app), request_timeout=2) as triton:
        with pytest.raises(servers.LoadRejected):
            await triton.load("tiny_llm", {"backend": "vllm"}, files={"file:1/model.json": b"{}"})


@pytest.mark.looptime
async def test_a_pod_whose_gate_cannot_be_reopened_counts_as_out_of_service() -> None:
    # Up to date, left out by an interrupted rollout, its gate's write fails: it still does not
    # serve, so beside a dead Pod it fills maxUnavailable 2 and no other gated Pod leaves.
    stuck = target("triton-0", gated=True, gate="False")
    dead = target("triton-1", gated=True, gate="True")
    behind = target("triton-2", gated=True, gate="True")
    fleet = FakeFleet(
        {
            stuck.http_url: FakeServer(profile="interactive"),
            dead.http_url: FakeServer(unreachable=True),
            behind.http_url: FakeServer(),
        }
    )
    gates = FakeGates()
    gates.fail[True] = RuntimeError("injected API outage")
    replicas = [stuck, dead, behind]
    two = dataclasses.replace(plan(), rollout=specs.Rollout.model_validate({"maxUnavailable": 2}))

    result = await rollouts.roll_out(
        replicas, await rollouts.survey(replicas, ["gpu_sim"], fleet), two, fleet, gates
    )

    assert [outcome.state for outcome in result.outcomes] == ["Failed", "Unreachable", "Pending"]
    assert result.outcomes[2].message.startswith("held: triton-0, triton-1 out of service")
    assert gates.changes == []
