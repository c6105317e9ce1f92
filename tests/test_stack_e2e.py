"""The whole stack for real: worker, exporter and Prometheus on loopback, every dashboard
query and rule evaluated by Prometheus, and the foreign-memory alert made to fire.

The exporter also watches three vLLM-shaped servers (tests/vllm_tree.py: real process trees serving a
recorded /metrics and, for two, a ledger recorded from the vLLM plugin), one per kind of rank: vLLM's
CPU build, and vLLM's CUDA worker whose profile run counted a neighbour's memory as its own; the third,
vLLM's CPU build without the plugin, declares nothing (the dashboards draw it observed only)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import mem_hog
import psutil
import pytest
import yaml
from dashboard_queries import RULES_DIR, dashboard_queries, metric_names, variable_queries
from local_stack_path import LocalStack

from vramledger.worker.selfcheck.processes import wait_until

pytestmark = pytest.mark.slow  # it starts processes (`make test-fast` leaves it out)

# Series that only exist on some devices: NVML's v2 memory call (reserved memory).
MAY_BE_ABSENT = {"vramledger_device_memory_reserved_bytes"}
GiB = 1 << 30
DATA = Path(__file__).parent / "data"
VLLM_SERVERS = (("vllm_spec_metrics.txt", "vllm_ledger.json"),
                ("vllm_spec_metrics.txt", "vllm_ledger_cuda_neighbour.json"),
                ("vllm_metrics.txt", None))  # an explicit KV cache size and no plugin: no declaration


def foreign_floor() -> int:
    """Host mode counts only processes above this floor as foreign: above everything running now."""
    largest = max((p.info["memory_info"].rss for p in psutil.process_iter(["memory_info"])
                   if p.info["memory_info"] is not None), default=0)
    return max(2 * GiB, largest + GiB)


@pytest.fixture(scope="module")
def vllm_servers():
    """The vLLM-shaped trees' URLs; each tree exits when its stdin closes."""
    tree = Path(__file__).parent / "vllm_tree.py"
    trees = [subprocess.Popen([sys.executable, str(tree), str(DATA / metrics),
                               *(("--ledger", str(DATA / ledger)) if ledger else ())],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for metrics, ledger in VLLM_SERVERS]
    try:
        yield [f"http://127.0.0.1:{tree.stdout.readline().split()[1]}" for tree in trees]
    finally:
        for tree in trees:
            tree.stdin.close()
            tree.wait(timeout=30)


@pytest.fixture(scope="module")
def stack(checkpoints, vllm_servers, tmp_path_factory):
    floor = foreign_floor()
    # The vLLM servers are watched by the exporter and scraped by Prometheus (job vllm), as with
    # `make run VLLM=URL`: the recording rules over vLLM's own counters have data too.
    s = LocalStack(tmp_path_factory.mktemp("stack"), scrape_interval="1s", rule_for="2s", vllm_urls=vllm_servers,
                   exporter_args=["--min-process-memory", str(floor)], worker_args=[
        "--model", checkpoints["llama"], "--draft-model", checkpoints["llama-draft"], "--max-model-len", "256"])
    try:
        s.start(timeout=180)
        s.foreign_floor = floor
        yield s
    finally:
        s.stop()


def query(stack, expr: str) -> list:
    body = httpx.get(stack.url("prometheus") + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def send_traffic(stack) -> None:
    url = stack.url("worker")
    with httpx.Client(timeout=60) as client:
        model = client.get(url + "/v1/models").json()["data"][0]["id"]
        for i in range(6):
            body = {"model": model, "prompt": f"def f{i}(x):", "max_tokens": 24, "temperature": 0.0 if i % 2 else 0.8,
                    "stream": i % 3 == 0}
            r = client.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text


def test_dashboards_and_rules_evaluate_with_data(stack):
    wait_until(lambda: query(stack, "vramledger_device_foreign_memory_bytes"), 30, "the exporter's first scrape")
    assert not query(stack, "vramledger_device_foreign_memory_bytes > 0"), "a foreign process before the test"
    hog = mem_hog.start(stack.foreign_floor + GiB // 2)  # a real foreign process above the floor
    try:
        send_traffic(stack)
        # Enough scrapes for rate() windows to hold traffic.
        wait_until(lambda: query(stack, 'count_over_time(up{job="vramledger-worker"}[1m]) >= 10')
                   and query(stack, f'vramledger_device_process_memory_bytes{{owner="foreign",pid="{hog.pid}"}}'), 60,
                   "scrapes of the worker and the foreign process")
        send_traffic(stack)
        time.sleep(2)
        empty = []
        for q in dashboard_queries(rate_interval="1m", range_="5m"):
            if not query(stack, q.expr) and not metric_names(q.expr) <= MAY_BE_ABSENT:
                empty.append(f"{q.dashboard} / {q.panel}: {q.expr}")
        assert not empty, "queries without data:\n" + "\n".join(empty)
        for dashboard, variable, selector, _label in variable_queries():
            series = httpx.get(stack.url("prometheus") + "/api/v1/series", params={"match[]": selector}).json()
            assert series["data"], f"{dashboard}: variable {variable} has no values ({selector})"
        for path in RULES_DIR.glob("*.yml"):
            for group in yaml.safe_load(path.read_text())["groups"]:
                for rule in group["rules"]:
                    result = query(stack, rule["expr"])
                    if "record" in rule:
                        assert result, f"recording rule {rule['record']} has no data"
        rules = httpx.get(stack.url("prometheus") + "/api/v1/rules").json()["data"]["groups"]
        unhealthy = [r["name"] for g in rules for r in g["rules"] if r["health"] != "ok"]
        assert not unhealthy, unhealthy

        def foreign_alert():
            alerts = httpx.get(stack.url("prometheus") + "/api/v1/alerts").json()["data"]["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "VramledgerForeignMemoryOnDevice"
                    and a["state"] == "firing"]
        firing = wait_until(foreign_alert, 60, "VramledgerForeignMemoryOnDevice to fire")
        assert firing[0]["labels"]["device"] == "host"
        base = yaml.safe_load((RULES_DIR.parent / "prometheus.yml").read_text())["global"]["external_labels"]
        assert firing[0]["annotations"]["runbook_url"] == (base["runbook_base_url"]
                                                           + "/VramledgerForeignMemoryOnDevice.md")
    finally:
        mem_hog.stop(hog)
    # With the foreign process gone, the alert resolves.
    wait_until(lambda: not [a for a in httpx.get(stack.url("prometheus") + "/api/v1/alerts").json()["data"]["alerts"]
                            if a["labels"]["alertname"] == "VramledgerForeignMemoryOnDevice"], 60,
               "the foreign-memory alert to resolve")
