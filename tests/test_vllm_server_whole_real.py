"""A real vLLM server (its CPU build, serving the shipped pair with the draft) with the vLLM plugin, the
exporter beside it on the host: every process of the server is in its ledger, so after 20 requests no
alert rule fires on what the exporter publishes; its own /metrics serves the speculative-decoding
counters the recording rules read, which give its acceptance in the worker's recorded series and
raise the speculation alert exactly when that acceptance is low; and once its engine core dies the
exporter no longer calls it serving.

Needs the vLLM venv (`make vllm-venv`); skipped, saying so, without it. One vLLM start for the module.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from metric_catalogue import catalogue
from prometheus_client.parser import text_string_to_metric_families
from test_exporter_host import find, one, scrape, spawn, start_exporter  # noqa: F401
from test_rules import ALERT_RULES, PROM, RULE_FILES, _promtool
from test_vllm_plugin_real import (  # noqa: F401
    DRAFT,
    TARGET,
    VllmServer,
    cache_config_info,
    plugin_env,
    plugin_site,
    python_path,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import vllm_peer  # noqa: E402

pytestmark = pytest.mark.skipif(vllm_peer.vllm_python() is None,
                                reason="no vLLM venv (VLLM_VENV or .venv-vllm): run `make vllm-venv`")
MiB = 1 << 20
REQUESTS = 20
# The series' own labels as Prometheus scrapes the exporter (the rules' tests use the same).
SCRAPED = {"job": "vramledger-exporter", "instance": "exporter:9400"}
UNACCOUNTED = "VramledgerUnaccountedMemoryHigh"


@pytest.fixture(scope="module", autouse=True)
def started(tmp_path_factory, plugin_site):  # noqa: F811
    """Started before the module's first test, which needs no server: they overlap."""
    # Kept alive after its engine core dies (vLLM's API server exits within 5 s otherwise), so the
    # last test sees what the exporter makes of that window.
    env = {"PYTHONPATH": python_path(*plugin_site), "VLLM_PLUGINS": "vramledger",
           "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"}
    server = VllmServer(tmp_path_factory, "whole", env, draft=DRAFT)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(started):
    return started.ready()


def test_vllm_imports_this_checkouts_plugin(plugin_site, tmp_path):  # noqa: F811
    """The vLLM venv may hold another install of the plugin: the server below must run this one's."""
    code = "import vramledger.vllm_plugin.server_processes as m; print(m.__file__)"
    out = subprocess.run([str(vllm_peer.vllm_python()), "-c", code], capture_output=True, text=True,
                         env=plugin_env(plugin_site), cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    imported = Path(out.stdout.strip().splitlines()[-1])
    for name in ("server_processes.py", "endpoint.py", "own_memory.py", "rank_ledger.py"):
        assert (imported.parent / name).read_bytes() == (ROOT / "vramledger" / "vllm_plugin" / name).read_bytes()


def completions(url: str, n: int) -> None:
    for i in range(n):
        response = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": str(TARGET), "prompt": f"def add_{i}(a, b):", "max_tokens": 32, "temperature": 0})
        assert response.status_code == 200, response.text


def label_text(labels: dict) -> str:
    return "{" + ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items())) + "}"


