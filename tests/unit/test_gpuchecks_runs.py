"""The GPU check's run, the parts that need no server: torch_mlp's config for a device and size,
the server's environment, the policy, and the report."""

from __future__ import annotations

from pathlib import Path

from batchpilot.api import documents
from batchpilot_harness.gpuchecks import accounting, devices, findings, plans, runs
from batchpilot_triton import reports, scraping


def plan(
    device: plans.Device = "cuda", *, gpu: int = 0, hidden_width: int = 8192, hidden_layers: int = 4
) -> plans.Plan:
    return plans.Plan(
        device=device,
        gpu=gpu,
        rate=800.0,
        segment_seconds=30.0,
        cycles=2,
        hidden_width=hidden_width,
        hidden_layers=hidden_layers,
        out=Path("/tmp/out"),
    )


def test_torch_mlp_is_configured_for_the_device_and_size_and_keeps_the_rest(
    tmp_path: Path,
) -> None:
    repository = runs.build_repository(plan(gpu=2), tmp_path)
    config = (repository / "torch_mlp" / "config.pbtxt").read_text()
    original = (plans.Plan.model_repository / "torch_mlp" / "config.pbtxt").read_text()
    assert config.startswith(original.rstrip())
    assert config.endswith(
        'parameters { key: "device" value: { string_value: "cuda" } }\n'
        'parameters { key: "hidden_width" value: { string_value: "8192" } }\n'
        'parameters { key: "hidden_layers" value: { string_value: "4" } }\n'
    )
    assert (repository / "torch_mlp" / "1" / "model.py").is_file()
    assert not list(repository.rglob("__pycache__"))
    on_cpu = runs.model_config(original, plan("cpu", hidden_width=1024, hidden_layers=2))
    assert 'parameters { key: "device" value: { string_value: "cpu" } }' in on_cpu


def test_triton_sees_only_the_chosen_gpu_in_nvmls_order() -> None:
    assert runs.server_environment(plan(gpu=2)) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "2",
    }
    assert runs.server_environment(plan("cpu")) == {}


def test_the_policy_has_both_profiles_and_starts_interactive() -> None:
    spec = documents.parse_document(runs.policy_document())
    assert set(spec.profiles) == {"interactive", "bulk"}
    assert spec.default_profile == "interactive"
    assert spec.target.models == ["torch_mlp"]


def recorded(step_time: reports.StepTimeReport) -> findings.Findings:
    initial = accounting.Switch("interactive", None, -3.0, -1.0, (2.5,))
    to_bulk = accounting.Switch("bulk", "interactive", 30.0, 31.5, (1.4,))
    requests = [
        accounting.Request(sent=t / 100, latency=0.004, succeeded=True) for t in range(6000)
    ]
    samples = [accounting.Sample(float(t), 0.3 if t <= 32 else 0.1) for t in range(61)]
    profiles = accounting.profile_accounts(
        switches=[initial, to_bulk],
        requests=requests,
        samples=samples,
        counted={
            accounting.Stretch("interactive", 0.0, 31.5): scraping.ModelCounters(
                inferences=3150, executions=1575
            )
        },
        start=0.0,
        end=60.0,
    )
    smi = devices.SmiReading(index=0, name="NVIDIA H100 80GB HBM3", utilization_percent=29)
    sidecar = reports.DeviceReport(index=0, name="NVIDIA H100 80GB HBM3", utilization=0.31)
    return findings.Findings(
        plan=plan().describe(),
        device="cuda",
        gpu=0,
        startup_seconds=12.5,
        comparisons=(
            findings.Comparison(
                moment="under load (bulk)",
                gpus=devices.compare([sidecar], [smi]),
                sidecar_gpu="available via nvml",
                smi_problem=None,
            ),
        ),
        step_time=step_time,
        initial=initial,
        switches=accounting.switch_accounts([to_bulk], requests),
        profiles=profiles,
        sent=len(requests),
        all_requests=accounting.latencies(requests),
        failures=(),
        samples=len(samples),
        problems=(),
    )


def test_the_report_shows_the_readings_the_fit_the_switches_and_the_device_cost() -> None:
    fit = reports.StepTimeReport(
        status="fitted",
        batch_sizes=(1, 2, 4, 8, 16),
        observations=120,
        executions=4000,
        t0_ms=0.81,
        c_ms=0.052,
        alpha=0.93,
        r_squared=0.994,
        rmse_ms=0.021,
    )
    text = runs.render(recorded(fit))
    assert text.startswith("GPU check: torch_mlp (hidden 8192 x 4) on cuda (GPU 0); 800 req/s")
    assert "NVML (the sidecar's /status) next to nvidia-smi, under load (bulk):" in text
    utilization = next(line for line in text.splitlines() if "utilization %" in line)
    assert utilization.split()[-3:] == ["31.0", "29.0", "+2.0"]
    assert (
        "  t0 0.810 ms, c 0.052 ms, alpha 0.93, R^2 0.994, RMSE 0.021 ms (5 batch sizes 1-16, "
        "120 observations, 4000 executions)"
    ) in text
    assert "Before the load: interactive, reload 2.50 s, 2.00 s from asking to serving." in text
    switch_line = next(line for line in text.splitlines() if line.startswith("  bulk "))
    assert switch_line.split()[:4] == ["bulk", "1.40", "1.50", "250"]
    rows = {line.split()[0]: line.split() for line in text.splitlines()[-8:] if line[:3] == "  i"}
    interactive = rows["interactive"]
    # 31.5 s at 30% busy over 3,150 requests served; the model's timer saw nothing.
    assert interactive[1:4] == ["31.5", "3150", "0"]
    assert interactive[7] == "2.0"  # average batch from Triton's counters
    assert interactive[8:11] == ["30.0%", "3.000", "-"]
    assert "All requests: 6000 sent, 6000 answered or failed, 0 failed" in text


def test_a_fit_that_is_not_there_says_why() -> None:
    fit = reports.StepTimeReport(status="insufficient", reason="3 distinct batch sizes")
    assert "insufficient: 3 distinct batch sizes" in runs.render(recorded(fit))
