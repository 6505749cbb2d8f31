"""Rollouts through a canary (spec.rollout.canary), reconcile by reconcile, with fakes at the
Kubernetes and Triton boundaries and recorded per-replica figures."""

from __future__ import annotations

import copy
import datetime
from typing import Any

import pytest
from operator_fakes import FakeFleet, FakeGates, FakePods, FakeServer, target

from batchpilot import reconciling, telemetry
from batchpilot.api import documents
from batchpilot.applying import canaries
from batchpilot.applying.replicas import Replica
from batchpilot.policy import decisions, rendering
from batchpilot.signals import sources
from batchpilot_triton import reports, scraping
from builders import market_hours, spec_document, utc

START = utc(2026, 11, 24, 15)
CANARY = {"replicas": 1, "analysisSeconds": 30, "minRequests": 100}


class Figures:
    """Per-replica figures a test sets before each pass, as the signal source reads them."""

    def __init__(self) -> None:
        self.per_server: dict[str, dict[str, scraping.ModelRates]] = {}
        self.engines: dict[str, dict[str, reports.LlmReport]] = {}

    def serve(
        self,
        replica: Replica,
        *,
        p95_ms: float = 20.0,
        requests: float = 60.0,
        failed: float = 0.0,
        inter_token_p95_ms: float | None = None,
    ) -> None:
        counted = scraping.ModelCounters(
            requests_succeeded=requests - failed, requests_failed=failed
        )
        self.per_server[replica.http_url] = {
            "gpu_sim": scraping.ModelRates(seconds=5.0, counted=counted, pending=0, p95_ms=p95_ms)
        }
        if inter_token_p95_ms is not None:
            self.engines[replica.http_url] = {"gpu_sim": engine_report(inter_token_p95_ms)}

    async def read(self) -> sources.Reading:
        return sources.Reading(
            decisions.Signals(),
            per_server=copy.deepcopy(self.per_server),
            engines_per_server=copy.deepcopy(self.engines),
        )

    async def close(self) -> None:
        pass


def engine_report(inter_token_p95_ms: float) -> reports.LlmReport:
    """What an LLM engine measured in a window: only the inter-token p95 matters here."""
    return reports.LlmReport(
        ttft_p50_ms=200.0,
        ttft_p95_ms=400.0,
        inter_token_p50_ms=inter_token_p95_ms / 2,
        inter_token_p95_ms=inter_token_p95_ms,
        first_tokens=10,
        output_tokens_per_second=500,
        prompt_tokens_per_second=2000,
        running_sequences=8,
        waiting_sequences=0,
        kv_cache_usage=0.3,
    )


class World:
    """Four replicas on bulk, one policy with a canary, a clock a test moves."""

    def __init__(self, replicas: int = 4, **canary: Any) -> None:
        self.replicas = [target(f"triton-{n}") for n in range(replicas)]
        self.fleet = FakeFleet({r.http_url: FakeServer() for r in self.replicas})
        self.figures = Figures()
        self.now = START
        self.generation = 1
        self.state = reconciling.PolicyMemory()
        self.status: dict[str, Any] = {}
        self.events: list[tuple[str, str]] = []
        self.spec = spec_document(rollout={"canary": {**CANARY, **canary}})
        self.reconciler = reconciling.Reconciler(
            replicas=FakePods(self.replicas),
            gates=FakeGates(),
            fleet=self.fleet,
            signal_source=lambda namespace, policy, found: self.figures,
            metrics=telemetry.controller_metrics(),
            clock=lambda: self.now,
            settle_seconds=0,
        )

    def with_spec(self, **fields: Any) -> None:
        self.spec = copy.deepcopy(self.spec)
        self.spec.update(fields)
        self.generation += 1

    def edit_profile(self, profile: str, **fields: Any) -> None:
        self.spec = copy.deepcopy(self.spec)
        self.spec["profiles"][profile].update(fields)
        self.generation += 1

    def all_serving(self, **figures: Any) -> None:
        for replica in self.replicas:
            self.figures.serve(replica, **figures)

    async def reconcile(self, seconds: float = 5.0) -> reconciling.Reconciled:
        self.now += datetime.timedelta(seconds=seconds)
        outcome = await self.reconciler.reconcile(
            namespace="ns",
            name="fleet",
            spec=self.spec,
            status=self.status,
            generation=self.generation,
            state=self.state,
        )
        self.status = outcome.status
        self.events += [(event.reason, event.message) for event in outcome.events]
        return outcome

    def applies(self) -> list[str]:
        applied = [url for call, url in self.fleet.calls if call == "apply"]
        self.fleet.calls.clear()
        return [next(r.name for r in self.replicas if r.http_url == url) for url in applied]

    def served_delays(self) -> dict[str, int | None]:
        return {
            replica.name: (
                settings.dynamic_batching["max_queue_delay_microseconds"]
                if (settings := self.fleet.servers[replica.http_url].settings)
                else None
            )
            for replica in self.replicas
        }

    def verdicts(self, verdict: str) -> float | None:
        return self.reconciler.metrics.registry.get_sample_value(
            "batchpilot_canary_verdicts_total",
            {"policy_namespace": "ns", "policy": "fleet", "verdict": verdict},
        )

    def reasons(self) -> list[str]:
        return [reason for reason, _ in self.events]


