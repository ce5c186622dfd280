"""deploy/k8s/ (kustomize): every core object validated offline against the Kubernetes API
schemas (kubernetes-validate, strict: unknown fields fail), the CRDs it has no schema for
(KubeRay's RayCluster, the Prometheus Operator's ServiceMonitor, Kueue's queues) checked for
their structure, with the RayCluster's pod templates validated as core PodTemplates; then the
references between objects (Secrets, Services, HPA targets, PDB selectors, metrics), the
security posture (only the sandbox is privileged; pools never get the database secret), and,
where a kustomize renderer is installed, each overlay rendered and validated again."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.deploy.files import K8S, ROOT, celery_queues
from tests.skips import host_reason

kv = pytest.importorskip("kubernetes_validate.utils",
                         reason="kubernetes-validate missing: pip install -e .[dev]")

# The oldest Kubernetes release docs/deploy.md supports, and the newest schema shipped.
VERSIONS = ("1.30.0", "1.37.0")
CRDS = {
    ("ray.io/v1", "RayCluster"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("kueue.x-k8s.io/v1beta1", "LocalQueue"),
    ("kueue.x-k8s.io/v1beta1", "ClusterQueue"),
    ("kueue.x-k8s.io/v1beta1", "ResourceFlavor"),
}
CLUSTER_SCOPED = {"Namespace", "ClusterQueue", "ResourceFlavor"}
KUSTOMIZATIONS = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
# Not Kubernetes objects: prometheus-adapter's Helm values.
NOT_OBJECTS = {K8S / "components" / "monitoring" / "prometheus-adapter-rules.yaml"}
# Objects no kustomization applies: the Secrets, which people create themselves so that
# `kubectl apply -k` never overwrites them.
SECRETS_TEMPLATE = K8S / "secrets.template.yaml"


def kustomization(folder: Path) -> dict:
    return yaml.safe_load((folder / "kustomization.yaml").read_text())


def resource_files(folder: Path) -> list[Path]:
    return [folder / r for r in kustomization(folder).get("resources", [])
            if (folder / r).is_file()]


def all_resource_files() -> list[Path]:
    return sorted({f for folder in KUSTOMIZATIONS for f in resource_files(folder)})


def object_files() -> list[Path]:
    return [*all_resource_files(), SECRETS_TEMPLATE]


def documents(paths: list[Path]) -> list[dict]:
    return [d for p in paths for d in yaml.safe_load_all(p.read_text()) if d]


def source_objects() -> list[dict]:
    """Everything the base, the components, kueue-cluster and the Secret templates define,
    before any overlay."""
    return documents(object_files())


def key(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def pod_specs(doc: dict) -> Iterator[tuple[str, dict]]:
    """(where, pod template) of a workload or a RayCluster group."""
    spec = doc.get("spec") or {}
    if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
        yield key(doc), spec["template"]
    if doc["kind"] == "RayCluster":
        yield f"{key(doc)} head", spec["headGroupSpec"]["template"]
        for group in spec["workerGroupSpecs"]:
            yield f"{key(doc)} {group['groupName']}", group["template"]


def containers(template: dict) -> list[dict]:
    spec = template["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def validate_core(doc: dict) -> None:
    for version in VERSIONS:
        kv.validate(doc, version, strict=True)


# -- every file, as written -------------------------------------------------------------------

def test_every_kustomization_names_files_that_exist() -> None:
    assert {p.relative_to(K8S).as_posix() for p in KUSTOMIZATIONS} >= {
        "base", "components/ray", "components/monitoring", "components/kueue", "kueue-cluster",
        "overlays/dev", "overlays/production"}
    for folder in KUSTOMIZATIONS:
        k = kustomization(folder)
        for ref in k.get("resources", []) + k.get("components", []):
            assert (folder / ref).exists(), f"{folder}/kustomization.yaml: {ref} missing"
        for ref in k.get("components", []):
            assert kustomization(folder / ref)["kind"] == "Component"


def test_no_manifest_is_left_out_of_every_kustomization() -> None:
    listed = set(all_resource_files())
    files = {p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert files - listed - NOT_OBJECTS == {SECRETS_TEMPLATE}


@pytest.mark.parametrize("path", object_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_core_objects_validate_against_the_kubernetes_schemas(path: Path) -> None:
    docs = documents([path])
    assert docs, f"{path} is empty"
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            with pytest.raises(kv.SchemaNotFoundError):
                kv.validate(doc, VERSIONS[-1], strict=True)  # checked structurally below
            continue
        validate_core(doc)


def test_the_validator_rejects_what_it_should() -> None:
    deployment = next(d for d in source_objects() if key(d) == "Deployment/crucible-web")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kv.ValidationError):
        validate_core(broken)
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["replica"] = 2  # a typo: strict validation refuses unknown fields
    with pytest.raises(kv.ValidationError):
        validate_core(broken)


# -- the CRDs: no schema in kubernetes-validate, so their structure is checked here --------------

def crd(kind: str) -> list[dict]:
    return [d for d in source_objects() if d["kind"] == kind]


def test_raycluster_structure_and_pod_templates() -> None:
    (ray,) = crd("RayCluster")
    assert ray["apiVersion"] == "ray.io/v1"
    spec = ray["spec"]
    assert set(spec) <= {"rayVersion", "headGroupSpec", "workerGroupSpecs",
                         "enableInTreeAutoscaling", "autoscalerOptions", "suspend"}
    assert isinstance(spec["headGroupSpec"]["rayStartParams"], dict)
    for group in spec["workerGroupSpecs"]:
        assert set(group) <= {"groupName", "replicas", "minReplicas", "maxReplicas",
                              "rayStartParams", "template", "numOfHosts", "suspend"}
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
    for where, template in pod_specs(ray):
        podtemplate = {"apiVersion": "v1", "kind": "PodTemplate",
                       "metadata": {"name": "check"}, "template": template}
        try:
            validate_core(podtemplate)
        except kv.ValidationError as exc:
            pytest.fail(f"{where}: {exc.message}")
    # The Ray container comes first (KubeRay treats containers[0] as Ray's); GPU workers ask
    # for whole GPUs and take the node's name as their Crucible node name.
    worker = spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == \
        worker["resources"]["requests"]["nvidia.com/gpu"]
    env = {e["name"]: e for e in worker["env"]}
    assert env["CRUCIBLE_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["CRUCIBLE_WORKER_QUEUES"]["value"] == "gpu"
    assert ray["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    assert "KUBERAY_GEN_RAY_START_CMD" in " ".join(worker["command"])


def test_node_agent_and_gpu_workers_agree_on_node_names() -> None:
    (agent,) = [d for d in source_objects() if key(d) == "DaemonSet/crucible-node-agent"]
    container = agent["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "workers.agent"]
    env = {e["name"]: e for e in container["env"]}
    assert env["CRUCIBLE_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["CRUCIBLE_NODE_POOL"]["value"] == "gpu"


def test_servicemonitor_scrapes_a_named_port_of_the_web_service() -> None:
    (monitor,) = crd("ServiceMonitor")
    services = [d for d in source_objects() if d["kind"] == "Service"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    matched = [s for s in services
               if selector.items() <= s["metadata"].get("labels", {}).items()]
    assert [s["metadata"]["name"] for s in matched] == ["crucible-web"]
    ports = {p["name"] for p in matched[0]["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme",
                                 "tlsConfig", "authorization", "honorLabels"}
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
        # /metrics wants a bearer token: the one the web reads as CRUCIBLE_METRICS_TOKEN.
        auth = endpoint["authorization"]
        assert auth["type"] == "Bearer"
        (secret,) = [s for s in documents([SECRETS_TEMPLATE])
                     if s["metadata"]["name"] == auth["credentials"]["name"]]
        assert auth["credentials"]["key"] == "CRUCIBLE_METRICS_TOKEN" in secret["stringData"]
        web = next(d for d in source_objects() if key(d) == "Deployment/crucible-web")
        refs = [e["secretRef"]["name"] for e in
                web["spec"]["template"]["spec"]["containers"][0]["envFrom"] if "secretRef" in e]
        assert secret["metadata"]["name"] in refs


def test_kueue_objects_and_quota_cover_the_raycluster() -> None:
    (local,) = crd("LocalQueue")
    (cluster,) = crd("ClusterQueue")
    (flavor,) = crd("ResourceFlavor")
    assert local["spec"]["clusterQueue"] == cluster["metadata"]["name"]
    groups = cluster["spec"]["resourceGroups"]
    quotas: dict[str, float] = {}
    for group in groups:
        for f in group["flavors"]:
            assert f["name"] == flavor["metadata"]["name"]
            for r in f["resources"]:
                assert r["name"] in group["coveredResources"]
                quotas[r["name"]] = quantity(r["nominalQuota"])
    (ray,) = crd("RayCluster")
    need: dict[str, float] = {}
    groups_at_max = [(ray["spec"]["headGroupSpec"]["template"], 1)] + [
        (g["template"], g["maxReplicas"]) for g in ray["spec"]["workerGroupSpecs"]]
    for template, count in groups_at_max:
        for c in template["spec"]["containers"]:
            for name, value in c["resources"]["requests"].items():
                need[name] = need.get(name, 0) + quantity(value) * count
    for name, value in need.items():
        assert quotas.get(name, 0) >= value, f"Kueue quota of {name} below the RayCluster's max"


def quantity(value: str | int) -> float:
    text = str(value)
    for suffix, factor in (("Gi", 2**30), ("Mi", 2**20), ("m", 1e-3)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


# -- references and posture, on what the tree defines -------------------------------------------

def check_references(objects: list[dict]) -> None:
    by_key = {key(d): d for d in objects + documents([SECRETS_TEMPLATE])}
    workloads = [d for d in objects if list(pod_specs(d))]
    for doc in workloads:
        for where, template in pod_specs(doc):
            for c in containers(template):
                for source in c.get("envFrom", []):
                    ref = source.get("secretRef") or source.get("configMapRef")
                    kind = "Secret" if "secretRef" in source else "ConfigMap"
                    assert f"{kind}/{ref['name']}" in by_key, f"{where}: no {kind} {ref['name']}"
    for doc in objects:
        if doc["kind"] == "HorizontalPodAutoscaler":
            target = doc["spec"]["scaleTargetRef"]
            assert f"{target['kind']}/{target['name']}" in by_key, key(doc)
        if doc["kind"] == "PodDisruptionBudget":
            labels = doc["spec"]["selector"]["matchLabels"]
            if "ray.io/cluster" in labels:  # labels KubeRay puts on the pods it creates
                ray = by_key[f"RayCluster/{labels['ray.io/cluster']}"]
                groups = {g["groupName"] for g in ray["spec"]["workerGroupSpecs"]}
                assert labels["ray.io/group"] in groups
                continue
            assert any(labels.items() <= t["metadata"]["labels"].items()
                       for d in workloads for _, t in pod_specs(d)), f"{key(doc)} selects nothing"
        if doc["kind"] == "Service":
            selector = doc["spec"]["selector"]
            assert any(selector.items() <= t["metadata"]["labels"].items()
                       for d in workloads for _, t in pod_specs(d)), f"{key(doc)} selects nothing"
        if doc["kind"] == "Ingress":
            for rule in doc["spec"]["rules"]:
                for path in rule["http"]["paths"]:
                    service = by_key[f"Service/{path['backend']['service']['name']}"]
                    port = path["backend"]["service"]["port"]["name"]
                    assert port in {p["name"] for p in service["spec"]["ports"]}


def test_references_between_objects_hold() -> None:
    check_references(source_objects())


def test_only_the_sandbox_is_privileged_and_pools_never_get_the_database() -> None:
    for doc in source_objects():
        for where, template in pod_specs(doc):
            pod_ctx = template["spec"].get("securityContext", {})
            for c in containers(template):
                ctx = c.get("securityContext", {})
                secrets = {s["secretRef"]["name"] for s in c.get("envFrom", []) if "secretRef" in s}
                if c["image"].startswith("crucible-worker-sandbox"):
                    assert ctx.get("privileged") is True and ctx.get("runAsUser") == 0
                else:
                    assert not ctx.get("privileged"), f"{where}/{c['name']} is privileged"
                    assert pod_ctx.get("runAsNonRoot") is True, f"{where} may run as root"
                    assert ctx.get("allowPrivilegeEscalation") is False, where
                if "crucible-worker" in secrets:
                    assert "crucible-control-plane" not in secrets, (
                        f"{where}/{c['name']} is a pool and gets the database secret")


def test_secret_templates_hold_no_values_and_nothing_applies_them() -> None:
    secrets = crd("Secret")
    assert {s["metadata"]["name"] for s in secrets} == {
        "crucible-control-plane", "crucible-broker", "crucible-object-store", "crucible-worker",
        "crucible-metrics"}
    assert all(d["kind"] != "Secret" for d in documents(all_resource_files()))
    for secret in secrets:
        assert secret.get("stringData"), key(secret)
        assert all(v == "" for v in secret["stringData"].values()), f"{key(secret)} has values"
        assert "data" not in secret


def test_queue_hpas_read_the_adapter_metric_for_their_own_queue() -> None:
    rules = yaml.safe_load(
        (K8S / "components" / "monitoring" / "prometheus-adapter-rules.yaml").read_text())
    served = {r["name"]["as"] for r in rules["rules"]["external"]}
    objects = {key(d): d for d in source_objects()}
    external = [d for d in objects.values() if d["kind"] == "HorizontalPodAutoscaler"
                and d["spec"]["metrics"][0]["type"] == "External"]
    assert {d["metadata"]["name"] for d in external} == {"crucible-worker-cpu",
                                                         "crucible-worker-sandbox"}
    for hpa in external:
        metric = hpa["spec"]["metrics"][0]["external"]["metric"]
        assert metric["name"] in served
        queue = metric["selector"]["matchLabels"]["pool"]
        assert queue in celery_queues()
        target = objects[f"Deployment/{hpa['spec']['scaleTargetRef']['name']}"]
        env = {e["name"]: e.get("value") for e in
               target["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["CRUCIBLE_WORKER_QUEUES"] == queue


def test_ingress_keeps_websockets_open() -> None:
    (ingress,) = crd("Ingress")
    notes = ingress["metadata"]["annotations"]
    for name in ("proxy-read-timeout", "proxy-send-timeout"):
        assert int(notes[f"nginx.ingress.kubernetes.io/{name}"]) >= 3600
    assert ingress["spec"]["tls"][0]["secretName"]


def test_container_commands_name_what_the_images_hold() -> None:
    for doc in source_objects():
        for where, template in pod_specs(doc):
            for c in containers(template):
                argv = c.get("command", [])
                for word in " ".join(argv).split():
                    if word.startswith("/app/"):
                        assert (ROOT / word.removeprefix("/app/")).is_file(), f"{where}: {word}"
                if argv[:2] == ["python", "-m"]:
                    module = ROOT.joinpath(*argv[2].split("."))
                    assert module.with_suffix(".py").is_file() or module.is_dir(), where
                if argv[:1] == ["python"] and len(argv) > 1 and argv[1].endswith(".py"):
                    assert (ROOT / argv[1].removeprefix("/app/")).is_file(), where


def test_migrations_run_before_the_web_serves() -> None:
    objects = {key(d): d for d in source_objects()}
    job = objects["Job/crucible-migrate"]
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][-2:] == ["migrate",
                                                                                 "--noinput"]
    # /readyz fails while a migration is unapplied (docs/operations.md), so a new release's
    # web pods join only once the Job has run; the rolling update never drops below its size.
    web = objects["Deployment/crucible-web"]
    container = web["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert web["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_probed_paths_are_routes_of_the_web() -> None:
    urls = (ROOT / "config" / "urls.py").read_text()
    probed = {"/metrics"}
    for doc in source_objects():
        for _, template in pod_specs(doc):
            for c in containers(template):
                for probe in ("readinessProbe", "livenessProbe"):
                    if "httpGet" in c.get(probe, {}):
                        probed.add(c[probe]["httpGet"]["path"])
                    if "exec" in c.get(probe, {}):
                        argv = c[probe]["exec"]["command"]
                        if argv[:2] == ["python", "-m"]:
                            assert ROOT.joinpath(*argv[2].split(".")).with_suffix(".py").is_file()
    assert probed == {"/readyz", "/healthz", "/metrics"}
    for path in probed:
        assert f'path("{path.lstrip("/")}"' in urls, f"{path} is not a route in config/urls.py"


# -- rendered overlays -----------------------------------------------------------------------

def renderer() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    kubectl = shutil.which("kubectl")
    if kubectl and subprocess.run([kubectl, "kustomize", "--help"], capture_output=True,
                                  check=False, timeout=60).returncode == 0:
        return [kubectl, "kustomize"]
    return None


@pytest.mark.parametrize("overlay", ["overlays/dev", "overlays/production", "kueue-cluster"])
def test_rendered_overlay_validates(overlay: str) -> None:
    command = renderer()
    if command is None:
        pytest.skip(host_reason("no kustomize renderer here (kustomize, or kubectl with its "
                                "built-in kustomize); the files were validated one by one"))
    out = subprocess.run([*command, str(K8S / overlay)], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    objects = [d for d in yaml.safe_load_all(out) if d]
    assert objects
    assert not [d for d in objects if d["kind"] == "Secret"], "apply -k would overwrite Secrets"
    for doc in objects:
        if (doc["apiVersion"], doc["kind"]) not in CRDS:
            validate_core(doc)
        if overlay == "kueue-cluster":
            assert "namespace" not in doc["metadata"], f"{key(doc)} is cluster-scoped"
        elif doc["kind"] not in CLUSTER_SCOPED:
            assert doc["metadata"]["namespace"] == kustomization(K8S / overlay)["namespace"]
    if overlay == "kueue-cluster":
        return
    check_references(objects)
    for doc in objects:
        for _, template in pod_specs(doc):
            for c in containers(template):
                name, _, tag = c["image"].rpartition(":")
                assert tag == "0.1.0", c["image"]
                if overlay == "overlays/production":
                    assert name.startswith("registry.example.com/crucible/"), c["image"]
    if overlay == "overlays/production":
        (ray,) = [d for d in objects if d["kind"] == "RayCluster"]
        assert ray["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "crucible-gpu"
        check_scheduler_nodes(objects)


def check_scheduler_nodes(objects: list[dict]) -> None:
    """With the scheduler on, a run is claimable only from its allocation's node: every pool
    worker claims as its Kubernetes node's name, and runs where an agent of its pool registers
    that node."""
    (config,) = [d for d in objects if key(d) == "ConfigMap/crucible-config"]
    assert config["data"]["CRUCIBLE_SCHEDULER"] == "true"
    agents: dict[str, dict] = {}
    for doc in objects:
        if doc["kind"] == "DaemonSet":
            c = doc["spec"]["template"]["spec"]["containers"][0]
            env = {e["name"]: e for e in c.get("env", [])}
            if "workers.agent" in c["command"]:
                assert env["CRUCIBLE_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == \
                    "spec.nodeName"
                agents[env["CRUCIBLE_NODE_POOL"]["value"]] = doc["spec"]["template"]["spec"]
    assert set(agents) == {"gpu", "cpu"}
    for doc in objects:
        for where, template in pod_specs(doc):
            c = template["spec"]["containers"][0]
            env = {e["name"]: e for e in c.get("env", [])}
            queue = env.get("CRUCIBLE_WORKER_QUEUES", {}).get("value")
            if queue is None:
                continue
            assert env["CRUCIBLE_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == \
                "spec.nodeName", where
            if queue in ("cpu", "sandbox"):
                assert template["spec"].get("nodeSelector") == agents["cpu"]["nodeSelector"], (
                    f"{where} runs off the nodes the cpu agent registers")


def test_worker_pods_outlast_their_drain() -> None:
    """A worker that gets SIGTERM drains for up to CRUCIBLE_DRAIN_TIMEOUT_S (checkpoint, hand
    the run back): every pod that runs a Celery worker must be given longer before SIGKILL."""
    objects = source_objects()
    config = next(d for d in objects if key(d) == "ConfigMap/crucible-config")
    drain = float(config["data"]["CRUCIBLE_DRAIN_TIMEOUT_S"])
    checked = []
    for doc in objects:
        for where, template in pod_specs(doc):
            text = yaml.safe_dump(containers(template))
            if "celery" not in text and "CRUCIBLE_WORKER_QUEUES" not in text:
                continue
            grace = template["spec"].get("terminationGracePeriodSeconds", 30)
            assert grace >= drain + 15, (where, grace, drain)
            checked.append(where)
    assert any("worker-cpu" in w for w in checked) and any("worker-sandbox" in w
                                                          for w in checked), checked
