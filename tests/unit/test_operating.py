"""The per-policy daemon loop and the handlers' poke logic, on fake loop time (looptime)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from typing import Any

import kopf
import operator_fakes
import pytest
from aiohttp import web
from kopf._cogs.structs import references as kopf_references

from batchpilot import handlers, operating, reconciling, reporting, telemetry
from batchpilot.api import names
from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import fleets
from batchpilot.applying.replicas import Replica
from batchpilot.kube import client
from batchpilot.kube import pods as kube_pods
from batchpilot.kube import policies as kube_policies
from batchpilot.policy import governing
from batchpilot.signals import prometheus, sidecars, sources
from batchpilot_harness import local_triton
from builders import spec_document

START = datetime.datetime(2026, 11, 24, 15, tzinfo=datetime.UTC)


class ScriptedReconciler:
    """Returns prepared outcomes and notes the loop time of every call."""

    def __init__(self, wake_after: float | None = None, failures: int = 0) -> None:
        self.calls: list[float] = []
        self.seen: list[dict[str, Any]] = []
        """The status each reconcile started from."""
        self.forgotten: list[tuple[str, str]] = []
        self.released: list[tuple[str, float]] = []
        """(namespace, loop time) of each release of a deleted policy's Pods."""
        self.wake_after = wake_after
        self.failures = failures

    async def forget_policy(self, namespace: str, name: str) -> None:
        self.forgotten.append((namespace, name))

    async def release_pods(
        self, namespace: str, spec: dict[str, Any], *, name: str = ""
    ) -> list[str]:
        self.released.append((namespace, asyncio.get_running_loop().time()))
        return ["triton-0"]

    async def reconcile(self, *, status: dict[str, Any], **_: Any) -> reconciling.Reconciled:
        now = asyncio.get_running_loop().time()
        self.calls.append(now)
        self.seen.append(status)
        if len(self.calls) <= self.failures:
            raise RuntimeError("the API server went away")
        wake = (
            START + datetime.timedelta(seconds=now + self.wake_after) if self.wake_after else None
        )
        return reconciling.Reconciled(
            at=START,
            status={"activeProfile": "bulk"},
            events=(reporting.Event("Normal", "ProfileSwitched", "x"),)
            if len(self.calls) == 1
            else (),
            wake_at=wake,
        )


class Recorder(kube_policies.Policies):
    """The status writer with its API call recorded, and the events poster."""

    def __init__(self) -> None:
        self.statuses: list[dict[str, Any]] = []
        self.events: list[str] = []

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.statuses.append(status)

    async def post(self, body: Any, *, type: str, reason: str, message: str) -> None:  # noqa: A002
        self.events.append(reason)


class Stopped:
    """A stand-in for kopf's DaemonStopped flag."""

    def __init__(self) -> None:
        self.flag = asyncio.Event()

    def __bool__(self) -> bool:
        return self.flag.is_set()

    async def wait(self) -> None:
        await self.flag.wait()


def controller(
    reconciler: ScriptedReconciler, recorder: Recorder, interval: float = 5.0
) -> operating.Controller:
    return operating.Controller(
        options=operating.Options(interval=interval, metrics_port=None),
        reconciler=reconciler,  # type: ignore[arg-type]
        policies=recorder,
        metrics=telemetry.controller_metrics(),
        events=recorder,
        clock=lambda: START + datetime.timedelta(seconds=asyncio.get_running_loop().time()),
    )


async def run_for(
    subject: operating.Controller, seconds: float, *, poke_at: float | None = None
) -> None:
    stopped = Stopped()
    body = {"spec": spec_document(), "status": {}, "metadata": {"generation": 1}}
    follow = asyncio.create_task(
        subject.follow(namespace="ns", name="fleet", body=body, stopped=stopped)  # type: ignore[arg-type]
    )
    if poke_at is not None:
        await asyncio.sleep(poke_at)
        subject.poke("ns", "fleet")
        await asyncio.sleep(seconds - poke_at)
    else:
        await asyncio.sleep(seconds)
    stopped.flag.set()
    await asyncio.wait_for(follow, timeout=1)


