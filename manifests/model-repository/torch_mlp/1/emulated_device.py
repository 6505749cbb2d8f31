"""One emulated accelerator shared by every model instance of a Triton server.

A GPU runs the kernels of all instances of all models placed on it one after another. Python-backend
instances are separate processes, so the device here is a lock file (`fcntl.flock`) that an
execution holds for as long as it "runs on the device". The lock file comes from the environment
variable BATCHPILOT_DEVICE_LOCK, which `batchpilot_harness.local_triton` sets per server; without
it, the server's PID (the stub's parent) names one in the temporary directory, so that two
servers on one machine never share a device.

Device time is exported as Triton custom metrics on the server's metrics endpoint, labelled like
Triton's own `nv_inference_*` metrics (model, version) and, in addition, by model instance and stub
process: Triton hands every stub the same underlying counter for equal labels but lets each one
delete it, and during a reload the old and the new instances of a model live side by side. Sum
over `model_instance` and `stub_pid` for a model's total; each series starts at zero with its stub.

This file is copied verbatim into the version directory of each demo model (the Python backend puts
that directory on `sys.path`); a unit test keeps the copies identical.
"""

import contextlib
import fcntl
import os
import tempfile
import time

import triton_python_backend_utils as pb_utils

DEVICE_LOCK_ENV = "BATCHPILOT_DEVICE_LOCK"

BUSY_SECONDS = "emulated_device_busy_seconds_total"
WAIT_SECONDS = "emulated_device_wait_seconds_total"
EXECUTIONS = "emulated_device_executions_total"
INFERENCES = "emulated_device_inferences_total"

_DESCRIPTIONS = {
    BUSY_SECONDS: "Seconds the emulated device spent executing this model's batches",
    WAIT_SECONDS: "Seconds this model's executions waited for the emulated device",
    EXECUTIONS: "Batches this model executed on the emulated device",
    INFERENCES: "Inferences (batch items) this model executed on the emulated device",
}

# Below this, time.sleep() tends to overshoot by more than it has left to wait.
_SPIN_SECONDS = 0.0002


def lock_path():
    configured = os.environ.get(DEVICE_LOCK_ENV)
    if configured:
        return configured
    return os.path.join(tempfile.gettempdir(), f"batchpilot-device-{os.getppid()}.lock")


def sleep_until(deadline):
    """Sleep until `time.perf_counter()` reaches `deadline`, finishing with a short spin."""
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return
        if remaining > _SPIN_SECONDS:
            time.sleep(remaining - _SPIN_SECONDS)


class EmulatedDevice:
    def __init__(self, *, model_name, model_version, instance_name):
        self._lock_fd = os.open(lock_path(), os.O_RDWR | os.O_CREAT, 0o600)
        labels = {
            "model": model_name,
            "version": str(model_version),
            "model_instance": instance_name,
            "stub_pid": str(os.getpid()),
        }
        self._families = {
            name: pb_utils.MetricFamily(
                name=name, description=description, kind=pb_utils.MetricFamily.COUNTER
            )
            for name, description in _DESCRIPTIONS.items()
        }
        self._metrics = {
            name: family.Metric(labels=labels) for name, family in self._families.items()
        }

    @contextlib.contextmanager
    def occupied(self, *, batch_size):
        """Hold the device for the body; yield the `perf_counter()` time it was acquired."""
        requested = time.perf_counter()
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        acquired = time.perf_counter()
        try:
            yield acquired
        finally:
            released = time.perf_counter()
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            # Reporting talks to the server over shared memory: do it off the device.
            self._metrics[BUSY_SECONDS].increment(released - acquired)
            self._metrics[WAIT_SECONDS].increment(acquired - requested)
            self._metrics[EXECUTIONS].increment(1)
            self._metrics[INFERENCES].increment(batch_size)

    def close(self):
        # A MetricFamily must outlive its Metrics.
        self._metrics.clear()
        self._families.clear()
        os.close(self._lock_fd)
