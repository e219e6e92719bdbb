"""deploy/kubernetes: every manifest valid against the Kubernetes schema, and consistent with
the server it runs (ports, probe paths, labels, the config itself)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from stoker.server import load_config

pytestmark = pytest.mark.timeout(60)

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
MANIFESTS = sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")
K8S_VERSION = "1.30.0"  # the oldest release still supported upstream, as of writing


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind() -> dict[str, dict]:
    return {d["kind"]: d for p in MANIFESTS for d in docs(p)}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_kubernetes(path: Path) -> None:
    for doc in docs(path):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises with the path


def test_a_broken_manifest_is_caught() -> None:
    bad = by_kind()["Deployment"]
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == [p.name for p in MANIFESTS]


def test_manifests_agree_with_the_server(tmp_path: Path) -> None:
    k = by_kind()
    config_file = tmp_path / "config.yaml"
    config_file.write_text(k["ConfigMap"]["data"]["config.yaml"])
    config = load_config(config_file)  # a config the server accepts
    pod = k["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": config.server.port, "http": config.server.http_port}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # One worker per requested core; the drain ends before Kubernetes kills.
    assert config.server.workers == int(container["resources"]["requests"]["cpu"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > config.server.grace_seconds
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    labels = pod["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        spec = k[kind]["spec"]
        selector = spec["selector"].get("matchLabels", spec["selector"])
        assert selector.items() <= labels.items(), kind
    assert k["Service"]["spec"]["clusterIP"] == "None"  # headless: DNS lists every replica
    assert {p["name"] for p in k["Service"]["spec"]["ports"]} == {"grpc", "http"}
    assert k["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]["name"] == (
        k["Deployment"]["metadata"]["name"])