async def started_on_bulk(world: World) -> None:
    """The policy's first rollout: nothing of batchpilot's to return to, so no canary."""
    world.all_serving()
    await world.reconcile()
    assert world.applies() == ["triton-0", "triton-1", "triton-2", "triton-3"]
    assert world.status["settings"]["servedProfile"] == "bulk"
    assert "canary" not in world.status


@pytest.mark.looptime
async def test_new_settings_go_to_one_replica_and_then_to_the_rest() -> None:
    world = World()
    await started_on_bulk(world)
    world.edit_profile("bulk", maxQueueDelayMicroseconds=80000)
    await world.reconcile()
    assert world.applies() == ["triton-0"]
    canary = world.status["canary"]
    assert (canary["phase"], canary["replicas"]) == ("Analysing", ["triton-0"])
    assert "CanaryStarted" in world.reasons()
    details = {d["name"]: d for d in world.status["targetDetails"]}
    assert details["triton-1"]["message"] == "waiting for the canary"

    for _ in range(6):  # 30 s of readings, the canary serving like the rest
        await world.reconcile()
    assert world.applies() == ["triton-1", "triton-2", "triton-3"]
    assert set(world.served_delays().values()) == {80000}
    assert world.status["canary"]["phase"] == "Promoted"
    assert world.status["canary"]["figures"].endswith("p95 1.00x")
    assert "CanaryPromoted" in world.reasons()
    assert world.verdicts("promoted") == 1
    hash_ = world.status["canary"]["settingsHash"]
    assert world.status["settings"]["proven"][-1] == hash_


@pytest.mark.looptime
async def test_slow_new_settings_are_rolled_back_and_not_tried_again() -> None:
    world = World()
    await started_on_bulk(world)
    world.edit_profile("bulk", maxQueueDelayMicroseconds=80000)
    await world.reconcile()
    world.applies()
    world.figures.serve(world.replicas[0], p95_ms=70.0)  # 3.5x the others
    for _ in range(6):
        await world.reconcile()
    assert world.applies() == ["triton-0"], "the canary goes back to what the fleet serves"
    assert world.served_delays() == {f"triton-{n}": 50000 for n in range(4)}
    assert world.status["canary"]["phase"] == "RolledBack"
    assert world.status["canary"]["reason"] == "p95 3.50x the baseline's (limit 1.5x)"
    failed = world.status["settings"]["failed"]
    assert [(f["profile"], f["generation"]) for f in failed] == [("bulk", 2)]
    conditions = {c["type"]: c for c in world.status["conditions"]}
    assert conditions["CanaryFailed"]["status"] == "True"
    assert conditions["Ready"]["reason"] == "CanaryFailed"
    assert "CanaryRolledBack" in world.reasons()
    assert world.verdicts("rolled_back") == 1

    for _ in range(3):
        await world.reconcile()
    assert world.applies() == [], "failed settings are not tried again under the same spec"
    world.edit_profile("bulk", maxQueueDelayMicroseconds=60000)
    world.all_serving()
    await world.reconcile()
    assert world.applies() == ["triton-0"], "a changed spec gets a canary of its own"
    assert world.status["settings"]["failed"] == []


@pytest.mark.looptime
async def test_failing_settings_roll_back_before_the_window_ends() -> None:
    world = World()
    await started_on_bulk(world)
    world.edit_profile("bulk", maxQueueDelayMicroseconds=80000)
    await world.reconcile()
    world.applies()
    world.figures.serve(world.replicas[0], failed=12.0)  # 20% of the canary's requests
    await world.reconcile()
    assert world.status["canary"]["phase"] == "Analysing", "60 requests of the 100 needed"
    await world.reconcile()
    assert world.status["canary"]["phase"] == "RolledBack"
    assert world.status["canary"]["reason"].startswith("failure rate 20.00%")
    assert world.applies() == ["triton-0"]


