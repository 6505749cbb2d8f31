"""The BatchPolicy API (`batchpilot.dev/v1alpha1`) as typed, immutable Python objects.

These models are the one source of truth for the API: `batchpilot.api.crds` renders
`crds/batchpolicy.yaml` from them (every attribute docstring becomes the field's description in
`kubectl explain`, every constraint becomes an OpenAPI check, every cross-field rule a CEL rule),
and the operator, the standalone runner and `batchpilot explain` parse policies with them.
Field names are camelCase on the wire and snake_case in Python.
"""

from __future__ import annotations

import datetime
import re
import zoneinfo
from collections.abc import Callable
from functools import cached_property
from typing import Annotated, Any, ClassVar, Literal, get_args

import pydantic
import pydantic_core
from pydantic import AwareDatetime, ConfigDict, Field
from pydantic.alias_generators import to_camel

from batchpilot.api import calendar_names, durations, validations
from batchpilot_triton import endpoints, repositories

MAX_QUEUE_DELAY_MICROSECONDS = 60_000_000
MAX_BATCH_SIZE = 4096
PROFILE_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"

Weekday = Literal["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
WEEKDAYS: tuple[Weekday, ...] = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
ProfileRole = Literal["latency", "throughput"]
LoadMetric = Literal[
    "queueDepth",
    "requestRate",
    "p95LatencyMs",
    "queueTimeMs",
    "gpuUtilization",
    "ttftP95Ms",
    "interTokenP95Ms",
    "outputTokensPerSecond",
    "waitingSequences",
]
LOAD_METRICS: tuple[LoadMetric, ...] = get_args(LoadMetric)

BatchSize = Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)]
QueueDelay = Annotated[int, Field(ge=0, le=MAX_QUEUE_DELAY_MICROSECONDS)]
LocalTime = Annotated[str, Field(max_length=5, pattern=r"^([01][0-9]|2[0-3]):[0-5][0-9]$")]
LocalEndTime = Annotated[
    str, Field(max_length=5, pattern=r"^(([01][0-9]|2[0-3]):[0-5][0-9]|24:00)$")
]
# A reference to one of spec.profiles; bounded so the API server can cost the CEL rules.
ProfileRef = Annotated[str, Field(min_length=1, max_length=63)]
Duration = Annotated[str, Field(min_length=2, max_length=32, pattern=durations.DURATION_PATTERN)]
LeadTime = Annotated[
    str,
    Field(
        min_length=2,
        max_length=32,
        pattern=r"^(auto|([0-9]+h)?([0-9]+m)?([0-9]+s)?)$",
    ),
]
PortRef = Annotated[int | str, Field(json_schema_extra={"x-kubernetes-int-or-string": True})]
PORT_NAME_PATTERN = "^[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?$"
"""A container port's name: an IANA service name, at most 15 characters."""


def _port_rule(field: str) -> Callable[[Any], bool]:
    """Whether an object's `field` is a port reference, as a cross-field rule's predicate."""
    return lambda holder: _port_reference(getattr(holder, field))


def _port_reference(port: int | str) -> bool:
    """A port number (1 to 65535, also written as a string) or a container port's name."""
    if isinstance(port, str) and re.fullmatch("[0-9]{1,5}", port):
        port = int(port)
    if isinstance(port, int):
        return 1 <= port <= 65535
    return re.fullmatch(PORT_NAME_PATTERN, port) is not None


