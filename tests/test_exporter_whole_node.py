"""One exporter (a real process, host reader) watching one engine of every kind at once: our real worker
(`python -m vramledger.worker serve` on a small random model), vLLM's real CPU build with the vramledger plugin, and
the kinds that need a GPU as fake servers in their engines' shapes (tests/fake_engines.py, each shape's
source in tests/engine_shapes.py). Each engine is given its own processes and no other's, declares what
its kind declares, publishes its KV usage, and the exposition is docs/metrics.md's.

Needs the vLLM venv (`make vllm-venv`); skipped, saying so, without it. One vLLM start for the module
(test_vllm_plugin_real's fixture), one worker start beside it.
"""
from __future__ import annotations

import functools
import subprocess

import engine_shapes as shapes
import fake_engines
import httpx
import psutil
import pytest
from fake_engines import every_kind, kind_of, of_engine, owned
from prometheus_client.parser import text_string_to_metric_families
from test_exporter_host import ROOT, spawn, start_exporter  # noqa: F401
from test_exporter_nvml import split_samples
from test_exporter_real_worker import start_real_worker
from test_metrics_catalogue import conforms
from test_vllm_plugin_real import plugin_site, vllm_peer, with_plugin  # noqa: F401

from vramledger.exporter.engines import llamacpp, ollama, sglang, tgi, triton, vllm, vramledger
from vramledger.exporter.engines.registry import kinds
from vramledger.worker.selfcheck.processes import wait_http

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(vllm_peer.vllm_python() is None,
                                 reason="no vLLM venv (VLLM_VENV or .venv-vllm): run `make vllm-venv`")]
HOST = (("device", "host"),)


def own_metric(url: str, name: str) -> float:
    """The one sample of a series in an engine's own /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    [value] = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    return value


def sglang_declared() -> int:
    """What the fake SGLang's one rank holds: its weights, KV cache and graphs, SGLang's GB being 2^30 bytes."""
    usage = shapes.sglang_memory()
    return sum(round(usage[key] * sglang.GIB) for key in ("weight", "kvcache", "graph"))


@pytest.fixture(scope="module")
def engines(request, checkpoints):
    """Our worker and vLLM with the plugin, started together: our worker loads and profiles while vLLM
    starts, rather than after it (the two starts are the module's setup)."""
    worker = start_real_worker(functools.partial(subprocess.Popen, cwd=ROOT), checkpoints)
    try:
        vllm_running = request.getfixturevalue("with_plugin")  # started and waited for
        wait_http(worker[1] + "/health", 180, worker[0])
        yield worker, vllm_running
    finally:
        worker[0].kill()
        worker[0].wait(timeout=10)


def test_one_exporter_watches_an_engine_of_every_kind(spawn, engines, tmp_path):  # noqa: F811
    (worker_proc, worker_url), (vllm_server, vllm_url, _) = engines
    fakes = every_kind(spawn, tmp_path)
    flags = [arg for kind, fake in fakes for arg in (kind.flag, fake.url)]
    _, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host", "--worker", worker_url,
                             "--vllm", vllm_url, *flags, "--engine-timeout", "10")
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    values, errors = split_samples(text_string_to_metric_families(text))

    ledger = httpx.get(worker_url + "/v1/memory", timeout=30).json()
    plugin = httpx.get(vllm_url + "/vramledger/memory", timeout=30).json()
    [model] = shapes.ollama_ps(shapes.ollama_model())["models"]
    used, free = fake_engines.TRITON_BLOCKS
    vllm_tree = {vllm_server.pid} | {p.pid for p in psutil.Process(vllm_server.pid).children(recursive=True)}
    # url -> (kind, its processes, what it declares or None, its KV usage or None)
    expected = {
        worker_url: (vramledger.NAME, {worker_proc.pid}, ledger["declared_bytes"],
                     own_metric(worker_url, "vramledger_kv_cache_usage_ratio")),
        vllm_url: (vllm.NAME, vllm_tree, plugin["ranks"][0]["declared_bytes"] + sum(
            p["bytes"] for p in plugin["processes"]), own_metric(vllm_url, vllm.KV_USAGE)),
    }
    usages = {sglang.NAME: fake_engines.SGLANG_TOKEN_USAGE, ollama.NAME: None,
              llamacpp.NAME: fake_engines.LLAMACPP_KV_RATIO,
              tgi.NAME: fake_engines.TGI_BATCH_TOKENS / shapes.tgi_info()["max_batch_total_tokens"],
              triton.NAME: used / (used + free)}
    # Ollama: size_vram on its GPUs, the rest of its size on the host; llama.cpp, TGI and Triton: nothing.
    declared = {sglang.NAME: sglang_declared(), ollama.NAME: model["size"]}
    for kind, fake in fakes:
        expected[fake.url] = (kind.name, set(fake.tree), declared.get(kind.name), usages[kind.name])
    assert len(plugin["ranks"]) == 1
    assert sorted(kind for kind, *_ in expected.values()) == sorted(kind.name for kind in kinds())

    for url, (kind, processes, declares, kv_usage) in expected.items():
        series = of_engine(values, url)
        assert kind_of(values, url) == kind
        assert series[("up", ())] == 1, kind
        mine = owned(values, url)
        assert set(mine) == processes, kind  # every process of it, and none of another engine's
        observed = series[("observed_memory_bytes", HOST)]
        assert observed == sum(mine.values()) > 0, kind
        assert series.get(("declared_memory_bytes", ())) == declares, kind
        assert series.get(("kv_cache_usage_ratio", ())) == (None if kv_usage is None else pytest.approx(kv_usage)), kind
        # On the host: our worker and vLLM declare there, and so does Ollama (none of its model, here all on
        # its GPU); SGLang declares only on its GPUs, the others nowhere.
        on_host = {vramledger.NAME: declares, vllm.NAME: declares, ollama.NAME: model["size"] - model["size_vram"]}
        unaccounted = series.get(("unaccounted_memory_bytes", HOST))
        assert unaccounted == (max(0, observed - on_host[kind]) if kind in on_host else None), kind
    assert {kind.source for kind in kinds()} <= set(errors)
    assert set(errors.values()) == {0}
    conforms("exporter", text)  # every family it emits is docs/metrics.md's, with its type and labels
