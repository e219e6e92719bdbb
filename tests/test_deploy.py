"""deploy/kubernetes (the demo) and deploy/kubernetes/production: every manifest valid against
the Kubernetes schema, and consistent with the server it runs (ports, probe paths, labels, the
config itself); the production set with TLS, a token, a NetworkPolicy and a namespace. The
autoscalers on the data stall (deploy/kubernetes/autoscaling): the HPA against the Kubernetes
schema, the KEDA ScaledObject against KEDA's CRD (vendored), the prometheus-adapter rule
against the HPA, and all of them against the metric a server exports."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema  # a kubernetes-validate dependency
import kubernetes_validate
import prometheus_client
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from stoker.server import load_config
from stoker.server.front.metrics import Metrics

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
    # The data port fixed (not 0, a free one), so that the pod, the Service and a
    # NetworkPolicy can name it: batches between machines travel on it.
    assert ports == {"grpc": server["port"], "data": server["data_port"],
                     "http": server["http_port"]}
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
    assert {p["name"] for p in service["ports"]} == {"grpc", "data", "http"}
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
    # Only trainers reach gRPC and the data port, only the monitoring namespace reaches HTTP.
    policy = k["NetworkPolicy", "stoker-server"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items())
    assert policy["policyTypes"] == ["Ingress"]
    allowed = {p["port"]: rule["from"] for rule in policy["ingress"] for p in rule["ports"]}
    assert set(allowed) == {"grpc", "data", "http"}
    for port in ("grpc", "data"):  # trainers reach both: batches travel on the data port
        assert allowed[port] == [{"namespaceSelector": {},
                                  "podSelector": {"matchLabels": {"stoker-client": "true"}}}]
    assert allowed["http"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]


# -- autoscaling on the data stall: deploy/kubernetes/autoscaling -------------------------------
AUTOSCALING = DEMO / "autoscaling"
KEDA = AUTOSCALING / "keda"
EXTERNAL_HPA = AUTOSCALING / "external-hpa"
ADAPTER_VALUES = AUTOSCALING / "prometheus-adapter-values.yaml"
# KEDA's ScaledObject CRD, vendored (source and licence in its header).
KEDA_CRD = REPO / "tests" / "schemas" / "keda.sh_scaledobjects.yaml"
STALL_TARGET = 0.05  # docs/deployment.md: the worst trainer waits at most 5% of its time


def only_doc(path: Path) -> dict:
    (doc,) = docs(path)
    return doc


def strict(schema: object) -> object:
    """A CRD's structural schema with unknown fields refused, as the API server's strict field
    validation (kubectl apply's default) refuses them; jsonschema would let them pass."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def validate_scaled_object(doc: dict) -> None:
    """Raise jsonschema.ValidationError unless `doc` fits the vendored ScaledObject CRD."""
    (crd,) = docs(KEDA_CRD)
    group, _, name = doc["apiVersion"].partition("/")
    assert group == crd["spec"]["group"]
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == name]
    assert doc["kind"] == crd["spec"]["names"]["kind"]
    schema = strict(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator(schema).validate(doc)
    spec = doc["spec"]  # the CRD's one CEL rule, which jsonschema cannot run
    assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100)


def stall_series() -> set[str]:
    """The stall series a server exports once a client reported (absent before that)."""
    metrics = Metrics(lambda: {"workers": 1, "queued": 0, "building": 0})
    metrics.client_report(stream=1, dataset="shapes", wait_s=1.0, loop_s=10.0)
    text = prometheus_client.generate_latest(metrics.registry).decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("stoker_client_data_stall") and s.labels == {"dataset": "shapes"}}


@pytest.mark.parametrize("folder", [KEDA, EXTERNAL_HPA], ids=lambda p: p.name)
def test_autoscaling_kustomizations_list_their_manifest(folder: Path) -> None:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in manifests(folder)]
    assert "namespace" not in kustomization  # the set that lists the folder gives it


def test_the_stall_hpa_is_valid_kubernetes_and_scales_on_the_stall() -> None:
    hpa = only_doc(EXTERNAL_HPA / "hpa.yaml")
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] in stall_series()
    target = metric["external"]["target"]
    assert target["type"] == "Value"  # replicas x stall / target; AverageValue divides by pods
    assert float(target["value"].removesuffix("m")) / 1000 == STALL_TARGET


