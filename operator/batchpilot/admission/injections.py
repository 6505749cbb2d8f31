"""What the admission webhook adds to a Triton Pod that opted in, as a pure function.

A Pod whose template carries `names.INJECT_LABEL` gets, at its creation, what
manifests/triton-deployment.yaml wires by hand: the label the operator's watch selects
(`names.GOVERNED_LABEL`), the readiness gate, named ports on the Triton container, the sidecar
beside it (its image the chart's, versioned with the operator's) and, where an annotation asks,
Triton's flags: explicit model control, the restricted model-repository API in the syntax of
the Triton version found (with the credential's environment), summary latencies.

`inject(pod, settings, namespace=...)` returns a JSON patch (RFC 6902) and the Pod it makes, or
raises `Refused` with what is wrong: the webhook then denies the Pod with that message (the
ReplicaSet's FailedCreate event shows it) and nothing is changed. What is already there (a
sidecar, a gate, a port's name, a flag) is kept: injecting twice adds nothing the second time.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from batchpilot.api import names
from batchpilot.api.v1alpha1 import specs
from batchpilot_triton import endpoints

SIDECAR_CONTAINER = "batchpilot-sidecar"
SIDECAR_PORT_NAME = "sidecar"
TRITON_CONTAINER = "triton"
TOKEN_VARIABLE = "TRITON_REPOSITORY_TOKEN"  # noqa: S105 - a variable's name, not a value
TOKEN_KEY = "token"  # noqa: S105 - the Secret's key
SUMMARY_LATENCIES = "--metrics-config=summary_latencies=true"

EXPLICIT = "explicit-model-control"
RESTRICTED = "restricted-api"
SUMMARIES = "summary-latencies"
FLAG_SETS = (EXPLICIT, RESTRICTED, SUMMARIES)

RESTRICTED_CATEGORIES = "model-repository,logging,trace,shared-memory"
"""The operator needs model-repository locked to its credential; logging, trace and shared
memory are an administrator's, locked alike (as the example Deployment does)."""
RESTRICTED_SINCE = (2, 51)
"""The first Triton whose restricted-API syntax (`<categories>:<header>=<value>`, for both
flags) batchpilot has run (the nvidia-pytriton wheel's 2.51); earlier ones are refused."""
RESTRICTED_SINCE_NGC = (24, 10)
"""The NGC container release of that Triton (nvcr.io/nvidia/tritonserver:24.10-py3)."""

_SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh"})
_SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_VERSION = re.compile(r"^2\.(\d{1,3})(\.\d{1,3})?$")
_NGC_TAG = re.compile(r"^(\d{2})\.(\d{2})(-.+)?$")


