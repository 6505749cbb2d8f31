"""How the operator will log in, decided from files alone, before kopf is imported.

In a Pod the operator logs in with its ServiceAccount; elsewhere with the kubeconfig's current
user. Only a user without a credential of its own (an exec plugin, an auth provider) needs the
Kubernetes client library to log in (it runs the plugin). Otherwise the operator keeps that
library out of the process: kopf imports its models whenever it is installed (to tell them apart
from dicts, which is all the operator hands it), and they cost 34 MiB (`cli`'s operator command).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
CREDENTIALS = ("token", "client-certificate", "client-certificate-data", "username")
"""What kopf's own kubeconfig login reads (`kopf.login_with_kubeconfig`); anything else is the
client's to run."""


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
    current: str | None = None
    contexts: dict[str, Any] = {}
    users: dict[str, Any] = {}
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
            users.setdefault(entry.get("name"), entry.get("user") or {})
    context = contexts.get(current) if current else None
    user = users.get(str(context.get("user"))) if isinstance(context, dict) else None
    return user if isinstance(user, dict) else None


def needs_the_client(service_account: Path = SERVICE_ACCOUNT) -> bool:
    """Whether logging in must run the kubeconfig user's exec plugin or auth provider."""
    if in_cluster(service_account):
        return False
    user = current_user()
    if user is None:
        return False
    has_credential = any(user.get(key) for key in CREDENTIALS)
    provider_token = ((user.get("auth-provider") or {}).get("config") or {}).get("access-token")
    return not has_credential and not provider_token
