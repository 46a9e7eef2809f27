"""The Kubernetes manifests under deploy/kubernetes, without a cluster.

Every object is validated strictly (unknown fields fail): built-in kinds against the Kubernetes OpenAPI
schemas of `kubernetes-validate`, the custom ones (InferencePool, Gateway, HTTPRoute, the endpoint picker's
EndpointPickerConfig, a Kustomization, prometheus-adapter's rules) against the JSON schemas in
deploy/schemas, written from those projects' CRDs and types. Then the cross-references a typo would break
silently at apply time: selectors against pod labels, ports against container ports, the HPA's target and
metric, RBAC subjects, ConfigMap keys, kustomization listings, and the tritium command lines (parsed by
tritium's own CLI parser) and model.json (read by tritium's own settings loader).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tritium.backend.serving.settings import load_settings
from tritium.client.cli.main import build_parser
from tritium.client.cluster.replica_load import EngineLoad, vllm_metrics

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
SCHEMAS = ROOT / "deploy" / "schemas"
# The oldest Kubernetes the manifests are meant for and the newest kubernetes-validate knows.
K8S_VERSIONS = ["1.30", kubernetes_validate.latest_version()]
CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool.schema.json",
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateway.schema.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute.schema.json",
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"): "kustomization.schema.json",
}
# The flags of the endpoint picker image pinned in epp-deployment.yaml (epp:v1.0.2,
# cmd/epp/runner/runner.go of gateway-api-inference-extension v1.0.2).
EPP_FLAGS = {
    "grpc-port", "grpc-health-port", "metrics-port", "enable-pprof", "pool-name", "pool-group", "pool-namespace",
    "v", "secure-serving", "health-checking", "cert-path", "total-queued-requests-metric",
    "kv-cache-usage-percentage-metric", "lora-info-metric", "refresh-metrics-interval",
    "refresh-prometheus-metrics-interval", "metrics-staleness-threshold", "config-file", "config-text",
    "model-server-metrics-port", "model-server-metrics-path", "model-server-metrics-scheme",
    "model-server-metrics-https-insecure-skip-verify", "ha-enable-leader-election",
}
EPP_METRIC_FLAGS = ["total-queued-requests-metric", "kv-cache-usage-percentage-metric", "lora-info-metric"]


@dataclass(frozen=True)
class Doc:
    path: Path
    obj: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.obj["kind"]

    @property
    def name(self) -> str:
        return self.obj["metadata"]["name"]

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}: {self.kind}/{self.obj.get('metadata', {}).get('name')}"


def load_docs() -> list[Doc]:
    docs = []
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        docs += [Doc(path, obj) for obj in yaml.safe_load_all(path.read_text(encoding="utf-8")) if obj]
    return docs


DOCS = load_docs()


def of_kind(kind: str) -> list[Doc]:
    return [d for d in DOCS if d.kind == kind]


def one(kind: str, name: str) -> Doc:
    found = [d for d in of_kind(kind) if d.name == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def schema(file: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / file).read_text(encoding="utf-8"))


def config_data(name: str, key: str) -> str:
    return one("ConfigMap", name).obj["data"][key]


def validate(obj: dict[str, Any], version: str = K8S_VERSIONS[-1]) -> None:
    """Strict validation of one object: a CRD schema of deploy/schemas, else Kubernetes' own."""
    crd = CRD_SCHEMAS.get((obj.get("apiVersion"), obj.get("kind")))
    if crd is not None:
        jsonschema.validate(obj, schema(crd), cls=jsonschema.Draft202012Validator)
    else:
        kubernetes_validate.validate(obj, version, strict=True)


def pod_spec(deployment: Doc) -> dict[str, Any]:
    return deployment.obj["spec"]["template"]["spec"]