class Refused(Exception):
    """The Pod asks for something the webhook cannot do; the message says what and why."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """What the chart decides for every injected Pod."""

    sidecar_image: str
    operator_namespace: str | None = None
    """Never inject there: the operator's own Pods must start whatever the webhook's state."""
    credential_secret: str = "triton-repository-credential"  # noqa: S105 - a Secret's name
    dcgm_url: str | None = None
    sidecar_port: int = endpoints.SIDECAR_PORT
    sidecar_pull_policy: str | None = None


@dataclasses.dataclass(frozen=True)
class Injection:
    patch: list[dict[str, Any]]
    """JSON patch operations, empty when there is nothing to add."""
    pod: dict[str, Any]
    """The Pod with the patch applied."""
    added: tuple[str, ...]
    """What was added, in words (the Pod's INJECTED_ANNOTATION lists it)."""


def opted_in(pod: Mapping[str, Any]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(names.INJECT_LABEL) == names.INJECT_VALUE)


def inject(pod: Mapping[str, Any], settings: Settings, *, namespace: str | None) -> Injection:
    """The patch that makes `pod` (in `namespace`) a Pod batchpilot governs; see the module."""
    if not opted_in(pod) or (namespace is not None and namespace == settings.operator_namespace):
        return Injection(patch=[], pod=copy.deepcopy(dict(pod)), added=())
    builder = _Builder(pod)
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    flag_sets = _flag_sets(annotations.get(names.TRITON_FLAGS_ANNOTATION))
    index, triton = _triton_container(builder.pod)
    argv = _argv(triton, flag_sets)
    http_port = _port_flag(argv, "--http-port", endpoints.TRITON_HTTP_PORT)
    builder.label(names.GOVERNED_LABEL, names.GOVERNED_VALUE)
    builder.readiness_gate(names.CONFIG_APPLIED_GATE)
    for name, flag, default in (
        ("http", "--http-port", endpoints.TRITON_HTTP_PORT),
        ("grpc", "--grpc-port", endpoints.TRITON_GRPC_PORT),
        ("metrics", "--metrics-port", endpoints.TRITON_METRICS_PORT),
    ):
        builder.named_port(index, name, _port_flag(argv, flag, default))
    if EXPLICIT in flag_sets:
        builder.explicit_model_control(index, argv)
    if RESTRICTED in flag_sets:
        version = _triton_version(triton, annotations.get(names.TRITON_VERSION_ANNOTATION))
        secret = (
            annotations.get(names.REPOSITORY_CREDENTIAL_ANNOTATION) or settings.credential_secret
        )
        if not _SECRET_NAME.match(secret):
            raise Refused(
                f"annotation {names.REPOSITORY_CREDENTIAL_ANNOTATION}: {secret!r} is not a "
                "Secret's name"
            )
        builder.restricted_api(index, argv, restricted_flags(version), secret=secret)
    if SUMMARIES in flag_sets and not any(
        a.startswith("--metrics-config=summary_latencies") for a in argv
    ):
        builder.append_args(index, [SUMMARY_LATENCIES], "summary latencies")
    builder.sidecar(settings, http_port=http_port, model_repository=_repository_mount(triton, argv))
    if builder.added:
        builder.annotate(names.INJECTED_ANNOTATION, ", ".join(builder.added))
    return Injection(patch=builder.patch, pod=builder.pod, added=tuple(builder.added))


def _flag_sets(text: str | None) -> set[str]:
    wanted = {item.strip() for item in (text or "").split(",") if item.strip()}
    unknown = sorted(wanted - set(FLAG_SETS))
    if unknown:
        raise Refused(
            f"annotation {names.TRITON_FLAGS_ANNOTATION}: unknown {', '.join(map(repr, unknown))}"
            f" (known: {', '.join(FLAG_SETS)})"
        )
    return wanted


def _runs_tritonserver(container: Mapping[str, Any]) -> bool:
    argv = [*(container.get("command") or []), *(container.get("args") or [])]
    return bool(argv) and str(argv[0]).rsplit("/", 1)[-1] == "tritonserver"


def _triton_container(pod: Mapping[str, Any]) -> tuple[int, Mapping[str, Any]]:
    containers = (pod.get("spec") or {}).get("containers") or []
    for index, container in enumerate(containers):
        if container.get("name") == TRITON_CONTAINER:
            return index, container
    running = [(i, c) for i, c in enumerate(containers) if _runs_tritonserver(c)]
    if len(running) == 1:
        return running[0]
    raise Refused(
        f"no container to govern: name Triton's container {TRITON_CONTAINER!r}, or run "
        "`tritonserver` as the command of exactly one container"
    )


def _argv(container: Mapping[str, Any], flag_sets: set[str]) -> list[str]:
    """Triton's command line as the container gives it. Flags are added to `args`, which only
    works where tritonserver itself reads them, not a shell's script."""
    argv = [str(a) for a in (*(container.get("command") or []), *(container.get("args") or []))]
    if flag_sets and argv and argv[0].rsplit("/", 1)[-1] in _SHELLS:
        raise Refused(
            f"annotation {names.TRITON_FLAGS_ANNOTATION}: container {container.get('name')!r} "
            "runs a shell; batchpilot adds flags only where `tritonserver` is the command"
        )
    if flag_sets and not container.get("command") and not container.get("args"):
        raise Refused(
            f"annotation {names.TRITON_FLAGS_ANNOTATION}: container {container.get('name')!r} "
            "runs its image's default command, whose flags the webhook cannot see; give "
            "`command: [tritonserver]` and its args"
        )
    return argv


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    found = None
    for position, argument in enumerate(argv):
        if argument.startswith(f"{flag}="):
            found = argument.split("=", 1)[1]
        elif argument == flag and position + 1 < len(argv):
            found = argv[position + 1]
    return found


def _port_flag(argv: Sequence[str], flag: str, default: int) -> int:
    value = _flag_value(argv, flag)
    if value is None:
        return default
    if not (value.isascii() and value.isdigit()) or not 0 < int(value) < 65536:
        raise Refused(f"Triton's {flag} {value!r} is not a port")
    return int(value)


def _triton_version(container: Mapping[str, Any], annotated: str | None) -> tuple[int, int]:
    """Triton's version, as (2, minor): from the annotation, else from an NGC image's tag."""
    if annotated:
        matched = _VERSION.match(annotated.strip())
        if not matched:
            raise Refused(
                f"annotation {names.TRITON_VERSION_ANNOTATION}: {annotated!r} is not a Triton "
                "version such as 2.51"
            )
        version = (2, int(matched.group(1)))
        where = f"{names.TRITON_VERSION_ANNOTATION} {annotated}"
    else:
        image = str(container.get("image") or "")
        repository, _, tag = image.split("@", 1)[0].rpartition(":")
        matched = _NGC_TAG.match(tag) if repository.endswith("/tritonserver") else None
        if not matched:
            raise Refused(
                f"annotation {names.TRITON_FLAGS_ANNOTATION} asks for {RESTRICTED}, whose syntax "
                f"depends on Triton's version, and image {image!r} does not say it (NGC's "
                f".../tritonserver:YY.MM-py3 does): set {names.TRITON_VERSION_ANNOTATION}"
            )
        release = (int(matched.group(1)), int(matched.group(2)))
        if release >= RESTRICTED_SINCE_NGC:
            return RESTRICTED_SINCE  # the syntax is the same from there on
        version, where = (2, 0), f"image {image}"
    if version < RESTRICTED_SINCE:
        raise Refused(
            f"{RESTRICTED}: batchpilot knows the restricted-API flags of Triton "
            f"{'.'.join(map(str, RESTRICTED_SINCE))} (NGC {RESTRICTED_SINCE_NGC[0]}."
            f"{RESTRICTED_SINCE_NGC[1]:02d}) and later, and found an earlier one ({where}); "
            "lock the API by hand or leave it out of the annotation"
        )
    return version


def restricted_flags(version: tuple[int, int]) -> list[str]:
    """Triton's flags that lock its model-repository API to the operator's header, in the
    syntax of `version` (one syntax from RESTRICTED_SINCE on; `_triton_version` refuses earlier
    ones). Kubernetes expands the variable from the container's environment."""
    if version < RESTRICTED_SINCE:
        raise Refused(f"no known restricted-API syntax for Triton 2.{version[1]}")
    locked = f"{RESTRICTED_CATEGORIES}:{specs.DEFAULT_REPOSITORY_HEADER}=$({TOKEN_VARIABLE})"
    return [f"--http-restricted-api={locked}", f"--grpc-restricted-protocol={locked}"]


def _repository_mount(container: Mapping[str, Any], argv: Sequence[str]) -> dict[str, Any] | None:
    """The volume mount that holds Triton's local model repository, if one does."""
    path = _flag_value(argv, "--model-repository")
    if not path or "://" in path:
        return None
    for mount in container.get("volumeMounts") or []:
        mounted = str(mount.get("mountPath") or "").rstrip("/")
        if mounted and (path.rstrip("/") == mounted or path.startswith(f"{mounted}/")):
            return {"mount": mount, "path": path}
    return None


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


class _Builder:
    """Collects JSON patch operations and applies each to its copy of the Pod as it goes, so
    every later operation sees the Pod as the earlier ones left it."""

    def __init__(self, pod: Mapping[str, Any]) -> None:
        self.pod: dict[str, Any] = copy.deepcopy(dict(pod))
        self.pod.setdefault("metadata", {})
        self.pod.setdefault("spec", {})
        self.patch: list[dict[str, Any]] = []
        self.added: list[str] = []

    def _add(self, path: str, value: Any) -> None:
        self.patch.append({"op": "add", "path": path, "value": copy.deepcopy(value)})
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]
        target: Any = self.pod
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            target.insert(len(target) if last == "-" else int(last), copy.deepcopy(value))
        else:
            target[last] = copy.deepcopy(value)

    def _ensure(self, parent: str, holder: dict[str, Any], key: str, empty: Any) -> None:
        if holder.get(key) is None:
            self._add(f"{parent}/{_escape(key)}", empty)

    def label(self, key: str, value: str) -> None:
        metadata = self.pod["metadata"]
        if (metadata.get("labels") or {}).get(key) == value:
            return
        self._ensure("/metadata", metadata, "labels", {})
        self._add(f"/metadata/labels/{_escape(key)}", value)
        self.added.append(f"label {key}")

    def annotate(self, key: str, value: str) -> None:
        metadata = self.pod["metadata"]
        self._ensure("/metadata", metadata, "annotations", {})
        self._add(f"/metadata/annotations/{_escape(key)}", value)

    def readiness_gate(self, condition: str) -> None:
        spec = self.pod["spec"]
        if any(g.get("conditionType") == condition for g in spec.get("readinessGates") or []):
            return
        self._ensure("/spec", spec, "readinessGates", [])
        self._add("/spec/readinessGates/-", {"conditionType": condition})
        self.added.append("readiness gate")

    def named_port(self, index: int, name: str, number: int) -> None:
        """Policies and the chart's PodMonitor find ports by name: name Triton's."""
        containers = self.pod["spec"]["containers"]
        taken = {p.get("name") for c in containers for p in c.get("ports") or []}
        ports = containers[index].get("ports") or []
        for position, port in enumerate(ports):
            if port.get("containerPort") == number:
                if not port.get("name") and name not in taken:
                    self._add(f"/spec/containers/{index}/ports/{position}/name", name)
                    self.added.append(f"port name {name}")
                return
        if name in taken:
            return  # the user's own port of that name stays theirs
        self._ensure(f"/spec/containers/{index}", containers[index], "ports", [])
        self._add(f"/spec/containers/{index}/ports/-", {"name": name, "containerPort": number})
        self.added.append(f"port {name}")

    def append_args(self, index: int, arguments: list[str], what: str) -> None:
        container = self.pod["spec"]["containers"][index]
        self._ensure(f"/spec/containers/{index}", container, "args", [])
        for argument in arguments:
            self._add(f"/spec/containers/{index}/args/-", argument)
        self.added.append(what)

    def explicit_model_control(self, index: int, argv: list[str]) -> None:
        mode = _flag_value(argv, "--model-control-mode")
        if mode == "explicit":
            return
        if mode not in (None, "none"):
            raise Refused(
                f"annotation {names.TRITON_FLAGS_ANNOTATION} asks for {EXPLICIT}, and Triton "
                f"runs with --model-control-mode={mode}; batchpilot replaces only the default "
                "mode (none), which loads every model at start"
            )
        container = self.pod["spec"]["containers"][index]
        if any(a.startswith("--model-control-mode") for a in container.get("command") or []):
            raise Refused(
                f"{EXPLICIT}: --model-control-mode is in the container's command; move it to args"
            )
        for position, argument in enumerate(container.get("args") or []):
            if argument == "--model-control-mode=none":
                self.patch.append(
                    {
                        "op": "replace",
                        "path": f"/spec/containers/{index}/args/{position}",
                        "value": "--model-control-mode=explicit",
                    }
                )
                container["args"][position] = "--model-control-mode=explicit"
                break
            if argument == "--model-control-mode":
                raise Refused(f"{EXPLICIT}: write --model-control-mode=none as one argument")
        else:
            self.append_args(index, ["--model-control-mode=explicit"], "explicit model control")
            argv.append("--model-control-mode=explicit")
        if _flag_value(argv, "--load-model") is None:
            # In the default mode Triton loads every model of the repository: so does this.
            self.append_args(index, ["--load-model=*"], "every model loaded")

    def restricted_api(self, index: int, argv: list[str], flags: list[str], *, secret: str) -> None:
        if all(flag in argv for flag in flags):
            pass  # injected before (a reinvocation): the credential below may still be missing
        elif any(
            a.startswith(("--http-restricted-api", "--grpc-restricted-protocol")) for a in argv
        ):
            raise Refused(
                f"annotation {names.TRITON_FLAGS_ANNOTATION} asks for {RESTRICTED}, and Triton "
                "already runs with restricted-API flags: leave it out of the annotation"
            )
        else:
            self.append_args(index, flags, "restricted API")
        container = self.pod["spec"]["containers"][index]
        if any(e.get("name") == TOKEN_VARIABLE for e in container.get("env") or []):
            return
        self._ensure(f"/spec/containers/{index}", container, "env", [])
        # Not optional: without the Secret, Triton would take the literal `$(...)` as its value.
        variable = {
            "name": TOKEN_VARIABLE,
            "valueFrom": {"secretKeyRef": {"name": secret, "key": TOKEN_KEY}},
        }
        self._add(f"/spec/containers/{index}/env/-", variable)
        self.added.append(f"credential {secret}")

    def sidecar(
        self, settings: Settings, *, http_port: int, model_repository: dict[str, Any] | None
    ) -> None:
        spec = self.pod["spec"]
        if any(c.get("name") == SIDECAR_CONTAINER for c in spec.get("containers") or []):
            return
        self._add("/spec/containers/-", sidecar_container(settings, http_port, model_repository))
        self.added.append(f"sidecar {settings.sidecar_image}")