@pytest.mark.looptime
async def test_one_slow_reading_does_not_decide() -> None:
    world = World()
    await started_on_bulk(world)
    world.edit_profile("bulk", maxQueueDelayMicroseconds=80000)
    await world.reconcile()
    for number in range(6):
        world.figures.serve(world.replicas[0], p95_ms=400.0 if number == 2 else 21.0)
        await world.reconcile()
    assert world.status["canary"]["phase"] == "Promoted"


@pytest.mark.looptime
async def test_switches_between_proven_settings_roll_straight_on() -> None:
    world = World()
    await started_on_bulk(world)
    world.spec = copy.deepcopy(world.spec)
    world.spec["override"] = {"profile": "interactive"}
    await world.reconcile()
    world.applies()
    for _ in range(6):
        await world.reconcile()
    assert world.applies() == ["triton-1", "triton-2", "triton-3"], "interactive was new"
    del world.spec["override"]
    await world.reconcile()
    assert world.applies() == ["triton-0", "triton-1", "triton-2", "triton-3"]
    world.spec["override"] = {"profile": "interactive"}
    await world.reconcile()
    assert world.applies() == ["triton-0", "triton-1", "triton-2", "triton-3"]


@pytest.mark.looptime
async def test_a_restarted_operator_knows_the_proven_settings_from_the_status() -> None:
    world = World()
    await started_on_bulk(world)
    world.state = reconciling.PolicyMemory()  # a new operator: only the status remains
    world.edit_profile("bulk", maxQueueDelayMicroseconds=80000)
    await world.reconcile()
    assert world.applies() == ["triton-0"], "it knows what the fleet served: a canary"


@pytest.mark.looptime
async def test_a_fleet_of_one_has_nothing_to_compare_with() -> None:
    world = World(replicas=1)
    world.all_serving()
    await world.reconcile()
    world.applies()
    world.edit_profile("bulk", maxQueueDelayMicroseconds=80000)
    await world.reconcile()
    assert world.applies() == ["triton-0"], "onInconclusive Promote: the fleet takes them"
    assert world.status["canary"]["phase"] == "Inconclusive"
    assert world.status["canary"]["reason"] == (
        "no replica to compare with: 1 answer, the canary takes 1"
    )
    assert "CanaryInconclusive" in world.reasons()

    rolled_back = World(replicas=1, onInconclusive="Rollback")
    rolled_back.all_serving()
    await rolled_back.reconcile()
    rolled_back.applies()
    rolled_back.edit_profile("bulk", maxQueueDelayMicroseconds=80000)
    await rolled_back.reconcile()
    assert rolled_back.applies() == []
    assert rolled_back.served_delays() == {"triton-0": 50000}


@pytest.mark.looptime
async def test_settings_a_replica_cannot_apply_fail_at_once() -> None:
    world = World()
    await started_on_bulk(world)
    world.fleet.servers[world.replicas[0].http_url].fail_with = RuntimeError("model rejected")
    world.edit_profile("bulk", maxQueueDelayMicroseconds=80000)
    await world.reconcile()
    assert world.status["canary"]["phase"] == "RolledBack"
    assert world.status["canary"]["reason"].startswith("the settings could not be applied")
    assert world.applies()[1:] == [], "no other replica was touched"


def test_the_settings_hash_names_what_a_model_runs_not_the_profile() -> None:
    from batchpilot.api.v1alpha1 import specs

    one = rendering.render(specs.Profile.model_validate({"maxQueueDelayMicroseconds": 100}))
    same = rendering.render(specs.Profile.model_validate({"maxQueueDelayMicroseconds": 100}))
    other = rendering.render(specs.Profile.model_validate({"maxQueueDelayMicroseconds": 200}))
    assert rendering.settings_hash(one) == rendering.settings_hash(same)
    assert rendering.settings_hash(one) != rendering.settings_hash(other)
    assert rendering.from_document(rendering.settings_document(one)) == one