def pod_labels(deployment: Doc) -> dict[str, str]:
    return deployment.obj["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def selected_deployments(selector: dict[str, str]) -> list[Doc]:
    return [d for d in of_kind("Deployment") if selects(selector, pod_labels(d))]


def container(deployment: Doc, name: str) -> dict[str, Any]:
    return next(c for c in pod_spec(deployment)["containers"] if c["name"] == name)


def container_ports(c: dict[str, Any]) -> set[int | str]:
    ports = c.get("ports", [])
    return {p["containerPort"] for p in ports} | {p["name"] for p in ports if "name" in p}


def port_number(c: dict[str, Any], port: int | str) -> int:
    return next(p["containerPort"] for p in c["ports"] if port in (p["containerPort"], p.get("name")))


def probes(c: dict[str, Any]) -> Iterator[tuple[str, int | str]]:
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c.get(kind)
        if probe is None:
            continue
        handler = probe.get("httpGet") or probe.get("tcpSocket") or probe.get("grpc")
        assert handler is not None, f"{c['name']} {kind}: no httpGet, tcpSocket or grpc"
        yield kind, handler["port"]


def tritium_deployment() -> Doc:
    return one("Deployment", "tritium")


def flag_values(args: list[str]) -> dict[str, str]:
    """`--flag=value` arguments as a dict (the endpoint picker's Go flags)."""
    values = {}
    for arg in args:
        assert arg.startswith("--") and "=" in arg, f"EPP argument {arg!r}: write --flag=value"
        flag, value = arg[2:].split("=", 1)
        values[flag] = value
    return values


def exported_vllm_metrics() -> set[str]:
    """The metric names `tritium openai` serves on /metrics (client/cluster/replica_load.py renders them)."""
    text = vllm_metrics(EngineLoad(), "tritium")
    return {m.group(1) for line in text.splitlines() if (m := re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", line))}


def adapter_rules() -> list[dict[str, Any]]:
    return yaml.safe_load(config_data("prometheus-adapter", "config.yaml"))["rules"]


def epp_config() -> dict[str, Any]:
    return yaml.safe_load(config_data("tritium-epp-config", "epp-config.yaml"))


# --- schemas ---------------------------------------------------------------------------------------------


def test_manifests_were_found() -> None:
    kinds = {d.kind for d in DOCS}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "InferencePool", "Gateway", "HTTPRoute"} <= kinds


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("doc", DOCS, ids=str)
def test_every_manifest_is_valid(doc: Doc, version: str) -> None:
    validate(doc.obj, version)


@pytest.mark.parametrize("mutate", [
    lambda o: o["spec"].update(replica=2),  # Deployment: replicas misspelt
    lambda o: container(Doc(Path(), o), "tritonserver").update(readinesProbe={}),
    lambda o: o["spec"]["template"]["spec"]["volumes"][0]["emptyDir"].update(medium="Memory", sizelimit="1Gi"),
    lambda o: container(Doc(Path(), o), "openai")["ports"][0].update(containerPort="9000"),  # a string
], ids=["spec-field", "container-field", "volume-field", "wrong-type"])
def test_a_typo_in_a_builtin_kind_fails(mutate: Any) -> None:
    obj = copy.deepcopy(tritium_deployment().obj)
    validate(obj)
    mutate(obj)
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(obj)


@pytest.mark.parametrize(("kind", "name", "mutate"), [
    ("InferencePool", "tritium", lambda o: o["spec"].update(targetPort=[{"number": 9000}])),
    ("InferencePool", "tritium", lambda o: o["spec"]["endpointPickerRef"].update(failureMode="FailOpened")),
    ("InferencePool", "tritium", lambda o: o["spec"]["endpointPickerRef"].pop("port")),
    ("InferencePool", "tritium", lambda o: o["spec"]["targetPorts"].append({"number": 8000})),
    ("HTTPRoute", "tritium", lambda o: o["spec"]["rules"][0]["backendRefs"][0].update(kindd="InferencePool")),
    ("HTTPRoute", "tritium", lambda o: o["spec"]["rules"][0]["timeouts"].update(request="10 minutes")),
    ("Gateway", "tritium-gateway", lambda o: o["spec"]["listeners"][0].update(port=0)),
], ids=["pool-field", "pool-enum", "pool-port-required", "pool-max-items", "route-field", "route-duration",
        "gateway-port"])
def test_a_typo_in_a_custom_kind_fails(kind: str, name: str, mutate: Any) -> None:
    obj = copy.deepcopy(one(kind, name).obj)
    validate(obj)
    mutate(obj)
    with pytest.raises(jsonschema.ValidationError):
        validate(obj)


def test_a_crd_kind_without_a_schema_fails() -> None:
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate({"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferencePool",
                  "metadata": {"name": "x"}, "spec": {}})


# --- the tritium Deployment --------------------------------------------------------------------------------


def test_every_service_selects_a_deployment_and_its_ports() -> None:
    for service in of_kind("Service"):
        selector = service.obj["spec"]["selector"]
        deployments = selected_deployments(selector)
        assert len(deployments) == 1, f"{service}: selector {selector} matches {len(deployments)} Deployments"
        declared = set().union(*(container_ports(c) for c in pod_spec(deployments[0])["containers"]))
        for port in service.obj["spec"]["ports"]:
            assert port.get("targetPort", port["port"]) in declared, f"{service}: port {port['name']}"


def test_every_deployment_selects_its_own_pods() -> None:
    for deployment in of_kind("Deployment"):
        assert selects(deployment.obj["spec"]["selector"]["matchLabels"], pod_labels(deployment)), str(deployment)


def test_every_probe_points_at_a_declared_port() -> None:
    for deployment in of_kind("Deployment"):
        for c in pod_spec(deployment)["containers"]:
            for kind, port in probes(c):
                assert port in container_ports(c), f"{deployment} {c['name']} {kind}: port {port}"


def test_tritium_pod_probes_model_readiness_and_waits_for_the_model() -> None:
    server = container(tritium_deployment(), "tritonserver")
    assert server["readinessProbe"]["httpGet"]["path"] == "/v2/models/tritium/ready"
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model load takes minutes"
    openai = container(tritium_deployment(), "openai")
    assert openai["readinessProbe"]["httpGet"] == {"path": "/health", "port": "openai"}


def test_tritium_pod_has_a_gpu_and_a_memory_backed_shm() -> None:
    spec = pod_spec(tritium_deployment())
    server = container(tritium_deployment(), "tritonserver")
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert server["resources"]["requests"]["nvidia.com/gpu"] == 1
    shm = next(m["name"] for m in server["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert next(v for v in spec["volumes"] if v["name"] == shm)["emptyDir"]["medium"] == "Memory"


def test_scrape_annotations_point_at_the_openai_endpoint() -> None:
    annotations = tritium_deployment().obj["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert port_number(container(tritium_deployment(), "openai"), "openai") == int(annotations["prometheus.io/port"])


def without_flag(command: list[str], flag: str) -> list[str]:
    i = command.index(flag)
    return command[:i] + command[i + 2:]


def test_tritium_command_lines_parse_with_tritiums_cli() -> None:
    parser = build_parser()
    server = container(tritium_deployment(), "tritonserver")
    assert server["command"][:2] == ["tritium", "serve"]
    serve = parser.parse_args(server["command"][1:])
    assert serve.host == "0.0.0.0" and serve.model_repository == "/models/repo"
    assert serve.model_control == "explicit" and serve.load_model == ["tritium"]
    assert [serve.http_port, serve.grpc_port, serve.metrics_port] == [port_number(server, p)
                                                                       for p in ("http", "grpc", "metrics")]
    endpoint = container(tritium_deployment(), "openai")
    assert endpoint["command"][:2] == ["tritium", "openai"]
    openai = parser.parse_args(endpoint["command"][1:])
    assert openai.host == "0.0.0.0" and openai.port == port_number(endpoint, "openai")
    assert openai.upstream == [f"127.0.0.1:{serve.grpc_port}"]
    assert openai.upstream_metrics == [f"http://127.0.0.1:{serve.metrics_port}/metrics"]


def secret_env(c: dict[str, Any]) -> dict[str, str]:
    """The container's environment variables that come from a Secret: name -> "secret/key"."""
    out = {}
    for env in c.get("env", []):
        ref = env.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            out[env["name"]] = f"{ref['name']}/{ref['key']}"
    return out


def unkeyed_exposures(docs: list[Doc]) -> list[str]:
    """Every tritium server in `docs` that binds a non-loopback address without its keys from a Secret
    (`tritium serve`: the API and admin keys; `tritium openai`: the API key), and every vllm-router that
    would reach keyed workers without the key."""
    from tritium.client.cli.bind_policy import is_loopback

    parser = build_parser()
    found = []
    for deployment in (d for d in docs if d.kind == "Deployment"):
        for c in pod_spec(deployment)["containers"]:
            command, secrets = c.get("command", []), secret_env(c)
            if command[:2] in (["tritium", "serve"], ["tritium", "openai"]):
                args = parser.parse_args(command[1:])
                if is_loopback(args.host) or "--unsafe-no-auth" in command:
                    continue
                wanted = ["TRITIUM_API_KEY", "TRITIUM_ADMIN_KEY"] if command[1] == "serve" else ["TRITIUM_API_KEY"]
                missing = [name for name in wanted if name not in secrets
                           and f"--{name.removeprefix('TRITIUM_').lower().replace('_', '-')}" not in command]
                if missing:
                    found.append(f"{deployment} container {c['name']}: binds {args.host} without "
                                 f"{', '.join(missing)} from a Secret")
            elif command[:1] == ["vllm-router"] and ("--api-key" not in command or "TRITIUM_API_KEY" not in secrets):
                found.append(f"{deployment} container {c['name']}: no --api-key $(TRITIUM_API_KEY) from a "
                             "Secret for its workers")
    return found


def test_no_manifest_exposes_a_port_without_keys() -> None:
    assert unkeyed_exposures(DOCS) == []
    secrets = {ref for d in of_kind("Deployment") for c in pod_spec(d)["containers"] for ref in secret_env(c).values()}
    assert secrets == {"tritium-keys/api-key", "tritium-keys/admin-key"}


@pytest.mark.parametrize(("name", "drop"), [("tritonserver", "TRITIUM_ADMIN_KEY"), ("openai", "TRITIUM_API_KEY"),
                                            ("vllm-router", "TRITIUM_API_KEY")])
def test_a_manifest_without_a_key_is_caught(name: str, drop: str) -> None:
    docs = copy.deepcopy(DOCS)
    for d in docs:
        for c in pod_spec(d)["containers"] if d.kind == "Deployment" else []:
            if c["name"] == name:
                c["env"] = [e for e in c.get("env", []) if e["name"] != drop]
    assert len(unkeyed_exposures(docs)) == 1


def test_model_json_loads_and_names_the_mounted_weights(tmp_path: Path) -> None:
    version_dir = tmp_path / "tritium" / "1"
    version_dir.mkdir(parents=True)
    (version_dir / "model.json").write_text(config_data("tritium-model-config", "model.json"), encoding="utf-8")
    settings = load_settings(version_dir)  # raises on an unknown key or a bad value
    server = container(tritium_deployment(), "tritonserver")
    weights = next(m["mountPath"] for m in server["volumeMounts"] if m["name"] == "weights")
    assert settings.engine.model is not None and settings.engine.model.startswith(weights + "/")
    openai = parse_openai_tokenizer(container(tritium_deployment(), "openai")["command"])
    assert openai == settings.engine.model, "the endpoint's tokenizer is the served model's"
    mount = next(m for m in server["volumeMounts"] if m["name"] == "model-config")
    assert mount["mountPath"] == "/models/repo/tritium/1/model.json" and mount["subPath"] == "model.json"


def parse_openai_tokenizer(command: list[str]) -> str:
    return command[command.index("--tokenizer") + 1]


def test_every_mounted_volume_exists() -> None:
    for deployment in of_kind("Deployment"):
        spec = pod_spec(deployment)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            for mount in c.get("volumeMounts", []):
                volume = volumes[mount["name"]]
                if "configMap" in volume:
                    data = one("ConfigMap", volume["configMap"]["name"]).obj["data"]
                    assert mount.get("subPath", next(iter(data))) in data, f"{deployment}: {mount}"
                if "persistentVolumeClaim" in volume:
                    one("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])


def test_pdb_selects_the_tritium_pods() -> None:
    for pdb in of_kind("PodDisruptionBudget"):
        assert selected_deployments(pdb.obj["spec"]["selector"]["matchLabels"]) == [tritium_deployment()]


# --- autoscaling -------------------------------------------------------------------------------------------


def test_hpa_targets_the_deployment_on_the_adapters_metric() -> None:
    hpa = one("HorizontalPodAutoscaler", "tritium").obj["spec"]
    target = hpa["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
    assert one("Deployment", target["name"]) == tritium_deployment()
    assert hpa["minReplicas"] <= tritium_deployment().obj["spec"]["replicas"] <= hpa["maxReplicas"]
    (metric,) = hpa["metrics"]
    published = {r["name"]["as"]: r["seriesQuery"] for r in adapter_rules()}
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] in published
    series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", published[metric["pods"]["metric"]["name"]]).group(0)
    assert series == "vllm:num_requests_waiting" and series in exported_vllm_metrics()


def test_adapter_rules_are_valid() -> None:
    jsonschema.validate({"rules": adapter_rules()}, schema("prometheus-adapter-config.schema.json"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"rules": [{**adapter_rules()[0], "metricQuery": "x"}]},
                            schema("prometheus-adapter-config.schema.json"))


# --- Gateway API Inference Extension -----------------------------------------------------------------------


def test_inferencepool_selects_the_openai_port_of_the_tritium_pods() -> None:
    pool = one("InferencePool", "tritium").obj["spec"]
    assert selected_deployments(pool["selector"]["matchLabels"]) == [tritium_deployment()]
    (target,) = pool["targetPorts"]
    assert target["number"] in container_ports(container(tritium_deployment(), "openai"))


def test_inferencepool_endpoint_picker_is_the_epp_service() -> None:
    ref = one("InferencePool", "tritium").obj["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref["failureMode"] == "FailOpen"
    service = one("Service", ref["name"]).obj["spec"]
    port = next(p for p in service["ports"] if p["port"] == ref["port"]["number"])
    (epp,) = selected_deployments(service["selector"])
    args = flag_values(container(epp, "epp")["args"])
    assert port_number(container(epp, "epp"), port["targetPort"]) == int(args["grpc-port"])


def test_epp_flags_exist_and_name_metrics_tritium_serves() -> None:
    epp = one("Deployment", "tritium-epp")
    args = flag_values(container(epp, "epp")["args"])
    assert set(args) <= EPP_FLAGS, f"unknown EPP flags: {sorted(set(args) - EPP_FLAGS)}"
    assert args["pool-name"] == "tritium" and args["pool-group"] == "inference.networking.k8s.io"
    served = exported_vllm_metrics()
    for flag in EPP_METRIC_FLAGS:
        assert args[flag] in served, f"--{flag}={args[flag]}: not a metric tritium openai serves ({served})"
    pool = one("InferencePool", "tritium").obj["spec"]
    assert int(args["model-server-metrics-port"]) == pool["targetPorts"][0]["number"]
    health = int(args["grpc-health-port"])
    c = container(epp, "epp")
    assert all(port_number(c, port) == health for _, port in probes(c))
    config = epp.obj["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"]
    mount = c["volumeMounts"][0]["mountPath"]
    key = args["config-file"].removeprefix(mount + "/")
    assert key in one("ConfigMap", config).obj["data"]


def test_epp_config_is_valid_and_its_references_resolve() -> None:
    config = epp_config()
    jsonschema.validate(config, schema("endpointpickerconfig.schema.json"))
    names = [p.get("name", p["type"]) for p in config["plugins"]]
    assert len(names) == len(set(names))
    for profile in config["schedulingProfiles"]:
        for ref in profile["plugins"]:
            assert ref["pluginRef"] in names, f"profile {profile['name']}: {ref['pluginRef']} is not a plugin"
    assert sum(p["type"].endswith("-profile-handler") for p in config["plugins"]) == 1


def test_a_typo_in_the_epp_config_fails() -> None:
    config = epp_config()
    config["schedulingProfiles"][0]["plugins"][0] = {"pluginref": "queue-scorer"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, schema("endpointpickerconfig.schema.json"))
    config = epp_config()
    config["plugins"][1]["type"] = "queue-scorrer"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, schema("endpointpickerconfig.schema.json"))


def test_httproute_sends_the_gateway_to_the_inferencepool() -> None:
    route = one("HTTPRoute", "tritium").obj["spec"]
    for parent in route["parentRefs"]:
        one(parent.get("kind", "Gateway"), parent["name"])
    (rule,) = route["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool")
    one("InferencePool", backend["name"])


# --- vllm-router -------------------------------------------------------------------------------------------


def test_vllm_router_discovers_the_openai_port_of_the_tritium_pods() -> None:
    command = container(one("Deployment", "vllm-router"), "vllm-router")["command"]
    values = command[command.index("--selector") + 1:]
    labels = values[:next((i for i, v in enumerate(values) if v.startswith("--")), len(values))]
    selector = dict(label.split("=", 1) for label in labels)
    assert selected_deployments(selector) == [tritium_deployment()]
    port = int(command[command.index("--service-discovery-port") + 1])
    assert port_number(container(tritium_deployment(), "openai"), "openai") == port
    assert command[command.index("--policy") + 1] == "cache_aware"
    assert "--service-discovery" in command


# --- RBAC and kustomize ------------------------------------------------------------------------------------


def test_rbac_bindings_resolve() -> None:
    for binding in of_kind("RoleBinding") + of_kind("ClusterRoleBinding"):
        role = binding.obj["roleRef"]
        one(role["kind"], role["name"])
        namespace = kustomization_namespace(binding.path.parent)
        for subject in binding.obj["subjects"]:
            one(subject["kind"], subject["name"])
            assert subject["namespace"] == namespace, f"{binding}: subject namespace"
    for deployment in of_kind("Deployment"):
        account = pod_spec(deployment).get("serviceAccountName")
        if account:
            one("ServiceAccount", account)


def kustomization_namespace(folder: Path) -> str | None:
    return yaml.safe_load((folder / "kustomization.yaml").read_text(encoding="utf-8")).get("namespace")


@pytest.mark.parametrize("folder", sorted({d.path.parent for d in DOCS}), ids=lambda p: str(p.relative_to(ROOT)))
def test_kustomization_lists_every_file(folder: Path) -> None:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text(encoding="utf-8"))
    listed = kustomization["resources"]
    present = sorted(p.name for p in folder.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == present
    images = {c["image"] for d in DOCS if d.kind == "Deployment" and d.path.parent == folder
              for c in pod_spec(d)["containers"]}
    for image in kustomization.get("images", []):
        assert image["name"] in images, f"{folder}: image {image['name']} is used by no container"
