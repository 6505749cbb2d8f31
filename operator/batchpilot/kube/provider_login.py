"""Prints the token a kubeconfig's legacy auth provider gives (`oidc`, or an older client's
`gcp` and `azure`) as an ExecCredential, and exits.

The operator runs this module as an exec plugin of its own (`logins.kubeconfig_credential`)
because the Kubernetes client library, the one thing that refreshes such a token, does so with
no deadline: in a child process the plugin's deadline and output cap bound it, a hung identity
provider costs one killed process rather than the operator's login thread, and the library
(34 MiB) stays out of the operator's process.

    python -m batchpilot.kube.provider_login   # KUBECONFIG as the operator has it
"""

from __future__ import annotations

import json
import sys

from batchpilot.kube import logins


def main() -> int:
    try:
        import kubernetes.client  # the one place the product imports the client library
        import kubernetes.config
    except ImportError:
        print(
            "the kubeconfig's user logs in through an auth provider, which needs the "
            "Kubernetes client library (pip install kubernetes)",
            file=sys.stderr,
        )
        return 2
    try:
        kubernetes.config.load_kube_config()  # type: ignore[no-untyped-call]
    except Exception as error:  # the provider's refresh fails in ways of its own
        print(f"the auth provider gave no token: {error}", file=sys.stderr)
        return 1
    configuration = kubernetes.client.Configuration.get_default_copy()
    # The provider's token, as kopf's login_via_client reads it: "BearerToken" from client
    # 36 on, "authorization" before.
    header = configuration.get_api_key_with_prefix(
        "BearerToken"
    ) or configuration.get_api_key_with_prefix("authorization")
    token = header.split(" ", 1)[-1] if header else ""
    if not token:
        print("the auth provider gave no token", file=sys.stderr)
        return 1
    credential = {
        "apiVersion": logins.EXEC_API,
        "kind": "ExecCredential",
        "status": {"token": token},
    }
    json.dump(credential, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
