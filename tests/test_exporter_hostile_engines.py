"""Hostile engines beside the exporter: answers dripped a byte at a time, bodies without end, values no
device could hold, labels no engine would send, pids claimed from another engine. Each is a real server
on a real socket; each must cost that engine only, counted, never the scrape or another engine's series."""
from __future__ import annotations

import copy
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fake_pynvml import FakeGpu, GiB, proc
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_exporter_host import find, one, read_line, scrape, spawn, start_exporter  # noqa: F401
from test_exporter_lifecycle import ledger_worker
from test_exporter_nvml import WORKER, exporter, ledger_doc, split_samples
from test_exporter_vllm import MODEL, gpu_text
from test_exporter_vllm_ledger import NEIGHBOUR, load

from vramledger.exporter.engines import Engines, VllmEngine, VramledgerEngine
from vramledger.exporter.engines.base import Unreachable, Wrong
from vramledger.exporter.engines.fetch import MAX_BODY, HttpClient, fetch
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.processes import PortLocator

MiB = 1 << 20
DRIP_S = 0.05  # a byte every DRIP_S: each receive is quick, the whole answer is not


class RawServer:
    """A TCP server answering every request on a connection with `answer(conn)`, one thread per
    connection: what an engine that misbehaves below HTTP looks like."""

    def __init__(self, answer):
        self._answer = answer
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket):
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                request += chunk
            try:
                self._answer(conn, self.stop)
            except OSError:  # the exporter gave up and closed: expected
                pass

    def close(self):
        self.stop.set()
        self._sock.close()


def response(body: bytes, status: str = "200 OK") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


# This process serves it, so the pid it claims is the one behind its port.
LEDGER = json.dumps({"version": 1, "worker": {"pid": os.getpid(), "host_pid": None, "container_id": None},
                     "device": {"kind": "cpu"}, "declared_bytes": 1 << 30}).encode()


def dripped(whole: bytes, from_byte: int):
    """Sends `whole` at once up to from_byte, then a byte every DRIP_S: every receive is answered quickly."""

    def answer(conn, stop):
        conn.sendall(whole[:from_byte])
        for i in range(from_byte, len(whole)):
            if stop.wait(DRIP_S):
                return
            conn.sendall(whole[i:i + 1])
    return answer


@pytest.fixture
def raw_server():
    servers: list[RawServer] = []

    def start(answer) -> RawServer:
        servers.append(RawServer(answer))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


# --- whole-read deadlines -----------------------------------------------------------------------

@pytest.mark.parametrize("from_byte", [0, len(response(LEDGER)) - len(LEDGER)], ids=["headers", "body"])
def test_a_dripped_answer_is_cut_at_one_deadline_and_counted(raw_server, from_byte):
    whole = response(LEDGER)
    server = raw_server(dripped(whole, from_byte))
    assert (len(whole) - from_byte) * DRIP_S > 5  # it would take longer than the wait below
    client = HttpClient(0.5)
    with pytest.raises(Unreachable, match="not complete within 0.5 s") as e:
        fetch(client, server.url + "/v1/memory")
    assert e.value.counted  # the engine answers, too slowly: a fault, not an engine that is down

    errors = ErrorLog()
    engines = Engines([VramledgerEngine(server.url, client, errors)], errors, client, timeout=0.5)
    try:
        # Waiting well past the read's own deadline: the read ends by itself, at its deadline.
        reading = engines.read(wait_s=5)[server.url]
        assert reading.status.value == "unreachable"
        assert "not complete within 0.5 s" in reading.reason
        assert errors.counts() == {"worker": 1}
    finally:
        engines.close()