def _cel_rules_into_schema(schema: dict[str, Any], model: type[Any]) -> None:
    rules = getattr(model, "cross_field_rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [rule.as_cel_validation() for rule in rules]


SignalSourceKind = Literal["sidecar", "triton", "prometheus"]


class Model(pydantic.BaseModel):
    """Base of every API object: immutable, camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        use_attribute_docstrings=True,
        json_schema_extra=_cel_rules_into_schema,
    )

    cross_field_rules: ClassVar[tuple[validations.CrossFieldRule, ...]] = ()

    @pydantic.model_validator(mode="after")
    def _check_cross_field_rules(self) -> Model:
        for rule in self.cross_field_rules:
            if not rule.holds(self):
                raise pydantic_core.PydanticCustomError(
                    "cross_field",
                    rule.message,
                    {"field_path": rule.field_path or ""},
                )
        return self


class QueuePolicy(Model):
    """How Triton treats queued requests: timeouts and the queue's bound."""

    timeout_action: Literal["REJECT", "DELAY"] = "REJECT"
    """What happens to a request that times out in the queue: REJECT fails it, DELAY lets it
    wait behind requests that have not timed out."""
    default_timeout_microseconds: Annotated[int, Field(ge=0)] = 0
    """Queue timeout for requests that do not set their own; 0 means no timeout."""
    allow_timeout_override: bool = False
    """Whether a request may set a shorter timeout of its own."""
    max_queue_size: Annotated[int, Field(ge=0, le=4_294_967_295)] = 0
    """Requests beyond this many queued are rejected at once; 0 means unbounded."""


class PriorityQueuePolicy(QueuePolicy):
    """A queue policy for one priority level."""

    priority_level: Annotated[int, Field(ge=1)]
    """The priority level (1 is highest) this policy applies to."""


class LlmEngine(Model):
    """The batching knobs of an LLM engine behind Triton, which batches continuously inside the
    engine instead of in Triton's dynamic batcher. For Triton's vLLM backend they become engine
    arguments in the model's `model.json` (max_num_seqs, max_num_batched_tokens,
    enable_chunked_prefill); for its TensorRT-LLM backend, config parameters
    (enable_chunked_context, batch_scheduler_policy, max_tokens_in_paged_kv_cache). A field left
    out keeps the model's own value; a field the model's backend has no setting for is refused."""

    max_num_seqs: Annotated[int, Field(ge=1, le=repositories.MAX_NUM_SEQS)] | None = None
    """How many sequences the engine runs at once (vLLM max_num_seqs; vLLM only: TensorRT-LLM
    fixes it when the engine is built). Fewer keeps inter-token latency low; more raises output
    tokens per second."""
    max_num_batched_tokens: (
        Annotated[int, Field(ge=1, le=repositories.MAX_NUM_BATCHED_TOKENS)] | None
    ) = None
    """How many tokens one engine step may process (vLLM max_num_batched_tokens; vLLM only:
    TensorRT-LLM fixes it when the engine is built). Small values with chunked prefill keep long
    prompts from stalling the running sequences."""
    chunked_prefill: bool | None = None
    """Split long prompts into chunks that share steps with decoding sequences (vLLM
    enable_chunked_prefill, TensorRT-LLM enable_chunked_context; a TensorRT-LLM engine must be
    built with use_paged_context_fmha for it)."""
    batch_scheduler_policy: Literal["maxUtilization", "guaranteedNoEvict"] | None = None
    """How the engine admits requests (TensorRT-LLM only, batch_scheduler_policy):
    maxUtilization packs as many as fit each step and may pause some when the KV cache runs out
    (more throughput); guaranteedNoEvict starts a request only if it can run to the end (the
    backend's default)."""
    max_tokens_in_paged_kv_cache: Annotated[int, Field(ge=1, le=2_147_483_647)] | None = None
    """A cap on the KV cache in tokens (TensorRT-LLM only, max_tokens_in_paged_kv_cache); the
    cache is the smaller of this and what kv_cache_free_gpu_mem_fraction allows. A smaller cache
    bounds how many long sequences run together."""

    cross_field_rules = (
        validations.CrossFieldRule(
            cel="!has(self.maxNumSeqs) || !has(self.maxNumBatchedTokens)"
            " || self.maxNumBatchedTokens >= self.maxNumSeqs",
            message="maxNumBatchedTokens must be at least maxNumSeqs: every running sequence "
            "needs one token of each step",
            field_path=".maxNumBatchedTokens",
            holds=lambda e: (
                e.max_num_seqs is None
                or e.max_num_batched_tokens is None
                or e.max_num_batched_tokens >= e.max_num_seqs
            ),
        ),
        validations.CrossFieldRule(
            cel="!(has(self.maxNumSeqs) || has(self.maxNumBatchedTokens))"
            " || !(has(self.batchSchedulerPolicy) || has(self.maxTokensInPagedKvCache))",
            message="maxNumSeqs and maxNumBatchedTokens (vLLM only) cannot be combined with "
            "batchSchedulerPolicy and maxTokensInPagedKvCache (TensorRT-LLM only): no model's "
            "backend could take the profile",
            field_path=".batchSchedulerPolicy",
            holds=lambda e: (
                (e.max_num_seqs is None and e.max_num_batched_tokens is None)
                or (e.batch_scheduler_policy is None and e.max_tokens_in_paged_kv_cache is None)
            ),
        ),
    )

    def engine_arguments(self) -> dict[str, Any]:
        """The fields set, under vLLM's engine-argument names."""
        named = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enable_chunked_prefill": self.chunked_prefill,
        }
        return {name: value for name, value in named.items() if value is not None}


