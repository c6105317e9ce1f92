"""The vLLM plugin in a real vLLM (its CPU build), installed the way docs/vllm.md says (pip --no-deps):
in vLLM's venv by `make test` when that install is this checkout's, else into a folder of the test's
own (tests/vllm_plugin_install.py); and the exporter reading it.

Needs the vLLM venv (`make vllm-venv`); skipped, saying so, without it. Three vLLM starts, side by side:
the plugin enabled with the shipped pair, installed but not enabled, and on a vLLM version it was not
built for.
"""
from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_exporter_host import find, one, scrape, spawn, start_exporter  # noqa: F401
from vllm_plugin_install import plugin_path

from vramledger.ledger_reading import parse_server_document
from vramledger.worker.selfcheck.processes import free_port, wait_http

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import vllm_peer  # noqa: E402

pytestmark = pytest.mark.skipif(vllm_peer.vllm_python() is None,
                                reason="no vLLM venv (VLLM_VENV or .venv-vllm): run `make vllm-venv`")
TARGET = ROOT / "worker" / "assets" / "tiny-coder-target"
DRAFT = ROOT / "worker" / "assets" / "tiny-coder-draft"
FAKE_VERSION_DIR = Path(__file__).resolve().parent / "vllm_fake_version"
GiB = 1 << 30


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> list[str]:
    """PYTHONPATH entries that give vLLM this checkout's plugin (none: its venv has it installed)."""
    return plugin_path(vllm_peer.vllm_python(), tmp_path_factory.mktemp("plugin") / "site")


def python_path(*entries: str) -> str | None:
    return os.pathsep.join(entries) or None  # None: no PYTHONPATH at all


class VllmServer:
    """vLLM's OpenAI server on the shipped target, uncompiled (-O0), 1 GiB of KV cache; its cwd is a
    folder of its own, so no checkout's metadata on sys.path shadows the installed plugin. Started
    here and waited for in ready(), so that several start side by side."""

    def __init__(self, tmp_path_factory, name: str, env: dict, **kwargs):
        folder = tmp_path_factory.mktemp(name)
        port, self.log = free_port(), folder / "vllm.log"
        self.process = vllm_peer.start_vllm(TARGET, port, self.log, kv_cache_gib=1, max_model_len=256,
                                            extra=["-O0"], env=env, cwd=folder, **kwargs)
        self.url = f"http://127.0.0.1:{port}"

    def ready(self) -> tuple[subprocess.Popen, str, Path]:
        """(the server's process, its URL, its log) once it answers /health."""
        wait_http(self.url + "/health", vllm_peer.STARTUP_TIMEOUT, self.process, self.log)
        return self.process, self.url, self.log

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # its own session: the engine core and workers go too
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def with_plugin(tmp_path_factory, plugin_site):
    env = {"PYTHONPATH": python_path(*plugin_site), "VLLM_PLUGINS": "vramledger"}
    server = VllmServer(tmp_path_factory, "enabled", env, draft=DRAFT)
    try:
        yield server.ready()
    finally:
        server.stop()


@pytest.fixture(scope="module", autouse=True)
def servers_without_the_plugin_at_work(request, tmp_path_factory, plugin_site) -> dict[str, VllmServer]:
    """The module's other vLLM servers that its selected tests use, started before its first test
    (with_plugin's start too): a start is mostly one process at work at a time, so they overlap."""
    envs = {"not_enabled": {"PYTHONPATH": python_path(*plugin_site), "VLLM_PLUGINS": None},
            "unsupported": {"PYTHONPATH": python_path(str(FAKE_VERSION_DIR), *plugin_site),
                            "VLLM_PLUGINS": "vramledger", "FAKE_VLLM_VERSION": "0.99.0"}}
    wanted = {name for item in request.session.items if item.module is request.module
              for name in item.fixturenames}
    started = {name: VllmServer(tmp_path_factory, name, env) for name, env in envs.items() if name in wanted}
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture(scope="module")
def not_enabled(servers_without_the_plugin_at_work):
    return servers_without_the_plugin_at_work["not_enabled"].ready()


@pytest.fixture(scope="module")
def unsupported(servers_without_the_plugin_at_work):
    return servers_without_the_plugin_at_work["unsupported"].ready()


