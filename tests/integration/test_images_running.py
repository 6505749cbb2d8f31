"""The images `make images` builds run as a cluster runs them: imported from their OCI archives into
a containerd of the test's own (root, state and socket in a temporary folder) and started with
`ctr run` on a read-only root filesystem, each as its image's user, on the host's network bound to
loopback. The Triton image runs manifests/triton-deployment.yaml's own command and flags (ports and
addresses moved to free loopback ones) with the model repository mounted read-only and /tmp a
folder of its own, as an emptyDir; the sidecar image runs against it.

Skipped where containerd, ctr or runc are missing, without root, or when the images are not built
from the current inputs (`make images`; `make integration` builds them first)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc
import tritonclient.http
import tritonclient.utils
import yaml

from batchpilot_cluster import images, locations

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

NAMESPACE = "batchpilot-images-test"
TOKEN = "0123456789abcdef"
HEADER = "batchpilot-repository-token"
MODELS = locations.REPO_ROOT / "manifests" / "model-repository"
# containerd 1.6's default set; ctr takes no `ALL`. Dropping each is `drop: [ALL]` (the tests
# check that the bounding set ends up empty).
DEFAULT_CAPABILITIES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
)  # fmt: skip


def missing_prerequisite() -> str | None:
    for tool in ("containerd", "ctr", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (`make deps`)"
    if os.geteuid() != 0:
        return "containerd needs root"
    return None


# Creates a file as `touch` does and exits with the errno it failed with (0 if it did not). The
# answer is the exit status because a short process's output can be lost on its way through
# containerd to `ctr task exec`, and its status is not: a busy run's `touch` of a read-only path
# came back with status 1 and an empty stderr.
CREATE_AND_EXIT_WITH_ERRNO = """
import os, sys
try:
    os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_NOCTTY | os.O_NONBLOCK, 0o666))
except OSError as error:
    sys.exit(error.errno)
