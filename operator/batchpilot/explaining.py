"""`batchpilot explain`: what a policy decides at an instant, why, and what it would apply."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from typing import Any

import pydantic

from batchpilot.api import durations
from batchpilot.api.v1alpha1 import specs, statuses
from batchpilot.policy import decisions, leads, loads, rendering

SIGNAL_NAMES = (*specs.LOAD_METRICS, *decisions.RECOMMENDATIONS)


def parse_signals(assignments: list[str]) -> decisions.Signals:
    """`NAME=VALUE` pairs into signals; raises ValueError naming the bad pair."""
    metrics: dict[str, float] = {}
    for assignment in assignments:
        name, separator, value = assignment.partition("=")
        if not separator or name not in SIGNAL_NAMES:
            raise ValueError(
                f"--signal {assignment!r}: expected NAME=VALUE with NAME one of "
                + ", ".join(SIGNAL_NAMES)
            )
        try:
            metrics[name] = float(value)
        except ValueError:
            raise ValueError(f"--signal {assignment!r}: {value!r} is not a number") from None
    return decisions.Signals(metrics=metrics)


def parse_instant(text: str, spec: specs.BatchPolicySpec) -> datetime.datetime:
    """An ISO 8601 instant; one without an offset is read in the schedule's time zone."""
    try:
        instant = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"--at {text!r} is not an ISO 8601 time such as 2026-11-27T10:00:00-05:00"
        ) from None
    if instant.tzinfo is None:
        zone = spec.schedule.zone if spec.schedule else datetime.UTC
        instant = instant.replace(tzinfo=zone)
    return instant


def lead(
    spec: specs.BatchPolicySpec, *, replicas: int = 1, wave_seconds: float | None = None
) -> leads.Lead:
    """The lead time for a fleet of `replicas`, one wave taking `wave_seconds` (or assumed)."""
    return leads.lead_for(spec, replicas=replicas, wave_seconds=wave_seconds)


def explain(
    spec: specs.BatchPolicySpec,
    at: datetime.datetime,
    signals: decisions.Signals,
    lead_time: leads.Lead | None = None,
) -> decisions.Decision:
    """The decision at `at`, taking the signals as steady and no profile as active yet."""
    memory = decisions.steady_memory(spec, signals)
    early = (lead_time or lead(spec)).lead
    return decisions.decide(spec, at, signals, memory, lead=early)


def canary(
    spec: specs.BatchPolicySpec, decision: decisions.Decision, status: Mapping[str, Any]
) -> dict[str, Any] | None:
    """With spec.rollout.canary: whether the decided settings are proven, new or failed, from the
    status of a policy read back from the cluster (none: as far as the file says), and the
    latest canary there."""
    wanted = spec.rollout.canary
    if wanted is None:
        return None
    try:
        known = statuses.BatchPolicyStatus.model_validate(status)
    except pydantic.ValidationError:
        known = statuses.BatchPolicyStatus()
    settings_hash = rendering.settings_hash(decision.settings)
    history = known.settings
    failed = next(
        (
            entry
            for entry in (history.failed if history else [])
            if entry.settings_hash == settings_hash
        ),
        None,
    )
    trial = (
        f"{wanted.replicas} replica(s) take them first, compared with the rest for "
        f"{durations.format_duration(wanted.analysis_seconds)}"
    )
    if failed is not None:
        verdict = (
            f"failed their canary ({failed.reason}); the fleet keeps the settings it served "
            "until the spec changes"
        )
    elif history is not None and settings_hash in history.proven:
        verdict = "proven (the fleet served them): they roll straight on"
    elif history is not None and history.served_hash is None:
        verdict = "the policy's first rollout: it rolls straight on"
    elif status:
        verdict = f"new: {trial}"
    else:
        verdict = (
            f"new unless the fleet served them: {trial} (explain a policy read back with "
            "`kubectl get bp NAME -o yaml` to know)"
        )
    latest = known.canary
    return {
        "settings_hash": settings_hash,
        "settings": verdict,
        "latest": latest.model_dump(by_alias=True, mode="json", exclude_none=True)
        if latest
        else None,
    }


def _canary_lines(found: dict[str, Any] | None) -> list[str]:
    if found is None:
        return []
    lines = [f"Settings:         {found['settings_hash']}: {found['settings']}"]
    latest = found["latest"]
    if latest:
        since = f" since {latest['startedAt']}" if latest.get("startedAt") else ""
        figures = f"; {latest['figures']}" if latest.get("figures") else ""
        lines.append(
            f"Canary:           {latest['phase']}: {latest['profile']} settings "
            f"{latest['settingsHash']} on {', '.join(latest['replicas'])}{since}: "
            f"{latest.get('reason', '')}{figures}"
        )
    return lines


def _iso(instant: datetime.datetime | None) -> str | None:
    if instant is None:
        return None
    return instant.astimezone(datetime.UTC).isoformat().replace("+00:00", "Z")