class Profile(Model):
    """One batching configuration, rendered into the model's `dynamic_batching` message, or for
    an LLM engine behind Triton into its engine arguments (`llm`).

    A profile owns the whole `dynamic_batching` message: a field left out takes Triton's default,
    so switching between profiles never depends on which profile was applied before."""

    max_queue_delay_microseconds: QueueDelay = 0
    """How long Triton may hold a request to build a bigger batch (0..60,000,000 µs; Triton's
    default is 0)."""
    preferred_batch_sizes: Annotated[
        list[BatchSize],
        Field(max_length=16, json_schema_extra={"x-kubernetes-list-type": "set"}),
    ] = []
    """Batch sizes Triton dispatches as soon as it can form them (1..4096 each)."""
    max_batch_size: BatchSize | None = None
    """Caps the model's max_batch_size while the profile is active; never above the model's own.
    When absent the model's own max_batch_size is used."""
    preserve_ordering: bool | None = None
    """Return responses in the order requests arrived."""
    priority_levels: Annotated[int, Field(ge=1, le=255)] | None = None
    """Number of priority levels; requests with a higher level (smaller number) go first."""
    default_priority_level: Annotated[int, Field(ge=1, le=255)] | None = None
    """Priority level of requests that do not set one; needs priorityLevels."""
    queue_policy: QueuePolicy | None = None
    """Queue policy for all priority levels without one of their own (default_queue_policy)."""
    priority_queue_policy: Annotated[
        list[PriorityQueuePolicy],
        Field(
            max_length=255,
            json_schema_extra={
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["priorityLevel"],
            },
        ),
    ] = []
    """Queue policies for individual priority levels."""
    llm: LlmEngine | None = None
    """Engine settings for the LLM models the policy governs (Triton's vLLM and TensorRT-LLM
    backends). A model served by an LLM engine takes only these; the dynamic-batching fields
    apply to the others."""
    role: ProfileRole | None = None
    """What the profile is for: latency (answers fast, e.g. interactive) or throughput (spends
    latency on device efficiency, e.g. bulk). Alerts and dashboards group profiles by it. When
    absent, the profile with the longest maxQueueDelayMicroseconds of the policy is the
    throughput profile (if no other has as long a delay) and the others are latency profiles."""

    cross_field_rules = (
        validations.CrossFieldRule(
            cel="!has(self.maxBatchSize) || !has(self.preferredBatchSizes)"
            " || self.preferredBatchSizes.all(b, b <= self.maxBatchSize)",
            message="every preferred batch size must be at most maxBatchSize",
            field_path=".preferredBatchSizes",
            holds=lambda p: (
                p.max_batch_size is None
                or all(size <= p.max_batch_size for size in p.preferred_batch_sizes)
            ),
        ),
        validations.CrossFieldRule(
            cel="!has(self.priorityLevels) || has(self.defaultPriorityLevel)",
            message="priorityLevels needs defaultPriorityLevel: Triton must know the level of "
            "requests that set none",
            field_path=".defaultPriorityLevel",
            holds=lambda p: p.priority_levels is None or p.default_priority_level is not None,
        ),
        validations.CrossFieldRule(
            cel="!has(self.defaultPriorityLevel)"
            " || (has(self.priorityLevels) && self.defaultPriorityLevel <= self.priorityLevels)",
            message="defaultPriorityLevel needs priorityLevels and must be at most priorityLevels",
            field_path=".defaultPriorityLevel",
            holds=lambda p: (
                p.default_priority_level is None
                or (p.priority_levels is not None and p.default_priority_level <= p.priority_levels)
            ),
        ),
        validations.CrossFieldRule(
            cel="!has(self.priorityQueuePolicy) || size(self.priorityQueuePolicy) == 0"
            " || (has(self.priorityLevels)"
            " && self.priorityQueuePolicy.all(q, q.priorityLevel <= self.priorityLevels))",
            message="every priorityQueuePolicy level needs priorityLevels and must be at most it",
            field_path=".priorityQueuePolicy",
            holds=lambda p: all(
                p.priority_levels is not None and q.priority_level <= p.priority_levels
                for q in p.priority_queue_policy
            ),
        ),
    )


LabelValue = Annotated[str, Field(max_length=63)]
"""A label's value, as Kubernetes bounds it."""


class LabelSelectorRequirement(Model):
    """A label selector requirement, as in Kubernetes label selectors."""

    key: Annotated[str, Field(min_length=1, max_length=317)]
    """The label key."""
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    """How the key relates to the values."""
    values: Annotated[list[LabelValue], Field(max_length=64)] = []
    """Values for In and NotIn; empty for Exists and DoesNotExist."""


class LabelSelector(Model):
    """Selects Pods by label, as in a Deployment's selector."""

    match_labels: Annotated[dict[str, LabelValue], Field(max_length=16)] = {}
    """Labels a Pod must carry, all of them (at most 16)."""
    match_expressions: Annotated[list[LabelSelectorRequirement], Field(max_length=16)] = []
    """Requirements a Pod must meet, all of them."""

    cross_field_rules = (
        validations.CrossFieldRule(
            cel="!has(self.matchLabels) || self.matchLabels.all(k, size(k) <= 317)",
            message="a matchLabels key is at most 317 characters (a prefix of 253 and a name "
            "of 63)",
            field_path=".matchLabels",
            holds=lambda s: all(len(key) <= 317 for key in s.match_labels),
        ),
    )


DEFAULT_REPOSITORY_HEADER = "batchpilot-repository-token"
REPOSITORY_HEADER_PATTERN = r"^(batchpilot|triton)-[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
"""No standard or hop-by-hop header starts with either prefix."""