def test_an_answer_that_never_starts_is_unreachable_not_counted(raw_server):
    server = raw_server(lambda conn, stop: stop.wait(10))
    with pytest.raises(Unreachable, match="no answer within 0.3 s") as e:
        fetch(HttpClient(0.3), server.url + "/v1/memory")
    assert not e.value.counted  # a stopped or busy engine, as a restart looks


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_beyond_the_bound_is_wrong(raw_server, chunked):
    piece = b"x" * MiB

    def answer(conn, stop):
        if chunked:  # no length said: the bound is found while reading
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(MAX_BODY // len(piece) + 2):
                conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            conn.sendall(b"0\r\n\r\n")
        else:
            conn.sendall(response(b"x" * (MAX_BODY + 1)))
    server = raw_server(answer)
    with pytest.raises(Wrong, match=f"body over {MAX_BODY} bytes"):
        fetch(HttpClient(5), server.url + "/metrics")


def test_a_body_within_the_bound_is_read_whole(raw_server):
    body = b"y" * MAX_BODY
    server = raw_server(lambda conn, stop: conn.sendall(response(body)))
    assert fetch(HttpClient(5), server.url + "/metrics").content == body


def test_dripping_costs_the_dripping_engine_only(raw_server):
    good = raw_server(lambda conn, stop: conn.sendall(response(LEDGER)))
    slow = raw_server(dripped(response(LEDGER), 0))
    errors = ErrorLog()
    client = HttpClient(0.5)
    engines = Engines([VramledgerEngine(slow.url, client, errors), VramledgerEngine(good.url, client, errors)],
                      errors, client, timeout=0.5)
    try:
        readings = engines.read(wait_s=5)
        assert {url: r.status.value for url, r in readings.items()} == {slow.url: "unreachable",
                                                                       good.url: "serving"}
        assert errors.counts() == {"worker": 1}
    finally:
        engines.close()


# --- values beyond physical bounds: that engine wrong, the scrape whole ---------------------------

class Routes(BaseHTTPRequestHandler):
    """Serves the class's {path: body} as JSON or text, as an engine would; 404 elsewhere."""
    protocol_version = "HTTP/1.1"
    bodies: dict[str, bytes] = {}

    def do_GET(self):
        body = self.server.bodies.get(self.path)
        self.send_response(404 if body is None else 200)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


@pytest.fixture
def engine_server():
    """An engine on a real socket, served by this process, so the pid it claims is behind its port."""
    servers: list[ThreadingHTTPServer] = []

    def start(bodies: dict[str, bytes]) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), Routes)
        server.bodies, server.daemon_threads = bodies, True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def exposed(registry) -> tuple[dict, dict]:
    """What /metrics answers (prometheus_client's exposition, as its HTTP handler runs it), as
    ({(metric, labels): value} without the exporter's own health, {source: errors})."""
    return split_samples(text_string_to_metric_families(generate_latest(registry).decode()))


# The neighbours every case runs beside: a worker and a GPU (the engine under test is this process).
GPU = dict(uuid="GPU-0", allocated=30 * GiB, processes=[proc(4242, "python3", 20), proc(os.getpid(), "engine", 4)])
LONG_NAME = 'a"\n' * 200_000  # 600 KB of quotes and newlines


def beside_a_worker(monkeypatch, make_engine) -> tuple[str, dict, dict, dict]:
    """Scrapes a worker and the device beside the engine make_engine(errors) builds, then without it:
    (that engine's URL, the scrape's values, its errors, the values without the engine)."""
    alone, _ = exporter(monkeypatch, [FakeGpu(**GPU)], {WORKER: ledger_doc(4242, 20 * GiB)})
    baseline, _ = exposed(alone)
    built: list = []

    def make(errors):
        built.append(make_engine(errors))
        return built[-1]
    registry, _ = exporter(monkeypatch, [FakeGpu(**GPU)], {WORKER: ledger_doc(4242, 20 * GiB)}, engines=[make])
    values, errors = exposed(registry)
    return built[0].url, values, errors, baseline


def assert_only_that_engine_is_wrong(url, values, errors, baseline, source):
    theirs = {key: v for key, v in values.items() if ("engine", url) in key[1]}
    assert theirs == {("vramledger_engine_up", (("engine", url),)): 0} | {
        ("vramledger_engine_state", (("engine", url), ("state", s))): int(s == "wrong")
        for s in ("serving", "loading", "unreachable", "wrong")}
    assert {key: v for key, v in values.items() if key not in theirs} == baseline  # the others' series intact
    assert errors[source] == 1