@pytest.mark.looptime
async def test_reconciles_every_interval_and_writes_status_once() -> None:
    reconciler, recorder = ScriptedReconciler(), Recorder()
    await run_for(controller(reconciler, recorder, interval=5), 16)
    assert reconciler.calls == pytest.approx([0, 5, 10, 15])
    # The body never catches up here; the loop knows what it wrote and writes it once.
    assert len(recorder.statuses) == 1
    assert recorder.events == ["ProfileSwitched"]
    # Its loop ended (the policy was deleted): its servers need not keep their clients.
    assert reconciler.forgotten == [("ns", "fleet")]


@pytest.mark.looptime
async def test_a_pass_starts_from_the_status_the_loop_wrote_before_the_body_catches_up() -> None:
    """kopf's body lags the loop's own writes; a pass poked right after a write (a Pod turning
    Ready as a rollout ends) must not start from, and write back, the status before it."""
    reconciler = ScriptedReconciler()
    await run_for(controller(reconciler, Recorder(), interval=30), 4, poke_at=1)
    assert reconciler.seen == [{}, {"activeProfile": "bulk"}]


class RollingOut(ScriptedReconciler):
    """Writes the interim status, then rolls out for a minute; the first rollout fails."""

    async def reconcile(  # type: ignore[override]
        self, *, status: dict[str, Any], progress: reconciling.StatusProgress, **kwargs: Any
    ) -> reconciling.Reconciled:
        self.seen.append(status)
        self.calls.append(asyncio.get_running_loop().time())
        await progress({"desiredProfile": "bulk", "observedGeneration": len(self.calls)})
        await asyncio.sleep(60)
        if len(self.calls) == 1:
            raise RuntimeError("the rollout broke")
        return reconciling.Reconciled(
            at=START, status={"activeProfile": "bulk"}, events=(), wake_at=None
        )


@pytest.mark.looptime
async def test_a_pass_writes_its_interim_status_at_once_and_its_own_after_it() -> None:
    """A rollout's status is written when it starts, not a minute later when it ends; the
    next pass starts from it, even after a pass that failed."""
    reconciler, recorder = RollingOut(), Recorder()
    await run_for(controller(reconciler, recorder, interval=5), 123)
    assert recorder.statuses == [
        {"desiredProfile": "bulk", "observedGeneration": 1},
        {"desiredProfile": "bulk", "observedGeneration": 2},
        {"activeProfile": "bulk"},
    ]
    assert reconciler.seen == [{}, {"desiredProfile": "bulk", "observedGeneration": 1}]


def test_the_remembered_status_follows_merge_patch_semantics() -> None:
    before = {"activeProfile": "bulk", "targets": {"a": 1, "b": 2}, "conditions": [1, 2]}
    patch = {"targets": {"b": None, "c": 3}, "conditions": [3], "lastError": None}
    assert kube_policies.merge_patch(before, patch) == {
        "activeProfile": "bulk",
        "targets": {"a": 1, "c": 3},
        "conditions": [3],
    }
    assert before["targets"] == {"a": 1, "b": 2}  # not changed in place


async def test_the_status_is_written_only_when_a_field_changed_and_a_failed_write_is_unknown() -> (
    None
):
    class Refused(Recorder):
        async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
            raise client.KubeError("writing the status", 409, "Conflict")

    known = {"activeProfile": "bulk", "targets": {"a": 1}}
    writer = Recorder()
    assert await writer.write_status("ns", "p", known, {"activeProfile": "bulk"}) is known
    assert writer.statuses == []
    after = await writer.write_status("ns", "p", known, {"targets": {"b": 2}})
    assert writer.statuses == [{"targets": {"b": 2}}]
    assert after == {"activeProfile": "bulk", "targets": {"a": 1, "b": 2}}
    assert await Refused().write_status("ns", "p", known, {"activeProfile": "x"}) is None