def sidecar_container(
    settings: Settings, http_port: int, model_repository: dict[str, Any] | None
) -> dict[str, Any]:
    """The sidecar as manifests/triton-deployment.yaml declares it."""
    args = [
        f"--triton-url=http://127.0.0.1:{http_port}",
        f"--listen={endpoints.EVERY_ADDRESS}:{settings.sidecar_port}",
        "--pod-name=$(POD_NAME)",
        "--pod-namespace=$(POD_NAMESPACE)",
    ]
    if settings.dcgm_url:
        args.append(f"--dcgm-url={settings.dcgm_url}")
    mounts = []
    if model_repository is not None:
        mount = model_repository["mount"]
        mounts.append(
            {
                key: mount[key]
                for key in ("name", "mountPath", "subPath", "subPathExpr")
                if mount.get(key)
            }
            | {"readOnly": True}
        )
        args.append(f"--model-repository={model_repository['path']}")
    probe = {"httpGet": {"path": "/healthz", "port": SIDECAR_PORT_NAME}, "periodSeconds": 10}
    container: dict[str, Any] = {
        "name": SIDECAR_CONTAINER,
        "image": settings.sidecar_image,
        "command": ["python", "-m", "batchpilot_sidecar"],
        "args": args,
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {
                "name": "POD_NAMESPACE",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
            },
        ],
        "ports": [{"name": SIDECAR_PORT_NAME, "containerPort": settings.sidecar_port}],
        "readinessProbe": probe,
        "livenessProbe": {**probe, "failureThreshold": 3},
        "resources": {"requests": {"cpu": "50m", "memory": "96Mi"}, "limits": {"memory": "192Mi"}},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if settings.sidecar_pull_policy:
        container["imagePullPolicy"] = settings.sidecar_pull_policy
    if mounts:
        container["volumeMounts"] = mounts
    return container
