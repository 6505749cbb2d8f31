"""A small web server in a Pod of the real node: it answers its Pod's name (or, at
`/api-version`, the API server's version through in-cluster configuration), for tests and
benchmarks of what the kubelet, the Service and kube-proxy do with a Pod."""

from kubernetes import client

from batchpilot_cluster import realnodes
from batchpilot_testbed.kubes import Kube

PORT = 8000
SERVER = """\
import http.server, json, os, ssl, urllib.request

ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def api_version():
    # In-cluster configuration, as a client library builds it: the kubernetes Service's
    # address from the environment, the service account's CA and token.
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    context = ssl.create_default_context(cafile=f"{ACCOUNT}/ca.crt")
    with open(f"{ACCOUNT}/token") as token:
        headers = {"Authorization": "Bearer " + token.read().strip()}
    request = urllib.request.Request(f"https://{host}:{port}/version", headers=headers)
    with urllib.request.urlopen(request, context=context, timeout=5) as response:
        return json.load(response)["gitVersion"]


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        status = 200
        try:
            body = (api_version() if self.path == "/api-version" else os.environ["POD"]).encode()
        except Exception as error:  # the test shows why, not a closed connection
            status, body = 502, repr(error).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("0.0.0.0", LISTEN_PORT), Handler).serve_forever()
""".replace("LISTEN_PORT", str(PORT))


def web_pod(name: str, image: str, *, gates: tuple[str, ...] = ()) -> client.V1Pod:
    key, value = realnodes.NODE_LABEL
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels={"app": "web"}),
        spec=client.V1PodSpec(
            node_selector={key: value},
            tolerations=[
                client.V1Toleration(key=realnodes.TAINT_KEY, operator="Exists", effect="NoSchedule")
            ],
            containers=[
                client.V1Container(
                    name="web",
                    image=image,
                    image_pull_policy="Never",  # nothing to pull from: the image was imported
                    command=["python3", "-c", SERVER],
                    env=[
                        client.V1EnvVar(
                            name="POD",
                            value_from=client.V1EnvVarSource(
                                field_ref=client.V1ObjectFieldSelector(field_path="metadata.name")
                            ),
                        )
                    ],
                    ports=[client.V1ContainerPort(name="http", container_port=PORT)],
                    readiness_probe=client.V1Probe(
                        http_get=client.V1HTTPGetAction(path="/", port=PORT),
                        period_seconds=1,
                    ),
                    security_context=client.V1SecurityContext(
                        run_as_non_root=True,
                        run_as_user=65532,
                        read_only_root_filesystem=True,
                        allow_privilege_escalation=False,
                        capabilities=client.V1Capabilities(drop=["ALL"]),
                    ),
                )
            ],
            readiness_gates=[client.V1PodReadinessGate(condition_type=gate) for gate in gates]
            or None,
            enable_service_links=False,
            termination_grace_period_seconds=2,
        ),
    )


def create_service(kube: Kube, namespace: str, name: str = "web") -> str:
    """A ClusterIP Service, port `http` 80, over the web Pods; its cluster IP."""
    service = client.V1Service(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1ServiceSpec(
            selector={"app": "web"},
            ports=[client.V1ServicePort(name="http", port=80, target_port=PORT, protocol="TCP")],
        ),
    )
    created = kube.core.create_namespaced_service(namespace, service)
    assert created.spec is not None
    return str(created.spec.cluster_ip)