def checkpoint_tensor_bytes(model_dir: Path) -> int:
    """The tensors' bytes in a safetensors checkpoint, from its header (no tensor is read)."""
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        total += sum(end - start for name, t in header.items() if name != "__metadata__"
                     for start, end in [t["data_offsets"]])
    return total


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 4) -> int:
    """Keys and values of one token in every layer of a model, from its config."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * dtype_bytes


def cache_config_info(url: str) -> dict:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if family.name == "vllm:cache_config_info":
            return family.samples[0].labels
    raise AssertionError("vLLM's /metrics has no vllm:cache_config_info")


def complete(url: str) -> str:
    response = httpx.post(url + "/v1/completions", timeout=60,
                          json={"model": str(TARGET), "prompt": "def add(a, b):", "max_tokens": 4})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_ledger_has_weights_per_model_and_the_kv_cache_vllm_allocated(with_plugin):
    server, url, _ = with_plugin
    response = httpx.get(url + "/vramledger/memory", timeout=30)
    assert response.status_code == 200, response.text
    doc = response.json()
    assert (doc["version"], doc["engine"], doc["engine_version"]) == (1, "vllm", "0.32.0")
    assert parse_server_document(doc) is doc  # the document's one reader reads it (vramledger/ledger_reading.py)
    [rank] = doc["ranks"]
    assert rank["rank"] == 0 and rank["errors"] == []
    entries = {(e["component"], e["model"]): e for e in rank["entries"]}

    # Each model's weights as vLLM holds them, against the tensors of its checkpoint.
    for model, path in (("target", TARGET), ("draft", DRAFT)):
        held, checkpoint = entries["weights", model]["bytes"], checkpoint_tensor_bytes(path)
        assert abs(held - checkpoint) <= 0.02 * checkpoint, (model, held, checkpoint)
    assert rank["models"] == {"target": str(TARGET), "draft": str(DRAFT)}
    # Both tie their LM head to the embedding, which the CPU backend keeps for lookups and packs for
    # its matmul kernel twice (as the embedding layer and as the head): two kernel-only copies each.
    for model, path in (("target", TARGET), ("draft", DRAFT)):
        config = json.loads((path / "config.json").read_text())
        assert entries["kernels", model]["bytes"] == 2 * config["vocab_size"] * config["hidden_size"] * 4

    # The KV cache vLLM allocated: its blocks hold the target's and the draft's layers.
    info = cache_config_info(url)
    blocks, block_size = int(info["num_gpu_blocks"]), int(info["block_size"])
    per_block = block_size * (kv_bytes_per_token(TARGET) + kv_bytes_per_token(DRAFT))
    assert entries["kv_cache", ""]["bytes"] == blocks * per_block
    # The blocks vLLM's scheduler hands out, and the null block it keeps back (vllm/v1/core/block_pool.py).
    assert rank["kv_cache"]["blocks_total"] == blocks - 1 and rank["kv_cache"]["blocks_reserved"] == 1
    assert rank["kv_cache"]["bytes_per_block"] == per_block
    assert rank["kv_cache"]["sized_bytes"] == 1 * GiB == rank["budget"]["kv_cache_memory"]

    # The CPU backend runs no memory profile and sizes its KV cache as told: no such entries, no budget.
    assert {c for c, _ in entries} <= {"runtime", "weights", "kernels", "kv_cache"}
    assert rank["profile"] is None
    assert rank["budget"]["sized_by"] == "kv_cache_memory" and rank["budget"]["bytes"] is None
    assert all(e["scope"] == "process" and e["in_budget"] is None for e in rank["entries"])

    # The rank is a process of the server's tree, and what it holds now is read from its PSS, as the
    # exporter's host reader observes it (pages it shares with the server's other processes split).
    tree = {p.pid for p in psutil.Process(server.pid).children(recursive=True)}
    assert rank["worker"]["pid"] in tree
    assert rank["device"]["kind"] == "cpu" and rank["live"]["process_source"] == "pss"
    assert rank["declared_bytes"] == sum(e["bytes"] for e in rank["entries"])
    rss = psutil.Process(rank["worker"]["pid"]).memory_info().rss
    assert 0.5 * rss < rank["live"]["process_bytes"] < rss
    assert 0 < entries["runtime", ""]["bytes"] < rank["live"]["process_bytes"]
    assert complete(url)  # and vLLM serves as ever


def test_the_exporter_publishes_the_ledger_and_declares_it(with_plugin, spawn, tmp_path):  # noqa: F811
    _, url, _ = with_plugin
    doc = httpx.get(url + "/vramledger/memory", timeout=30).json()
    [rank] = doc["ranks"]
    _, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host", "--vllm", url,
                             "--engine-timeout", "10")
    samples = scrape(port)
    published = {(s.labels["component"], s.labels["model"]): s.value
                 for s in find(samples, "vramledger_engine_memory_bytes", engine=url, rank="0")}
    assert published == {(e["component"], e["model"]): e["bytes"] for e in rank["entries"]}
    # Given its KV cache size, vLLM's CPU build has no budget; its ledger is what it declares, with what
    # its other processes (the API server, the engine core) held when it became ready.
    declared = one(samples, "vramledger_engine_declared_memory_bytes", engine=url)
    assert declared == rank["declared_bytes"] + sum(p["bytes"] for p in doc["processes"])
    observed = one(samples, "vramledger_engine_observed_memory_bytes", engine=url, device="host")
    assert one(samples, "vramledger_engine_unaccounted_memory_bytes", engine=url, device="host") == max(
        0, observed - declared)
    for name in ("vramledger_engine_memory_budget_bytes", "vramledger_engine_weights_outside_budget_bytes",
                 "vramledger_engine_foreign_charged_bytes"):
        assert find(samples, name) == []
    assert one(samples, "vramledger_exporter_errors_total", source="vllm") == 0

    # tests/data/vllm_ledger.json, recorded from this server's configuration, holds what it holds now.
    [recorded] = json.loads((ROOT / "tests" / "data" / "vllm_ledger.json").read_text())["ranks"]
    static = lambda doc: {(e["component"], e["model"]): e["bytes"] for e in doc["entries"]
                          if e["component"] != "runtime"}  # the process's PSS when it started
    assert static(rank) == static(recorded) and rank["kv_cache"] == recorded["kv_cache"]


def test_plugin_imports_neither_the_worker_nor_the_exporter(plugin_site, tmp_path):
    code = ("import sys, vramledger.vllm_plugin.hooks, vramledger.vllm_plugin.endpoint; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'worker', 'exporter'}))")
    out = subprocess.run([str(vllm_peer.vllm_python()), "-c", code], capture_output=True, text=True,
                         env=plugin_env(plugin_site), cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


def plugin_env(plugin_site: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return env | ({"PYTHONPATH": python_path(*plugin_site)} if plugin_site else {})


REGISTER = """
import os, vllm.version
from vllm.v1.worker.worker_base import WorkerBase
from vramledger.vllm_plugin import register
original, patched = WorkerBase.__init__, []
cases = [("0.99.0", "vramledger"), ("0.32.0", None), ("0.32.0", "other"), ("0.32.0", "vramledger")]
for version, plugins in cases:  # install() cannot be undone: the one case that patches comes last
    vllm.version.__version__ = version
    os.environ.pop("VLLM_PLUGINS", None) if plugins is None else os.environ.update(VLLM_PLUGINS=plugins)
    register()
    patched.append(WorkerBase.__init__ is not original)
