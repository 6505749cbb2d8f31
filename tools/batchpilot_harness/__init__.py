"""The development and demo harness: what runs batchpilot for real on one machine, but is not
batchpilot.

- `local_triton`: a real `tritonserver` (from the `nvidia-pytriton` wheel) on CPU, started and
  stopped cleanly, with the demo models;
- `local_sidecar`: batchpilot's sidecar beside it as a child process, as in a Triton Pod;
- `demo_models`: the demo model repository and the emulated accelerator's parameters;
- `loadgen`: open-loop Poisson load against Triton, one record per request;
- `processes`: what /proc says about a process, its group, CPU time and memory;
- `demo`: `batchpilot demo` (the `commands` module registers it with the `batchpilot` command).
- `gpuchecks`: `make gpu-check`, the same on a real GPU, and the wheels it carries there.

The tests, the benchmarks and the e2e suite use it; no product module imports it (an
import-linter contract says so), and the operator's image does not carry it.
"""
