"""`make run VLLM=URL`: the stack watches a running vLLM server, and its Prometheus scrapes that server's
own /metrics under the job the recording rules' vLLM sources come from. Config only: nothing starts."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml
from local_stack_path import LocalStack

from vramledger.exporter.cli import build_parser


def test_a_watched_vllm_is_scraped_and_read(tmp_path):
    urls = ["http://127.0.0.1:8123", "http://[::1]:8124"]
    stack = LocalStack(tmp_path, vllm_urls=urls, ports={"worker": 1, "exporter": 2, "prometheus": 3})
    config_path = stack._write_prometheus_config()
    jobs = {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
            for job in yaml.safe_load(config_path.read_text())["scrape_configs"]}
    assert jobs == {"vramledger-worker": ["127.0.0.1:1"], "vramledger-exporter": ["127.0.0.1:2"],
                    "vllm": ["127.0.0.1:8123", "[::1]:8124"], "prometheus": ["127.0.0.1:3"]}
    assert build_parser().parse_args(stack.exporter_args).vllm == urls
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: run `make system-deps`")
    out = subprocess.run([promtool, "check", "config", str(config_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_without_a_vllm_nothing_of_it_is_scraped(tmp_path):
    stack = LocalStack(tmp_path, ports={"worker": 1, "exporter": 2, "prometheus": 3})
    jobs = {job["job_name"] for job in yaml.safe_load(stack._write_prometheus_config().read_text())["scrape_configs"]}
    assert jobs == {"vramledger-worker", "vramledger-exporter", "prometheus"}
    assert "--vllm" not in stack.exporter_args
