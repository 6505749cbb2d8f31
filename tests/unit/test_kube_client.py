"""The operator's one client: a deadline on each whole call, one error whatever failed, and
Events posted as news (a failure is logged, never raised)."""

from __future__ import annotations

import asyncio
import datetime
import threading
from typing import Any

import kubernetes.client
import pytest
import urllib3.exceptions

from batchpilot.kube import client, events


def kube_client(timeout: float = 5.0) -> client.KubeClient:
    return client.KubeClient(kubernetes.client.ApiClient(), timeout=timeout)


async def test_a_call_that_never_answers_ends_the_wait_at_its_deadline() -> None:
    release = threading.Event()
    seen: dict[str, Any] = {}

    def hangs(name: str, **kwargs: Any) -> None:
        seen.update(kwargs, name=name)
        release.wait(30)

    try:
        with pytest.raises(client.KubeError) as raised:
            await kube_client(timeout=0.05).call("setting a gate", hangs, "triton-0")
    finally:
        release.set()
    assert seen == {"name": "triton-0", "_request_timeout": 0.05}
    assert raised.value.status is None
    assert str(raised.value) == "setting a gate: no answer in time"


async def test_calls_that_hang_hold_the_clients_threads_never_the_loops() -> None:
    release = threading.Event()
    kube = client.KubeClient(kubernetes.client.ApiClient(), timeout=0.05, workers=2)

    def hangs(**_: Any) -> None:
        release.wait(30)

    try:
        for _ in range(3):
            with pytest.raises(client.KubeError):
                await kube.call("reading a Secret", hangs)
        # Both of its threads hang: the default pool (name resolution) still answers, and
        # another call waits its deadline in the queue rather than starting a third thread.
        assert await asyncio.to_thread(lambda: "resolved") == "resolved"
        with pytest.raises(client.KubeError):
            await kube.call("reading a Secret", hangs)
        assert len(kube._threads._threads) == 2
    finally:
        release.set()
        kube.close()


async def test_an_answer_in_time_is_returned() -> None:
    assert await kube_client().call("doubling", lambda x, **_: x * 2, 21) == 42


@pytest.mark.parametrize(
    ("failure", "status", "reason"),
    [
        (kubernetes.client.ApiException(status=403, reason="Forbidden"), 403, "Forbidden"),
        (kubernetes.client.ApiException(status=409), 409, "HTTP 409"),
        (urllib3.exceptions.MaxRetryError(None, "/api"), None, "no connection (MaxRetryError)"),  # type: ignore[arg-type]
    ],
)
async def test_every_failure_is_one_error_with_its_status_or_none(
    failure: Exception, status: int | None, reason: str
) -> None:
    def fails(**_: Any) -> None:
        raise failure

    with pytest.raises(client.KubeError) as raised:
        await kube_client().call("writing a status", fails)
    assert (raised.value.status, raised.value.reason) == (status, reason)


POLICY = {
    "apiVersion": "batchpilot.dev/v1alpha1",
    "kind": "BatchPolicy",
    "metadata": {"name": "desk", "namespace": "team-a", "uid": "u-1"},
}


def test_an_event_names_its_policy_and_batchpilot_as_its_source() -> None:
    now = datetime.datetime(2026, 11, 27, 9, 30, tzinfo=datetime.UTC)
    body = events.event_body(
        POLICY, now, type="Warning", reason="TargetUnreachable", message="x" * 2000
    )
    assert body["involvedObject"] == {
        "apiVersion": "batchpilot.dev/v1alpha1",
        "kind": "BatchPolicy",
        "name": "desk",
        "namespace": "team-a",
        "uid": "u-1",
    }
    assert body["metadata"] == {"namespace": "team-a", "generateName": "batchpilot-"}
    assert (body["type"], body["reason"]) == ("Warning", "TargetUnreachable")
    assert len(body["message"]) == events.MAX_MESSAGE_LENGTH
    assert body["source"] == {"component": "batchpilot"}
    assert body["firstTimestamp"] == body["lastTimestamp"] == "2026-11-27T09:30:00+00:00"


async def test_an_event_that_cannot_be_posted_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    posted: list[tuple[str, dict[str, Any]]] = []

    class RefusingCore:
        def create_namespaced_event(self, namespace: str, body: dict[str, Any], **_: Any) -> None:
            posted.append((namespace, body))
            raise kubernetes.client.ApiException(status=403, reason="Forbidden")

    kube = kube_client()
    kube.core = RefusingCore()  # type: ignore[assignment]
    await events.Events(kube).post(
        POLICY, type="Normal", reason="ProfileSwitched", message="bulk -> interactive"
    )
    assert [namespace for namespace, _ in posted] == ["team-a"]
    assert "event not posted (posting a ProfileSwitched event in team-a: Forbidden)" in caplog.text
