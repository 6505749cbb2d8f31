"""The GPU check (`make gpu-check`): batchpilot on a real GPU, end to end, in one command.

Everything else in this project was measured on CPUs with an emulated device, and NVML was
tested against a fake. On a machine with an NVIDIA GPU this runs tritonserver (from the
nvidia-pytriton wheel) with `torch_mlp` on CUDA, the sidecar with its real NVML path, and the
standalone runner switching profiles under load, and prints NVML's readings next to
nvidia-smi's, the sidecar's step-time fit, the reloads with the failures and p99 during them,
and device-seconds per 1,000 requests per profile from NVML's utilization.

GPU machines are lent without a registry, so what the check needs beyond what they have
travels as a folder of wheels (`make gpu-wheels`, about 52 MiB; see `wheels`).

- `devices`: is there a GPU; nvidia-smi's CSV; NVML next to nvidia-smi (standard library only);
- `wheels`: what is carried and why, the download and its size, the install on the device;
- `plans`: what a run does; `accounting`: the figures, pure; `runs`: the run itself;
- `commands`: the command line and the checks before a run.
"""