def worker_ledger(change) -> bytes:
    doc = ledger_doc(os.getpid(), GiB)
    change(doc)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("change", [
    lambda d: d.update(declared_bytes=10 ** 400),  # beyond a float: the exposition itself failed
    lambda d: d.update(declared_bytes=10 ** 30),
    lambda d: d["worker"].update(pid=2 ** 63),
    lambda d: d["worker"].update(host_pid=2 ** 63),
    lambda d: d["worker"].update(container_id=LONG_NAME),
    lambda d: d.update(models={"target": LONG_NAME}),
    lambda d: d.update(models={"target": "two\nlines"}),
], ids=["declared-1e400", "declared-1e30", "pid-2^63", "host-pid-2^63", "container-600KB", "model-600KB",
        "model-newline"])
def test_a_worker_ledger_beyond_bounds(monkeypatch, engine_server, caplog, change):
    url = engine_server({"/v1/memory": worker_ledger(change)})
    with caplog.at_level(logging.INFO):
        found = beside_a_worker(monkeypatch, lambda errors: VramledgerEngine(url, HttpClient(5), errors))
    assert_only_that_engine_is_wrong(*found, source="worker")
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"vramledger {url}: wrong")]
    assert len(line) < 400 and "\n" not in line  # the value named, clipped: no engine floods the log


def test_the_exporter_process_answers_whatever_an_engine_declares(spawn, engine_server, tmp_path):  # noqa: F811
    hostile = engine_server({"/v1/memory": worker_ledger(lambda d: d.update(declared_bytes=10 ** 400))})
    _, worker_url = ledger_worker(spawn)
    _, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host", "--worker", hostile,
                             "--worker", worker_url, "--engine-timeout", "5")
    for scrape_number in range(1, 3):
        samples = scrape(port)  # 200: /metrics answered 500 when a float could not hold the value
        assert one(samples, "vramledger_engine_up", engine=worker_url) == 1
        assert find(samples, "vramledger_engine_state", engine=hostile, state="wrong")[0].value == 1
        assert find(samples, "vramledger_device_memory_total_bytes", device="host")
        assert one(samples, "vramledger_exporter_errors_total", source="worker") >= scrape_number


def vllm_text(old: str, new: str) -> bytes:
    text = gpu_text()
    assert old in text
    return text.replace(old, new).encode()


@pytest.mark.parametrize("metrics", [
    vllm_text('gpu_memory_utilization="0.9"', 'gpu_memory_utilization="1e400"'),  # cost the whole join
    vllm_text('gpu_memory_utilization="0.9"', 'gpu_memory_utilization="NaN"'),
    vllm_text('gpu_memory_utilization="0.9"', 'gpu_memory_utilization="1e30"'),
    vllm_text('kv_cache_memory_bytes="None"', 'kv_cache_memory_bytes="1e400"'),
    vllm_text("0.4375\n", "+Inf\n"),
    vllm_text(f'usage_perc{{engine="0",model_name="{MODEL}"}}',  # escaped as the text format says
              'usage_perc{engine="0",model_name="' + LONG_NAME.replace('"', '\\"').replace("\n", "\\n") + '"}'),
], ids=["utilization-1e400", "utilization-nan", "utilization-1e30", "kv-size-1e400", "kv-usage-inf",
        "model-600KB"])
def test_a_vllm_metrics_text_beyond_bounds(monkeypatch, engine_server, metrics):
    url = engine_server({"/metrics": metrics, "/version": b'{"version": "0.32.0"}', "/health": b""})
    found = beside_a_worker(monkeypatch, lambda errors: VllmEngine(url, HttpClient(5), errors, PortLocator(url)))
    assert_only_that_engine_is_wrong(*found, source="vllm")


def plugin_ledger(change) -> bytes:
    doc = copy.deepcopy(load(NEIGHBOUR))
    change(doc["ranks"][0])
    return json.dumps(doc).encode()