def as_json(
    spec: specs.BatchPolicySpec,
    at: datetime.datetime,
    signals: decisions.Signals,
    decision: decisions.Decision,
    status: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "at": _iso(at),
        "profile": decision.profile,
        "source": decision.source,
        "reason": decision.reason,
        "next_transition": _iso(decision.next_transition),
        "rollout_starts": _iso(decision.rollout_starts),
        "dynamic_batching": decision.settings.dynamic_batching,
        "max_batch_size": decision.settings.max_batch_size,
        "llm_engine_arguments": decision.settings.engine_arguments,
        "llm_tensorrt_llm_parameters": decision.settings.tensorrt_llm_parameters,
        "signals": dict(signals.metrics),
        "canary": canary(spec, decision, status or {}),
        "load_rules": [
            {"rule": loads.describe(rule), "profile": rule.profile, "holding": state.holding}
            for rule, state in zip(
                spec.load.rules if spec.load else [],
                decision.memory.rules.values(),
                strict=True,
            )
        ],
    }


def as_text(
    spec: specs.BatchPolicySpec,
    at: datetime.datetime,
    signals: decisions.Signals,
    decision: decisions.Decision,
    lead_time: leads.Lead | None = None,
    status: Mapping[str, Any] | None = None,
) -> str:
    zone = spec.schedule.zone if spec.schedule else datetime.UTC

    def local(instant: datetime.datetime) -> str:
        return f"{_iso(instant)} ({instant.astimezone(zone).strftime('%a %Y-%m-%d %H:%M %Z')})"

    lines = [
        f"At:               {local(at)}",
        f"Profile:          {decision.profile}",
        f"Decided by:       {decision.source}",
        f"Reason:           {decision.reason}",
        "Next transition:  "
        + (local(decision.next_transition) if decision.next_transition else "none scheduled"),
    ]
    if decision.rollout_starts is not None and decision.rollout_starts != decision.next_transition:
        lines.append(f"Rollout starts:   {local(decision.rollout_starts)}, so that it is over then")
    if lead_time is not None and spec.schedule is not None:
        lines.append(
            f"Lead time:        {durations.format_duration(lead_time.lead.total_seconds())} "
            f"(schedule.leadTime {spec.schedule.lead_time}; the rollout: {lead_time.describe()})"
        )
    if signals.metrics:
        lines.append("Signals:          " + _pairs(signals.metrics))
    lines += _canary_lines(canary(spec, decision, status or {}))
    recommended = llm_recommendation(spec, signals)
    if recommended is not None:
        lines.append(f"LLM engines:      {recommended}")
    lines.append("dynamic_batching: " + json.dumps(decision.settings.dynamic_batching, indent=2))
    if decision.settings.max_batch_size is not None:
        lines.append(f"max_batch_size:   {decision.settings.max_batch_size}")
    settings = decision.settings
    if settings.engine_arguments is not None:
        lines.append(
            "LLM engine (vLLM model.json): "
            + _engine_settings(settings.engine_arguments, settings, rendering.VLLM_FIELDS)
        )
    if settings.tensorrt_llm_parameters is not None:
        lines.append(
            "LLM engine (TensorRT-LLM config parameters): "
            + _engine_settings(
                settings.tensorrt_llm_parameters, settings, rendering.TENSORRT_LLM_FIELDS
            )
        )
    return "\n".join(lines)


def _engine_settings(
    values: Mapping[str, Any], settings: rendering.Settings, takes: frozenset[str]
) -> str:
    """An llm section as one backend takes it, or why that backend would refuse it."""
    unsupported = sorted(settings.llm_fields - takes)
    if unsupported:
        return "refused: the backend has no setting for " + ", ".join(unsupported)
    return json.dumps(dict(values))


def llm_recommendation(spec: specs.BatchPolicySpec, signals: decisions.Signals) -> str | None:
    """What the sidecars recommend for the LLM objectives, which batchpilot never applies."""
    named = {
        "maxNumSeqs": signals.metrics.get(decisions.RECOMMENDED_MAX_NUM_SEQS),
        "maxNumBatchedTokens": signals.metrics.get(decisions.RECOMMENDED_MAX_NUM_BATCHED_TOKENS),
    }
    limits = [f"{name} {value:g}" for name, value in named.items() if value is not None]
    if not limits:
        return None
    slo = spec.slo
    objectives = {
        "ttftP95Ms": slo.ttft_p95_ms if slo else None,
        "itlP95Ms": slo.itl_p95_ms if slo else None,
    }
    given = [f"{name} {value:g}" for name, value in objectives.items() if value is not None]
    towards = f" for {', '.join(given)}" if given else ""
    return f"sidecars recommend {', '.join(limits)}{towards} (shown, not applied)"


def _pairs(values: Mapping[str, float]) -> str:
    return ", ".join(f"{name}={value:g}" for name, value in values.items())