class RepositoryCredential(Model):
    """The credential of a Triton whose model-repository API is restricted
    (`--http-restricted-api=model-repository:<header>=<value>` and
    `--grpc-restricted-protocol=model-repository:<header>=<value>`): a header the operator sends
    on every repository call (index, load, unload), its value read from a Secret in the
    policy's own namespace."""

    secret_name: Annotated[
        str,
        Field(
            min_length=1,
            max_length=253,
            pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        ),
    ]
    """The Secret, in the policy's namespace, that holds the header's value. The operator may
    read only the Secrets its installation names (the chart's
    `repositoryCredentials.secretNames`)."""
    key: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")] = "token"
    """The Secret's data key that holds the value."""
    header: Annotated[
        str, Field(min_length=1, max_length=64, pattern=REPOSITORY_HEADER_PATTERN)
    ] = DEFAULT_REPOSITORY_HEADER
    """The header's name, lower case (gRPC metadata keys are): the `<header>` in Triton's
    restricted-API flags. It starts with `batchpilot-` or `triton-`, so it is never a header
    that HTTP or a proxy acts on (Content-Length, Expect, Host, Connection, ...): a server
    that chokes on such a header may quote it, value and all, in its error answer."""


class Target(Model):
    """Which Triton servers and models the policy governs."""

    selector: LabelSelector
    """Triton Pods in the policy's namespace that the policy governs."""
    port: PortRef = 8000
    """Triton's HTTP port on each Pod, by number or by container port name."""
    sidecar_port: PortRef = endpoints.SIDECAR_PORT
    """The batchpilot sidecar's port on each Pod, by number or name (load signals, SLO fit)."""
    models: Annotated[
        list[
            Annotated[
                str,
                Field(min_length=1, max_length=253, pattern=repositories.MODEL_NAME_PATTERN),
            ]
        ],
        Field(max_length=64, json_schema_extra={"x-kubernetes-list-type": "set"}),
    ] = []
    """Names of the Triton models to govern (as the model repository's directories name them:
    letters, digits, '_', '.', '-'); empty means every model the server has loaded."""
    repository_credential: RepositoryCredential | None = None
    """The credential for Triton servers whose model-repository API is restricted to a header
    (recommended: an open repository API lets anything that reaches Triton load code into it).
    Without it, no header is sent."""

    cross_field_rules = (
        validations.CrossFieldRule(
            cel="(has(self.selector.matchLabels) && size(self.selector.matchLabels) > 0)"
            " || (has(self.selector.matchExpressions)"
            " && self.selector.matchExpressions.exists(e, e.operator in ['In', 'Exists']))",
            message="selector needs matchLabels or a matchExpressions requirement with In or "
            "Exists: an empty selector, or NotIn and DoesNotExist alone, would select every Pod "
            "of the namespace that lacks a label, future ones included",
            field_path=".selector",
            holds=lambda t: bool(
                t.selector.match_labels
                or any(e.operator in ("In", "Exists") for e in t.selector.match_expressions)
            ),
        ),
        *(
            validations.CrossFieldRule(
                cel=f"!has(self.{field}) || (type(self.{field}) == int"
                f" ? self.{field} >= 1 && self.{field} <= 65535"
                f" : self.{field}.matches('^[0-9]{{1,5}}$')"
                f" ? int(self.{field}) >= 1 && int(self.{field}) <= 65535"
                f" : self.{field}.matches('{PORT_NAME_PATTERN}'))",
                message=f"{field} is a port number (1 to 65535) or a container port's name "
                "(at most 15 lower-case letters, digits and '-')",
                field_path=f".{field}",
                holds=_port_rule(name),
            )
            for field, name in (("port", "port"), ("sidecarPort", "sidecar_port"))
        ),
    )


class Window(Model):
    """A weekly window in which a profile applies, in the schedule's time zone."""

    profile: ProfileRef
    """The profile that applies inside the window; must name one of spec.profiles."""
    days: Annotated[
        list[Weekday],
        Field(min_length=1, max_length=7, json_schema_extra={"x-kubernetes-list-type": "set"}),
    ] = list(WEEKDAYS)
    """Days the window starts on (Mon..Sun); a window that crosses midnight belongs to the day it
    starts. Defaults to every day."""
    start: LocalTime
    """Local start time, HH:MM (24-hour clock)."""
    end: LocalEndTime
    """Local end time, HH:MM or 24:00. An end at or before the start crosses midnight."""

    @pydantic.field_validator("start", "end", mode="before")
    @classmethod
    def _quoted_time(cls, value: Any) -> Any:
        if isinstance(value, int):
            raise ValueError(
                f'write times in quotes, e.g. "16:00" (unquoted, YAML 1.1 reads 16:00 as the '
                f"number {value})"
            )
        return value

    @property
    def length_seconds(self) -> int:
        """How long the window lasts on a day without a clock change."""

        def minutes(hhmm: str) -> int:
            hours, mins = hhmm.split(":")
            return int(hours) * 60 + int(mins)

        length = minutes(self.end) - minutes(self.start)
        return 60 * (length if length > 0 else length + 24 * 60)

    cross_field_rules = (
        validations.CrossFieldRule(
            cel="self.start != self.end",
            message="end must differ from start",
            field_path=".end",
            holds=lambda w: w.start != w.end,
        ),
    )


