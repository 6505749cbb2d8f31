"""Fixtures for tests against a real API server: ``pytest e2e --e2e``.

With ``KUBECONFIG`` set, the tests use that cluster, but only if its current context is plainly a
test cluster (``batchpilot-e2e`` or ``kind-batchpilot``). Without it they use the local control
plane (see ``batchpilot_cluster``): the one ``make cluster-up`` left running, or one started for the
session. That happens after collection and outside every test, so the per-test timeouts measure
the tests, not the start of the cluster.
"""

import asyncio
import contextlib
import os
import re
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from batchpilot_cluster import building, controlplane, locations, podnetwork
from batchpilot_testbed import fleet, kubes, namespaces, operators, waiting

ALLOWED_CONTEXTS = ("batchpilot-e2e", "kind-batchpilot")


@pytest.fixture(scope="session", autouse=True)
def _current_event_loop() -> Iterator[None]:
    """A current event loop that is closed at the end (see tests/conftest.py: pytest-asyncio
    otherwise creates one after a test's asyncio.run() and never closes it)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield
    asyncio.set_event_loop(None)
    loop.close()


DUMP_LOG_LINES = 20
PREVIOUS_LOG_LINES = 80


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--e2e",
        action="store_true",
        default=False,
        help="run the e2e tests: against $KUBECONFIG if set, else a local cluster started here",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--e2e"):
        return
    skip = pytest.mark.skip(reason="e2e test: give --e2e to run it")
    for item in items:
        if item.get_closest_marker("e2e"):
            item.add_marker(skip)


class _LocalCluster:
    """The session's local cluster, if it starts one; held by the config, stopped at exit."""

    def __init__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.cluster: controlplane.Cluster | None = None
        self.error: str | None = None


_LOCAL_KEY = pytest.StashKey[_LocalCluster]()


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _runs_side_by_side(config: pytest.Config) -> bool:
    """`-n N`: pytest-xdist's workers share one cluster, which this process (their controller)
    starts before they do; a worker never starts one of its own."""
    return bool(config.getoption("numprocesses", None)) and not _is_xdist_worker(config)


def _start_local_cluster(config: pytest.Config) -> None:
    if _LOCAL_KEY in config.stash:
        return
    local = _LocalCluster()
    config.stash[_LOCAL_KEY] = local
    state_dir = locations.state_dir()
    if controlplane.is_up(state_dir):  # `make cluster-up` started it; leave it running after
        local.cluster = controlplane.Cluster.load(state_dir)
        return
    if _is_xdist_worker(config):
        local.error = f"the controller of this -n run left no cluster up in {state_dir}"
        return
    try:
        building.require_binaries()
        local.cluster = local.stack.enter_context(
            controlplane.running(keep_logs=True, real_nodes=controlplane.E2E_REAL_NODES)
        )
    except (building.BuildError, controlplane.ClusterError) as error:
        local.error = str(error)


