"""How the operator will log in, decided from files alone, before kopf is imported.

In a Pod the operator logs in with its ServiceAccount; elsewhere with the kubeconfig's current
user: its token or certificate, or what its exec plugin (`gcloud`, `aws eks get-token`,
`kubelogin`) prints, run here (`run_exec_plugin`) as kubectl runs it, but with a deadline: the
Kubernetes client waits on a plugin for ever. A user with a legacy auth provider and no token
(`needs_the_client`) is logged in by the Kubernetes client library, which refreshes the token
with no deadline either: in a child process run as an exec plugin (`provider_login`), under the
same deadline. The operator's own process never imports that library: kopf imports its models
whenever it is installed (to tell them apart from dicts, which is all the operator hands it),
and they cost 34 MiB (`cli`'s operator command).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
CREDENTIALS = ("token", "client-certificate", "client-certificate-data", "username")
"""What kopf's own kubeconfig login reads (`kopf.login_with_kubeconfig`)."""

EXEC_SECONDS = 20.0
"""How long an exec plugin may take to print its credential: within kopf's login deadline
(`client.LOGIN_SECONDS`), and long enough for a cloud's token endpoint."""
MAX_EXEC_OUTPUT_BYTES = 1024 * 1024
"""The most of a plugin's output that is read: past it the plugin is killed, not read on."""
EXEC_STDERR_KEPT_BYTES = 4096
"""The tail of a plugin's stderr kept for its last line."""
EXEC_API = "client.authentication.k8s.io/v1beta1"
"""The ExecCredential version a plugin is told when its entry names none."""


class LoginFailed(Exception):
    """Logging in cannot succeed as configured; the message says why."""


@dataclasses.dataclass(frozen=True)
class ExecCredential:
    """What an exec plugin printed: a token, or a client certificate and key (PEM)."""

    token: str | None = None
    client_certificate_data: str | None = None
    client_key_data: str | None = None
    expiration: datetime.datetime | None = None


def in_cluster(service_account: Path = SERVICE_ACCOUNT) -> bool:
    """Whether the process runs in a Pod with a ServiceAccount token, as the client decides."""
    return bool(
        os.environ.get("KUBERNETES_SERVICE_HOST")
        and os.environ.get("KUBERNETES_SERVICE_PORT")
        and (service_account / "token").is_file()
    )


def _paths() -> list[Path]:
    listed = os.environ.get("KUBECONFIG") or "~/.kube/config"
    return [Path(path).expanduser() for path in listed.split(os.pathsep) if path.strip()]


def current_user() -> dict[str, Any] | None:
    """The kubeconfig's current context's user (the first file that names each wins), or None
    when there is no kubeconfig, no current context or no such user."""
    found = _current_user()
    return found[0] if found else None


def _current_user() -> tuple[dict[str, Any], Path] | None:
    """The current user and the kubeconfig file that names it (a plugin's relative command is
    relative to that file's folder)."""
    current: str | None = None
    contexts: dict[str, Any] = {}
    users: dict[str, tuple[Any, Path]] = {}
    for path in _paths():
        try:
            config = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        if not isinstance(config, dict):
            continue
        current = current or config.get("current-context")
        for entry in config.get("contexts") or []:
            contexts.setdefault(entry.get("name"), entry.get("context") or {})
        for entry in config.get("users") or []:
            users.setdefault(entry.get("name"), (entry.get("user") or {}, path))
    context = contexts.get(current) if current else None
    named = users.get(str(context.get("user"))) if isinstance(context, dict) else None
    if named is None or not isinstance(named[0], dict):
        return None
    return named


def needs_the_client(service_account: Path = SERVICE_ACCOUNT) -> bool:
    """Whether logging in needs the Kubernetes client: a kubeconfig user with a legacy auth
    provider and no token of its own (an exec plugin is run here, `run_exec_plugin`)."""
    if in_cluster(service_account):
        return False
    user = current_user()
    return user is not None and _through_a_provider(user)


def _through_a_provider(user: dict[str, Any]) -> bool:
    if user.get("exec"):
        return False
    has_credential = any(user.get(key) for key in CREDENTIALS)
    provider_token = ((user.get("auth-provider") or {}).get("config") or {}).get("access-token")
    return not has_credential and not provider_token


def kubeconfig_credential(timeout: float = EXEC_SECONDS) -> ExecCredential | None:
    """What the current kubeconfig user's exec plugin prints, or the token its legacy auth
    provider gives (the Kubernetes client library run in a child process, `provider_login`,
    under an exec plugin's deadline and cap); None when the kubeconfig holds the credential."""
    found = _current_user()
    if found is None:
        return None
    user, kubeconfig = found
    if isinstance(user.get("exec"), dict):
        return run_exec_plugin(user["exec"], folder=kubeconfig.parent, timeout=timeout)
    if not _through_a_provider(user):
        return None
    provider = user.get("auth-provider")
    name = provider.get("name") if isinstance(provider, dict) else None
    plugin = {"command": sys.executable, "args": ["-m", "batchpilot.kube.provider_login"]}
    return run_exec_plugin(
        plugin,
        folder=kubeconfig.parent,
        timeout=timeout,
        name=f"for the auth provider {name or '(unnamed)'}",
    )