class Schedule(Model):
    """When each profile applies by the clock: weekly windows, exception dates and an optional
    exchange calendar."""

    timezone: Annotated[str, Field(min_length=1, max_length=64)] = "UTC"
    """IANA time zone of the windows and exception dates, e.g. America/New_York."""
    calendar: Annotated[str, Field(min_length=1, max_length=32)] | None = None
    """Exchange calendar, e.g. XNYS. When set, a window applies only inside that day's trading
    session: not on holidays, and only until an early close."""
    windows: Annotated[list[Window], Field(max_length=64)] = []
    """Windows in order of precedence: the first that covers an instant wins."""
    exceptions: Annotated[
        list[datetime.date],
        Field(max_length=1000, json_schema_extra={"x-kubernetes-list-type": "set"}),
    ] = []
    """Local dates (YYYY-MM-DD) on which no window starts."""
    lead_time: LeadTime = "auto"
    """How early a scheduled change into a latency profile starts rolling out, so that the
    profile is in force on every replica at the window's start: `auto` (the policy's own
    measured switch time per replica, times the waves its replicas need, plus a margin; a
    conservative estimate until a rollout was measured), a duration such as 45s or 2m, or 0s
    (change at the boundary). Only a change from a throughput profile to a latency profile
    starts early; leaving a latency profile never happens before its window ends. A duration
    may not be longer than any window."""

    cross_field_rules = (
        validations.CrossFieldRule(
            cel="self.leadTime == 'auto' || !has(self.windows) || self.windows.all(w, "
            "duration(self.leadTime) <= (w.end == '24:00' ? timestamp('2000-01-02T00:00:00Z') "
            ": timestamp('2000-01-01T' + w.end + ':00Z')) - timestamp('2000-01-01T' + w.start "
            "+ ':00Z') + (w.end != '24:00' && w.end <= w.start ? duration('24h') "
            ": duration('0s')))",
            message="leadTime must be auto, or at most the length of the shortest window",
            field_path=".leadTime",
            holds=lambda schedule: (
                schedule.lead_time == "auto"
                or all(
                    durations.parse_duration(schedule.lead_time) <= window.length_seconds
                    for window in schedule.windows
                )
            ),
        ),
    )

    @pydantic.field_validator("timezone")
    @classmethod
    def _known_timezone(cls, name: str) -> str:
        try:
            zoneinfo.ZoneInfo(name)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {name!r} (use an IANA name such as UTC)") from None
        return name

    @pydantic.field_validator("calendar")
    @classmethod
    def _known_calendar(cls, name: str | None) -> str | None:
        if name is None:
            return name
        try:
            known = calendar_names.is_known(name)
        except calendar_names.CalendarsUnavailable as error:
            raise ValueError(f"calendar {name!r}: {error}") from None
        if not known:
            raise ValueError(f"unknown exchange calendar {name!r} (for example XNYS, XLON)")
        return name

    @cached_property
    def zone(self) -> zoneinfo.ZoneInfo:
        return zoneinfo.ZoneInfo(self.timezone)


class LoadRule(Model):
    """Switch to a profile while a load signal stays high."""

    profile: ProfileRef
    """The profile that applies while the rule holds; must name one of spec.profiles."""
    metric: LoadMetric
    """The signal, aggregated over all governed replicas and models: queueDepth (pending
    requests, summed), requestRate (requests/s, summed), p95LatencyMs (worst replica),
    queueTimeMs (average queue time per request), gpuUtilization (percent, averaged). For
    models served by an LLM engine that exports its metrics (Triton's vLLM backend with
    REPORT_CUSTOM_METRICS): ttftP95Ms (time to first token p95, worst replica), interTokenP95Ms
    (time between tokens p95, worst replica), outputTokensPerSecond (tokens generated per
    second, summed) and waitingSequences (sequences waiting for the engine, summed)."""
    above: float
    """The rule starts to hold once the metric has stayed above this for the `for` duration."""
    below: float | None = None
    """Once holding, the rule lets go when the metric has stayed below this for the `for`
    duration; defaults to `above`. Must be at most `above`."""
    hold_for: Duration = Field("0s", alias="for")
    """How long the metric must stay past a threshold before the rule changes state, e.g. 60s."""

    cross_field_rules = (
        validations.CrossFieldRule(
            cel="!has(self.below) || self.below <= self.above",
            message="below must be at most above",
            field_path=".below",
            holds=lambda r: r.below is None or r.below <= r.above,
        ),
    )

    @property
    def release_below(self) -> float:
        return self.above if self.below is None else self.below

    @property
    def hold_seconds(self) -> int:
        return durations.parse_duration(self.hold_for)