@pytest.mark.parametrize("change", [
    lambda r: r["entries"][0].update(bytes=10 ** 400),
    lambda r: r["entries"][0].update(component="kv\ncache"),
    lambda r: r["entries"][0].update(model=LONG_NAME),
    lambda r: r.update(rank=10 ** 30),
    lambda r: r["sizing"].update(vllm_charged_bytes=10 ** 400, charged_bytes=10 ** 400),
    lambda r: r["sizing"].update(fallback=LONG_NAME),
    lambda r: r["budget"].update(bytes=10 ** 30),
    lambda r: r.update(entries=r["entries"] * 1000),
], ids=["entry-1e400", "component-newline", "model-600KB", "rank-1e30", "charge-1e400", "fallback-600KB",
        "budget-1e30", "entries-many"])
def test_a_vllm_plugin_ledger_beyond_bounds(monkeypatch, engine_server, change):
    url = engine_server({"/metrics": gpu_text().encode(), "/version": b'{"version": "0.32.0"}', "/health": b"",
                         "/vramledger/memory": plugin_ledger(change)})
    found = beside_a_worker(monkeypatch, lambda errors: VllmEngine(url, HttpClient(5), errors, PortLocator(url)))
    assert_only_that_engine_is_wrong(*found, source="vllm")


@pytest.mark.parametrize("process", [{"role": "api_server", "pid": 1, "bytes": 10 ** 30},
                                     {"role": "engine_core", "pid": 10 ** 9, "bytes": 1}],
                         ids=["process-bytes-1e30", "process-pid-1e9"])
def test_a_vllm_servers_processes_beyond_bounds(monkeypatch, engine_server, process):
    ledger = json.dumps(load(NEIGHBOUR) | {"processes": [process]}).encode()
    url = engine_server({"/metrics": gpu_text().encode(), "/version": b'{"version": "0.32.0"}', "/health": b"",
                         "/vramledger/memory": ledger})
    found = beside_a_worker(monkeypatch, lambda errors: VllmEngine(url, HttpClient(5), errors, PortLocator(url)))
    assert_only_that_engine_is_wrong(*found, source="vllm")


def test_the_same_engines_within_bounds_serve(monkeypatch, engine_server):
    # The cases above are refused for their one value: unchanged, each source serves.
    worker = engine_server({"/v1/memory": worker_ledger(lambda d: None)})
    vllm = engine_server({"/metrics": gpu_text().encode(), "/version": b'{"version": "0.32.0"}', "/health": b"",
                          "/vramledger/memory": plugin_ledger(lambda r: None)})
    for make in (lambda errors: VramledgerEngine(worker, HttpClient(5), errors),
                 lambda errors: VllmEngine(vllm, HttpClient(5), errors, PortLocator(vllm))):
        url, values, errors, _ = beside_a_worker(monkeypatch, make)
        assert values[("vramledger_engine_up", (("engine", url),))] == 1
        assert set(errors.values()) == {0}


# --- claims: an engine's processes are the ones behind its port ----------------------------------

ELSEWHERE = "http://192.0.2.1:8000"  # an address of no interface here: as a server in another network namespace


def claiming(pid: int) -> bytes:
    return json.dumps(ledger_doc(pid, GiB)).encode()


def test_an_engine_cannot_claim_the_process_behind_another_port(spawn, engine_server):  # noqa: F811
    worker, worker_url = ledger_worker(spawn)
    liar = engine_server({"/v1/memory": claiming(worker.pid)})  # listed first, claiming the worker's pid
    errors = ErrorLog()
    client = HttpClient(5)
    engines = Engines([VramledgerEngine(liar, client, errors), VramledgerEngine(worker_url, client, errors)],
                      errors, client, timeout=5)
    try:
        for scrape_number in range(1, 3):
            readings = engines.read()
            assert readings[worker_url].status.value == "serving"
            assert readings[worker_url].state.pids == {worker.pid}
            assert readings[liar].status.value == "wrong"
            assert f"claims pid {worker.pid}, which is not behind its port" in readings[liar].reason
            assert errors.counts() == {"worker": scrape_number}
    finally:
        engines.close()


