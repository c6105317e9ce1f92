"""Hostile engines beside the exporter: answers dripped a byte at a time, bodies without end, values no
device could hold, labels no engine would send, pids claimed from another engine. Each is a real server
on a real socket; each must cost that engine only, counted, never the scrape or another engine's series."""
from __future__ import annotations

import json
import os
import socket
import threading

import pytest

from exporter.engines import Engines, VramledgerEngine
from exporter.engines.base import Unreachable, Wrong
from exporter.engines.fetch import MAX_BODY, HttpClient, fetch
from exporter.errors import ErrorLog

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
