"""What an operator gets wrong on the command line, each answered with what to do: real exporter processes
beside real servers (a vLLM-shaped process tree serving recorded /metrics, a ledger worker). What the
exporter serves is docs/metrics.md, checked by test_metrics_catalogue.py."""
from __future__ import annotations

import socket
import subprocess

from test_exporter_host import PY, ROOT, find, one, scrape, spawn, start_exporter  # noqa: F401
from test_exporter_lifecycle import ledger_worker, state_of
from test_exporter_vllm import RECORDED, start_tree

from vramledger.exporter.engines import Engines, VramledgerEngine
from vramledger.exporter.engines.fetch import HttpClient
from vramledger.exporter.errors import ErrorLog


def run_exporter(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "vramledger.exporter", "--backend", "host", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)


def test_an_openai_base_url_means_its_server(spawn, tmp_path):  # noqa: F811
    *_, vllm = start_tree(spawn, RECORDED.read_text(), tmp_path)
    _, worker = ledger_worker(spawn)
    log = tmp_path / "exporter.log"
    _, port = start_exporter(spawn, log, "--backend", "host", "--vllm", vllm + "/v1", "--worker", worker + "/v1/")
    samples = scrape(port)
    assert {s.labels["engine"] for s in find(samples, "vramledger_engine_up")} == {vllm, worker}
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
        assert {s.labels["engine"] for s in find(samples, "vramledger_engine_up")} == {first}
        assert {int(s.labels["pid"]) for s in find(samples, "vramledger_device_process_memory_bytes",
                                                   owner="engine")} == {api, core, rank}
        assert {s.labels["engine"] for s in find(samples, "vramledger_device_process_memory_bytes",
                                                 owner="engine")} == {first}
        assert one(samples, "vramledger_exporter_errors_total", source="vllm") == 0
    warnings = [line for line in log.read_text().splitlines() if " WARNING " in line]
    assert len(warnings) == 1, warnings
    assert warnings[0].endswith(f"{second} reaches the same processes as {first}: watching that server once, "
                                f"as {first}")
