"""exporter/kubernetes.py against a local server answering the Kubernetes API's pod list and get:
engines discovered by label, processes named by pod, a pod that goes away, an API that is down."""
from __future__ import annotations

import pytest
import yaml
from kube_api import Clock, KubeAPI, pod
from kubernetes import client

from vramledger.exporter.cgroups import CgroupIdentity, parse_cgroup
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.kubernetes import NO_POD, SOURCE, PodDirectory, PodLabels

NODE = "gpu-node-1"
CID = {name: (f"{i:x}" * 64)[:64] for i, name in enumerate(("worker", "sidecar", "vllm", "trainer", "new"), 1)}


@pytest.fixture
def clock():
    return Clock()


def directory(api: KubeAPI, clock: Clock, errors: ErrorLog | None = None, proc_root="/proc") -> PodDirectory:
    config = client.Configuration(host=api.url)
    config.retries = 0  # an API that is down fails at once
    return PodDirectory(client.CoreV1Api(client.ApiClient(config)), NODE, errors or ErrorLog(), max_age=30,
                        min_interval=5, timeout=2, clock=clock, proc_root=proc_root)


def identity_of(p: dict, container: str) -> CgroupIdentity:
    """What the process's /proc/<pid>/cgroup says (systemd driver, containerd, cgroup v2)."""
    uid = p["metadata"]["uid"].replace("-", "_")
    return parse_cgroup(f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/"
                        f"cri-containerd-{CID[container]}.scope\n")


def lists(api: KubeAPI) -> list[str]:
    return [r for r in api.requests if r.startswith("/api/v1/pods")]


@pytest.fixture
def worker_pod(api):
    p = pod("vramledger-worker-5f7d8", "inference", NODE, containers={"worker": CID["worker"],
                                                                      "exporter": CID["sidecar"]},
            labels={"vramledger.io/engine": "vramledger"}, annotations={"vramledger.io/port": "8000"},
            ip="10.244.1.17")
    api.pods.append(p)
    return p


def test_a_process_is_named_by_its_pod_and_container(api, clock, worker_pod):
    pods = directory(api, clock)
    assert pods.labels(identity_of(worker_pod, "worker")) == PodLabels("inference", "vramledger-worker-5f7d8",
                                                                       "worker")
    assert pods.labels(identity_of(worker_pod, "sidecar")).container == "exporter"
    assert lists(api) == ["/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-node-1"]  # one list, then cached


def test_a_process_in_no_pod_gets_empty_labels_without_asking(api, clock, worker_pod):
    pods = directory(api, clock)
    assert pods.labels(None) == NO_POD == PodLabels("", "", "")
    assert pods.labels(CgroupIdentity(None, CID["worker"], "docker")) == NO_POD  # a container outside k8s
    assert api.requests == []


def test_a_pod_started_after_the_list_is_found_by_listing_again(api, clock, worker_pod):
    pods = directory(api, clock)
    pods.refresh()
    trainer = pod("trainer-0", "research", NODE, containers={"pytorch": CID["trainer"]})
    api.pods.append(trainer)
    assert pods.labels(identity_of(trainer, "trainer")) == NO_POD  # listed under min_interval ago
    clock.now += 5
    assert pods.labels(identity_of(trainer, "trainer")) == PodLabels("research", "trainer-0", "pytorch")
    assert len(lists(api)) == 2


def test_a_restarted_container_is_found_by_reading_its_pod(api, clock, worker_pod):
    pods = directory(api, clock)
    pods.refresh()
    worker_pod["status"]["containerStatuses"][0]["containerID"] = f"containerd://{CID['new']}"
    worker_pod["status"]["containerStatuses"][0]["restartCount"] = 1
    assert pods.labels(identity_of(worker_pod, "new")).container == "worker"
    assert api.requests[-1] == "/api/v1/namespaces/inference/pods/vramledger-worker-5f7d8"
    assert len(lists(api)) == 1


def test_an_unknown_container_of_a_known_pod_names_the_pod_only(api, clock, worker_pod):
    # e.g. the pod sandbox's pause process: its id is in no container status.
    pods = directory(api, clock)
    sandbox = CgroupIdentity(worker_pod["metadata"]["uid"], "9" * 64, "containerd")
    assert pods.labels(sandbox) == PodLabels("inference", "vramledger-worker-5f7d8", "")
    assert pods.labels(sandbox) == PodLabels("inference", "vramledger-worker-5f7d8", "")
    assert len([r for r in api.requests if "/namespaces/" in r]) == 1  # asked once per interval


def test_a_pod_that_goes_away_loses_its_labels(api, clock, worker_pod):
    pods = directory(api, clock)
    process = identity_of(worker_pod, "worker")
    assert pods.labels(process).pod == "vramledger-worker-5f7d8"
    api.pods.remove(worker_pod)
    clock.now += 30  # the cache's age
    assert pods.labels(process) == NO_POD
    assert pods.engines() == []


