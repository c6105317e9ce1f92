"""`python -m vramledger.exporter --kubernetes` as a process: it finds a real worker through a local server
answering the Kubernetes API's pod list, reads its ledger, and labels process series by pod."""
from __future__ import annotations

import yaml
from kube_api import KubeAPI, pod
from test_exporter_host import PY, find, one, scrape, spawn, start_exporter  # noqa: F401
from test_exporter_real_worker import worker  # noqa: F401

NODE = "gpu-node-1"


def kubeconfig(path, server: str):
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server}}],
        "users": [{"name": "test", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}]}))
    return path


def test_exporter_finds_the_workers_of_its_node_through_the_api(spawn, worker, tmp_path, monkeypatch):  # noqa: F811
    proc, url = worker
    port = url.rsplit(":", 1)[1]
    api = KubeAPI()
    try:
        api.pods = [
            pod("vramledger-worker-5f7d8", "inference", NODE, ip="127.0.0.1",
                labels={"vramledger.io/engine": "vramledger"}, annotations={"vramledger.io/port": port}),
            # on another node: not this exporter's
            pod("vramledger-worker-x9k2p", "inference", "gpu-node-2", ip="127.0.0.2",
                labels={"vramledger.io/engine": "vramledger"}, annotations={"vramledger.io/port": port}),
        ]
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "kubeconfig", api.url)))
        monkeypatch.setenv("NODE_NAME", NODE)
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        _, exporter_port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host",
                                          "--min-process-memory", "1MiB", "--kubernetes")
        samples = scrape(exporter_port)
        assert one(samples, "vramledger_engine_up", engine=url) == 1
        assert [s.labels["engine"] for s in find(samples, "vramledger_engine_up")] == [url]
        [mine] = find(samples, "vramledger_device_process_memory_bytes", pid=str(proc.pid))
        assert mine.labels["owner"] == "engine" and mine.labels["engine"] == url
        # This worker runs in no pod (no kubelet here): its pod labels are empty, not guessed.
        assert (mine.labels["namespace"], mine.labels["pod"], mine.labels["container"]) == ("", "", "")
        assert one(samples, "vramledger_exporter_errors_total", source="kubernetes") == 0
        assert any(r.startswith("/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-node-1") for r in api.requests)
    finally:
        api.stop()


def test_exporter_without_a_node_name_refuses_to_start(spawn, tmp_path, monkeypatch):  # noqa: F811
    api = KubeAPI()
    try:
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "kubeconfig", api.url)))
        monkeypatch.delenv("NODE_NAME", raising=False)
        proc = spawn([PY, "-m", "vramledger.exporter", "--port", "0", "--backend", "host", "--kubernetes"],
                     stderr=(tmp_path / "err.log").open("w"))
        assert proc.wait(timeout=60) == 1
        assert "NODE_NAME" in (tmp_path / "err.log").read_text()
    finally:
        api.stop()