@pytest.mark.looptime
async def test_a_deleted_policy_releases_its_pods_only_once_its_loop_has_stopped() -> None:
    """kopf signals the daemon and calls the deletion handler side by side: a release before
    the loop's cancelled rollout ends could be undone by a gate that rollout closes after."""
    reconciler, recorder = ScriptedReconciler(), Recorder()
    subject = controller(reconciler, recorder, interval=30)
    stopped = Stopped()
    body = {"spec": spec_document(), "status": {}, "metadata": {"generation": 1}}
    follow = asyncio.create_task(
        subject.follow(namespace="ns", name="fleet", body=body, stopped=stopped)  # type: ignore[arg-type]
    )
    await asyncio.sleep(1)
    deleted = asyncio.create_task(
        subject.policy_deleted(namespace="ns", name="fleet", spec=spec_document())
    )
    await asyncio.sleep(2)
    assert reconciler.released == []  # the loop still runs
    stopped.flag.set()
    await asyncio.wait_for(follow, timeout=1)
    await asyncio.wait_for(deleted, timeout=1)
    assert reconciler.released == [("ns", pytest.approx(3))]
    # No loop (the operator restarted after the deletion): released at once.
    await subject.policy_deleted(namespace="ns", name="fleet", spec=spec_document())
    assert len(reconciler.released) == 2


async def test_a_deleted_policy_pokes_the_others_of_its_namespace() -> None:
    """A Pod it governed may pass to another policy that selects it too."""
    subject = controller(ScriptedReconciler(), Recorder())
    for namespace, name in (("ns", "newer"), ("ns", "fleet"), ("elsewhere", "desk")):
        subject.wakeup(namespace, name)
    await subject.policy_deleted(namespace="ns", name="fleet", spec=spec_document())
    assert subject.wakeup("ns", "newer").is_set()
    assert not subject.wakeup("elsewhere", "desk").is_set()


@pytest.mark.looptime
async def test_wakes_at_the_next_transition_before_the_interval() -> None:
    reconciler = ScriptedReconciler(wake_after=2)
    await run_for(controller(reconciler, Recorder(), interval=30), 7)
    assert reconciler.calls[:3] == pytest.approx([0, 2.05, 4.1], abs=0.01)


@pytest.mark.looptime
async def test_a_poke_wakes_the_loop_at_once() -> None:
    reconciler = ScriptedReconciler()
    await run_for(controller(reconciler, Recorder(), interval=30), 10, poke_at=3)
    assert reconciler.calls == pytest.approx([0, 3])


@pytest.mark.looptime
async def test_a_failing_reconcile_backs_off_exponentially_and_the_loop_goes_on() -> None:
    reconciler = ScriptedReconciler(failures=3)
    await run_for(controller(reconciler, Recorder(), interval=30), 10)
    assert reconciler.calls == pytest.approx([0, 1, 3, 7])


def test_pod_changes_poke_only_the_policies_that_select_the_pod() -> None:
    subject = controller(ScriptedReconciler(), Recorder())
    index = {
        "ns": [
            ("fleet", {"matchLabels": {"app": "triton"}}),
            ("other", {"matchLabels": {"app": "x"}}),
        ]
    }
    pod = {"metadata": {"uid": "u1", "labels": {"app": "triton"}}, "status": {"podIP": "10.0.0.1"}}
    subject.pod_changed(namespace="ns", pod=pod, event_type="ADDED", index=index)  # type: ignore[arg-type]
    assert subject.wakeup("ns", "fleet").is_set()
    assert not subject.wakeup("ns", "other").is_set()
    subject.wakeup("ns", "fleet").clear()
    # The same Pod again, unchanged where it matters: no poke.
    subject.pod_changed(namespace="ns", pod=pod, event_type="MODIFIED", index=index)  # type: ignore[arg-type]
    assert not subject.wakeup("ns", "fleet").is_set()
    ready = {
        **pod,
        "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    subject.pod_changed(namespace="ns", pod=ready, event_type="MODIFIED", index=index)  # type: ignore[arg-type]
    assert subject.wakeup("ns", "fleet").is_set()
    subject.wakeup("ns", "fleet").clear()
    # Triton's container restarted: the Pod's Ready may not have changed yet, its gate is stale.
    restarted = {
        **ready,
        "status": {
            **ready["status"],
            "containerStatuses": [{"name": "triton", "restartCount": 1, "state": {"running": {}}}],
        },
    }
    subject.pod_changed(namespace="ns", pod=restarted, event_type="MODIFIED", index=index)  # type: ignore[arg-type]
    assert subject.wakeup("ns", "fleet").is_set()


class ListingApi:
    """An API server answering Pod LISTs with `pods` (a page of `limit`), recording each query."""

    def __init__(self, *pods: dict[str, Any], more: bool = False) -> None:
        self.pods = list(pods)
        self.more = more
        self.failing = False
        self.queries: list[dict[str, str]] = []

    async def answer(self, request: web.Request) -> web.Response:
        self.queries.append({"path": request.path, **request.query})
        if self.failing:
            return web.json_response({"message": "etcd is down"}, status=503)
        metadata = {"continue": "page-2"} if self.more else {}
        return web.json_response({"items": self.pods, "metadata": metadata})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self.answer)
        return app


