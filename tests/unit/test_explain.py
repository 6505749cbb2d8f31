"""`batchpilot explain` on the sample policy and on broken files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot import cli, explaining
from batchpilot.policy import decisions
from builders import make_spec

SAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "batchpolicy.yaml"


def explain_json(capsys: pytest.CaptureFixture[str], *arguments: str) -> dict[str, Any]:
    assert cli.main(["explain", "--policy", str(SAMPLE), "-o", "json", *arguments]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


@pytest.mark.parametrize(
    ("at", "profile", "next_transition"),
    [
        # Thanksgiving: NYSE closed, bulk all day until Friday's open.
        ("2026-11-26T10:00:00-05:00", "bulk", "2026-11-27T14:30:00Z"),
        # The day after: interactive, but only until the 13:00 early close.
        ("2026-11-27T10:00:00-05:00", "interactive", "2026-11-27T18:00:00Z"),
        ("2026-11-27T13:30:00-05:00", "bulk", "2026-11-30T14:30:00Z"),
        # DST started on 2026-03-08: Monday opens at 13:30Z, not 14:30Z.
        ("2026-03-07T12:00:00Z", "bulk", "2026-03-09T13:30:00Z"),
        ("2026-03-09T09:45:00", "interactive", "2026-03-09T20:00:00Z"),
        # DST ended on 2026-11-01: Monday opens at 14:30Z again.
        ("2026-10-31T12:00:00Z", "bulk", "2026-11-02T14:30:00Z"),
        # The desk's own exception date, an XNYS early-close day.
        ("2026-12-24T10:00:00-05:00", "bulk", "2026-12-28T14:30:00Z"),
    ],
)
def test_explain_sample_at_named_instants(
    capsys: pytest.CaptureFixture[str], at: str, profile: str, next_transition: str
) -> None:
    result = explain_json(capsys, "--at", at)
    assert result["profile"] == profile
    assert result["next_transition"] == next_transition
    assert result["reason"]
    assert result["dynamic_batching"]["max_queue_delay_microseconds"] > 0


def test_explain_with_a_load_signal_switches_and_shows_the_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = explain_json(capsys, "--at", "2026-11-24T10:00:00-05:00", "--signal", "queueDepth=500")
    assert (result["profile"], result["source"]) == ("bulk", "load")
    assert result["dynamic_batching"]["preferred_batch_size"] == [64, 128]
    assert result["load_rules"] == [
        {"rule": "queueDepth > 200 for 1m", "profile": "bulk", "holding": True}
    ]


def test_explain_applies_the_autotuned_delay_within_bounds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = explain_json(
        capsys,
        "--at",
        "2026-11-24T10:00:00-05:00",
        "--signal",
        "recommendedQueueDelayMicroseconds=1500",
    )
    assert result["profile"] == "interactive"
    assert result["dynamic_batching"]["max_queue_delay_microseconds"] == 1500
    assert result["max_batch_size"] == 16


def test_explain_text_output_reads_well(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["explain", "--policy", str(SAMPLE), "--at", "2026-11-27T12:00:00-05:00"]) == 0
    out = capsys.readouterr().out
    assert "Profile:          interactive" in out
    assert "clipped to the XNYS session 09:30-13:00" in out
    assert "Next transition:  2026-11-27T18:00:00Z (Fri 2026-11-27 13:00 EST)" in out
    assert '"max_queue_delay_microseconds": 2000' in out


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            "kind: BatchPolicy\napiVersion: batchpilot.dev/v1alpha1\nspec:\n  profiles: {}\n",
            "spec.target: Field required",
        ),
        ("{not yaml", "(yaml)"),
        ("kind: Deployment\napiVersion: apps/v1\n", "kind: must be BatchPolicy"),
        (
            "target: {selector: {matchLabels: {app: triton}}}\n"
            "profiles: {a: {maxQueueDelayMicroseconds: 1}}\n"
            "defaultProfile: a\nschedule: {timezone: Mars/Olympus}\n",
            "spec.schedule.timezone: unknown time zone 'Mars/Olympus'",
        ),
        (
            "target: {selector: {matchLabels: {app: triton}}}\n"
            "profiles: {a: {maxQueueDelayMicroseconds: 1}}\n"
            "defaultProfile: a\nschedule: {calendar: NOPE}\n",
            "spec.schedule.calendar: unknown exchange calendar 'NOPE'",
        ),
        (
            "target: {selector: {matchLabels: {app: triton}}}\n"
            "profiles: {a: {maxQueueDelayMicroseconds: 1, maxQueueDelay: 5}}\n"
            "defaultProfile: a\n",
            "spec.profiles.a.maxQueueDelay: Extra inputs are not permitted",
        ),
    ],
)
def test_broken_policy_prints_the_field_path_and_exits_non_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, expected: str
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(content, encoding="utf-8")
    assert cli.main(["explain", "--policy", str(policy)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert expected in captured.err


def test_missing_file_and_bad_arguments_are_clear(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert cli.main(["explain", "--policy", str(tmp_path / "absent.yaml")]) == 2
    assert "No such file or directory" in capsys.readouterr().err
    assert cli.main(["explain", "--policy", str(SAMPLE), "--signal", "cpu=3"]) == 2
    assert "expected NAME=VALUE with NAME one of queueDepth" in capsys.readouterr().err
    assert cli.main(["explain", "--policy", str(SAMPLE), "--at", "tomorrow"]) == 2
    assert "is not an ISO 8601 time" in capsys.readouterr().err


def test_unquoted_time_gets_a_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "target: {selector: {matchLabels: {app: triton}}}\n"
        "profiles: {a: {maxQueueDelayMicroseconds: 1}}\n"
        "defaultProfile: a\nschedule: {windows: [{profile: a, start: '09:30', end: 16:00}]}\n",
        encoding="utf-8",
    )
    assert cli.main(["explain", "--policy", str(policy)]) == 2
    assert (
        'spec.schedule.windows[0].end: write times in quotes, e.g. "16:00"'
        in capsys.readouterr().err
    )


def test_explain_shows_an_llm_profile_s_engine_arguments(
    capsys: pytest.CaptureFixture[str],
) -> None:
    llm_policy = SAMPLE.parent / "policies" / "llm-market-hours.yaml"
    at = "2026-11-24T10:00:00-05:00"
    assert cli.main(["explain", "--policy", str(llm_policy), "--at", at]) == 0
    text = capsys.readouterr().out
    assert "Profile:          interactive" in text
    assert (
        'LLM engine (vLLM model.json): {"max_num_seqs": 8, "max_num_batched_tokens": 256, '
        '"enable_chunked_prefill": true}'
    ) in text
    assert cli.main(["explain", "--policy", str(llm_policy), "--at", at, "-o", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["llm_engine_arguments"]["max_num_seqs"] == 8


def test_explain_shows_an_llm_profile_s_tensorrt_llm_parameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "target: {selector: {matchLabels: {app: triton}}}\n"
        "profiles: {bulk: {llm: {batchSchedulerPolicy: maxUtilization, chunkedPrefill: true}}}\n"
        "defaultProfile: bulk\n",
        encoding="utf-8",
    )
    assert cli.main(["explain", "--policy", str(policy)]) == 0
    text = capsys.readouterr().out
    assert (
        "LLM engine (TensorRT-LLM config parameters): "
        '{"enable_chunked_context": "true", "batch_scheduler_policy": "max_utilization"}'
    ) in text
    assert (
        "LLM engine (vLLM model.json): refused: the backend has no setting for batchSchedulerPolicy"
    ) in text
    assert cli.main(["explain", "--policy", str(policy), "-o", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["llm_tensorrt_llm_parameters"] == {
        "enable_chunked_context": "true",
        "batch_scheduler_policy": "max_utilization",
    }


def test_explain_shows_a_rule_on_an_llm_engine_signal_and_its_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    llm_policy = SAMPLE.parent / "policies" / "llm-market-hours.yaml"
    arguments = ["explain", "--policy", str(llm_policy), "--at", "2026-11-24T10:00:00-05:00"]
    queued = [*arguments, "--signal", "waitingSequences=30", "--signal", "ttftP95Ms=2400"]
    assert cli.main(queued) == 0
    text = capsys.readouterr().out
    assert "Profile:          bulk" in text
    assert "Decided by:       load" in text
    assert (
        "Reason:           load rule #1 (waitingSequences > 16 for 1m) holds: "
        "lets go once waitingSequences < 4 for 1m"
    ) in text
    assert "Signals:          waitingSequences=30, ttftP95Ms=2400" in text
    assert '"max_num_seqs": 48' in text

    assert cli.main([*arguments, "--signal", "waitingSequences=3", "-o", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["profile"], result["source"]) == ("interactive", "schedule")
    assert result["signals"] == {"waitingSequences": 3}
    assert result["load_rules"] == [
        {"rule": "waitingSequences > 16 for 1m", "profile": "bulk", "holding": False}
    ]


def test_explain_names_the_llm_signals_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["explain", "--policy", str(SAMPLE), "--signal", "ttft=1"]) == 2
    error = capsys.readouterr().err
    for name in ("ttftP95Ms", "interTokenP95Ms", "outputTokensPerSecond", "waitingSequences"):
        assert name in error


def test_explain_shows_the_sidecars_llm_limits_and_applies_none(
    capsys: pytest.CaptureFixture[str],
) -> None:
    arguments = ["--at", "2026-11-24T10:00:00-05:00"]
    arguments += ["--signal", "recommendedMaxNumSeqs=12"]
    arguments += ["--signal", "recommendedMaxNumBatchedTokens=384"]
    assert cli.main(["explain", "--policy", str(SAMPLE), *arguments]) == 0
    out = capsys.readouterr().out
    assert (
        "LLM engines:      sidecars recommend maxNumSeqs 12, maxNumBatchedTokens 384 "
        "(shown, not applied)"
    ) in out
    assert "LLM engine (vLLM model.json)" not in out, "the sample's profiles set no LLM knobs"


def test_the_llm_recommendation_names_the_objectives_it_serves() -> None:
    spec = make_spec(slo={"ttftP95Ms": 500, "itlP95Ms": 40})
    signals = decisions.Signals(metrics={decisions.RECOMMENDED_MAX_NUM_SEQS: 24})
    assert explaining.llm_recommendation(spec, signals) == (
        "sidecars recommend maxNumSeqs 24 for ttftP95Ms 500, itlP95Ms 40 (shown, not applied)"
    )
    assert explaining.llm_recommendation(spec, decisions.Signals()) is None


def test_explain_says_whether_the_settings_are_proven_new_or_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = yaml.safe_load(SAMPLE.read_text())
    document["spec"]["rollout"] = {"canary": {"replicas": 1, "analysisSeconds": 60}}
    arguments = ["explain", "--at", "2026-11-24T12:00:00-05:00"]
    written = tmp_path / "policy.yaml"
    written.write_text(yaml.safe_dump(document))
    assert cli.main([*arguments, "--policy", str(written)]) == 0
    assert "compared with the rest for 1m (explain a policy read back" in capsys.readouterr().out

    assert cli.main([*arguments, "--policy", str(written), "-o", "json"]) == 0
    settings_hash = json.loads(capsys.readouterr().out)["canary"]["settings_hash"]
    document["status"] = {
        "settings": {
            "servedProfile": "interactive",
            "servedHash": "0123456789ab",
            "failed": [
                {"settingsHash": settings_hash, "profile": "interactive", "reason": "p95 3.1x"}
            ],
        },
        "canary": {
            "profile": "interactive",
            "settingsHash": settings_hash,
            "replicas": ["triton-0"],
            "phase": "RolledBack",
            "reason": "p95 3.1x the baseline's (limit 1.5x)",
        },
    }
    written.write_text(yaml.safe_dump(document))
    assert cli.main([*arguments, "--policy", str(written)]) == 0
    text = capsys.readouterr().out
    assert f"Settings:         {settings_hash}: failed their canary (p95 3.1x)" in text
    assert (
        f"Canary:           RolledBack: interactive settings {settings_hash} on triton-0: "
        "p95 3.1x the baseline's (limit 1.5x)"
    ) in text