def promtool_cases(path: Path, samples: list, url: str, without_processes: tuple[float, float]) -> None:
    """A promtool test of the project's rules over the exporter's samples, held for 20 minutes: no alert
    fires at 15 minutes; and the unaccounted-memory alert's expression over the same server's figures
    without its processes' declarations (declared, unaccounted) does return that server."""
    series = [{"series": s.name + label_text(s.labels | SCRAPED), "values": f"{s.value!r}x20"} for s in samples]
    declared, unaccounted = without_processes
    before = [{"series": "vramledger_engine_declared_memory_bytes" + label_text({"engine": url} | SCRAPED),
               "values": f"{declared!r}x20"},
              {"series": "vramledger_engine_unaccounted_memory_bytes"
               + label_text({"engine": url, "device": "host"} | SCRAPED), "values": f"{unaccounted!r}x20"}]
    external = {"runbook_base_url": "https://runbooks.example.com/vramledger"}
    path.write_text(yaml.safe_dump({
        "rule_files": [str(p) for p in RULE_FILES], "evaluation_interval": "1m",
        "tests": [
            {"interval": "1m", "external_labels": external, "input_series": series,
             "alert_rule_test": [{"eval_time": "15m", "alertname": name, "exp_alerts": []}
                                 for name in ALERT_RULES]},
            {"interval": "1m", "external_labels": external, "input_series": before,
             "promql_expr_test": [{"expr": ALERT_RULES[UNACCOUNTED]["expr"], "eval_time": "15m", "exp_samples": [
                 {"labels": "vramledger_engine_unaccounted_memory_bytes"
                  + label_text({"engine": url, "device": "host"} | SCRAPED), "value": unaccounted}]}]}]}))


def test_no_alert_fires_on_a_healthy_server_with_the_plugin(server, spawn, tmp_path):  # noqa: F811
    api, url, _ = server
    completions(url, REQUESTS)
    doc = httpx.get(url + "/vramledger/memory", timeout=30).json()
    [rank] = doc["ranks"]
    processes = {p["pid"]: p for p in doc["processes"]}

    # Every process of the tree but the rank declares itself; on vLLM's CPU build the rank is a process
    # of its own, below the engine core.
    tree = psutil.Process(api.pid).children(recursive=True)
    [core] = [p for p in tree if p.name().startswith("VLLM::EngineCore")]
    assert psutil.Process(rank["worker"]["pid"]).ppid() == core.pid
    assert processes.keys() == {api.pid} | {p.pid for p in tree} - {rank["worker"]["pid"]}
    assert (processes[api.pid]["role"], processes[core.pid]["role"]) == ("api_server", "engine_core")
    assert {p["measure"] for p in processes.values()} == {"pss"} and rank["live"]["process_source"] == "pss"
    # Its KV cache: the blocks vLLM's scheduler can hand out, and the one it keeps back.
    kv = rank["kv_cache"]
    assert kv["blocks_total"] + kv["blocks_reserved"] == int(cache_config_info(url)["num_gpu_blocks"])
    assert kv["blocks_reserved"] == 1

    # --min-process-memory: only the server's processes are listed on this shared host (no foreign ones).
    _, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host", "--vllm", url,
                             "--engine-timeout", "10", "--min-process-memory", str(1 << 40))
    samples = scrape(port)
    declared = one(samples, "vramledger_engine_declared_memory_bytes", engine=url)
    at_ready = sum(p["bytes"] for p in processes.values())
    assert declared == rank["declared_bytes"] + at_ready
    by_role = {s.labels["role"]: s.value
               for s in find(samples, "vramledger_engine_process_declared_bytes", engine=url)}
    assert by_role["api_server"] == processes[api.pid]["bytes"]
    assert by_role["engine_core"] == processes[core.pid]["bytes"]
    observed = one(samples, "vramledger_engine_observed_memory_bytes", engine=url, device="host")
    unaccounted = one(samples, "vramledger_engine_unaccounted_memory_bytes", engine=url, device="host")
    assert unaccounted == max(0, observed - declared)
    # What is left unaccounted is what the processes grew by since they declared (the rank since it
    # measured its runtime, the others since the server was ready), as the plugin read it just before.
    grown = rank["live"]["process_bytes"] - rank["declared_bytes"] + sum(
        p["live_bytes"] - p["bytes"] for p in processes.values())
    assert abs(unaccounted - max(0, grown)) < 64 * MiB, (unaccounted, grown)
    assert unaccounted < 0.05 * declared and unaccounted < 512 * MiB

    # Every rule over every series the exporter published: nothing fires. Without the processes'
    # declarations (the API server and the engine core in no ledger) the same server would fire.
    cases = tmp_path / "server_whole_test.yml"
    promtool_cases(cases, samples, url, (declared - at_ready, observed - (declared - at_ready)))
    out = subprocess.run([_promtool(), "test", "rules", str(cases)], capture_output=True, text=True, timeout=300,
                         cwd=PROM)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]