def test_a_claim_beyond_sight_cannot_take_a_process_found_behind_a_port(spawn, engine_server):  # noqa: F811
    worker, worker_url = ledger_worker(spawn)
    liar = engine_server({"/v1/memory": claiming(worker.pid)})
    errors = ErrorLog()
    client = HttpClient(5)
    # The liar's port is out of sight, so its claim cannot be checked there; the worker's pid was found
    # behind the worker's own port, and stays the worker's.
    engines = Engines([VramledgerEngine(liar, client, errors, locator=PortLocator(ELSEWHERE)),
                       VramledgerEngine(worker_url, client, errors)], errors, client, timeout=5)
    try:
        readings = engines.read()
        assert readings[worker_url].status.value == "serving"
        assert readings[worker_url].state.pids == {worker.pid}
        assert readings[liar].status.value == "wrong"
        assert f"found behind {worker_url}'s port" in readings[liar].reason
        assert errors.counts() == {"worker": 1}
    finally:
        engines.close()


def test_a_url_left_out_as_an_alias_is_watched_again_once_the_alias_ends(spawn, engine_server,  # noqa: F811
                                                                         caplog):
    worker, worker_url = ledger_worker(spawn)
    bodies = {"/v1/memory": claiming(worker.pid)}
    first = engine_server(bodies)
    errors = ErrorLog()
    client = HttpClient(5)
    # Neither port in sight: two claims of one pid are two URLs of one server, as far as anyone can tell.
    engines = Engines([VramledgerEngine(first, client, errors, locator=PortLocator(ELSEWHERE)),
                       VramledgerEngine(worker_url, client, errors, locator=PortLocator(ELSEWHERE))],
                      errors, client, timeout=5)
    try:
        with caplog.at_level(logging.INFO, logger="vramledger.exporter.engines"):
            assert list(engines.read()) == [first]
            assert list(engines.read()) == [first]
            bodies["/v1/memory"] = claiming(os.getpid())  # the first one fixed: it claims its own process
            readings = engines.read()
        assert {url: r.state.pids for url, r in readings.items()} == {first: {os.getpid()},
                                                                      worker_url: {worker.pid}}
        assert errors.counts() == {}
        said = [r.getMessage() for r in caplog.records if "processes" in r.getMessage()]
        assert said == [f"{worker_url} reaches the same processes as {first}: watching that server once, as {first}",
                        f"{worker_url} no longer reaches the processes of {first}: watched again"]
    finally:
        engines.close()


def forwarded(spawn, tmp_path, name: str, to_url: str) -> str:  # noqa: F811
    """A forwarder listening under `name` (a symlink to this Python), passing connections to to_url."""
    exe = tmp_path / name
    exe.symlink_to(sys.executable)
    proc = spawn([str(exe), "tests/port_forwarder.py", "--to", to_url.rsplit(":", 1)[1]],
                 stdout=subprocess.PIPE, text=True)
    line = read_line(proc)
    assert line.startswith("port "), line
    return f"http://127.0.0.1:{line.split()[1]}"


@pytest.mark.parametrize("name, refused", [("docker-proxy", False), ("not-the-worker", True)])
def test_a_worker_watched_through_a_port_forwarder(spawn, tmp_path, name, refused):  # noqa: F811
    # A worker in a container, its port published by Docker's userland proxy, watched from the host:
    # the process listening is the proxy, and the worker's pid cannot be checked there. Any other
    # process listening in front of the worker is not a forwarder the exporter knows: the pid is refused.
    worker, worker_url = ledger_worker(spawn)
    url = forwarded(spawn, tmp_path, name, worker_url)
    errors = ErrorLog()
    client = HttpClient(5)
    engines = Engines([VramledgerEngine(url, client, errors)], errors, client, timeout=5)
    try:
        reading = engines.read()[url]
        if refused:
            assert reading.status.value == "wrong"
            assert f"claims pid {worker.pid}, which is not behind its port" in reading.reason
            assert errors.counts() == {"worker": 1}
        else:
            assert reading.status.value == "serving", reading.reason
            assert reading.state.pids == {worker.pid}
            assert errors.counts() == {}
    finally:
        engines.close()