def pytest_configure(config: pytest.Config) -> None:
    wanted = config.getoption("--e2e") and not os.environ.get("KUBECONFIG")
    if wanted and _runs_side_by_side(config):
        _start_local_cluster(config)


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    wanted = any(item.get_closest_marker("e2e") for item in session.items)
    if not config.getoption("--e2e") or not wanted or os.environ.get("KUBECONFIG"):
        return
    _start_local_cluster(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    local = config.stash.get(_LOCAL_KEY, None)
    if local is not None:
        local.stack.close()


@pytest.fixture(scope="session")
def kube(pytestconfig: pytest.Config) -> kubes.Kube:
    configured = os.environ.get("KUBECONFIG")
    if configured:
        return _given_cluster(Path(configured.split(os.pathsep)[0]))
    started = pytestconfig.stash.get(_LOCAL_KEY, None)
    if started is None or started.cluster is None:
        pytest.fail(f"no local cluster: {started.error if started else 'not started'}")
    cluster = started.cluster
    return kubes.Kube(
        kubeconfig=cluster.kubeconfig,
        context=kubes.current_context(cluster.kubeconfig),
        local=cluster,
    )


def _given_cluster(kubeconfig: Path) -> kubes.Kube:
    context = kubes.current_context(kubeconfig)
    if not any(allowed in context for allowed in ALLOWED_CONTEXTS):
        pytest.exit(
            f"refusing to run e2e tests against context {context!r} of {kubeconfig}: "
            f"its name must contain one of {ALLOWED_CONTEXTS}",
            returncode=4,
        )
    # A cluster that `python -m batchpilot_cluster up` started is as local as one started here.
    state_dir = locations.state_dir()
    local = None
    if kubeconfig.resolve() == state_dir / "kubeconfig" and controlplane.is_up(state_dir):
        local = controlplane.Cluster.load(state_dir)
    return kubes.Kube(kubeconfig=kubeconfig, context=context, local=local)


@pytest.fixture
def local_cluster(kube: kubes.Kube) -> controlplane.Cluster:
    """The local cluster, for tests that reach into its real node (a container's processes, a
    Pod's link); skips on other clusters."""
    if kube.local is None:
        pytest.skip("needs the local cluster (its real node); KUBECONFIG points elsewhere")
    return kube.local


@pytest.fixture
def client_host(local_cluster: controlplane.Cluster) -> Iterator[podnetwork.Host]:
    """A network namespace of its own for clients that go through Services (kube-proxy routes
    what enters the host from it), removed at teardown; only on the local cluster."""
    with podnetwork.client_host(routes=controlplane.HOST_ROUTES) as host:
        yield host


@pytest.fixture
def triton_pods(kube: kubes.Kube) -> None:
    """For tests that need Triton Pods that really run: the local cluster, or kind with the
    images of `python -m batchpilot_testbed.kind`; skips elsewhere."""
    if not fleet.pods_run_here(kube.local is not None):
        pytest.skip(
            "needs real Triton Pods: the local cluster's real node, or kind with "
            f"${fleet.TRITON_IMAGE_ENV} (python -m batchpilot_testbed.kind test)"
        )


@pytest.fixture
def namespace(kube: kubes.Kube, request: pytest.FixtureRequest) -> Iterator[str]:
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")
    name = namespaces.unique(f"e2e-{slug[:40].strip('-')}")
    with namespaces.created(kube, name, label="batchpilot.dev/e2e") as created:
        yield created


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and call.when in ("setup", "call"):
        with contextlib.suppress(Exception):  # a broken cluster must not hide the failure
            _add_diagnostics(item, report)
    return report


def _add_diagnostics(item: pytest.Item, report: pytest.TestReport) -> None:
    funcargs = getattr(item, "funcargs", {})
    kube = funcargs.get("kube")
    namespace = funcargs.get("namespace")
    if isinstance(kube, kubes.Kube) and isinstance(namespace, str):
        report.sections.append(
            (
                f"events in {namespace}",
                kube.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp"),
            )
        )
        report.sections.append(
            (
                f"objects in {namespace}",
                kube.kubectl(
                    "get",
                    "pods,deployments,replicasets,services,configmaps",
                    "-n",
                    namespace,
                    "-o",
                    "yaml",
                ),
            )
        )
        report.sections.extend(_restarted_containers_logs(kube, namespace))
    for log_path in getattr(item, "operator_logs", []):
        lines = log_path.read_text(errors="replace").splitlines()[-60:]
        report.sections.append((f"operator log {log_path.name}", "\n".join(lines)))
    if isinstance(kube, kubes.Kube) and kube.local is not None:
        for log in sorted(kube.local.logs_dir.rglob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-DUMP_LOG_LINES:]
            name = log.relative_to(kube.local.logs_dir)
            report.sections.append((f"log tail {name}", "\n".join(lines)))


def _restarted_containers_logs(kube: kubes.Kube, namespace: str) -> Iterator[tuple[str, str]]:
    """The last lines a restarted container wrote before it ended (`fleet.container_restarts`)."""
    for restart in fleet.container_restarts(kube, namespace, tail=PREVIOUS_LOG_LINES):
        yield (f"previous log of {restart.describe()}", restart.previous_log)


@pytest.fixture(scope="session")
def operator_kubeconfig(kube: kubes.Kube, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CRDs and the operator's RBAC installed; a kubeconfig that is its ServiceAccount."""
    return operators.install_and_log_in(kube, tmp_path_factory.mktemp("operator") / "kubeconfig")


@pytest.fixture
def start_operator(
    operator_kubeconfig: Path, namespace: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., operators.OperatorProcess]]:
    """Start `batchpilot operator` for the test's namespace (or the `namespaces` given);
    stopped (log kept) at teardown."""
    started: list[operators.OperatorProcess] = []
    request.node.operator_logs = []  # read by the report hook when a test fails

    def start(**options: Any) -> operators.OperatorProcess:
        process = operators.OperatorProcess(
            kubeconfig=operator_kubeconfig,
            log_path=tmp_path / f"operator-{len(started)}.log",
            **{"namespaces": [namespace], **options},
        )
        started.append(process)
        request.node.operator_logs.append(process.log_path)
        waiting.wait_for("the operator's liveness endpoint", process.healthy, timeout=30)
        return process

    yield start
    for process in started:
        process.stop()