def run_exec_plugin(
    spec: dict[str, Any], *, folder: Path, timeout: float = EXEC_SECONDS, name: str | None = None
) -> ExecCredential:
    """Runs a kubeconfig's exec plugin as kubectl does (its command and arguments as given,
    never through a shell; its `env` on top of ours; `KUBERNETES_EXEC_INFO` saying it may not
    ask anyone anything) and reads the ExecCredential it prints, as it comes, to a cap. A
    plugin that has not answered within `timeout`, or prints past the cap, is killed with
    whatever it started (its own session)."""
    command = spec.get("command")
    if not isinstance(command, str) or not command:
        raise LoginFailed("the kubeconfig user's exec plugin names no command")
    name = name or Path(command).name
    if os.sep in command and not Path(command).is_absolute():
        command = str(folder / command)  # relative to its kubeconfig, as kubectl reads it
    api_version = str(spec.get("apiVersion") or EXEC_API)
    environment = dict(os.environ)
    for entry in spec.get("env") or []:
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            environment[entry["name"]] = str(entry.get("value", ""))
    environment["KUBERNETES_EXEC_INFO"] = json.dumps(
        {"apiVersion": api_version, "kind": "ExecCredential", "spec": {"interactive": False}}
    )
    arguments = [str(argument) for argument in spec.get("args") or []]
    try:
        # The operator's own kubeconfig, which its installer wrote, never a tenant's input.
        plugin = subprocess.Popen(  # noqa: S603
            [command, *arguments],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=environment,
            start_new_session=True,
        )
    except OSError as error:
        raise LoginFailed(f"the exec plugin {name} cannot run: {error.strerror}") from None
    try:
        printed, said = _output(plugin, timeout)
    except TimeoutError:
        _kill_session(plugin)
        raise LoginFailed(f"the exec plugin {name} did not answer within {timeout:g} s") from None
    finally:
        for stream in (plugin.stdout, plugin.stderr):
            if stream is not None:
                stream.close()
    if len(printed) > MAX_EXEC_OUTPUT_BYTES:
        _kill_session(plugin)  # still printing: parse_exec_credential says so
    elif plugin.returncode != 0:
        last = (said.decode(errors="replace").strip().splitlines() or [""])[-1][:200]
        raise LoginFailed(
            f"the exec plugin {name} exited with {plugin.returncode}"
            + (f": {last}" if last else "")
        )
    return parse_exec_credential(printed, name)


def _output(plugin: subprocess.Popen[bytes], timeout: float) -> tuple[bytes, bytes]:
    """What a plugin printed, read as it comes until it ends: its stdout up to one byte past
    MAX_EXEC_OUTPUT_BYTES (then it is left running, to be killed), its stderr's tail. Raises
    TimeoutError when it has not ended within `timeout`, whatever holds its output open."""
    assert plugin.stdout is not None
    assert plugin.stderr is not None
    deadline = time.monotonic() + timeout
    printed, said = bytearray(), bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(plugin.stdout, selectors.EVENT_READ, printed)
        selector.register(plugin.stderr, selectors.EVENT_READ, said)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if len(printed) > MAX_EXEC_OUTPUT_BYTES:
                    return bytes(printed), bytes(said)
                del said[:-EXEC_STDERR_KEPT_BYTES]
    try:
        plugin.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        raise TimeoutError from None
    return bytes(printed), bytes(said)


def _kill_session(plugin: subprocess.Popen[bytes]) -> None:
    """Kills the plugin with whatever it started (its own session, even where it has exited and
    a child holds its output), and reaps it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(plugin.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        plugin.wait(timeout=1)


def parse_exec_credential(printed: bytes, name: str = "exec plugin") -> ExecCredential:
    """The credential in an ExecCredential a plugin printed (status: token, or client
    certificate and key; expirationTimestamp, RFC 3339)."""
    if len(printed) > MAX_EXEC_OUTPUT_BYTES:
        raise LoginFailed(f"the exec plugin {name} printed over {MAX_EXEC_OUTPUT_BYTES} bytes")
    try:
        document = json.loads(printed)
    except ValueError:
        raise LoginFailed(f"the exec plugin {name} printed no ExecCredential (not JSON)") from None
    status = document.get("status") if isinstance(document, dict) else None
    if not isinstance(status, dict):
        raise LoginFailed(f"the exec plugin {name} printed an ExecCredential without a status")
    credential = ExecCredential(
        token=_text(status.get("token")),
        client_certificate_data=_text(status.get("clientCertificateData")),
        client_key_data=_text(status.get("clientKeyData")),
        expiration=_timestamp(status.get("expirationTimestamp")),
    )
    has_certificate = credential.client_certificate_data and credential.client_key_data
    if not credential.token and not has_certificate:
        raise LoginFailed(
            f"the exec plugin {name} printed neither a token nor a client certificate and key"
        )
    return credential


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _timestamp(value: Any) -> datetime.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