def test_the_adapter_rule_serves_the_metric_the_hpa_asks_for() -> None:
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    (rule,) = values["rules"]["external"]
    hpa = only_doc(EXTERNAL_HPA / "hpa.yaml")
    (metric,) = hpa["spec"]["metrics"]
    assert rule["name"]["as"] == metric["external"]["metric"]["name"]
    assert rule["seriesQuery"].split("{")[0] in stall_series()
    # The HPA's namespace (and its selector) reach the query: only its own servers count.
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
    assert rule["metricsQuery"] == "max(<<.Series>>{<<.LabelMatchers>>})"  # the worst trainer


def test_the_keda_scaled_object_fits_the_keda_crd_and_scales_on_the_stall() -> None:
    scaled = only_doc(KEDA / "scaledobject.yaml")
    validate_scaled_object(scaled)
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    meta = trigger["metadata"]
    assert float(meta["threshold"]) == STALL_TARGET
    assert meta["ignoreNullValues"] == "false"  # no trainer reporting is not a stall of 0
    query = meta["query"]
    assert query.startswith("max(") and query.split("(")[1].split("{")[0] in stall_series()
    production = yaml.safe_load((PRODUCTION / "kustomization.yaml").read_text())
    assert f'namespace="{production["namespace"]}"' in query


def test_a_broken_scaled_object_is_caught() -> None:
    bad = only_doc(KEDA / "scaledobject.yaml")
    bad["spec"]["minReplicas"] = bad["spec"].pop("minReplicaCount")  # the HPA's spelling
    with pytest.raises(jsonschema.ValidationError, match="minReplicas"):
        validate_scaled_object(bad)
    bad = only_doc(KEDA / "scaledobject.yaml")
    bad["spec"]["triggers"][0]["metadata"]["threshold"] = 0.05  # metadata values are strings
    with pytest.raises(jsonschema.ValidationError):
        validate_scaled_object(bad)


@pytest.mark.parametrize("folder", SETS, ids=lambda p: p.name)
def test_the_stall_autoscalers_replace_the_cpu_hpa_one_for_one(folder: Path) -> None:
    """Same Deployment, same bounds as the set's CPU HPA, so that swapping is one line."""
    cpu = objects(folder)["HorizontalPodAutoscaler", "stoker-server"]
    deployment, _, _ = server_parts(folder)
    hpa = only_doc(EXTERNAL_HPA / "hpa.yaml")
    scaled = only_doc(KEDA / "scaledobject.yaml")
    for autoscaler in (hpa, scaled):
        assert autoscaler["metadata"]["name"] == cpu["metadata"]["name"]
        assert autoscaler["spec"]["scaleTargetRef"] == cpu["spec"]["scaleTargetRef"]
        assert autoscaler["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (
        cpu["spec"]["minReplicas"], cpu["spec"]["maxReplicas"])
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (
        cpu["spec"]["minReplicas"], cpu["spec"]["maxReplicas"])
    assert scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == (
        hpa["spec"]["behavior"])


@pytest.mark.parametrize("autoscaler", [KEDA, EXTERNAL_HPA], ids=lambda p: p.name)
@pytest.mark.parametrize("folder", SETS, ids=lambda p: p.name)
def test_a_set_builds_with_a_stall_autoscaler_in_place_of_the_cpu_hpa(
        tmp_path: Path, folder: Path, autoscaler: Path) -> None:
    """The one-line swap docs/deployment.md shows, built by kustomize (kubectl's)."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (its kustomize) is not installed")
    copy = tmp_path / "kubernetes"
    shutil.copytree(DEMO, copy)
    root = copy / folder.relative_to(DEMO)
    kustomization = root / "kustomization.yaml"
    swapped = kustomization.read_text().replace(
        "  - hpa.yaml\n", f"  - {os.path.relpath(autoscaler, folder)}\n")
    assert swapped != kustomization.read_text()
    kustomization.write_text(swapped)
    built = subprocess.run(["kubectl", "kustomize", str(root)], capture_output=True, text=True,
                           timeout=60)
    assert built.returncode == 0, built.stderr
    kinds = [(d["kind"], d["metadata"].get("namespace")) for d in yaml.safe_load_all(built.stdout)]
    namespace = yaml.safe_load(kustomization.read_text())["namespace"]
    want = "ScaledObject" if autoscaler is KEDA else "HorizontalPodAutoscaler"
    assert [k for k in kinds if k[0] in ("ScaledObject", "HorizontalPodAutoscaler")] == [
        (want, namespace)]
