"""--kubernetes's engines: a real worker found through a local server answering the Kubernetes API's
pod list, read like a --worker; adapters follow pods as they come and go; a vLLM pod's processes
are found by their cgroups."""
from __future__ import annotations

import pytest
from kube_api import Clock, pod
from kubernetes import client
from test_exporter_host import spawn  # noqa: F401
from test_exporter_real_worker import worker  # noqa: F401

from vramledger.exporter.discovery import DiscoveredEngines, PodLocator
from vramledger.exporter.engines import Engines, VllmEngine
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.kubernetes import PodDirectory
from vramledger.exporter.processes import TREE_MAX_AGE, NotFound

NODE = "gpu-node-1"
UID = "7c1f5c5a-3b9e-4f8e-9d6c-2a1b0c9d8e7f"


def discovered(api, clock, errors, given=()) -> DiscoveredEngines:
    config = client.Configuration(host=api.url)
    config.retries = 0
    pods = PodDirectory(client.CoreV1Api(client.ApiClient(config)), NODE, errors, max_age=30, min_interval=5,
                        clock=clock)
    return DiscoveredEngines(pods, Engines.open({"vramledger": list(given)}, 1.0, errors), 1.0, errors)


def worker_pod(url: str, uid: str | None = None) -> dict:
    return pod("vramledger-worker-5f7d8", "inference", NODE, uid=uid, ip="127.0.0.1",
               labels={"vramledger.io/engine": "vramledger"},
               annotations={"vramledger.io/port": url.rsplit(":", 1)[1]})


def test_a_worker_found_through_the_api_is_read_like_a_given_one(api, worker):  # noqa: F811
    proc, url = worker
    errors, clock = ErrorLog(), Clock()
    api.pods.append(worker_pod(url))
    engines = discovered(api, clock, errors)
    try:
        state = engines.read()[url].state
        assert engines.urls == [url]
        assert state.pids == {proc.pid} and state.declared_bytes > 0
        # The pod goes away: its adapter with it, once the list is refreshed.
        api.pods.clear()
        clock.now += 30
        assert engines.read() == {} and engines.urls == []
        assert errors.counts().get("kubernetes", 0) == 0
    finally:
        engines.close()


def test_given_engines_stay_and_are_not_read_twice(api, worker):  # noqa: F811
    proc, url = worker
    errors = ErrorLog()
    api.pods.append(worker_pod(url))
    engines = discovered(api, Clock(), errors, given=[url])
    try:
        assert list(engines.read()) == [url] and engines.urls == [url]
    finally:
        engines.close()


def test_adapters_follow_the_pods(api):
    errors, clock = ErrorLog(), Clock()
    vllm = pod("vllm-0", "inference", NODE, uid=UID, ip="10.244.1.30", labels={"vramledger.io/engine": "vllm"})
    api.pods.append(vllm)
    engines = discovered(api, clock, errors)
    try:
        engines._update(engines._pods.engines())
        [uid] = engines._found.values()
        [adapter] = engines._engines.engines
        assert isinstance(adapter, VllmEngine) and uid == UID and engines.urls == ["http://10.244.1.30:8000"]
        # Another pod takes the same IP and port: another adapter, for the new pod's processes.
        api.pods[:] = [pod("vllm-1", "inference", NODE, ip="10.244.1.30", labels={"vramledger.io/engine": "vllm"})]
        clock.now += 30
        engines._update(engines._pods.engines())
        [uid] = engines._found.values()
        assert uid == api.pods[0]["metadata"]["uid"] and adapter not in engines._engines.engines
    finally:
        engines.close()


def test_a_pods_processes_are_those_its_cgroups_name(tmp_path):
    def process(pid: str, path: str) -> None:
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cgroup").write_text(f"0::{path}\n")

    process("300", f"/kubepods/burstable/pod{UID}/{'a' * 64}")
    process("301", "/system.slice/x.service")
    clock = Clock()
    locator = PodLocator(UID, "inference/vllm-0", tmp_path, clock)
    assert locator.pids() == {300}
    # A scan reads every process's cgroup: the pod's processes are kept TREE_MAX_AGE seconds.
    process("302", f"/kubepods/burstable/pod{UID}/{'b' * 64}")
    assert locator.pids() == {300}
    clock.now += TREE_MAX_AGE
    assert locator.pids() == {300, 302}
    with pytest.raises(NotFound, match="inference/vllm-1"):
        PodLocator("0" * 32, "inference/vllm-1", tmp_path).pids()
