"""The repository credential: read from the policy's Secret, sent on repository calls, and a
missing or refused one is a condition and an event with nothing half-applied."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pydantic
import pytest
from operator_fakes import FakeFleet, FakeGates, FakePods, FakeServer, target

from batchpilot import reconciling, telemetry
from batchpilot.api.v1alpha1 import specs
from batchpilot.applying import credentials
from batchpilot.applying.replicas import Replica
from batchpilot.kube import client, secret_credentials
from batchpilot_triton import servers
from builders import spec_document, utc

NOW = utc(2026, 11, 24, 15)
TOKEN = "7f3c9a1e5b"
HEADER_NAME = specs.DEFAULT_REPOSITORY_HEADER
HEADER = {HEADER_NAME: TOKEN}
CREDENTIAL = specs.RepositoryCredential.model_validate({"secretName": "triton-credential"})
LOCKED_SPEC = spec_document(
    target={
        "selector": {"matchLabels": {"app": "triton"}},
        "repositoryCredential": {"secretName": "triton-credential"},
    }
)


class FixedCredential:
    def __init__(self, headers: dict[str, str] | None = None, problem: str = "") -> None:
        self.headers = headers or {}
        self.problem = problem
        self.asked: list[tuple[str, specs.RepositoryCredential | None]] = []
        self.forgotten: list[tuple[str, specs.RepositoryCredential | None]] = []

    async def repository_headers(
        self, namespace: str, credential: specs.RepositoryCredential | None
    ) -> dict[str, str]:
        self.asked.append((namespace, credential))
        if self.problem:
            raise credentials.CredentialUnavailable(self.problem)
        return dict(self.headers)

    def forget(self, namespace: str, credential: specs.RepositoryCredential | None) -> None:
        self.forgotten.append((namespace, credential))


def locked_fleet(*replicas: Replica) -> FakeFleet:
    return FakeFleet({r.http_url: FakeServer(repository_headers=dict(HEADER)) for r in replicas})


def reconciler(
    targets: list[Replica], fleet: FakeFleet, source: FixedCredential, gates: FakeGates
) -> reconciling.Reconciler:
    return reconciling.Reconciler(
        replicas=FakePods(targets),
        gates=gates,
        fleet=fleet,
        signal_source=lambda namespace, policy, found: _NoSignals(),
        metrics=telemetry.controller_metrics(),
        clock=lambda: NOW,
        settle_seconds=0,
        credential_source=source,
    )


class _NoSignals:
    async def read(self) -> Any:
        raise AssertionError("the base spec reads no signals")

    async def close(self) -> None:
        pass


async def reconcile(subject: reconciling.Reconciler, **kwargs: Any) -> reconciling.Reconciled:
    return await subject.reconcile(
        namespace="ns",
        name="fleet",
        spec=LOCKED_SPEC,
        status=kwargs.get("status", {}),
        generation=1,
        state=kwargs.get("state") or reconciling.PolicyMemory(),
    )


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


@pytest.mark.looptime
async def test_the_policys_credential_is_sent_and_a_locked_fleet_switches() -> None:
    targets = [target("triton-0", gated=True, gate="True"), target("triton-1")]
    fleet = locked_fleet(*targets)
    source = FixedCredential(dict(HEADER))
    outcome = await reconcile(reconciler(targets, fleet, source, FakeGates()))
    assert source.asked == [("ns", CREDENTIAL)]
    assert fleet.headers == {t.http_url: HEADER for t in targets}
    assert all(server.profile == "bulk" for server in fleet.servers.values())
    assert conditions(outcome.status)["CredentialRefused"] == ("False", "CredentialAccepted")
    assert conditions(outcome.status)["Ready"] == ("True", "RolledOut")


@pytest.mark.looptime
async def test_an_unreadable_secret_applies_nothing_and_says_why_once() -> None:
    targets = [target("triton-0", gated=True, gate="True"), target("triton-1")]
    fleet = locked_fleet(*targets)
    gates = FakeGates()
    problem = "Secret ns/triton-credential does not exist"
    subject = reconciler(targets, fleet, FixedCredential(problem=problem), gates)
    state = reconciling.PolicyMemory()
    first = await reconcile(subject, state=state)
    assert fleet.calls == []
    assert gates.changes == []
    assert all(server.profile is None for server in fleet.servers.values())
    assert conditions(first.status)["CredentialRefused"] == ("True", "SecretUnavailable")
    assert conditions(first.status)["Ready"] == ("False", "CredentialUnavailable")
    warnings = [(e.reason, e.message) for e in first.events if e.type == "Warning"]
    assert warnings == [
        (
            "CredentialRefused",
            f"spec.target.repositoryCredential: {problem}; nothing applied",
        )
    ]
    second = await reconcile(subject, status=first.status, state=state)
    assert [e.reason for e in second.events if e.type == "Warning"] == []


@pytest.mark.looptime
async def test_a_credential_triton_refuses_leaves_every_pod_serving_and_in_its_services() -> None:
    targets = [target("triton-0", gated=True, gate="True"), target("triton-1", gated=True)]
    fleet = locked_fleet(*targets)
    gates = FakeGates()
    wrong = {specs.DEFAULT_REPOSITORY_HEADER: "not-the-token"}
    outcome = await reconcile(reconciler(targets, fleet, FixedCredential(wrong), gates))
    assert [call for call in fleet.calls if call[0] == "apply"] == []
    # No gate was closed, and a Pod not yet in its Services joins them: it serves what it
    # served, and nothing will change that until the credential is right.
    assert gates.changes == [("triton-1", True, "CredentialRefused")]
    assert conditions(outcome.status)["CredentialRefused"] == ("True", "RefusedByTriton")
    assert {(e.reason, e.type) for e in outcome.events if e.type == "Warning"} == {
        ("CredentialRefused", "Warning")
    }
    details = {d["name"]: d["state"] for d in outcome.status["targetDetails"]}
    assert details == {"triton-0": "Failed", "triton-1": "Failed"}


def test_the_credential_is_optional_and_its_header_is_a_lower_case_token() -> None:
    parsed = specs.Target.model_validate(
        {
            "selector": {"matchLabels": {"app": "triton"}},
            "repositoryCredential": {"secretName": "triton-credential"},
        }
    )
    assert parsed.repository_credential == CREDENTIAL
    assert (CREDENTIAL.key, CREDENTIAL.header) == ("token", "batchpilot-repository-token")
    assert (
        specs.Target.model_validate(
            {"selector": {"matchLabels": {"app": "triton"}}}
        ).repository_credential
        is None
    )
    for bad in ({"secretName": "Other/ns"}, {"secretName": "x", "header": "X-Token"}):
        with pytest.raises(pydantic.ValidationError):
            specs.RepositoryCredential.model_validate(bad)


class FakeApiServer(client.KubeClient):
    """The operator's client over Secrets held here: what it asked for, and the API server's
    refusal (`status`) or answer."""

    def __init__(self, secrets_by_name: dict[str, dict[str, str]], status: int = 0) -> None:
        super().__init__()
        self.secrets = secrets_by_name
        self.status = status
        self.read: list[tuple[str, str]] = []

    async def request(self, what: str, method: str, path: str, **_: Any) -> dict[str, Any]:
        *_, namespace, plural, name = path.split("/")
        assert (method, plural) == ("GET", "secrets"), path
        self.read.append((namespace, name))
        if self.status:
            raise client.KubeError(what, self.status, f"HTTP {self.status}")
        if name not in self.secrets:
            raise client.KubeError(what, 404, "Not Found")
        data = {k: base64.b64encode(v.encode()).decode() for k, v in self.secrets[name].items()}
        return {"kind": "Secret", "data": data}


def secret_source(
    api: FakeApiServer, clock: Any = lambda: 0.0
) -> secret_credentials.SecretCredentials:
    return secret_credentials.SecretCredentials(api, clock=clock)


async def test_the_secret_is_read_once_a_cache_period_and_again_once_triton_refuses_it() -> None:
    """Issue 39: every pass of every policy read its Secret through the API, on the pool of
    threads all tenants share."""
    api = FakeApiServer({"triton-credential": {"token": TOKEN}})
    now = [0.0]
    source = secret_source(api, clock=lambda: now[0])
    for second in range(0, 30, 2):
        now[0] = second
        assert await source.repository_headers("team-a", CREDENTIAL) == HEADER
    assert api.read == [("team-a", "triton-credential")]
    now[0] = secret_credentials.CACHE_SECONDS
    await source.repository_headers("team-a", CREDENTIAL)
    assert len(api.read) == 2
    api.secrets["triton-credential"]["token"] = "rotated"
    source.forget("team-a", CREDENTIAL)
    assert await source.repository_headers("team-a", CREDENTIAL) == {HEADER_NAME: "rotated"}
    assert len(api.read) == 3
    other = specs.RepositoryCredential.model_validate(
        {"secretName": "triton-credential", "header": "triton-admin-key"}
    )
    assert await source.repository_headers("team-a", other) == {"triton-admin-key": "rotated"}
    assert len(api.read) == 3, "the same Secret and key under another header: cached"


@pytest.mark.looptime
async def test_a_credential_triton_refuses_is_read_afresh_on_the_next_pass() -> None:
    targets = [target("triton-0")]
    rotated = {HEADER_NAME: "rotated"}
    fleet = FakeFleet({targets[0].http_url: FakeServer(repository_headers=rotated)})
    source = FixedCredential(dict(HEADER))
    await reconcile(reconciler(targets, fleet, source, FakeGates()))
    assert source.forgotten == [("ns", CREDENTIAL)]
    accepted = FixedCredential(dict(rotated))
    await reconcile(reconciler(targets, fleet, accepted, FakeGates()))
    assert accepted.forgotten == []


async def test_the_secret_is_read_in_the_policys_own_namespace_only() -> None:
    api = FakeApiServer({"triton-credential": {"token": TOKEN + "\n"}})
    credential = CREDENTIAL
    headers = await secret_source(api).repository_headers("team-a", credential)
    assert headers == HEADER  # a trailing newline (echo > file) is not part of the value
    assert api.read == [("team-a", "triton-credential")]
    assert await secret_source(api).repository_headers("team-a", None) == {}


@pytest.mark.parametrize(
    ("api", "credential", "says"),
    [
        (FakeApiServer({}), {}, "Secret team-a/triton-credential does not exist"),
        (FakeApiServer({}, status=403), {}, "may not read Secret team-a/triton-credential"),
        (FakeApiServer({"triton-credential": {"other": TOKEN}}), {}, "has no key 'token'"),
        (FakeApiServer({"triton-credential": {"token": "two words"}}), {}, "not a usable header"),
    ],
)
async def test_a_secret_that_cannot_give_the_credential_says_why_without_its_value(
    api: FakeApiServer, credential: dict[str, str], says: str
) -> None:
    named = specs.RepositoryCredential.model_validate(
        {"secretName": "triton-credential", **credential}
    )
    with pytest.raises(credentials.CredentialUnavailable) as raised:
        await secret_source(api).repository_headers("team-a", named)
    assert says in str(raised.value)
    assert "two words" not in str(raised.value)


async def test_the_runner_takes_the_value_from_a_file_or_the_environment_never_an_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchpilot import cli

    named = specs.RepositoryCredential.model_validate(
        {"secretName": "x", "header": "triton-admin-key"}
    )
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n", encoding="utf-8")
    from_file = cli._repository_credential(token_file)
    assert await from_file.repository_headers("", named) == {"triton-admin-key": TOKEN}
    assert await from_file.repository_headers("", None) == HEADER
    monkeypatch.setenv(cli.REPOSITORY_TOKEN_ENV, TOKEN)
    assert await cli._repository_credential(None).repository_headers("", None) == HEADER
    monkeypatch.delenv(cli.REPOSITORY_TOKEN_ENV)
    with pytest.raises(credentials.CredentialUnavailable, match="BATCHPILOT_REPOSITORY_TOKEN"):
        await cli._repository_credential(None).repository_headers("", named)
    assert await cli._repository_credential(None).repository_headers("", None) == {}
    # No option takes the value itself: a command line is anyone's to read (ps).
    with pytest.raises(SystemExit):
        cli.main(
            ["run", "--policy", "p.yaml", "--triton", "http://x:1", "--repository-token", TOKEN]
        )


@pytest.mark.looptime
async def test_a_load_refused_for_its_credential_reopens_the_gate_it_closed() -> None:
    targets = [target("triton-0", gated=True, gate="True")]
    fleet = FakeFleet({targets[0].http_url: FakeServer()})
    fleet.servers[targets[0].http_url].fail_with = servers.RepositoryLocked(
        targets[0].http_url, "load of gpu_sim: the server refused the credential"
    )
    gates = FakeGates()
    outcome = await reconcile(reconciler(targets, fleet, FixedCredential(dict(HEADER)), gates))
    assert gates.changes == [
        ("triton-0", False, "Switching"),
        ("triton-0", True, "CredentialRefused"),
    ]
    assert conditions(outcome.status)["CredentialRefused"] == ("True", "RefusedByTriton")


async def test_a_secret_that_cannot_give_the_value_is_asked_again_only_a_cache_period_later() -> (
    None
):
    api = FakeApiServer({})
    now = [0.0]
    source = secret_source(api, clock=lambda: now[0])
    for second in (0.0, 5.0, secret_credentials.CACHE_SECONDS):
        now[0] = second
        with pytest.raises(credentials.CredentialUnavailable, match="does not exist"):
            await source.repository_headers("team-a", CREDENTIAL)
    assert len(api.read) == 2
