"""The alerts: every rule, with what it means and what to check, in one table.

Prometheus (the chart's PrometheusRule) and Grafana alerting both take their rules from `ALERTS`
(`rendering` writes them in each one's format), so a threshold changes in one place and the two
cannot disagree. `charts/batchpilot/tests/alerts_test.yaml` shows each rule firing and staying
silent (`promtool test rules`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from batchpilot import telemetry
from batchpilot.api.v1alpha1 import specs
from batchpilot_charts import queries

Severity = Literal["critical", "warning", "info"]


@dataclass(frozen=True, kw_only=True)
class Alert:
    name: str
    expr: str
    for_: str | None
    """How long the expression must hold before the alert fires; None fires at once."""
    severity: Severity
    summary: str
    description: str
    runbook: tuple[str, ...]
    """What to check, step by step."""
    panel: str
    """The title of the dashboard panel to look at first (Grafana links the alert to it)."""

    def runbook_text(self) -> str:
        return "\n".join(f"{number}. {step}" for number, step in enumerate(self.runbook, 1))


_ACTIVE = f"{telemetry.ACTIVE_PROFILE} == 1"
_BY = queries.POLICY_LABELS
_POLICY = (
    f"{{{{ with $labels.{telemetry.POLICY_NAMESPACE} }}}}{{{{ . }}}}/{{{{ end }}}}"
    f"{{{{ $labels.{telemetry.POLICY} }}}}"
)
"""The policy an alert is about, as namespace/name (a standalone runner's may lack the first)."""
# Go template pieces the texts below share (Prometheus and Grafana both render them).
_PROFILE = "{{ $labels.profile }}"
_REASON = "{{ $labels.reason }}"
_STATE = "{{ $labels.state }}"
_VALUE = "{{ $value }}"
_VALUE_HUMANIZED = "{{ $value | humanize }}"
_DESCRIBE = f"`kubectl -n <{telemetry.POLICY_NAMESPACE}> describe bp <policy>`"
_EVENTS = f"`kubectl -n <{telemetry.POLICY_NAMESPACE}> get events --field-selector"
_THROUGHPUT: specs.ProfileRole = "throughput"
_SIGNALS_MISSING = f"{telemetry.SIGNALS_UNAVAILABLE} == 1"

ALERTS: tuple[Alert, ...] = (
    Alert(
        name="BatchpilotSloBreached",
        panel="p95 latency against the objective",
        # A stale latency reading (signals missing) is that alert's business, not this one's.
        # The profile label comes from the profile in force (topk: one, even if a replica that
        # lost the lead still reports another).
        expr=(
            f"(\n  {queries.by_policy(queries.signal('p95LatencyMs'))} / 1000\n"
            f"  > on ({_BY}) {queries.by_policy(telemetry.SLO_P95_LATENCY)}\n"
            f"  unless on ({_BY}) {queries.by_policy(_SIGNALS_MISSING)}\n)\n"
            f"* on ({_BY}) group_left (profile) topk by ({_BY}) (\n"
            f"  1, max by ({_BY}, profile) ({_ACTIVE})\n)"
        ),
        for_="10m",
        severity="critical",
        summary=f"{_POLICY} misses its p95 latency objective in {_PROFILE}",
        description=(
            f"The fleet of policy {_POLICY} has answered with a p95 latency of "
            "{{ $value | humanizeDuration }} for 10 minutes, above spec.slo.p95LatencyMs, while "
            "{{ $labels.profile }} (a profile the objective governs, typically interactive) is "
            "in force."
        ),
        runbook=(
            f"{_DESCRIBE}: status.reason says why the profile is in force; a "
            "True SignalsUnavailable condition puts the latency reading itself in doubt.",
            "On the dashboard, compare the queue delay in force with the measured queue wait "
            "and the request rate. With slo.autotune the delay follows the sidecar's "
            "recommendation: `curl http://<pod-ip>:9400/status?sloP95Ms=<objective>` shows it "
            "and the fitted step time.",
            "A queue wait near zero with a high latency means the model is compute-bound: "
            "scale the Triton Deployment, or lower the profile's maxBatchSize and "
            "preferredBatchSizes.",
            "For immediate relief, set spec.override to a lower-latency profile with an `until`.",
        ),
    ),
    Alert(
        name="BatchpilotApplyFailures",
        panel="Apply latency",
        # Controllers export these counters from zero, so `increase` sees the first failure.
        expr=f"sum by ({_BY}, reason) (increase({telemetry.APPLY_ERRORS}[15m])) > 0",
        for_=None,
        severity="warning",
        summary=f"Applying a profile of {_POLICY} failed ({_REASON})",
        description=(
            f"batchpilot failed to apply a profile of policy {_POLICY} to a Triton "
            "server in the last 15 minutes (reason {{ $labels.reason }}). A configuration "
            "Triton rejects is rolled back to the previous one, so the server keeps serving."
        ),
        runbook=(
            f"{_EVENTS} reason=ApplyFailed` (and reason=RolledBack) "
            "names the pod and quotes Triton's error.",
            "explicit_mode_required: start tritonserver with --model-control-mode=explicit. "
            "refused: the profile asks for more than the model allows (a maxBatchSize above "
            "the model's own, preferred sizes above the cap); fix the profile. "
            "rejected, RolledBack: Triton refused the configuration; its log says why. "
            "rollback_failed: the model may be unloaded; check "
            "`curl http://<pod-ip>:8000/v2/models/<model>/ready` and load it again.",
            "batchpilot retries on every tick; the alert clears 15 minutes after the last failure.",
        ),
    ),
    Alert(
        name="BatchpilotDrainIneffective",
        panel="p95 latency against the objective",
        expr=f"sum by ({_BY}) (increase({telemetry.DRAINS_INEFFECTIVE}[1h])) > 0",
        for_=None,
        severity="warning",
        summary=f"{_POLICY}: Pods kept receiving requests while drained",
        description=(
            f"In the last hour a Pod of policy {_POLICY} kept receiving requests for all of "
            "rollout.drainTimeoutSeconds after the readiness gate took it out of its Services, "
            "and the reload went ahead with them still coming, stalling some. Its "
            "clients hold connections to the Pod (HTTP keep-alive, gRPC channels) rather than "
            "following the Service's endpoints."
        ),
        runbook=(
            f"{_EVENTS} reason=DrainIneffective` names the Pods and "
            "how many requests arrived; the policy's DrainIneffective condition says the same.",
            "Clients inside the cluster: make them follow endpoints (an endpoint-aware client, "
            "a service mesh, gRPC with xDS or a headless Service and client-side balancing), or "
            "cap connection lifetime (tritonclient.http: a new client per request or a short "
            "keep-alive; gRPC: keepalive and max connection age on the server side).",
            "If clients cannot change, expect the reload's stall on those requests: keep "
            "queue-timeout policies off the profiles, and keep rollout.maxUnavailable at 1.",
        ),
    ),
    Alert(
        name="BatchpilotCanaryRolledBack",
        panel="Profile switches",
        expr=(
            f"sum by ({_BY}) "
            f'(increase({telemetry.CANARY_VERDICTS}{{verdict="rolled_back"}}[1h])) > 0'
        ),
        for_=None,
        severity="warning",
        summary=f"{_POLICY}: new settings failed their canary and were rolled back",
        description=(
            f"In the last hour policy {_POLICY} tried new settings on its canary replicas "
            "(spec.rollout.canary) and rolled them back: they served worse than the other "
            "replicas. The fleet keeps the settings it served, and those settings are not "
            "tried again until the spec changes."
        ),
        runbook=(
            f"{_EVENTS} reason=CanaryRolledBack` and the policy's status.canary say which "
            "profile's settings failed, on which replicas, and by how much (failure rate, p95 "
            "and p99 against the other replicas).",
            "Compare the profile with the settings the fleet serves (status.settings.served): "
            "a longer queue delay, larger preferred batch sizes or a queue policy that rejects "
            "is the usual cause.",
            "Fix the profile and apply it: a new spec generation gets a canary of its own. If "
            "the verdict was wrong (a noisy replica, too little traffic), raise "
            "rollout.canary.minRequests or analysisSeconds, or the limit it broke.",
        ),
    ),
    Alert(
        name="BatchpilotProfileFlapping",
        panel="Profile switches",
        expr=f"sum by ({_BY}) (increase({telemetry.PROFILE_SWITCHES}[1h])) > 6",
        for_=None,
        severity="warning",
        summary=f"{_POLICY} switched profiles {_VALUE_HUMANIZED} times in an hour",
        description=(
            f"Policy {_POLICY} switched profiles more than 6 times in the last hour. "
            "Every switch reloads the model on every replica, which drains or stalls it."
        ),
        runbook=(
            f"The ProfileSwitched events ({_EVENTS} "
            "reason=ProfileSwitched`) show which rule keeps flipping.",
            "For a load rule, widen its hysteresis (a `below` well under `above`) and lengthen "
            "its `for`.",
            "Raise spec.minDwellSeconds: no switch happens before the profile in force has "
            "lasted that long (overrides excepted).",
        ),
    ),
    Alert(
        name="BatchpilotTargetsFailed",
        panel="Targets",
        expr=(f'max by ({_BY}, state) ({telemetry.TARGETS}{{state=~"failed|unreachable"}}) > 0'),
        for_="5m",
        severity="warning",
        summary=f"{_VALUE} targets of {_POLICY} are {_STATE}",
        description=(
            f"{_VALUE} Triton servers governed by policy {_POLICY} have been "
            "{{ $labels.state }} for 5 minutes and do not run the decided profile."
        ),
        runbook=(
            f"{_DESCRIBE}: the Degraded condition and status.targets name "
            "each failing pod and its error.",
            "unreachable: is the pod Running with an IP, and does Triton answer on the target "
            "port (`curl http://<pod-ip>:8000/v2/health/ready`)? NetworkPolicies must let the "
            "operator in.",
            "failed: BatchpilotApplyFailures gives the reason.",
        ),
    ),
    Alert(
        name="BatchpilotTargetsDrifted",
        panel="Targets",
        expr=f'max by ({_BY}) ({telemetry.TARGETS}{{state="pending"}}) > 0',
        for_="15m",
        severity="warning",
        summary=f"{_VALUE} targets of {_POLICY} lag behind the decided profile",
        description=(
            f"{_VALUE} Triton servers of policy {_POLICY} have not run the decided "
            "profile for 15 minutes: the rollout halted after rollout.maxUnavailable failures "
            "and left them on their previous configuration."
        ),
        runbook=(
            "Fix the failing targets first (BatchpilotTargetsFailed): a rollout stops once "
            "maxUnavailable replicas fail, and goes on at the next tick after they recover.",
            f"{_DESCRIBE}: the Progressing condition says RolloutPending and "
            "status.targets lists the pending pods.",
        ),
    ),
    Alert(
        name="BatchpilotOperatorDown",
        panel="Active profile",
        expr=f'absent(up{{job="{queries.OPERATOR_JOB}"}} == 1)',
        for_="5m",
        severity="critical",
        summary="No batchpilot operator is up",
        description=(
            "Prometheus has scraped no running batchpilot operator "
            f"(job {queries.OPERATOR_JOB}) for 5 minutes. Triton servers keep their "
            "configuration, but no schedule, load rule or override takes effect and no drift is "
            "repaired."
        ),
        runbook=(
            "`kubectl -n batchpilot-system get pods,events`: crash loops, image pulls, scheduling.",
            "`kubectl -n batchpilot-system logs deploy/batchpilot-operator`: API errors name a "
            "missing permission or CRD.",
            "If the operator runs but is not scraped: the ServiceMonitor must match the "
            "metrics Service and be selected by your Prometheus (serviceMonitor.labels); "
            f"other scrape setups must name the job {queries.OPERATOR_JOB}.",
        ),
    ),
    Alert(
        name="BatchpilotSignalsUnavailable",
        panel="Request rate",
        expr=queries.by_policy(_SIGNALS_MISSING),
        for_="10m",
        severity="warning",
        summary=f"{_POLICY} decides without its load signals",
        description=(
            f"For 10 minutes the decisions of policy {_POLICY} have lacked a load "
            "signal its rules need: the sidecars or Prometheus did not answer, or did not "
            "measure it. Load rules keep their last state for a grace period, then the "
            "schedule decides; SLO autotune keeps the last tuned delay."
        ),
        runbook=(
            f"{_DESCRIBE}: the SignalsUnavailable condition lists each "
            "problem (which sidecar, which query).",
            "spec.load.source sidecar: is the sidecar container running, and does "
            "`curl http://<pod-ip>:9400/status` answer? It reports the health of each of its "
            "sources (Triton's metrics, its statistics, the GPU).",
            "spec.load.source prometheus: check spec.load.prometheus.url from the operator's "
            "namespace.",
            "p95LatencyMs needs tritonserver's --metrics-config summary_latencies=true.",
        ),
    ),
    Alert(
        name="BatchpilotGpuUnderusedInThroughput",
        panel="GPU utilization",
        # Which profile trades latency for throughput is the policy's to say (its role, declared
        # or implied by the longest queue delay), so no profile name is written here. The
        # profile in force is chosen as for BatchpilotSloBreached, then kept only if the policy
        # gives it the throughput role.
        expr=(
            f"(\n  {queries.by_policy(queries.signal('gpuUtilization'))} < 30\n)\n"
            f"* on ({_BY}) group_left (profile) (\n"
            f"  topk by ({_BY}) (1, max by ({_BY}, profile) ({_ACTIVE}))\n"
            f"  and on ({_BY}, profile)\n"
            f'  {telemetry.PROFILE_ROLE}{{role="{_THROUGHPUT}"}} == 1\n)'
        ),
        for_="30m",
        severity="info",
        summary=(
            f"{_POLICY} runs its throughput profile {_PROFILE} with its "
            "GPUs {{ $value | humanize }}% busy"
        ),
        description=(
            f"Policy {_POLICY} has been in {_PROFILE}, a profile whose role "
            "is throughput, for 30 minutes while its GPUs were less than 30% busy: requests wait "
            "for big batches the load does not fill, paying latency for efficiency nobody needs."
        ),
        runbook=(
            "Compare the request rate with the average batch size on the dashboard: at this "
            "rate a shorter queue delay makes the same batches.",
            "Enable spec.slo.autotune for that profile, or lower its maxQueueDelayMicroseconds.",
            "If the schedule decides that profile, add a load rule that keeps a latency profile "
            "while the rate is low.",
            "The role comes from spec.profiles.<name>.role, else from the queue delay (the "
            "profile with the strictly longest one is the throughput profile); controllers "
            f"export it as {telemetry.PROFILE_ROLE}. Declare `role: latency` on a profile that "
            "should not be held to this.",
        ),
    ),
)