"""


class Containerd:
    """A containerd of the test's own; every container it ran is gone when it stops."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket = directory / "containerd.sock"
        self.log = directory / "containerd.log"
        config = directory / "config.toml"
        config.write_text(
            "version = 2\n"
            f'root = "{directory / "root"}"\n'
            f'state = "{directory / "state"}"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{self.socket}"\n'
            f'[ttrpc]\n  address = "{directory / "containerd.sock.ttrpc"}"\n'
            '[debug]\n  address = ""\n[metrics]\n  address = ""\n'
        )
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                ["containerd", "--config", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while self.ctr("version", check=False).returncode != 0:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"containerd did not start; log: {self.log}")
            time.sleep(0.2)

    def ctr(
        self, *arguments: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["ctr", "--address", str(self.socket), "--namespace", NAMESPACE, *arguments],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"ctr {' '.join(arguments)}: {done.stdout}{done.stderr}")
        return done

    def run_argv(
        self, reference: str, container: str, argv: Sequence[str], *, mounts: Sequence[str] = ()
    ) -> list[str]:
        """`ctr run` as a restricted Pod runs a container: read-only root, seccomp, the image's
        user; the host's network (the test binds servers to loopback)."""
        return [
            "ctr", "--address", str(self.socket), "--namespace", NAMESPACE,
            "run", "--rm", "--read-only", "--seccomp", "--net-host",
            *(argument for cap in DEFAULT_CAPABILITIES for argument in ("--cap-drop", cap)),
            "--env", "HOME=/tmp",
            *(argument for mount in mounts for argument in ("--mount", mount)),
            reference, container, *argv,
        ]  # fmt: skip

    def run(
        self, reference: str, container: str, argv: Sequence[str], *, mounts: Sequence[str] = ()
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.run_argv(reference, container, argv, mounts=mounts),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def task_pid(self, container: str) -> int:
        listing = self.ctr("task", "ls").stdout.splitlines()[1:]
        for line in listing:
            name, pid, _status = line.split()
            if name == container:
                return int(pid)
        raise AssertionError(f"no task {container}: {listing}")

    def exec(self, container: str, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return self.ctr("task", "exec", "--exec-id", f"probe-{time.monotonic_ns()}", container,
                        *argv, check=False)  # fmt: skip

    def stop(self) -> None:
        for line in self.ctr("task", "ls", check=False).stdout.splitlines()[1:]:
            name = line.split()[0]
            self.ctr("task", "kill", "--signal", "SIGKILL", name, check=False)
            self.ctr("task", "delete", "--force", name, check=False)
        for name in self.ctr("containers", "ls", "--quiet", check=False).stdout.split():
            self.ctr("containers", "delete", name, check=False)
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=15)
        unmount_below(self.directory)


def unmount_below(directory: Path) -> None:
    """Unmount whatever containerd left mounted in its folder (snapshots, the shim's rootfs)."""
    prefix = str(directory.resolve())
    mounted = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for point in sorted((m for m in mounted if m.startswith(prefix)), reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True, check=False, timeout=30)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for(
    url: str,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 120,
    process: subprocess.Popen[str] | None = None,
) -> None:
    """Until `url` answers; an OSError if it does not in time or `process` ends first."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise OSError(f"exited with {process.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url, headers=headers or {}), timeout=2
            ):
                return
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def post_status(url: str, *, headers: dict[str, str]) -> int:
    request = urllib.request.Request(url, data=b"{}", headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def deployment_triton_command() -> list[str]:
    """manifests/triton-deployment.yaml's triton container: its command and arguments, with the
    token Kubernetes would expand."""
    documents = list(
        yaml.safe_load_all(
            (locations.REPO_ROOT / "manifests" / "triton-deployment.yaml").read_text()
        )
    )
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    container = next(
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "triton"
    )
    argv = [*container["command"], *container["args"]]
    return [argument.replace("$(TRITON_REPOSITORY_TOKEN)", TOKEN) for argument in argv]


@pytest.fixture(scope="module")
def built() -> dict[str, images.BuiltImage]:
    reason = missing_prerequisite()
    if reason:
        pytest.skip(reason)
    try:
        return {recipe.name: images.archive(recipe.name) for recipe in images.IMAGES}
    except images.ImageError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def containerd(built: dict[str, images.BuiltImage]) -> Iterator[Containerd]:
    # A short path: a unix socket's name has at most 107 bytes.
    directory = Path(tempfile.mkdtemp(prefix="bp-containerd-", dir="/tmp"))
    daemon = Containerd(directory)
    try:
        for image in built.values():
            daemon.ctr("images", "import", str(image.archive), timeout=300)
        yield daemon
    finally:
        daemon.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def triton(
    containerd: Containerd,
    built: dict[str, images.BuiltImage],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, int]]:
    """The Triton image with the Deployment's command, on free loopback ports."""
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    scratch = tmp_path_factory.mktemp("triton-tmp")
    scratch.chmod(0o1777)  # as an emptyDir
    argv = [
        argument
        for argument in deployment_triton_command()
        if not argument.startswith(("--http-port=", "--grpc-port=", "--metrics-port="))
    ]
    for kind, port in ports.items():
        argv += [f"--{kind}-address=127.0.0.1", f"--{kind}-port={port}"]
    argv.append("--exit-timeout-secs=2")
    mounts = [
        f"type=bind,src={MODELS},dst=/models,options=rbind:ro",
        f"type=bind,src={scratch},dst=/tmp,options=rbind:rw",
    ]
    log = scratch.parent / "triton.log"
    with log.open("w") as stream:
        reference = built["batchpilot-triton"].reference
        process = subprocess.Popen(
            containerd.run_argv(reference, "triton", argv, mounts=mounts),
            stdin=subprocess.DEVNULL, stdout=stream, stderr=stream, text=True,
        )  # fmt: skip
    try:
        try:
            wait_for(f"http://127.0.0.1:{ports['http']}/v2/models/gpu_sim/ready", process=process)
        except OSError:
            pytest.fail(f"Triton did not become ready: {log.read_text()[-3000:]}")
        yield ports
    finally:
        containerd.ctr("task", "kill", "--signal", "SIGTERM", "triton", check=False)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            containerd.ctr("task", "kill", "--signal", "SIGKILL", "triton", check=False)
            process.wait(timeout=30)


def status_field(pid: int, field: str) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line for line in status.splitlines() if line.startswith(f"{field}:")).split()[1]


def uid_of(pid: int) -> int:
    return int(status_field(pid, "Uid"))


def test_triton_image_serves_gpu_sim_as_uid_1000_on_a_read_only_root(
    containerd: Containerd, triton: dict[str, int]
) -> None:
    client = tritonclient.http.InferenceServerClient(f"127.0.0.1:{triton['http']}")
    try:
        values = np.linspace(-2, 2, 16, dtype=np.float32).reshape(1, 16)
        request = tritonclient.http.InferInput("INPUT", [1, 16], "FP32")
        request.set_data_from_numpy(values)
        answer = client.infer("gpu_sim", [request]).as_numpy("OUTPUT")
    finally:
        client.close()
    np.testing.assert_allclose(answer, np.tanh(values), rtol=1e-6)

    server = containerd.task_pid("triton")
    children = Path(f"/proc/{server}/task/{server}/children").read_text().split()
    assert uid_of(server) == 1000
    assert int(status_field(server, "CapEff"), 16) == 0
    assert int(status_field(server, "CapBnd"), 16) == 0
    assert status_field(server, "NoNewPrivs") == "1"
    assert children, "the Python backend's stubs run as the server's children"
    assert {uid_of(int(child)) for child in children} == {1000}

    for path in ("/opt/tritonserver/backends/python/x", "/models/gpu_sim/x", "/x"):
        refused = containerd.exec("triton", ["python", "-c", CREATE_AND_EXIT_WITH_ERRNO, path])
        assert refused.returncode == errno.EROFS, (path, refused)
    assert (
        containerd.exec("triton", ["python", "-c", CREATE_AND_EXIT_WITH_ERRNO, "/tmp/x"]).returncode
        == 0
    )


