"""deploy/kubernetes (the demo) and deploy/kubernetes/production: every manifest valid against
the Kubernetes schema, and consistent with the server it runs (ports, probe paths, labels, the
config itself); the production set with TLS, a token, a NetworkPolicy and a namespace."""

from __future__ import annotations

import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from stoker.server import load_config

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "deploy" / "kubernetes"
PRODUCTION = DEMO / "production"
SETS = [DEMO, PRODUCTION]
K8S_VERSION = "1.30.0"  # the oldest release still supported upstream, as of writing

sys.path.insert(0, str(REPO / "tools"))
from docwalk import config_problems  # noqa: E402  (the config loader, bar machine-only paths)


def manifests(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.yaml") if p.name != "kustomization.yaml")


MANIFESTS = [p for s in SETS for p in manifests(s)]


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def objects(folder: Path) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for p in manifests(folder) for d in docs(p)}


def server_parts(folder: Path) -> tuple[dict, dict, dict]:
    """The server's Deployment, its pod template's one container, and its config."""
    k = objects(folder)
    deployment = k["Deployment", "stoker-server"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    config = yaml.safe_load(k["ConfigMap", "stoker-server"]["data"]["config.yaml"])
    return deployment, container, config


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEMO)))
def test_manifest_is_valid_kubernetes(path: Path) -> None:
    for doc in docs(path):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises with the path


def test_a_broken_manifest_is_caught() -> None:
    bad = objects(DEMO)["Deployment", "stoker-server"]
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


@pytest.mark.parametrize("folder", SETS, ids=lambda p: p.name)
def test_kustomization_lists_every_manifest_and_sets_the_namespace(folder: Path) -> None:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in manifests(folder)]
    namespaces = [d for d in objects(folder) if d[0] == "Namespace"]
    assert namespaces == [("Namespace", kustomization["namespace"])]


@pytest.mark.parametrize("folder", SETS, ids=lambda p: p.name)
def test_manifests_agree_with_the_server(tmp_path: Path, folder: Path) -> None:
    k = objects(folder)
    deployment, container, raw = server_parts(folder)
    text = k["ConfigMap", "stoker-server"]["data"]["config.yaml"]
    assert config_problems(text) == []  # the loader accepts it (files it names aside)
    if folder is DEMO:  # no files named: the loader itself, end to end
        (tmp_path / "config.yaml").write_text(text)
        load_config(tmp_path / "config.yaml")
    server = raw["server"]
    pod = deployment["spec"]["template"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": server["port"], "http": server["http_port"]}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # One worker per requested core; the drain ends before Kubernetes kills.
    assert server["workers"] == int(container["resources"]["requests"]["cpu"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > server["grace_seconds"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    labels = pod["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        spec = k[kind, "stoker-server"]["spec"]
        selector = spec["selector"].get("matchLabels", spec["selector"])
        assert selector.items() <= labels.items(), kind
    service = k["Service", "stoker-server"]["spec"]
    assert service["clusterIP"] == "None"  # headless: DNS lists every replica
    assert {p["name"] for p in service["ports"]} == {"grpc", "http"}
    hpa = k["HorizontalPodAutoscaler", "stoker-server"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    # Every config file the server reads is inside a volume mounted into the container.
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    config_path = Path(container["args"][container["args"].index("--config") + 1])
    assert str(config_path.parent) in mounts


def test_the_demo_creates_what_its_config_needs() -> None:
    """The S3 Secret and the MinIO the demo's config reads from are part of the set."""
    k = objects(DEMO)
    _, container, config = server_parts(DEMO)
    kustomization = yaml.safe_load((DEMO / "kustomization.yaml").read_text())
    secrets = {g["name"] for g in kustomization["secretGenerator"]}
    assert {e["secretRef"]["name"] for e in container["envFrom"]} <= secrets
    assert config["s3"]["endpoint_url"] == "http://minio:9000"
    assert ("Service", "minio") in k and ("Deployment", "minio") in k
    assert ("Job", "stoker-upload") in k


def test_production_has_tls_a_token_and_a_network_policy() -> None:
    k = objects(PRODUCTION)
    deployment, container, config = server_parts(PRODUCTION)
    server = config["server"]
    pod = deployment["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}

    def volume_of(path: str) -> dict:
        (mount,) = [m for m in mounts if path.startswith(m + "/")]
        return volumes[mounts[mount]]

    # TLS and the token: files the config names, in Secrets mounted read-only.
    assert server["host"] == "0.0.0.0"
    secrets = {volume_of(server["tls"][f])["secret"]["secretName"]
               for f in ("cert_file", "key_file")}
    assert secrets == {"stoker-tls"}
    assert volume_of(server["auth_token_file"])["secret"]["secretName"] == "stoker-token"
    assert all(m.get("readOnly") for m in container["volumeMounts"]
               if "secret" in volumes[m["name"]])
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS", probe
    # The data: every dataset reads from the read-only PersistentVolumeClaim.
    for name, ds in config["datasets"].items():
        claim = volume_of(ds["source"])["persistentVolumeClaim"]["claimName"]
        assert ("PersistentVolumeClaim", claim) in k, name
    # Only trainers reach gRPC, only the monitoring namespace reaches HTTP.
    policy = k["NetworkPolicy", "stoker-server"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items())
    assert policy["policyTypes"] == ["Ingress"]
    allowed = {p["port"]: rule["from"] for rule in policy["ingress"] for p in rule["ports"]}
    assert set(allowed) == {"grpc", "http"}
    assert allowed["grpc"] == [{"namespaceSelector": {},
                                "podSelector": {"matchLabels": {"stoker-client": "true"}}}]
    assert allowed["http"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]