def spec_decode_counters(url: str) -> dict[str, float]:
    """vLLM's counters the recording rules read, from its /metrics, checked against docs/metrics.md."""
    catalogued = catalogue()["vllm"]
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)}
    values = {}
    for name, entry in catalogued.items():
        family = families.get(entry.family)
        assert family is not None and family.type == "counter", f"{entry.family} not on vLLM's /metrics"
        [sample] = [s for s in family.samples if s.name == name]  # one engine core
        assert set(sample.labels) == entry.labels, sample.labels
        values[name] = sample.value
    return values


def test_its_speculation_feeds_the_recorded_acceptance_and_the_alert(server, tmp_path):
    api, url, _ = server
    before = spec_decode_counters(url)
    completions(url, 4)
    after = spec_decode_counters(url)
    grew = {name: after[name] - before[name] for name in after}
    drafts, proposed, accepted = (grew[f"vllm:spec_decode_num_{n}_total"]
                                  for n in ("drafts", "draft_tokens", "accepted_tokens"))
    assert drafts > 0 and proposed >= drafts and 0 <= accepted <= proposed, grew
    print(f"vLLM's CPU build with the shipped draft: {accepted:.0f} of {proposed:.0f} draft tokens accepted")
    # The same growth every minute for 30 minutes, as Prometheus would scrape it (job vllm).
    scraped = {"job": "vllm", "instance": url.removeprefix("http://")}
    series = [{"series": name + label_text({"engine": "0", "model_name": str(TARGET)} | scraped),
               "values": f"{before[name]!r}+{grew[name]!r}x30"} for name in after]
    rate = accepted / proposed
    recorded = 'vramledger:spec_decode_acceptance_rate:rate5m{kind="vllm"}'
    low = ALERT_RULES["VramledgerSpecDecodeAcceptanceLow"]["expr"]
    path = tmp_path / "vllm_speculation_test.yml"
    path.write_text(yaml.safe_dump({
        "rule_files": [str(p) for p in RULE_FILES], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": [
            {"expr": f"abs({recorded} - {rate!r}) < bool 1e-9", "eval_time": "20m",
             "exp_samples": [{"labels": label_text(scraped | {"kind": "vllm"}), "value": 1}]},
            {"expr": f"count({low})", "eval_time": "20m",
             "exp_samples": [{"labels": "{}", "value": 1}] if rate < 0.3 else []}]}]}))
    out = subprocess.run([_promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=300,
                         cwd=PROM)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]


def test_a_dead_engine_core_is_not_serving(server, spawn, tmp_path):  # noqa: F811
    api, url, _ = server
    _, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host", "--vllm", url,
                             "--engine-timeout", "10")
    assert one(scrape(port), "vramledger_engine_state", engine=url, state="serving") == 1
    [core] = [p for p in psutil.Process(api.pid).children() if p.name().startswith("VLLM::EngineCore")]
    os.kill(core.pid, signal.SIGKILL)
    core.wait(timeout=30)
    # The API server is still up and its /metrics answers; its /health says the engine is dead.
    assert httpx.get(url + "/metrics", timeout=10).status_code == 200
    assert httpx.get(url + "/health", timeout=10).status_code == 503
    samples = scrape(port)
    assert one(samples, "vramledger_engine_up", engine=url) == 0
    assert one(samples, "vramledger_engine_state", engine=url, state="unreachable") == 1
    assert find(samples, "vramledger_engine_observed_memory_bytes", engine=url) == []
    assert one(samples, "vramledger_exporter_errors_total", source="vllm") == 0  # a state, not a fault
    assert "its engine core is dead" in (tmp_path / "exporter.log").read_text()
