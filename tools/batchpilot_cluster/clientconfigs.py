"""Kubeconfig files with the certificates embedded, so a copied file keeps working."""

import base64
from pathlib import Path

import yaml

from batchpilot_cluster import certificates

CONTEXT = "batchpilot-e2e"


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode("ascii")


def render(*, server: str, pki: certificates.Pki, identity: certificates.Identity) -> str:
    user = f"{CONTEXT}-{identity.file_stem}"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": CONTEXT,
                "cluster": {
                    "server": server,
                    "certificate-authority-data": _b64(pki.ca_cert),
                },
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": _b64(pki.client_cert(identity)),
                    "client-key-data": _b64(pki.client_key(identity)),
                },
            }
        ],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": user}}],
        "current-context": CONTEXT,
        "preferences": {},
    }
    return yaml.safe_dump(config, sort_keys=False)


def write(
    path: Path, *, server: str, pki: certificates.Pki, identity: certificates.Identity
) -> Path:
    path.write_text(render(server=server, pki=pki, identity=identity))
    path.chmod(0o600)
    return path