PROMETHEUS_URL_PATTERN = (
    r"^https?://([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])"
    r"(:[0-9]{1,5})?(/[-A-Za-z0-9._~%/]*)?$"
)
"""Scheme, host, port and path: a query or fragment would add to (or replace) the operator's
own queries, and user information has no place in a policy anyone in its namespace reads."""


class PrometheusSource(Model):
    """Where to query load signals when load.source is prometheus."""

    url: Annotated[str, Field(max_length=2048, pattern=PROMETHEUS_URL_PATTERN)]
    """Base URL of the Prometheus HTTP API, e.g. http://prometheus.monitoring:9090: a scheme,
    a host, an optional port and an optional path, nothing else (no query, fragment or user:
    batchpilot writes every query itself)."""


class Load(Model):
    """Load rules: switch profiles on live signals, with hysteresis."""

    source: SignalSourceKind = "sidecar"
    """Where signals come from: the batchpilot sidecar on each Pod (default; also the only
    source of autotune recommendations), Triton's own metrics endpoint on each Pod (no sidecar
    needed), or a Prometheus server that scrapes them."""
    prometheus: PrometheusSource | None = None
    """Prometheus to query; required when source is prometheus."""
    rules: Annotated[list[LoadRule], Field(max_length=32)] = []
    """Rules in order of precedence: the first that holds wins."""

    cross_field_rules = (
        validations.CrossFieldRule(
            cel="self.source != 'prometheus' || has(self.prometheus)",
            message="prometheus.url is required when source is prometheus",
            field_path=".prometheus",
            holds=lambda load: load.source != "prometheus" or load.prometheus is not None,
        ),
    )


class Slo(Model):
    """The latency objectives (at least one), and whether the queue delay is tuned to meet the
    request-latency one."""

    p95_latency_ms: Annotated[float, Field(gt=0, le=600_000)] | None = None
    """The p95 request latency objective in milliseconds. Autotune and the guard of the queue
    delay work towards it, and do nothing without it."""
    ttft_p95_ms: Annotated[float, Field(gt=0, le=600_000)] | None = None
    """For LLM engines: the p95 time to first token objective in milliseconds. The sidecars
    recommend a maxNumBatchedTokens for it (shown, never applied)."""
    itl_p95_ms: Annotated[float, Field(gt=0, le=600_000)] | None = None
    """For LLM engines: the p95 inter-token latency objective in milliseconds. The sidecars
    recommend a maxNumSeqs for it (shown, never applied)."""
    profiles: Annotated[
        list[ProfileRef], Field(max_length=32, json_schema_extra={"x-kubernetes-list-type": "set"})
    ] = []
    """Profiles the objective applies to; empty means all."""
    autotune: bool = False
    """Replace the profile's queue delay with the sidecar's recommendation for p95LatencyMs,
    which it requires. An LLM engine's maxNumSeqs and maxNumBatchedTokens are never tuned."""
    min_queue_delay_microseconds: QueueDelay = 0
    """Lowest queue delay autotune may set."""
    max_queue_delay_microseconds: QueueDelay = 100_000
    """Highest queue delay autotune may set."""
    guard: bool = True
    """While a profile the objective governs is in force and the p95, measured under the queue
    delay in force, is above the objective, lower the delay at once (to the sidecars'
    recommendation where that is lower, else to half; never below minQueueDelayMicroseconds),
    without waiting for autotune's hysteresis; back to the profile's delay (or autotune's) once
    the p95 has stayed within the objective for guardIntervalSeconds. Needs p95LatencyMs."""
    guard_interval_seconds: Annotated[int, Field(ge=1, le=86_400)] = 60
    """How long a queue delay must have been in force before a p95 counts as measured under it,
    and the least time between two guard changes (each a reload). The default covers Triton's
    latency summaries, which describe about the last minute."""

    cross_field_rules = (
        validations.CrossFieldRule(
            cel="has(self.p95LatencyMs) || has(self.ttftP95Ms) || has(self.itlP95Ms)",
            message="slo needs at least one objective: p95LatencyMs, ttftP95Ms or itlP95Ms",
            field_path=".p95LatencyMs",
            holds=lambda slo: any(
                objective is not None
                for objective in (slo.p95_latency_ms, slo.ttft_p95_ms, slo.itl_p95_ms)
            ),
        ),
        validations.CrossFieldRule(
            cel="!self.autotune || has(self.p95LatencyMs)",
            message="autotune tunes the queue delay for p95LatencyMs, which is not set",
            field_path=".autotune",
            holds=lambda slo: not slo.autotune or slo.p95_latency_ms is not None,
        ),
        validations.CrossFieldRule(
            cel="self.minQueueDelayMicroseconds <= self.maxQueueDelayMicroseconds",
            message="minQueueDelayMicroseconds must be at most maxQueueDelayMicroseconds",
            field_path=".minQueueDelayMicroseconds",
            holds=lambda slo: slo.min_queue_delay_microseconds <= slo.max_queue_delay_microseconds,
        ),
    )


