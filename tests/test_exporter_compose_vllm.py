"""docker-compose.yml's commented-out vLLM example, uncommented: a valid file the exporter's CLI accepts, and
prometheus/prometheus.yml's vLLM job, uncommented, scraping that server's own /metrics."""
from __future__ import annotations

import re

import yaml
from dashboard_queries import ROOT
from local_stack_path import with_vllm_job

from vramledger.exporter.cli import build_parser
from vramledger.exporter.processes import url_address


def uncommented() -> dict:
    """The compose file with the vllm service and the lines marked for vLLM switched on."""
    lines, in_service = [], False
    for line in (ROOT / "docker-compose.yml").read_text().splitlines():
        if line == "  # vllm:":
            in_service = True
        elif in_service and not line.strip():
            in_service = False
        if in_service:
            line = "  " + line[4:]
        elif re.match(r"\s*# - (--vllm|http://127\.0\.0\.1:8001|\"8001:8001\")", line):
            line = line.replace("# ", "", 1)
        lines.append(line)
    return yaml.safe_load("\n".join(lines))


def test_the_vllm_example_when_switched_on():
    compose = uncommented()
    exporter, vllm = compose["services"]["exporter"], compose["services"]["vllm"]
    argv = [str(a) for a in exporter["command"]][3:]
    args = build_parser().parse_args(argv)
    [url] = args.vllm
    assert args.worker == ["http://worker:8000"]
    # The exporter finds vLLM by its port, so both live in one network namespace; vLLM listens there.
    assert vllm["network_mode"] == "service:exporter" and "ports" not in vllm
    port = url_address(url)[1]
    assert vllm["command"][vllm["command"].index("--port") + 1] == str(port)
    assert f"{port}:{port}" in exporter["ports"]
    assert any("gpu" in d["capabilities"] for d in vllm["deploy"]["resources"]["reservations"]["devices"])


def test_the_example_is_off_by_default():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert "vllm" not in compose["services"]
    assert "--vllm" not in compose["services"]["exporter"]["command"]


def scrape_jobs(config: str) -> dict[str, list[str]]:
    return {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
            for job in yaml.safe_load(config)["scrape_configs"]}


def test_prometheus_scrapes_the_example_vllm_when_switched_on():
    compose = uncommented()
    vllm = compose["services"]["vllm"]
    # It serves in the exporter's network namespace: reached by the exporter's service name, on its port.
    host = vllm["network_mode"].removeprefix("service:")
    port = vllm["command"][vllm["command"].index("--port") + 1]
    prometheus = (ROOT / "prometheus" / "prometheus.yml").read_text()
    assert "vllm" not in scrape_jobs(prometheus)  # off by default, as the service is
    jobs = scrape_jobs(with_vllm_job(prometheus))
    assert jobs["vllm"] == [f"{host}:{port}"]
    assert {name: targets for name, targets in jobs.items() if name != "vllm"} == scrape_jobs(prometheus)
