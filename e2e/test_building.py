"""The generated Go modules: staging replacements come from the release's own go.mod; Grafana
is built from the commit its pin names."""

from pathlib import Path

import pytest

from batchpilot_cluster import building, versions
from batchpilot_cluster.grafana import grafana_builds

KUBERNETES_GO_MOD = """\
module k8s.io/kubernetes

go 1.26.0

godebug default=go1.26

require (
\tk8s.io/api v0.0.0
)

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/cri-streaming => ./staging/src/k8s.io/cri-streaming
\tgithub.com/example/other => github.com/example/other v1.0.0
)
"""


def test_every_staging_module_is_replaced_with_its_published_version() -> None:
    product = building.kubernetes_product(KUBERNETES_GO_MOD)
    minor, patch = versions.KUBERNETES.split(".")[1:]
    assert product.replaces == {
        "k8s.io/api": f"v0.{minor}.{patch}",
        "k8s.io/cri-streaming": f"v0.{minor}.{patch}",
    }
    rendered = building.render_go_mod(product, go="1.26.0")
    assert f"require k8s.io/kubernetes {versions.KUBERNETES}" in rendered
    assert f"\tk8s.io/api => k8s.io/api v0.{minor}.{patch}" in rendered
    assert f"version.gitVersion={versions.KUBERNETES}" in " ".join(product.ldflags)


def test_go_directive_is_compared_as_numbers() -> None:
    assert building.go_directive(KUBERNETES_GO_MOD) == "1.26.0"
    assert building.parse_go_version("1.9") < building.parse_go_version("1.26.0")
    assert building.parse_go_version("1.26rc1") == (1, 26, 0)


def test_product_binaries_are_named_after_their_commands() -> None:
    names = [b for p in building.products(KUBERNETES_GO_MOD) for b in p.binaries]
    assert sorted(names) == sorted(building.ALL_BINARIES)


def test_a_cache_without_a_new_command_builds_that_command_alone(tmp_path: Path) -> None:
    (kubernetes,) = [p for p in building.products(KUBERNETES_GO_MOD) if p.name == "kubernetes"]
    before_kube_proxy = [name for name in building.KUBERNETES_COMMANDS if name != "kube-proxy"]
    for name in before_kube_proxy:
        (tmp_path / name).write_text("")
    stamps = dict.fromkeys(before_kube_proxy, kubernetes.source)
    stale = building.stale_binaries(kubernetes, bin_dir=tmp_path, stamps=stamps)
    assert stale == ["kube-proxy"]
    assert building.narrowed(kubernetes, stale).packages == ("k8s.io/kubernetes/cmd/kube-proxy",)
    stamps["kubectl"] = "k8s.io/kubernetes@v0.0.1"  # built from another release
    assert building.stale_binaries(kubernetes, bin_dir=tmp_path, stamps=stamps) == [
        "kube-proxy",
        "kubectl",
    ]


def test_grafana_is_built_from_the_commit_its_pseudo_version_names() -> None:
    assert grafana_builds.commit_of(versions.GRAFANA) == versions.GRAFANA[-12:]
    assert grafana_builds.commit_of("v0.0.0-20250220163425-b4c4b9abbdc8") == "b4c4b9abbdc8"
    with pytest.raises(building.BuildError):
        grafana_builds.commit_of("v12.2.0")


def test_wire_is_built_with_the_pinned_go_tools() -> None:
    rendered = grafana_builds.render_wire_go_mod()
    assert f"github.com/google/wire {versions.WIRE}" in rendered
    assert f"golang.org/x/tools {versions.WIRE_GO_TOOLS}" in rendered


def test_a_missing_grafana_names_the_make_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHPILOT_CACHE", str(tmp_path))
    with pytest.raises(building.BuildError, match="make grafana"):
        grafana_builds.require()