class Override(Model):
    """A manual override: this profile applies until the given time, ahead of every rule."""

    profile: ProfileRef
    """The profile to force; must name one of spec.profiles."""
    until: AwareDatetime | None = None
    """When the override ends (RFC 3339, e.g. 2026-11-22T23:00:00Z); absent means until removed."""
    reason: Annotated[str, Field(max_length=256)] = ""
    """Why, for the status and events."""


CanaryFallback = Literal["Promote", "Rollback"]


class Canary(Model):
    """Settings the fleet has not served before (a profile whose settings changed, a queue delay
    autotune recommends, a profile switched into for the first time) go to a few replicas first
    and are judged over an analysis window by what the change is for, then rolled out to the
    rest or rolled back. An edit of the profile in force is compared with the replicas still on
    its old settings. A switch into another profile is judged by that profile's own SLO
    objectives (where the SLO governs it; its latency is not judged where none does), never
    by replicas serving another profile. Failures are always judged against the other
    replicas, and a canary that counted less than three quarters of its share of the arrivals,
    short by more than chance explains, counts the rest as refused (Triton counts no request
    its full queue turns away).
    Switches between settings the fleet served before roll straight on, so a canary never makes
    a scheduled switch late, and neither do the SLO guard's emergency changes. A policy's first
    rollout has nothing of batchpilot's to return to, and rolls straight on."""

    replicas: Annotated[int, Field(ge=1, le=100)] = 1
    """How many replicas take new settings first."""
    analysis_seconds: Annotated[int, Field(ge=10, le=3600)] = 120
    """How long the canary replicas are compared with the rest, once they serve the settings."""
    min_requests: Annotated[int, Field(ge=1, le=100_000_000)] = 100
    """The fewest requests the canary replicas, and the rest, must serve in the window for a
    verdict; with fewer it is inconclusive (see onInconclusive)."""
    max_failure_rate: Annotated[float, Field(ge=0.0, le=1.0)] = 0.01
    """How much higher the canary's failure rate may be than the other replicas' (0.01: one
    percentage point), whatever the change; requests refused before Triton counted them (a full
    queue) count as failed. Past it the canary is rolled back at once, once minRequests were
    seen."""
    max_p95_ratio: Annotated[float, Field(ge=1.0, le=100.0)] = 1.5
    """The canary's p95 latency over the others' (the median of the readings' ratios, so a
    slow second does not decide) above which it is rolled back. For a switch into another
    profile, over that profile's slo.p95LatencyMs instead, and not judged where the SLO does
    not govern it."""
    max_p99_ratio: Annotated[float, Field(ge=1.0, le=100.0)] | None = None
    """The same for the p99, for edits only; not judged when absent."""
    max_ttft_p95_ratio: Annotated[float, Field(ge=1.0, le=100.0)] | None = None
    """For models behind an LLM engine: the same for the p95 time to first token, as the
    engine measures it (for a switch: over slo.ttftP95Ms); not judged when absent."""
    max_inter_token_p95_ratio: Annotated[float, Field(ge=1.0, le=100.0)] | None = None
    """For models behind an LLM engine: the same for the p95 time between tokens (for a switch:
    over slo.itlP95Ms); not judged when absent."""
    on_inconclusive: CanaryFallback = "Promote"
    """What happens when the window ends with too little to judge, or when there is no other
    replica to compare with: Promote (roll out to the rest) or Rollback. Promote keeps
    schedules on time but lets settings nobody judged reach the whole fleet; either way the
    canary's phase is Inconclusive and a CanaryInconclusive event and metric say so."""


class Rollout(Model):
    """How a profile change rolls out across the Triton replicas."""

    max_unavailable: Annotated[int, Field(ge=1, le=1000)] = 1
    """Replicas switched at the same time; for Pods with the readiness gate, the most out of
    their Services at once, counting those that do not answer; also how many may fail before
    the rollout stops."""
    drain_timeout_seconds: Annotated[int, Field(ge=0, le=3600)] = 15
    """For Pods with the batchpilot.dev/config-applied readiness gate: the longest wait, after
    taking the replica out of its Services, for its queue to empty and new requests to stop.
    Clients that keep connections to the Pod (HTTP keep-alive, gRPC channels) keep sending
    there; when they still do as this passes, the reload goes ahead and the DrainIneffective
    event says so."""
    unload_before_load: bool = False
    """Unload the model before loading the new configuration, so a GPU never holds two copies;
    the model is unavailable on that replica meanwhile."""
    verify_timeout_seconds: Annotated[int, Field(ge=1, le=3600)] = 120
    """How long a replica may take to load and report the new configuration before it is rolled
    back."""
    canary: Canary | None = None
    """Prove new settings on a few replicas before the rest take them; off when absent."""