def listed_pod(name: str, phase: str = "Running", **metadata: Any) -> dict[str, Any]:
    labels = {"app": "triton", names.INJECT_LABEL: names.INJECT_VALUE}
    return {"metadata": {"name": name, "labels": labels, **metadata}, "status": {"phase": phase}}


async def test_pods_created_without_injection_are_listed_by_a_selector_that_matches_only_them(
    serve_app: Any,
) -> None:
    api = ListingApi(
        listed_pod("triton-late"),
        listed_pod("triton-going", deletionTimestamp="2026-11-29T00:00:00Z"),
        listed_pod("triton-done", phase="Succeeded"),
        {**listed_pod("other"), "metadata": {"name": "other", "labels": {"app": "other"}}},
    )
    url = await serve_app(api.app())
    now = [1000.0]
    reader = kube_pods.Pods(
        client.KubeClient(lambda: kopf.ConnectionInfo(server=url)), clock=lambda: now[0]
    )
    selector = specs.LabelSelector.model_validate({"matchLabels": {"app": "triton"}})
    try:
        assert await reader.not_injected("team-a", selector) == ["triton-late"]
        assert api.queries == [
            {
                "path": "/api/v1/namespaces/team-a/pods",
                "labelSelector": "batchpilot.dev/inject=true,batchpilot.dev/governed!=true",
                "limit": str(kube_pods.NOT_INJECTED_LISTED),
                "resourceVersion": "0",
            }
        ]
        # Every policy's pass asks; the namespace is listed again only when its list is old...
        now[0] += kube_pods.NOT_INJECTED_EVERY_SECONDS - 1
        await reader.not_injected("team-a", selector)
        assert len(api.queries) == 1
        now[0] += 1
        api.pods, api.more = [listed_pod("a"), listed_pod("b")], True
        assert await reader.not_injected("team-a", selector) == ["a", "b", "more"]
        assert len(api.queries) == 2
        now[0] += kube_pods.NOT_INJECTED_EVERY_SECONDS
        api.pods, api.more = [listed_pod(f"p{number:02}") for number in range(12)], False
        named = await reader.not_injected("team-a", selector)
        assert named == [f"p{number:02}" for number in range(10)] + ["2 more"]
        assert reporting.pods_not_injected(named)[2].startswith(
            "p00, p01, p02, p03, p04, p05, p06, p07, p08, p09 and 2 more: "
        )
        # ... or when a governed Pod appeared there (a replacement), once in a few seconds.
        reader.governed_pod_appeared("team-a")
        await reader.not_injected("team-a", selector)
        assert len(api.queries) == 3, "listed less than NOT_INJECTED_AT_MOST_EVERY_SECONDS ago"
        now[0] += kube_pods.NOT_INJECTED_AT_MOST_EVERY_SECONDS
        api.pods, api.more = [], False
        assert await reader.not_injected("team-a", selector) == []
        assert len(api.queries) == 4
        # A failed LIST keeps what was known and is not retried at every pass.
        api.failing = True
        now[0] += kube_pods.NOT_INJECTED_EVERY_SECONDS
        assert await reader.not_injected("team-a", selector) == []
        assert await reader.not_injected("team-a", selector) == []
        assert len(api.queries) == 5
    finally:
        await reader._client.close()