print(patched)
"""


def test_worker_hooks_go_in_only_where_enabled_on_a_supported_version(plugin_site, tmp_path):
    out = subprocess.run([str(vllm_peer.vllm_python()), "-c", REGISTER], capture_output=True, text=True,
                         env=plugin_env(plugin_site), cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[False, False, False, True]"


def lines_saying(log: Path, pattern: str) -> list[str]:
    """The log's lines matching pattern, but for uvicorn's access lines ("INFO:     ... GET /...")."""
    return [line for line in log.read_text().splitlines()
            if re.search(pattern, line) and not line.startswith("INFO:")]


def test_installed_but_not_enabled_vllm_serves_and_says_why(not_enabled):
    _, url, log = not_enabled
    assert complete(url)
    assert httpx.get(url + "/vramledger/memory").status_code == 404
    [why] = lines_saying(log, r"vramledger")  # vLLM's own: endpoint plugins need VLLM_PLUGINS
    assert "VLLM_PLUGINS is not set" in why


def test_unsupported_vllm_version_serves_and_says_why(unsupported):
    _, url, log = unsupported
    assert httpx.get(url + "/version").json()["version"] == "0.99.0"  # the simulation took
    assert complete(url)
    assert httpx.get(url + "/vramledger/memory").status_code == 404
    [why] = lines_saying(log, r"vramledger: ")
    assert "vLLM 0.99.0 is not a version this plugin was built for" in why
