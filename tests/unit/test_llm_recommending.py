"""An LLM engine's limits: the most sequences that keep the inter-token objective, and the step
budget that prefills a prompt within the time-to-first-token objective."""

from __future__ import annotations

import math

import pytest

from batchpilot_sidecar import llm_recommending, steptimes

STEP = steptimes.StepTimeModel(t0_ms=3.0, c_ms=0.4, alpha=0.8)


def test_max_num_seqs_is_the_most_sequences_whose_step_and_margin_fit_the_objective() -> None:
    found = llm_recommending.max_num_seqs(STEP, itl_p95_ms=10.0, most_running_seen=64)
    budget = 10.0 - 1.0  # a 10% margin
    assert STEP.ms(found.value) <= budget < STEP.ms(found.value + 1)
    assert found.value == 29
    assert found.meets_objective
    assert found.margin_ms == pytest.approx(1.0)
    assert found.step_ms == pytest.approx(STEP.ms(29))
    assert "the largest that fits" in found.reason


def test_max_num_seqs_goes_no_further_than_twice_the_most_running_measured() -> None:
    found = llm_recommending.max_num_seqs(STEP, itl_p95_ms=10.0, most_running_seen=8)
    assert found.value == 16
    assert "capped at 2x the most running sequences measured (8)" in found.reason


def test_a_step_that_does_not_grow_is_capped_by_what_was_measured() -> None:
    flat = steptimes.StepTimeModel(t0_ms=3.0, c_ms=0.0, alpha=1.0)
    found = llm_recommending.max_num_seqs(flat, itl_p95_ms=10.0, most_running_seen=12)
    assert found.value == 24


def test_an_inter_token_objective_below_one_sequence_s_step_is_not_met() -> None:
    found = llm_recommending.max_num_seqs(STEP, itl_p95_ms=3.0, most_running_seen=16)
    assert found.value == 1
    assert not found.meets_objective
    assert "the objective cannot be met" in found.reason


def test_max_num_batched_tokens_prefills_a_mean_prompt_in_the_steps_the_ttft_allows() -> None:
    found = llm_recommending.max_num_batched_tokens(
        STEP, ttft_p95_ms=100.0, running=16, prompt_tokens=512, prompt_tokens_per_second=100
    )
    steps = math.floor(90.0 / STEP.ms(16))  # 6.68 ms a step
    assert steps == 13
    assert found.value == 16 + math.ceil(512 / 13)
    assert found.meets_objective
    assert "a 512-token prompt in 13 steps" in found.reason


def test_the_step_budget_keeps_up_with_the_prompts_that_arrive() -> None:
    # 200,000 prompt tokens a second arrive: a 6.68 ms step must carry twice 1,336 of them.
    found = llm_recommending.max_num_batched_tokens(
        STEP, ttft_p95_ms=100.0, running=16, prompt_tokens=64, prompt_tokens_per_second=200_000
    )
    assert found.value == 16 + math.ceil(2 * 200_000 * STEP.ms(16) / 1000)
    assert "keep up with 2e+05 arriving a second" in found.reason


def test_a_ttft_objective_shorter_than_one_step_is_not_met() -> None:
    found = llm_recommending.max_num_batched_tokens(
        STEP, ttft_p95_ms=5.0, running=16, prompt_tokens=300, prompt_tokens_per_second=10
    )
    assert not found.meets_objective
    assert found.value == 16 + 300
    assert "the objective cannot be met" in found.reason


def test_short_prompts_still_leave_every_running_sequence_its_token() -> None:
    found = llm_recommending.max_num_batched_tokens(
        STEP, ttft_p95_ms=1000.0, running=32, prompt_tokens=0.5, prompt_tokens_per_second=0.1
    )
    assert found.value == 33


def test_an_objective_must_be_a_positive_number() -> None:
    with pytest.raises(ValueError, match="itlP95Ms must be a positive number of ms, not -1"):
        llm_recommending.LlmObjective(itl_p95_ms=-1)
    assert not llm_recommending.LlmObjective().given
