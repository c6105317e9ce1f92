"""Our worker's adapter: ledger reads over real sockets, ledger validation, pid mapping, the command line."""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from vramledger.exporter.cli import build_parser
from vramledger.exporter.collector import ExporterCollector
from vramledger.exporter.engines import Engines
from vramledger.exporter.engines.vramledger import WorkerLedger, worker_ledger
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.processes import HostPidResolver, in_container, parse_nspid
from vramledger.exporter.sources import HostSource
from vramledger.ledger_reading import LedgerError
from vramledger.worker.selfcheck.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
TIB = 1 << 40


def documented_ledger() -> dict:
    """The example document of docs/ledger.md: the contract the exporter reads."""
    text = (ROOT / "docs" / "ledger.md").read_text()
    block = re.search(r"```json\n(.*?)```", text, re.DOTALL).group(1)
    return json.loads(block.replace('"GPU-…"', '"GPU-0"'))


def test_parse_the_documented_ledger():
    ledger = worker_ledger("http://w:8000", documented_ledger())
    assert ledger == WorkerLedger("http://w:8000", pid=4242, host_pid=4242, container_id=None,
                                  device_kind="cuda", declared_bytes=70267093696, model="/models/target",
                                  kv_usage=12 / 57220)  # blocks_used / blocks_total


@pytest.mark.parametrize("mangle", [
    lambda d: [d],
    lambda d: d | {"version": 2},
    lambda d: d | {"worker": None},
    lambda d: d | {"worker": d["worker"] | {"pid": True}},
    lambda d: d | {"worker": d["worker"] | {"pid": "4242"}},
    lambda d: d | {"worker": d["worker"] | {"host_pid": -1}},
    lambda d: d | {"worker": d["worker"] | {"container_id": 12}},
    lambda d: d | {"declared_bytes": -5},
    lambda d: d | {"declared_bytes": 1.5},
    lambda d: d | {"device": d["device"] | {"kind": "tpu"}},
    # Beyond physical bounds (exporter/engines/bounds.py): no kernel gives the pid, no memory holds the bytes.
    lambda d: d | {"worker": d["worker"] | {"pid": 2 ** 63}},
    lambda d: d | {"worker": d["worker"] | {"host_pid": (1 << 22) + 1}},
    lambda d: d | {"worker": d["worker"] | {"container_id": "c" * 257}},
    lambda d: d | {"declared_bytes": 10 ** 30},
    lambda d: d | {"declared_bytes": 10 ** 400},
])
def test_parse_rejects_garbage(mangle):
    with pytest.raises(LedgerError) as e:
        worker_ledger("http://w:8000", mangle(documented_ledger()))
    assert len(str(e.value)) < 200  # the value named, clipped


class Routes(BaseHTTPRequestHandler):
    """A worker that answers well, garbage, an error, or too late, depending on the path; this process
    serves it, so its ledger names this process (the one behind its port)."""
    ledger = json.dumps(documented_ledger() | {"worker": {"pid": os.getpid(), "host_pid": None,
                                                          "container_id": None}}).encode()
    info = b'vramledger_serving_info{model="m",draft_model="",device="cuda:0",num_speculative_tokens="0",' \
           b'version="9.8.7"} 1.0\n'
    bodies = {"/good/v1/memory": (200, ledger), "/good/metrics": (200, info),
              "/garbage/v1/memory": (200, b"<html>oops</html>"),
              "/shape/v1/memory": (200, b'{"version": 1}'), "/error/v1/memory": (500, b"boom")}

    def do_GET(self):
        if self.path.startswith("/slow"):
            time.sleep(2)
        status, body = self.bodies.get(self.path, (404, b""))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def routes():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Routes)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_down_and_garbage_workers_are_counted_not_fatal(routes, caplog):
    urls = [f"{routes}/{name}" for name in ("good", "garbage", "shape", "error", "slow")]
    urls.append(f"http://127.0.0.1:{free_port()}")
    errors = ErrorLog()
    fetcher = Engines.open({"vramledger": urls}, timeout=0.3, errors=errors)
    registry = CollectorRegistry()
    registry.register(ExporterCollector(HostSource(errors, min_process_bytes=TIB), fetcher, errors))
    expected = {urls[0]: "serving", urls[1]: "wrong", urls[2]: "wrong", urls[3]: "wrong", urls[4]: "unreachable",
                urls[5]: "unreachable"}
    try:
        with caplog.at_level(logging.INFO, logger="vramledger.exporter.engines"):
            for _ in range(3):
                start = time.perf_counter()
                values = {(s.name, tuple(s.labels.values())): s.value
                          for family in registry.collect() for s in family.samples}
                assert time.perf_counter() - start < 1.5  # the slow worker is cut at its timeout, in parallel
                assert {url: values[("vramledger_engine_up", (url,))] for url in urls} == {
                    url: 1.0 if url.endswith("/good") else 0.0 for url in urls}
                assert {labels[0]: labels[1] for (name, labels), v in values.items()
                        if name == "vramledger_engine_state" and v == 1} == expected
                assert [url for url in urls if ("vramledger_engine_declared_memory_bytes", (url,)) in values] == [
                    urls[0]]
                assert values[("vramledger_engine_declared_memory_bytes", (urls[0],))] == 70267093696
                assert [labels for name, labels in values if name == "vramledger_engine_info"] == [
                    (urls[0], "vramledger", "9.8.7", "/models/target")]
                assert values[("vramledger_engine_kv_cache_usage_ratio", (urls[0],))] == 12 / 57220
        # Wrong answers counted on every scrape (garbage, shape, error); down and slow are not errors...
        assert values[("vramledger_exporter_errors_total", ("worker",))] == 3 * 3
        # ...and each engine's state logged once, on one line, whatever the number of scrapes.
        lines = {r.getMessage().split(": ")[0]: (r.levelname, r.getMessage()) for r in caplog.records
                 if r.name == "vramledger.exporter.engines"}
        assert len(lines) == len(caplog.records) == len(urls)
        assert {name.split()[1]: (level, message.split(": ")[1].split(" ")[0])
                for name, (level, message) in lines.items()} == {
            url: ("INFO" if state == "serving" else "WARNING", state) for url, state in expected.items()}
        assert "HTTP 500" in lines[f"vramledger {urls[3]}"][1] and "\n" not in "".join(caplog.messages)
    finally:
        fetcher.close()