def test_a_pod_deleted_between_lists_is_dropped_when_read(api, clock, worker_pod):
    pods = directory(api, clock)
    pods.refresh()
    api.pods.remove(worker_pod)
    assert pods.labels(identity_of(worker_pod, "new")) == NO_POD  # get answers 404 NotFound
    assert pods.labels(identity_of(worker_pod, "worker")) == NO_POD  # and the pod left the cache
    assert pods.engines() == []


def test_a_pod_recreated_under_the_same_name_is_another_pod(api, clock, worker_pod):
    pods = directory(api, clock)
    pods.refresh()
    api.pods.remove(worker_pod)
    api.pods.append(pod("vramledger-worker-5f7d8", "inference", NODE, containers={"worker": CID["new"]}))
    assert pods.labels(identity_of(worker_pod, "new")) == NO_POD  # the old UID's process is no longer known


@pytest.mark.parametrize("outage", ["connection refused", "http 500"])
def test_an_api_that_is_down_is_counted_and_its_last_labels_dropped(api, clock, worker_pod, outage):
    errors = ErrorLog()
    pods = directory(api, clock, errors)
    process = identity_of(worker_pod, "worker")
    assert pods.labels(process).pod == "vramledger-worker-5f7d8"
    if outage == "connection refused":
        api.stop()
    else:
        api.fail_with = 500
    clock.now += 30
    assert pods.labels(process) == NO_POD  # not the pod it was in: nothing invented
    assert pods.engines() == []
    assert errors.counts()[SOURCE] == 1
    clock.now += 1  # within min_interval: no new request, still no labels
    assert pods.labels(process) == NO_POD and errors.counts()[SOURCE] == 1
    clock.now += 5
    assert pods.refresh() is False and errors.counts()[SOURCE] == 2
    if outage == "http 500":  # the API comes back
        api.fail_with = None
        clock.now += 5
        assert pods.labels(process).pod == "vramledger-worker-5f7d8"


def test_engines_on_this_node_are_discovered_by_label(api, clock, worker_pod):
    api.pods += [
        pod("vllm-0", "inference", NODE, containers={"vllm": CID["vllm"]}, ip="10.244.1.30",
            labels={"vramledger.io/engine": "vllm"}, annotations={"vramledger.io/port": "8080"}),
        pod("vllm-v6", "inference", NODE, ip="fd00:10:244::7", labels={"vramledger.io/engine": "vllm"}),
        pod("starting", "inference", NODE, phase="Pending", labels={"vramledger.io/engine": "vramledger"}),
        pod("other-node", "inference", "gpu-node-2", ip="10.244.2.5", labels={"vramledger.io/engine": "vllm"}),
        pod("unlabelled", "inference", NODE, ip="10.244.1.31"),
        pod("unknown-kind", "inference", NODE, ip="10.244.1.32", labels={"vramledger.io/engine": "no-such-engine"}),
    ]
    errors = ErrorLog()
    api.pods.append(pod("bad-port", "inference", NODE, ip="10.244.1.33", labels={"vramledger.io/engine": "vllm"},
                        annotations={"vramledger.io/port": "http"}))
    engines = directory(api, clock, errors).engines()
    assert [(e.kind, e.url, e.namespace, e.pod) for e in engines] == [
        ("vllm", "http://10.244.1.30:8080", "inference", "vllm-0"),
        ("vllm", "http://[fd00:10:244::7]:8000", "inference", "vllm-v6"),
        ("vramledger", "http://10.244.1.17:8000", "inference", "vramledger-worker-5f7d8"),
    ]  # by namespace and pod
    assert engines[-1].uid == worker_pod["metadata"]["uid"]
    assert errors.counts()[SOURCE] == 1  # the annotation that is no port


def test_connect_reads_a_kubeconfig_outside_a_cluster(api, worker_pod, tmp_path, monkeypatch):
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": api.url}}],
        "users": [{"name": "test", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    pods = PodDirectory.connect(NODE, ErrorLog())
    assert [e.pod for e in pods.engines()] == ["vramledger-worker-5f7d8"]


def test_an_empty_node_name_is_refused():
    with pytest.raises(ValueError, match="NODE_NAME"):
        PodDirectory(None, "", ErrorLog())


def test_a_host_pid_is_named_through_its_cgroup_file(api, clock, worker_pod, tmp_path):
    uid = worker_pod["metadata"]["uid"]
    (tmp_path / "48213").mkdir()
    (tmp_path / "48213" / "cgroup").write_text(f"0::/kubepods/burstable/pod{uid}/{CID['worker']}\n")
    pods = directory(api, clock, proc_root=tmp_path)  # a /proc tree holding just that process
    assert pods.labels_of_pid(48213) == PodLabels("inference", "vramledger-worker-5f7d8", "worker")
    assert pods.labels_of_pid("48213") == pods.labels_of_pid(48213)
    assert pods.labels_of_pid(48214) == NO_POD  # exited
    assert pods.labels_of_pid("other") == NO_POD  # the sum of the smallest processes