@pytest.mark.looptime
async def test_the_runner_pairs_each_server_with_its_sidecar_for_a_canary() -> None:
    from batchpilot import running
    from batchpilot.api import documents
    from batchpilot_triton import servers

    spec = documents.parse_spec(spec_document(rollout={"canary": CANARY}))
    tritons = [servers.TritonServer(f"http://127.0.0.1:{port}") for port in (8000, 8100)]

    def runner(sidecars: list[str]) -> running.Runner:
        return running.Runner(
            name="fleet",
            spec=spec,
            triton_servers=tritons,
            source=Figures(),
            metrics=telemetry.controller_metrics(),
            sidecar_urls=sidecars,
        )

    paired = runner(["http://127.0.0.1:9100/", "http://127.0.0.1:9200"])
    found, _ = await paired.engine.replica_source.replicas("", spec.target)
    assert [r.sidecar_url for r in found] == ["http://127.0.0.1:9100", "http://127.0.0.1:9200"]
    unpaired, _ = await runner(["http://127.0.0.1:9100"]).engine.replica_source.replicas(
        "", spec.target
    )
    assert [r.sidecar_url for r in unpaired] == [None, None], "one sidecar for two servers"


@pytest.mark.looptime
async def test_an_llm_canary_is_judged_by_its_engine_s_inter_token_latency() -> None:
    world = World(maxInterTokenP95Ratio=1.3)
    world.all_serving(inter_token_p95_ms=30.0)
    await world.reconcile()
    world.applies()
    world.edit_profile("bulk", maxQueueDelayMicroseconds=80000)
    await world.reconcile()
    world.figures.serve(world.replicas[0], inter_token_p95_ms=48.0)  # 1.6x, p95 alike
    for _ in range(6):
        await world.reconcile()
    assert world.status["canary"]["phase"] == "RolledBack"
    assert world.status["canary"]["reason"] == ("inter-token p95 1.60x the baseline's (limit 1.3x)")


@pytest.mark.looptime
async def test_settings_too_long_for_the_status_are_kept_in_memory_only() -> None:
    """A profile with many priority levels renders to more JSON than status.settings.served
    holds: the status leaves it out (the API server would refuse it), the canary still runs."""
    levels = [{"priorityLevel": level, "maxQueueSize": 10} for level in range(1, 201)]
    world = World()
    world.spec = copy.deepcopy(world.spec)
    bulk = world.spec["profiles"]["bulk"]
    bulk.update(priorityLevels=200, defaultPriorityLevel=1, priorityQueuePolicy=levels)
    await started_on_bulk(world)
    assert world.status["settings"]["servedHash"]
    assert not world.status["settings"]["served"], "too long for the status"
    world.edit_profile("bulk", maxQueueDelayMicroseconds=80000)
    await world.reconcile()
    assert world.applies() == ["triton-0"], "what the fleet served is still known in memory"


async def started_on_interactive_before_the_close(world: World) -> None:
    """Market hours (interactive 09:30-16:00 New York): 10:00 there, the first rollout."""
    world.with_spec(schedule=market_hours())
    world.all_serving()
    await world.reconcile()
    assert world.applies() == ["triton-0", "triton-1", "triton-2", "triton-3"]
    assert world.status["settings"]["servedProfile"] == "interactive"


async def at_the_close(world: World) -> None:
    """16:00 New York (21:00 UTC): the schedule switches into bulk, which the fleet never served."""
    world.now = utc(2026, 11, 24, 21)
    await world.reconcile(seconds=0)
    assert world.applies() == ["triton-0"], "new settings: a canary"
    assert world.status["canary"]["phase"] == "Analysing"


@pytest.mark.looptime
async def test_a_scheduled_first_switch_into_a_slower_bulk_is_promoted() -> None:
    """Bulk trades latency for throughput: its p95 against replicas still on interactive says
    nothing of whether its settings are right (main rolled it back, and every night after)."""
    world = World()
    await started_on_interactive_before_the_close(world)
    await at_the_close(world)
    assert "judged by bulk's objectives (none)" in world.events[-1][1]
    world.figures.serve(world.replicas[0], p95_ms=60.0)  # 3x interactive's, as bulk should
    for _ in range(6):
        await world.reconcile()
    assert world.status["canary"]["phase"] == "Promoted", world.status["canary"]
    assert "latency not judged" in world.status["canary"]["reason"]
    assert world.applies() == ["triton-1", "triton-2", "triton-3"]
    assert set(world.served_delays().values()) == {50000}
    assert world.status["activeProfile"] == "bulk"
    assert world.verdicts("promoted") == 1