def test_nspid_of_this_process():
    assert parse_nspid(Path("/proc/self/status").read_text())[-1] == os.getpid()
    assert parse_nspid("Name:\tx\nNSpid:\t31337\t7\n") == (31337, 7)
    assert parse_nspid("Name:\tx\n") == ()


def test_in_container_accepts_full_and_short_ids():
    cgroup = "0::/system.slice/docker-c0ffee1234abcd.scope\n"
    assert in_container(cgroup, "c0ffee1234abcd") and in_container(cgroup, "c0ffee1234")
    assert not in_container(cgroup, "deadbeef") and not in_container(cgroup, "")


def test_resolver_prefers_the_ledger_host_pid_then_the_pid():
    resolver = HostPidResolver("/nonexistent")
    assert resolver.host_pid(7, host_pid=31337, container_id="c0ffee") == 31337
    assert resolver.host_pid(4242) == 4242


def test_resolver_maps_container_pids_and_notices_reuse(tmp_path):
    def proc(pid, nspid, cgroup):
        (tmp_path / str(pid)).mkdir(exist_ok=True)
        (tmp_path / str(pid) / "status").write_text("NSpid:\t" + "\t".join(map(str, nspid)) + "\n")
        (tmp_path / str(pid) / "cgroup").write_text(cgroup)

    proc(1, (1,), "0::/kubepods/pod1/cri-containerd-c0ffee.scope\n")  # same pid and cgroup, host namespace
    proc(31337, (31337, 1), "0::/kubepods/pod1/cri-containerd-c0ffee.scope\n")
    proc(555, (555, 1), "0::/kubepods/pod2/cri-containerd-beef.scope\n")
    resolver = HostPidResolver(tmp_path)
    assert resolver.host_pid(1, container_id="c0ffee") == 31337
    assert resolver.host_pid(1, container_id="beef") == 555
    assert resolver.host_pid(9, container_id="c0ffee") is None
    proc(31337, (31337, 12), "0::/kubepods/pod9/cri-containerd-0ther.scope\n")  # pid reused elsewhere
    proc(40000, (40000, 1), "0::/kubepods/pod1/cri-containerd-c0ffee.scope\n")  # the worker restarted
    assert resolver.host_pid(1, container_id="c0ffee") == 40000


def test_cli_flags():
    args = build_parser().parse_args(["--worker", "http://a:8000", "--worker", "http://b:8000",
                                      "--host", "0.0.0.0", "--port", "9500", "--backend", "nvml",
                                      "--min-process-memory", "128MiB", "--max-processes", "8",
                                      "--engine-timeout", "0.5"])
    assert (args.worker, args.host, args.port, args.backend) == (["http://a:8000", "http://b:8000"],
                                                                 "0.0.0.0", 9500, "nvml")
    assert (args.min_process_memory, args.max_processes, args.engine_timeout) == (128 << 20, 8, 0.5)
    defaults = build_parser().parse_args([])
    assert (defaults.worker, defaults.host, defaults.port, defaults.backend) == ([], "127.0.0.1", 9400,
                                                                                 "auto")
    assert (defaults.min_process_memory, defaults.max_processes) == (64 << 20, 32)


def test_cli_rejects_bad_values():
    for argv in (["--backend", "rocm"], ["--min-process-memory", "lots"], ["--max-processes", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