def _names_profile(spec: BatchPolicySpec, name: str) -> bool:
    return name in spec.profiles


class BatchPolicySpec(Model):
    """Which Triton models are governed, which batching profiles exist, and when each applies:
    override > load rules > schedule windows > defaultProfile."""

    target: Target
    """Which Triton Pods and models the policy governs."""
    profiles: Annotated[dict[str, Profile], Field(min_length=1, max_length=32)]
    """Named batching profiles, e.g. interactive and bulk."""
    default_profile: ProfileRef
    """The profile that applies when no override, load rule or window does."""
    schedule: Schedule | None = None
    """Clock-based windows."""
    load: Load | None = None
    """Load-based rules."""
    slo: Slo | None = None
    """Latency objectives, and queue-delay autotuning."""
    min_dwell_seconds: Annotated[int, Field(ge=0, le=86_400)] = 300
    """Least time to stay in a profile before switching again (an override switches at once)."""
    override: Override | None = None
    """Manual override, ahead of every rule until it expires."""
    rollout: Rollout = Rollout()
    """How switches roll out across replicas."""
    dry_run: bool = False
    """Decide and report in status and events, but change no Triton server."""

    cross_field_rules = (
        validations.CrossFieldRule(
            cel="self.profiles.all(name, size(name) <= 63"
            f" && name.matches('{PROFILE_NAME_PATTERN}'))",
            message="profile names must be lowercase DNS labels (a-z, 0-9, '-'), e.g. interactive",
            field_path=".profiles",
            holds=lambda s: all(
                len(name) <= 63 and re.fullmatch(PROFILE_NAME_PATTERN, name) for name in s.profiles
            ),
        ),
        validations.CrossFieldRule(
            cel="self.defaultProfile in self.profiles",
            message="defaultProfile must name one of spec.profiles",
            field_path=".defaultProfile",
            holds=lambda s: _names_profile(s, s.default_profile),
        ),
        validations.CrossFieldRule(
            cel="!has(self.schedule) || !has(self.schedule.windows)"
            " || self.schedule.windows.all(w, w.profile in self.profiles)",
            message="every schedule window's profile must name one of spec.profiles",
            field_path=".schedule.windows",
            holds=lambda s: (
                s.schedule is None or all(_names_profile(s, w.profile) for w in s.schedule.windows)
            ),
        ),
        validations.CrossFieldRule(
            cel="!has(self.load) || !has(self.load.rules)"
            " || self.load.rules.all(r, r.profile in self.profiles)",
            message="every load rule's profile must name one of spec.profiles",
            field_path=".load.rules",
            holds=lambda s: (
                s.load is None or all(_names_profile(s, r.profile) for r in s.load.rules)
            ),
        ),
        validations.CrossFieldRule(
            cel="!has(self.override) || self.override.profile in self.profiles",
            message="override.profile must name one of spec.profiles",
            field_path=".override.profile",
            holds=lambda s: s.override is None or _names_profile(s, s.override.profile),
        ),
        validations.CrossFieldRule(
            cel="!has(self.slo) || !has(self.slo.profiles)"
            " || self.slo.profiles.all(p, p in self.profiles)",
            message="every slo.profiles entry must name one of spec.profiles",
            field_path=".slo.profiles",
            holds=lambda s: s.slo is None or all(_names_profile(s, p) for p in s.slo.profiles),
        ),
        validations.CrossFieldRule(
            cel="!has(self.rollout) || !has(self.rollout.canary) || !has(self.load)"
            " || !has(self.load.source) || self.load.source != 'prometheus'",
            message="rollout.canary compares replicas by their sidecars' or Triton's own "
            "figures; load.source prometheus gives none per replica",
            field_path=".rollout.canary",
            holds=lambda s: s.rollout.canary is None or s.signal_source != "prometheus",
        ),
    )

    def profile_role(self, profile: str) -> ProfileRole:
        """The profile's role: its own `role`, else the one its queue delay implies."""
        declared = self.profiles[profile].role
        if declared is not None:
            return declared
        mine = self.profiles[profile].max_queue_delay_microseconds
        others = [p.max_queue_delay_microseconds for n, p in self.profiles.items() if n != profile]
        return "throughput" if others and all(mine > other for other in others) else "latency"

    def slo_governs(self, profile: str) -> bool:
        """Whether the latency objective applies while `profile` is active."""
        return self.slo is not None and (not self.slo.profiles or profile in self.slo.profiles)

    @property
    def signal_source(self) -> SignalSourceKind:
        """Where the load signals come from: `load.source`, the sidecars without a `load`."""
        return self.load.source if self.load else "sidecar"


def parse_spec(document: Any) -> BatchPolicySpec:
    """Validate a spec (already decoded from YAML or JSON); raises pydantic.ValidationError."""
    return BatchPolicySpec.model_validate(document)
