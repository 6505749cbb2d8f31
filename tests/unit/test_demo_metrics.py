"""The demo models' files and the counters read from their metrics."""

from __future__ import annotations

import ast

import pytest

from batchpilot_harness import demo_models
from batchpilot_triton import scraping

EMULATED_DEVICE_COPIES = sorted(demo_models.MODEL_REPOSITORY.glob("*/1/emulated_device.py"))


def test_every_demo_model_carries_the_same_emulated_device() -> None:
    assert [p.parent.parent.name for p in EMULATED_DEVICE_COPIES] == ["gpu_sim", "torch_mlp"]
    first, *others = (p.read_text() for p in EMULATED_DEVICE_COPIES)
    assert all(other == first for other in others)


def test_metric_names_match_what_the_emulated_device_exports() -> None:
    module = ast.parse(EMULATED_DEVICE_COPIES[0].read_text())
    exported = {
        node.targets[0].id: node.value.value
        for node in module.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
    }

    names = {exported[key] for key in ("BUSY_SECONDS", "WAIT_SECONDS", "EXECUTIONS", "INFERENCES")}
    assert names == {f"{family}_total" for family in scraping.EMULATED_DEVICE_FAMILIES}


def test_step_time_comes_from_the_model_parameters() -> None:
    config = {
        "parameters": {
            "step_time_base_ms": {"string_value": "4.0"},
            "step_time_per_item_ms": {"string_value": "0.35"},
            "step_time_exponent": {"string_value": "0.7"},
        }
    }

    step_time = demo_models.StepTime.from_model_config(config)

    assert step_time.seconds(1) == pytest.approx(0.00435)
    assert step_time.seconds(128) == pytest.approx(0.004 + 0.00035 * 128**0.7)


def page(busy_by_stub: dict[str, float], *, inferences: int, executions: int) -> str:
    lines = [
        "# TYPE nv_inference_count counter",
        f'nv_inference_count{{model="gpu_sim",version="1"}} {inferences}',
        'nv_inference_count{model="other",version="1"} 999',
        "# TYPE nv_inference_exec_count counter",
        f'nv_inference_exec_count{{model="gpu_sim",version="1"}} {executions}',
        "# TYPE nv_inference_queue_duration_us counter",
        'nv_inference_queue_duration_us{model="gpu_sim",version="1"} 2500000',
        "# TYPE emulated_device_busy_seconds_total counter",
    ]
    lines += [
        f'emulated_device_busy_seconds_total{{model="gpu_sim",model_instance="gpu_sim_0_0",'
        f'stub_pid="{pid}",version="1"}} {value}'
        for pid, value in busy_by_stub.items()
    ]
    return "\n".join(lines) + "\n"


def test_totals_sum_series() -> None:
    snapshot = scraping.parse(page({"10": 1.5, "11": 0.5}, inferences=40, executions=10))

    totals = snapshot.totals("gpu_sim")

    assert totals.device_busy_seconds == 2.0
    assert totals.queue_us == 2_500_000
    assert totals.average_batch_size == 4.0
    assert scraping.parse("").totals("gpu_sim") == scraping.ModelCounters()


def test_increase_survives_the_series_churn_of_a_reload() -> None:
    before = scraping.parse(page({"10": 5.0, "11": 3.0}, inferences=100, executions=20))
    # Stub 10 was replaced by stub 12 (which counts from zero); stub 11 went on counting.
    after = scraping.parse(page({"11": 4.0, "12": 0.25}, inferences=160, executions=30))

    increase = scraping.increase(before, after, "gpu_sim")

    assert increase.device_busy_seconds == pytest.approx(1.25)
    assert increase.inferences == 60
    assert increase.average_batch_size == 6.0


def test_a_counter_that_went_down_was_reset() -> None:
    before = scraping.parse(page({"10": 5.0}, inferences=100, executions=20))
    after = scraping.parse(page({"10": 1.0}, inferences=8, executions=2))

    increase = scraping.increase(before, after, "gpu_sim")

    assert increase.device_busy_seconds == 1.0
    assert increase.inferences == 8
