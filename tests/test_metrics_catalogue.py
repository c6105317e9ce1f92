"""docs/metrics.md against what the processes publish, both ways: every family a live worker and a live
exporter beside it emit is catalogued with its type and labels, and every catalogued family is emitted.
Families the page marks conditional are emitted by the exporter over the fake NVML, watching a vLLM server
with the vramledger plugin, with --kubernetes' pod labels."""
from __future__ import annotations

import json
import sys

import httpx
import pytest
from fake_engines import every_kind
from fake_pynvml import FakeGpu, FakePynvml, proc
from metric_catalogue import catalogue
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import Server
from test_exporter_host import spawn, start_exporter  # noqa: F401
from test_exporter_kubernetes import clock, directory  # noqa: F401
from test_exporter_vllm import gpu_text, start_tree
from test_exporter_vllm_ledger import CPU_LEDGER, NEIGHBOUR

from vramledger.exporter.collector import ExporterCollector
from vramledger.exporter.engines import Engines, VllmEngine
from vramledger.exporter.engines.fetch import HttpClient
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.sources import NvmlSource

GiB = 1 << 30


def conforms(process: str, text: str) -> set[str]:
    """Checks every family of `text` against the catalogue of `process`; returns the names of those with
    series (a family may be announced with none)."""
    families = {f.family: f for f in catalogue()[process].values()}
    emitted = set()
    for family in text_string_to_metric_families(text):
        created = families.get(family.name.removesuffix("_created"))
        if family.name.endswith("_created") and created and created.type in ("counter", "histogram"):
            entry = created  # the start time the client library publishes beside them (docs/metrics.md)
            assert family.type == "gauge", family
        else:
            assert family.name in families, f"the {process} emits {family.name}, which docs/metrics.md lacks"
            entry = families[family.name]
            assert family.type == entry.type, f"{entry.name}: {family.type}, catalogued as {entry.type}"
        for sample in family.samples:
            labels = set(sample.labels) - ({"le"} if sample.name.endswith("_bucket") else set())
            assert entry.labels <= labels <= entry.labels | entry.optional_labels, \
                f"{sample.name}: labels {sorted(labels)}, catalogued {sorted(entry.labels)}" \
                f" (+ {sorted(entry.optional_labels)})"
        if family.samples:
            emitted.add(entry.name)
    return emitted


@pytest.fixture(scope="module")
def worker(checkpoints, tmp_path_factory):
    """One real worker with a draft, after one request (speculative steps ran)."""
    server = Server("catalogue", ["--model", checkpoints["llama"], "--draft-model", checkpoints["llama-draft"],
                                  "--max-model-len", "128"], tmp_path_factory.mktemp("worker") / "worker.log")
    server.start()
    try:
        server.wait_ready()
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "def f(x):", "max_tokens": 16, "temperature": 0}
        httpx.post(server.url + "/v1/completions", json=body, timeout=60).raise_for_status()
        yield server
    finally:
        server.stop()


def test_a_live_worker_and_exporter_publish_the_catalogue(worker, spawn, tmp_path):  # noqa: F811
    _, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host", "--worker", worker.url)
    worker_text = httpx.get(worker.url + "/metrics").text
    exporter_text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for process, text in (("worker", worker_text), ("exporter", exporter_text)):
        emitted = conforms(process, text)
        always = {name for name, f in catalogue()[process].items() if f.always}
        assert always <= emitted, f"the {process} does not emit {sorted(always - emitted)}"
        if process == "worker":  # nothing conditional left after a speculative request
            assert emitted == set(catalogue()["worker"])
    # The exporter reads the worker's version from the worker's own info series.
    [serving] = [s for f in text_string_to_metric_families(worker_text) for s in f.samples
                 if s.name == "vramledger_serving_info"]
    [info] = [s for f in text_string_to_metric_families(exporter_text) for s in f.samples
              if s.name == "vramledger_engine_info"]
    assert info.labels["version"] == serving.labels["version"] != ""


def test_the_conditional_exporter_families(monkeypatch, spawn, tmp_path, api, clock):  # noqa: F811
    """NVML's reserved memory, a vLLM rank's ledger (the plugin's, recorded on its CUDA path) and its
    server's other processes (recorded from vLLM's CPU build), pod labels; what the engines of the other
    kinds give (fakes in their shapes, tests/fake_engines.py)."""
    ledger = tmp_path / "ledger.json"
    ledger.write_text(json.dumps(json.loads(NEIGHBOUR.read_text())
                                 | {"processes": json.loads(CPU_LEDGER.read_text())["processes"]}))
    *_, [rank], url = start_tree(spawn, gpu_text(), tmp_path, ledger=ledger)
    monkeypatch.setitem(sys.modules, "pynvml", FakePynvml([FakeGpu("GPU-fake", total=80 * GiB,
                                                                   allocated=6 * GiB,
                                                                   processes=[proc(rank, "VLLM::Worker", 3)])]))
    errors, client = ErrorLog(), HttpClient(5)
    registry = CollectorRegistry()
    others = [kind.adapter(fake.url, client, errors, None) for kind, fake in every_kind(spawn, tmp_path)]
    registry.register(ExporterCollector(NvmlSource.open(errors),
                                        Engines([VllmEngine(url, client, errors), *others], errors),
                                        errors, pods=directory(api, clock)))
    emitted = conforms("exporter", generate_latest(registry).decode())
    client.close()
    conditional = {name for name, f in catalogue()["exporter"].items() if not f.always}
    assert conditional <= emitted, f"not emitted: {sorted(conditional - emitted)}"
    process = [s for s in registry.collect() if s.name == "vramledger_device_process_memory_bytes"]
    pod_labels = catalogue()["exporter"]["vramledger_device_process_memory_bytes"].optional_labels
    assert all(pod_labels <= set(s.labels) for s in process[0].samples) and process[0].samples
