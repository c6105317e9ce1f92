"""What an operator gets wrong on the command line, each answered with what to do, and a README
that names exactly what the exporter serves: real exporter processes beside real servers (a
vLLM-shaped process tree serving recorded /metrics, a ledger worker)."""
from __future__ import annotations

import re
import socket
import subprocess

import httpx
from prometheus_client.parser import text_string_to_metric_families
from test_exporter_host import PY, ROOT, find, one, scrape, spawn, start_exporter  # noqa: F401
from test_exporter_lifecycle import ledger_worker, state_of
from test_exporter_vllm import RECORDED, start_tree

from exporter.collector import ERRORS, GAUGES
from exporter.engines import Engines, VramledgerEngine
from exporter.engines.fetch import HttpClient
from exporter.errors import ErrorLog


def run_exporter(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "exporter", "--backend", "host", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)


def test_an_openai_base_url_means_its_server(spawn, tmp_path):  # noqa: F811
    *_, vllm = start_tree(spawn, RECORDED.read_text(), tmp_path)
    _, worker = ledger_worker(spawn)
    log = tmp_path / "exporter.log"
    _, port = start_exporter(spawn, log, "--backend", "host", "--vllm", vllm + "/v1", "--worker", worker + "/v1/")
    samples = scrape(port)
    assert {s.labels["worker"] for s in find(samples, "vramledger_worker_up")} == {vllm, worker}
    assert state_of(samples, vllm) == state_of(samples, worker) == "serving"
    assert f"{vllm}/v1 is an OpenAI API base URL: watching its server, {vllm}" in log.read_text()


def test_a_vllm_server_given_as_a_worker_is_refused_naming_the_flag(spawn, tmp_path):  # noqa: F811
    *_, vllm = start_tree(spawn, RECORDED.read_text(), tmp_path)
    done = run_exporter("--port", "0", "--worker", vllm)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"exporter: {vllm} is a vLLM server, not a vramledger worker: watch it with --vllm {vllm} "
        "(in a cluster: pod label vramledger.io/engine: vllm)")


def test_a_worker_given_as_a_vllm_server_is_refused_naming_the_flag(spawn):  # noqa: F811
    _, worker = ledger_worker(spawn)
    done = run_exporter("--port", "0", "--vllm", worker)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"exporter: {worker} is a vramledger worker, not a vLLM server: watch it with --worker {worker} "
        "(in a cluster: pod label vramledger.io/engine: vramledger)")


def test_a_vllm_server_that_comes_up_as_a_worker_later_is_wrong_and_counted(spawn, tmp_path):  # noqa: F811
    *_, vllm = start_tree(spawn, RECORDED.read_text(), tmp_path)
    errors = ErrorLog()
    client = HttpClient(5)
    engines = Engines([VramledgerEngine(vllm, client, errors)], errors, client)
    try:
        for _ in range(2):
            reading = engines.read()[vllm]
            assert (reading.status.value, reading.wrong_kind) == ("wrong", True)
            assert f"watch it with --vllm {vllm}" in reading.reason
        assert errors.counts() == {"worker": 2}
    finally:
        engines.close()


def test_a_port_in_use_is_one_line_and_status_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_exporter("--port", str(port))
    assert done.returncode == 2
    assert done.stderr.strip() == (f"exporter: cannot listen on 127.0.0.1:{port}: Address already in use "
                                   "(another exporter there? choose another --port)")


def test_two_urls_of_one_server_give_one_warning_and_one_set_of_series(spawn, tmp_path):  # noqa: F811
    api, core, [rank], vllm = start_tree(spawn, RECORDED.read_text(), tmp_path)
    port = vllm.rsplit(":", 1)[1]
    first, second = f"http://127.0.0.1:{port}", f"http://localhost:{port}"
    log = tmp_path / "exporter.log"
    _, exporter_port = start_exporter(spawn, log, "--backend", "host", "--vllm", first, "--vllm", second)
    for _ in range(3):
        samples = scrape(exporter_port)
        assert {s.labels["worker"] for s in find(samples, "vramledger_worker_up")} == {first}
        assert {int(s.labels["pid"]) for s in find(samples, "vramledger_device_process_memory_bytes",
                                                   owner="worker")} == {api, core, rank}
        assert {s.labels["worker"] for s in find(samples, "vramledger_device_process_memory_bytes",
                                                 owner="worker")} == {first}
        assert one(samples, "vramledger_exporter_errors_total", source="vllm") == 0
    warnings = [line for line in log.read_text().splitlines() if " WARNING " in line]
    assert len(warnings) == 1, warnings
    assert warnings[0].endswith(f"{second} reaches the same processes as {first}: watching that server once, "
                                f"as {first}")


def readme_exporter_series() -> set[str]:
    """Every vramledger_ series the README's exporter section names, {a,b} alternatives expanded."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## The exporter (sidecar)", 1)[1].split("\n## ", 1)[0]
    names = set()
    for code in re.findall(r"`(vramledger_[^`]*)`", section):
        expanded = [code]
        while any(ALTERNATIVES.search(c) for c in expanded):
            expanded = [c[:m.start()] + alt + c[m.end():] for c in expanded
                        for m in [ALTERNATIVES.search(c)] for alt in m.group(1).split(",")]
        names |= {c.split("{", 1)[0] for c in expanded}
    return names


ALTERNATIVES = re.compile(r"\{([a-z_]+(?:,[a-z_]+)+)\}")


def test_the_readme_names_what_the_exporter_serves(spawn, tmp_path):  # noqa: F811
    *_, vllm = start_tree(spawn, RECORDED.read_text(), tmp_path)
    _, worker = ledger_worker(spawn)
    _, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host", "--vllm", vllm,
                             "--worker", worker)
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    served = {f.name + "_total" if f.type == "counter" else f.name
              for f in text_string_to_metric_families(response.text)
              if f.name.startswith("vramledger_") and not f.name.endswith("_created")}  # client_python's own
    named = readme_exporter_series()
    assert served <= named, f"served, not in the README: {sorted(served - named)}"
    assert named == {*GAUGES, ERRORS + "_total", "vramledger_exporter_collect_seconds"}, (
        f"in the README, never served: {sorted(named - {*GAUGES, ERRORS + '_total'})}")