def test_a_governed_pod_seen_for_the_first_time_has_its_namespace_listed_again() -> None:
    subject = controller(ScriptedReconciler(), Recorder())
    appeared: list[str] = []

    class Reader(kube_pods.Pods):
        def governed_pod_appeared(self, namespace: str) -> None:
            appeared.append(namespace)

    subject.pods = Reader(client.KubeClient())
    pod = {"metadata": {"uid": "u1", "labels": {"app": "triton"}}, "status": {"podIP": "10.0.0.1"}}
    changed = {**pod, "status": {"podIP": "10.0.0.2"}}
    for seen in (pod, pod, changed):
        subject.pod_changed(namespace="ns", pod=seen, event_type="MODIFIED", index={})
    assert appeared == ["ns"], "once, when it first appears"


@pytest.mark.parametrize(
    ("selector", "labels", "selected"),
    [
        ({"matchLabels": {"app": "triton"}}, {"app": "triton", "x": "y"}, True),
        (
            {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["a", "b"]}]},
            {"tier": "b"},
            True,
        ),
        (
            {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["a"]}]},
            {"tier": "a"},
            False,
        ),
        ({"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}, {}, False),
        ({"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}, {}, True),
        ({}, {"anything": "goes"}, True),
    ],
)
def test_selector_semantics(
    selector: dict[str, Any], labels: dict[str, str], selected: bool
) -> None:
    assert governing.selects(selector, labels) is selected


def sidecar_target(name: str, sidecar_port: int | None) -> Replica:
    return dataclasses.replace(
        operator_fakes.target(name, ip="127.0.0.1"),
        sidecar_url=f"http://127.0.0.1:{sidecar_port}" if sidecar_port else None,
    )


async def test_signals_come_from_the_sidecars_by_default_and_name_pods_without_one() -> None:
    build = operating.signal_sources(fleets.TritonFleet())
    document = spec_document(
        load={"rules": [{"profile": "bulk", "metric": "queueDepth", "above": 8}]}
    )
    document["target"]["sidecarPort"] = "sidecar"
    policy = specs.BatchPolicySpec.model_validate(document)
    (silent_port,) = local_triton.free_ports("127.0.0.1", 1)
    targets = [sidecar_target("pod-1", silent_port), sidecar_target("pod-2", None)]
    source = build("ns", policy, targets)
    assert isinstance(source, sidecars.SidecarSource)
    reading = await source.read()  # nothing listens at the sidecar port: a problem, not zeros
    await source.close()
    assert reading.signals.metrics == {}
    assert reading.problems[0] == (
        "pod pod-2: no container port named 'sidecar' for the sidecar; left out"
    )
    assert f"sidecar http://127.0.0.1:{silent_port}" in reading.problems[1]


@pytest.mark.parametrize(
    ("load", "kind"),
    [
        ({"source": "triton"}, sources.TritonMetricsSource),
        (
            {"source": "prometheus", "prometheus": {"url": "http://prometheus:9090"}},
            prometheus.PrometheusSource,
        ),
    ],
)
async def test_signals_from_triton_or_prometheus_when_the_policy_says_so(
    load: dict[str, Any], kind: type
) -> None:
    build = operating.signal_sources(fleets.TritonFleet())
    policy = specs.BatchPolicySpec.model_validate(spec_document(load=load))
    source = build("ns", policy, [sidecar_target("pod-1", 9400)])
    assert isinstance(source, kind)
    await source.close()


async def test_the_governors_are_read_from_kopf_s_live_index_of_every_policy() -> None:
    subject = controller(ScriptedReconciler(), Recorder())
    assert subject.governors("ns") == []
    selector = {"matchLabels": {"app": "triton"}}
    index: dict[str | None, list[operating.GovernorEntry]] = {
        "ns": [("desk", "2026-01-01T00:00:00Z", selector)]
    }
    subject.governors_index = index
    assert subject.governors("ns") == [
        governing.Governor(name="desk", created="2026-01-01T00:00:00Z", selector=selector)
    ]
    index["ns"].append(("later", "2026-02-01T00:00:00Z", selector))  # the index is live
    assert [policy.name for policy in subject.governors("ns")] == ["desk", "later"]
    assert subject.governors("elsewhere") == []


async def test_the_governors_index_keeps_each_policy_s_name_creation_time_and_selector() -> None:
    body = kopf.Body(
        {
            "metadata": {
                "name": "desk",
                "namespace": "ns",
                "creationTimestamp": "2026-01-01T00:00:00Z",
            },
            "spec": {"target": {"selector": {"matchLabels": {"app": "triton"}}}},
        }
    )
    entry = await handlers.governors_by_namespace(
        namespace="ns", name="desk", spec=body.spec, meta=body.metadata
    )
    assert entry == {"ns": ("desk", "2026-01-01T00:00:00Z", {"matchLabels": {"app": "triton"}})}


async def test_the_pods_index_keeps_each_pod_trimmed_under_its_namespace() -> None:
    body = kopf.Body(
        {
            "metadata": {"name": "triton-0", "namespace": "ns", "labels": {"app": "triton"},
                         "managedFields": [{"manager": "kubelet"}]},
            "spec": {"containers": [{"name": "triton", "image": "triton", "ports": []}]},
            "status": {"phase": "Running", "podIP": "10.88.0.7", "hostIP": "10.0.0.1"},
        }
    )  # fmt: skip
    (entry,) = (await handlers.pods_by_namespace(namespace="ns", body=body)).items()
    assert entry[0] == "ns"
    assert entry[1]["metadata"] == {"name": "triton-0", "labels": {"app": "triton"}}
    assert entry[1]["status"] == {"phase": "Running", "podIP": "10.88.0.7"}


def test_the_handlers_hand_kopf_s_index_of_pods_to_the_reader_of_replicas() -> None:
    reader = kube_pods.Pods(client.KubeClient())
    subject = dataclasses.replace(controller(ScriptedReconciler(), Recorder()), pods=reader)
    index: dict[str | None, list[dict[str, Any]]] = {"ns": []}
    subject.attach_pods(index)
    assert reader.index is index


@pytest.mark.looptime
async def test_a_policy_whose_loop_ended_exports_no_series() -> None:
    """Its loop ends when the policy is deleted (or another replica takes it over): a series
    left behind would keep an alert firing, or hide one, about a policy nobody governs."""
    targets = [operator_fakes.target("triton-0")]
    fleet = operator_fakes.FakeFleet({t.http_url: operator_fakes.FakeServer() for t in targets})
    metrics = telemetry.controller_metrics()
    engine = reconciling.Reconciler(
        replicas=operator_fakes.FakePods(targets),
        gates=operator_fakes.FakeGates(),
        fleet=fleet,
        signal_source=lambda namespace, policy, found: pytest.fail("no signal is wanted"),
        metrics=metrics,
        clock=lambda: START,
        settle_seconds=0,
    )
    subject = dataclasses.replace(
        controller(ScriptedReconciler(), Recorder()), reconciler=engine, metrics=metrics
    )

    def exported() -> dict[tuple[str, str], float]:
        return {
            (sample.name, sample.labels.get("profile", "")): sample.value
            for family in metrics.registry.collect()
            for sample in family.samples
            if sample.labels.get("policy") == "fleet"
        }

    stopped = Stopped()
    body = {"spec": spec_document(), "status": {}, "metadata": {"generation": 1}}
    follow = asyncio.create_task(
        subject.follow(namespace="ns", name="fleet", body=body, stopped=stopped)  # type: ignore[arg-type]
    )
    await asyncio.sleep(1)
    assert exported()[(telemetry.ACTIVE_PROFILE, "bulk")] == 1
    stopped.flag.set()
    await asyncio.wait_for(follow, timeout=1)
    assert exported() == {}


def test_every_handler_kopf_calls_per_event_is_a_coroutine() -> None:
    # kopf runs a plain function in its thread pool: every Pod event would take a trip through
    # it, and a policy's wakeup (an asyncio.Event) would be set from a thread that is not the
    # loop's. The login is a coroutine too: it waits for its thread within a deadline.
    plain = [
        name
        for name, function in vars(handlers).items()
        if hasattr(function, "__module__")
        and getattr(function, "__module__", None) == handlers.__name__
        and callable(function)
        and name not in {"controller_of", "run", "_without_finalizers"}
        and not asyncio.iscoroutinefunction(function)
    ]
    assert plain == []


class GatePods(kube_pods.Pods):
    """The reader of Pods over a given index, with its gate writes recorded."""

    def __init__(self, index: dict[str | None, list[dict[str, Any]]]) -> None:
        super().__init__(client.KubeClient())
        self.index = index
        self.opened: list[tuple[str, str, str]] = []

    async def set_gate(
        self, namespace: str, pod: str, *, applied: bool, reason: str, message: str
    ) -> None:
        assert applied
        self.opened.append((namespace, pod, reason))
        for snapshot in self.index[namespace]:
            if snapshot["metadata"]["name"] == pod:
                snapshot["status"]["conditions"] = [{"type": kube_pods.GATE, "status": "True"}]


def gated_pod(name: str, labels: dict[str, str], gate: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [], "readinessGates": [{"conditionType": kube_pods.GATE}]},
        "status": {"phase": "Running", "conditions": [{"type": kube_pods.GATE, "status": gate}]},
    }


@pytest.mark.looptime
async def test_a_pod_relabelled_while_its_gate_was_closed_is_reopened() -> None:
    """Issue 39: a Pod whose gate a switch closed and that then stopped matching every selector
    was never reopened; a pass of any policy of its namespace opens it, and only it."""
    index: dict[str | None, list[dict[str, Any]]] = {
        "ns": [
            gated_pod("switching", {"app": "triton"}, "False"),  # its policy is switching it
            gated_pod("relabelled", {"app": "moved"}, "False"),
            gated_pod("open", {"app": "moved"}, "True"),
        ],
        "other": [gated_pod("elsewhere", {"app": "moved"}, "False")],
    }
    pods = GatePods(index)
    subject = dataclasses.replace(controller(ScriptedReconciler(), Recorder()), pods=pods)
    subject.governors_index = {"ns": [("fleet", "", {"matchLabels": {"app": "triton"}})]}
    await run_for(subject, 1)
    assert pods.opened == [("ns", "relabelled", "NotGoverned")]


async def test_a_pod_whose_opt_in_label_is_taken_off_while_its_gate_is_closed_is_reopened() -> None:
    """The watch selects Pods by the opt-in label on the server: a Pod relabelled out of it
    leaves the watch (a DELETED event) and no pass would see it again, so its gate is opened
    as it leaves. A Pod deleted for real, or one whose gate is open, is left alone."""
    governed = {names.GOVERNED_LABEL: names.GOVERNED_VALUE, "app": "triton"}
    pods = GatePods({"ns": []})
    subject = dataclasses.replace(controller(ScriptedReconciler(), Recorder()), pods=pods)
    await subject.pod_left(namespace="ns", pod=gated_pod("opted-out", {"app": "triton"}, "False"))
    await subject.pod_left(namespace="ns", pod=gated_pod("deleted", governed, "False"))
    await subject.pod_left(namespace="ns", pod=gated_pod("open", {"app": "triton"}, "True"))
    terminating = gated_pod("terminating", {"app": "triton"}, "False")
    terminating["metadata"]["deletionTimestamp"] = "2026-11-27T22:00:00Z"
    await subject.pod_left(namespace="ns", pod=terminating)
    assert pods.opened == [("ns", "opted-out", "NotGoverned")]


async def test_the_operator_watches_only_pods_with_the_opt_in_label() -> None:
    """The label selector goes to the API server with every LIST and WATCH of Pods (kopf's
    watching settings), and to no other resource's."""
    settings = kopf.OperatorSettings()
    subject = controller(ScriptedReconciler(), Recorder())
    await handlers.configure(settings=settings, memo={"controller": subject})
    pods = kopf_references.Resource("", "v1", "pods", namespaced=True)
    policies = kopf_references.Resource(names.GROUP, "v1alpha1", names.PLURAL, namespaced=True)
    assert settings.watching.label_selectors.collect(pods) == ["batchpilot.dev/governed=true"]
    assert settings.watching.label_selectors.collect(policies) == []
    assert settings.watching.chunk_size == handlers.WATCH_PAGE_SIZE


def test_no_handler_makes_kopf_put_a_finalizer_on_a_policy() -> None:
    """After an uninstall, or while the operator is down, a finalizer would hold every deleted
    policy, and its namespace, until someone removed it by hand."""
    registry = kopf.get_default_registry()
    handlers_of_policies = [
        handler
        for kind in (registry._spawning, registry._changing)
        for handler in kind.get_all_handlers()
    ]
    assert any(handler.id == "reconcile" for handler in handlers_of_policies)
    assert [h.id for h in handlers_of_policies if h.requires_finalizer] == []


class SlowPass(ScriptedReconciler):
    """A pass that takes a minute, as a rollout waiting on a drain does."""

    async def reconcile(self, *, status: dict[str, Any], **kwargs: Any) -> reconciling.Reconciled:
        outcome = await super().reconcile(status=status, **kwargs)
        await asyncio.sleep(60)
        return outcome


@pytest.mark.looptime
async def test_a_deleted_policy_s_loop_ends_on_its_deleted_event_and_then_releases() -> None:
    """No finalizer lets kopf stop the loop first: the DELETED event ends it, cancelling a pass
    in progress after a second's grace, and only then are the gates opened."""
    reconciler = SlowPass()
    subject = controller(reconciler, Recorder(), interval=30)
    body = {
        "spec": spec_document(),
        "status": {},
        "metadata": {"generation": 1, "uid": "u-1"},
    }
    follow = asyncio.create_task(
        subject.follow(namespace="ns", name="fleet", body=body, stopped=Stopped())  # type: ignore[arg-type]
    )
    await asyncio.sleep(5)
    await subject.policy_deleted(namespace="ns", name="fleet", spec=spec_document(), uid="u-1")
    await asyncio.wait_for(follow, timeout=1)
    assert reconciler.released == [("ns", pytest.approx(6))]
    assert reconciler.forgotten == [("ns", "fleet")]
    assert subject.deleted == {}
    # kopf may start a loop for a policy whose first event it saw was DELETED: it ends at once.
    subject.deleted["u-2"] = None
    late = {**body, "metadata": {"generation": 1, "uid": "u-2"}}
    await asyncio.wait_for(
        subject.follow(namespace="ns", name="late", body=late, stopped=Stopped()),  # type: ignore[arg-type]
        timeout=1,
    )
    assert len(reconciler.calls) == 1


async def test_a_pod_left_closed_by_a_policy_deleted_while_no_operator_ran_is_reopened() -> None:
    """Without a finalizer the deletion does not wait for an operator: the Pod's gate stays
    False until the operator, listing the Pods as it starts, finds no policy selecting it."""
    pods = GatePods({"ns": []})
    subject = dataclasses.replace(controller(ScriptedReconciler(), Recorder()), pods=pods)
    index = {"ns": [("fleet", {"matchLabels": {"app": "triton"}})]}
    for pod in (
        gated_pod("orphaned", {"app": "moved"}, "False"),
        gated_pod("switching", {"app": "triton"}, "False"),  # its policy is switching it
        gated_pod("open", {"app": "moved"}, "True"),
    ):
        await subject.open_if_ungoverned(namespace="ns", pod=pod, index=index)  # type: ignore[arg-type]
    assert pods.opened == [("ns", "orphaned", "NotGoverned")]


class ClosingFleet:
    def __init__(self) -> None:
        self.closed_at: float | None = None

    async def close(self) -> None:
        self.closed_at = asyncio.get_running_loop().time()


@pytest.mark.looptime
async def test_closing_ends_the_passes_still_running_before_the_clients_close() -> None:
    """A deleted policy's loop is no longer kopf's to stop when the operator shuts down: its
    pass must not use the clients after they closed (seen in bench_scale: `cannot schedule new
    futures after shutdown`)."""
    reconciler = SlowPass()
    fleet = ClosingFleet()
    reconciler.fleet = fleet  # type: ignore[attr-defined]
    subject = controller(reconciler, Recorder(), interval=30)
    body = {"spec": spec_document(), "status": {}, "metadata": {"generation": 1, "uid": "u-1"}}
    follow = asyncio.create_task(
        subject.follow(namespace="ns", name="fleet", body=body, stopped=Stopped())  # type: ignore[arg-type]
    )
    await asyncio.sleep(5)
    await subject.close()
    assert follow.done()
    assert fleet.closed_at == pytest.approx(6)
