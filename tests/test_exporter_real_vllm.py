"""The exporter beside a real vLLM server (vLLM's CPU build, host backend) and a real foreign process.

Needs the vLLM venv (`make vllm-venv`); skipped, saying so, without it. One vLLM start for the module.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from test_exporter_host import HOLD, PY, MiB, find, one, read_line, scrape, spawn, start_exporter  # noqa: F401

from vramledger.worker.selfcheck.processes import free_port, wait_http

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import vllm_peer

pytestmark = pytest.mark.skipif(vllm_peer.vllm_python() is None,
                                reason="no vLLM venv (VLLM_VENV or .venv-vllm): run `make vllm-venv`")
MODEL = ROOT / "worker" / "assets" / "tiny-coder-target"


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """vLLM's OpenAI server on the shipped target: short context, 1 GiB of KV cache, uncompiled
    (-O0: ready in ~30 s instead of ~72 s here; what it holds, not how fast it decodes, is tested)."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    server = vllm_peer.start_vllm(MODEL, port, log, kv_cache_gib=1, max_model_len=256,
                                  extra=["-O0"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", vllm_peer.STARTUP_TIMEOUT, server, log)
        yield server, url
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)  # its own session: the engine-core children go too
        server.wait(timeout=30)


def test_real_vllm_beside_a_foreign_process_then_killed(spawn, vllm, tmp_path):  # noqa: F811
    server, url = vllm
    foreign = spawn([PY, "-c", HOLD, "768"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert read_line(foreign) == "ready"
    exporter, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host", "--vllm", url,
                                    "--engine-timeout", "5")
    tree = [server.pid] + [p.pid for p in psutil.Process(server.pid).children(recursive=True)]
    [core] = [p for p in psutil.Process(server.pid).children() if p.name() == "VLLM::EngineCore"]

    samples = scrape(port)
    [theirs] = find(samples, "vramledger_device_process_memory_bytes", pid=str(foreign.pid))
    assert theirs.labels["owner"] == "foreign" and theirs.labels["engine"] == "" and theirs.value >= 768 * MiB
    [engine_core] = find(samples, "vramledger_device_process_memory_bytes", pid=str(core.pid))
    assert (engine_core.labels["owner"], engine_core.labels["engine"]) == ("engine", url)
    mine = find(samples, "vramledger_device_process_memory_bytes", engine=url)
    assert {int(s.labels["pid"]) for s in mine} == set(tree)  # the API server and all its descendants
    assert one(samples, "vramledger_engine_observed_memory_bytes", engine=url, device="host") == sum(
        s.value for s in mine)
    # Its processes share libraries and more: counted once (PSS), they hold less than their RSS sum.
    assert {s.labels["measure"] for s in mine} == {"pss"}
    assert sum(s.value for s in mine) < sum(psutil.Process(pid).memory_info().rss for pid in tree)
    assert one(samples, "vramledger_engine_up", engine=url) == 1
    assert one(samples, "vramledger_engine_state", engine=url, state="serving") == 1
    [info] = find(samples, "vramledger_engine_info", engine=url)
    assert info.labels == {"engine": url, "kind": "vllm", "version": "0.32.0", "model": str(MODEL)}
    assert 0 <= one(samples, "vramledger_engine_kv_cache_usage_ratio", engine=url) <= 1
    # vLLM's CPU backend sizes its KV cache explicitly: no budget, so nothing declared or unaccounted.
    assert find(samples, "vramledger_engine_declared_memory_bytes") == []
    assert find(samples, "vramledger_engine_unaccounted_memory_bytes") == []
    assert one(samples, "vramledger_exporter_errors_total", source="vllm") == 0

    os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=30)
    samples = scrape(port)
    assert one(samples, "vramledger_engine_up", engine=url) == 0
    assert one(samples, "vramledger_engine_state", engine=url, state="unreachable") == 1
    assert find(samples, "vramledger_device_process_memory_bytes", engine=url) == []
    assert find(samples, "vramledger_engine_observed_memory_bytes", engine=url) == []
    assert find(samples, "vramledger_engine_info", engine=url) == []
    assert len(find(samples, "vramledger_device_process_memory_bytes", pid=str(foreign.pid))) == 1
    assert one(samples, "vramledger_exporter_errors_total", source="vllm") == 0  # down: its state says it
    assert exporter.poll() is None