def test_triton_image_refuses_a_model_load_without_the_deployment_s_header(
    triton: dict[str, int],
) -> None:
    load = f"http://127.0.0.1:{triton['http']}/v2/repository/models/gpu_sim/load"
    assert post_status(load, headers={}) == 403
    assert post_status(load, headers={HEADER: "wrong"}) == 403
    assert post_status(load, headers={HEADER: TOKEN}) == 200
    wait_for(f"http://127.0.0.1:{triton['http']}/v2/models/gpu_sim/ready")

    grpc = tritonclient.grpc.InferenceServerClient(f"127.0.0.1:{triton['grpc']}")
    try:
        with pytest.raises(tritonclient.utils.InferenceServerException, match="restricted"):
            grpc.load_model("gpu_sim")
        with pytest.raises(tritonclient.utils.InferenceServerException, match="restricted"):
            grpc.load_model("gpu_sim", headers={HEADER: TOKEN})
        # Over gRPC, Triton expects the header's name with its own prefix.
        grpc.load_model("gpu_sim", headers={f"triton-grpc-protocol-{HEADER}": TOKEN})
        assert grpc.is_model_ready("gpu_sim")
    finally:
        grpc.close()


def test_operator_image_runs_batchpilot_as_65532_without_the_harness(
    containerd: Containerd, built: dict[str, images.BuiltImage]
) -> None:
    operator = built["batchpilot-operator"].reference
    # The image has no shell and no coreutils (a distroless base): Python says who it runs as.
    user = containerd.run(
        operator, "operator-id", ["python", "-c", "import os; print(os.getuid())"]
    )
    assert user.stdout.strip() == "65532", user.stderr
    # kopf names each replica in its peering `<user>@<host>`: a uid without a passwd entry made
    # the operator exit at start in a Pod (e2e/test_install.py found it).
    named = containerd.run(
        operator, "operator-user", ["python", "-c", "import getpass; print(getpass.getuser())"]
    )
    assert named.stdout.strip() == "batchpilot", named.stderr
    helped = containerd.run(operator, "operator-help", ["batchpilot", "--help"])
    assert helped.returncode == 0, helped.stderr
    assert "operator" in helped.stdout
    demo = containerd.run(operator, "operator-demo", ["batchpilot", "demo"])
    assert demo.returncode == 2
    assert "batchpilot demo: not part of this installation" in demo.stderr


def test_operator_image_refuses_a_policy_naming_a_calendar_saying_how_to_get_them(
    containerd: Containerd, built: dict[str, images.BuiltImage]
) -> None:
    # The image leaves exchange-calendars (and pandas, numpy) out; the sample policy names XNYS.
    sample = locations.REPO_ROOT / "manifests" / "batchpolicy.yaml"
    mounts = [f"type=bind,src={sample},dst=/policy.yaml,options=rbind:ro"]
    argv = ["batchpilot", "explain", "--policy", "/policy.yaml", "--at", "2026-11-24T15:00:00Z"]
    refused = containerd.run(
        built["batchpilot-operator"].reference, "operator-calendar", argv, mounts=mounts
    )
    assert refused.returncode != 0
    assert "spec.schedule.calendar: calendar 'XNYS'" in refused.stderr, refused.stderr
    assert "batchpilot[calendars]" in refused.stderr, refused.stderr
    shell = containerd.run(built["batchpilot-operator"].reference, "operator-sh", ["sh", "-c", ":"])
    assert shell.returncode != 0


def test_sidecar_image_serves_healthz_beside_the_triton_image(
    containerd: Containerd, built: dict[str, images.BuiltImage], triton: dict[str, int]
) -> None:
    port = free_port()
    argv = [
        "python", "-m", "batchpilot_sidecar",
        f"--triton-url=http://127.0.0.1:{triton['http']}",
        f"--listen=127.0.0.1:{port}",
        "--model-repository=/models",
    ]  # fmt: skip
    mounts = [f"type=bind,src={MODELS},dst=/models,options=rbind:ro"]
    reference = built["batchpilot-sidecar"].reference
    process = subprocess.Popen(
        containerd.run_argv(reference, "sidecar", argv, mounts=mounts),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for(f"http://127.0.0.1:{port}/healthz", timeout=60, process=process)
        assert uid_of(containerd.task_pid("sidecar")) == 65532
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as response:
            status = json.load(response)
        assert status
    finally:
        containerd.ctr("task", "kill", "--signal", "SIGTERM", "sidecar", check=False)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.communicate(timeout=30)
        if process.poll() is None:
            containerd.ctr("task", "kill", "--signal", "SIGKILL", "sidecar", check=False)
            process.communicate(timeout=30)