@pytest.mark.looptime
async def test_a_switch_is_judged_by_the_profile_s_own_objective() -> None:
    """With an SLO over bulk, the switch is held to bulk's p95 objective, not to interactive's
    replicas: 60 ms within a 100 ms objective passes; 400 ms is past 1.5x of it."""
    within = World()
    await started_on_interactive_before_the_close(within)
    within.with_spec(slo={"p95LatencyMs": 100, "profiles": ["bulk"], "guard": False})
    await at_the_close(within)
    within.figures.serve(within.replicas[0], p95_ms=60.0)
    for _ in range(6):
        await within.reconcile()
    assert within.status["canary"]["phase"] == "Promoted"
    assert within.status["canary"]["figures"].endswith("p95 0.60x of the objective")

    past = World()
    await started_on_interactive_before_the_close(past)
    past.with_spec(slo={"p95LatencyMs": 100, "profiles": ["bulk"], "guard": False})
    await at_the_close(past)
    past.figures.serve(past.replicas[0], p95_ms=400.0)
    for _ in range(6):
        await past.reconcile()
    assert past.status["canary"]["phase"] == "RolledBack"
    assert past.status["canary"]["reason"] == "p95 4.00x its objective (limit 1.5x)"
    assert past.served_delays() == {f"triton-{n}": 2000 for n in range(4)}


@pytest.mark.looptime
async def test_an_edit_is_still_compared_with_the_replicas_on_the_old_settings() -> None:
    """The same p95 that a switch may have fails an edit of the profile in force."""
    world = World()
    await started_on_bulk(world)
    world.edit_profile("bulk", maxQueueDelayMicroseconds=80000)
    await world.reconcile()
    world.applies()
    world.figures.serve(world.replicas[0], p95_ms=60.0)
    for _ in range(6):
        await world.reconcile()
    assert world.status["canary"]["reason"] == "p95 3.00x the baseline's (limit 1.5x)"


@pytest.mark.looptime
async def test_settings_whose_queue_refuses_requests_are_rolled_back_on_the_canary_only() -> None:
    """`maxQueueSize: 1` under load: Triton refuses most arrivals with a 503 and counts none of
    them (2.51 counts queue timeouts, not a full queue). The canary counted 20 of the 60
    requests each other replica did: the other 40 were refused."""
    world = World()
    await started_on_bulk(world)
    world.edit_profile("bulk", queuePolicy={"maxQueueSize": 1})
    await world.reconcile()
    assert world.applies() == ["triton-0"]
    world.figures.serve(world.replicas[0], requests=20.0)
    await world.reconcile()
    await world.reconcile()
    canary = world.status["canary"]
    assert canary["phase"] == "RolledBack", canary
    assert canary["reason"].startswith("failure rate 66.67%, 80 of them refused before Triton")
    assert "(80 refused uncounted)" in canary["figures"]
    assert world.applies() == ["triton-0"], "the canary goes back; no other replica took them"
    assert world.served_delays() == {f"triton-{n}": 50000 for n in range(4)}
    queues = {
        replica.name: settings.dynamic_batching["default_queue_policy"]["max_queue_size"]
        for replica in world.replicas
        if (settings := world.fleet.servers[replica.http_url].settings)
    }
    assert queues == {f"triton-{n}": 0 for n in range(4)}, "every replica's queue unbounded again"


@pytest.mark.looptime
async def test_a_canary_within_its_share_of_the_arrivals_refused_nothing() -> None:
    world = World()
    await started_on_bulk(world)
    world.edit_profile("bulk", maxQueueDelayMicroseconds=80000)
    await world.reconcile()
    world.figures.serve(world.replicas[0], requests=50.0)  # 83% of its share: balancing
    for _ in range(6):
        await world.reconcile()
    assert world.status["canary"]["phase"] == "Promoted"
    assert "refused" not in world.status["canary"]["figures"]


@pytest.mark.looptime
async def test_the_lead_plans_for_a_canary_until_the_latency_profile_is_proven() -> None:
    """On bulk, interactive's settings were never served: a switch into it is a canary's."""
    world = World()
    await started_on_bulk(world)
    policy = documents.parse_spec(world.spec)
    assert canaries.leads_through_canary(policy, world.state.canary)
    world.spec = copy.deepcopy(world.spec)
    world.spec["override"] = {"profile": "interactive"}
    for _ in range(7):
        await world.reconcile()
    assert world.status["canary"]["phase"] == "Promoted"
    assert not canaries.leads_through_canary(policy, world.state.canary), "proven now"
    assert not canaries.leads_through_canary(policy, reconciling.PolicyMemory().canary)
