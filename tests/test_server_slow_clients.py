"""Slow and vanishing clients against real worker processes on real sockets: an idle connection, headers
trickled a line at a time, a body held short of its length, hundreds of stalled uploads, and
clients that leave mid-request. None holds a socket past its timeout, none grows the process beyond
its ledger, and none writes a traceback to the log."""
from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest
from server_fixtures import Server

from vramledger.worker.http.prompt_bounds import PromptBound, body_limit
from vramledger.worker.models.loader import load_tokenizer

pytestmark = pytest.mark.slow  # it starts processes (`make test-fast` leaves it out)

PATIENCE = 60.0  # seconds a test waits for what the server does within its 1 s timeouts
STALLED = 200  # uploads held at once, far more than the bodies the server reads at once
HELD_SLOTS = 2


@pytest.fixture(scope="module")
def servers(checkpoints, tmp_path_factory):
    """quick: 1 s timeouts. held: two bodies read at once, and time enough to hold them."""
    workdir = tmp_path_factory.mktemp("slow-clients")
    common = ["--model", checkpoints["llama"], "--no-draft", "--max-model-len", "512"]
    started = {
        "quick": Server("quick", [*common, "--keep-alive-timeout", "1", "--header-timeout", "1",
                                  "--body-timeout", "1"], workdir / "quick.log"),
        "held": Server("held", [*common, "--max-receiving-bodies", str(HELD_SLOTS), "--body-timeout", "600"],
                       workdir / "held.log"),
    }
    for server in started.values():
        server.start()
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


def connect(server: Server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(PATIENCE)
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails the test)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def post_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_a_connection_that_sends_nothing_is_closed(servers):
    with connect(servers["quick"]) as sock:
        assert read_to_end(sock) == b""  # closed without a word: no request was made


def test_headers_trickled_a_line_at_a_time_get_408_and_the_connection_closed(servers):
    with connect(servers["quick"]) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        deadline = time.monotonic() + PATIENCE
        while not select.select([sock], [], [], 0.2)[0]:  # a header line every 0.2 s, never the last
            assert time.monotonic() < deadline, "the server let the headers trickle on"
            sock.sendall(b"X-Trickle: 1\r\n")
        answer = read_to_end(sock)
    assert answer.startswith(b"HTTP/1.1 408 "), answer


def test_a_body_held_short_of_its_length_gets_408_and_the_connection_closed(servers):
    body = json.dumps({"model": "llama", "prompt": "hi", "max_tokens": 1}).encode()
    with connect(servers["quick"]) as sock:
        sock.sendall(post_head("/v1/completions", len(body)) + body[:-10])
        answer = read_to_end(sock)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), answer
    assert json.loads(payload)["error"]["code"] == "request_timeout"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_mid_request_is_one_info_line_not_a_traceback(servers, stream):
    server = servers["quick"]
    logged = server.log_path.stat().st_size
    body = json.dumps({"model": "llama", "prompt": "def f(x):", "max_tokens": 100, "ignore_eos": True,
                       "stream": stream}).encode()
    with connect(server) as sock:  # ten requests pipelined, then no more: a half-close
        sock.sendall((post_head("/v1/completions", len(body)) + body) * 10)
        sock.shutdown(socket.SHUT_WR)
        read_to_end(sock)

    def new_log() -> str:
        with open(server.log_path) as log:
            log.seek(logged)
            return log.read()

    deadline = time.monotonic() + PATIENCE
    while "went away" not in new_log() and "Traceback" not in new_log():
        assert time.monotonic() < deadline, new_log()
        time.sleep(0.1)
    time.sleep(1)  # whatever else the server writes about it (no timing asserted: it could only add lines)
    text = new_log()
    assert "Traceback" not in text and " ERROR " not in text and "ERROR:" not in text, text
    assert text.count("the client went away") == 1, text  # the request that ran; the others never started


def test_stalled_uploads_hold_no_more_bodies_than_the_ledger_declares(servers, checkpoints):
    server = servers["held"]
    limit = body_limit(PromptBound.of(load_tokenizer(checkpoints["llama"])), 512, 4 << 20)
    with httpx.Client(base_url=server.url, timeout=PATIENCE) as client:
        assert client.post("/v1/completions", json={"model": "llama", "prompt": "hi", "max_tokens": 1}).status_code \
            == 200
        before = client.get("/v1/memory").json()["live"]
        stalled = []
        try:
            for _ in range(STALLED):  # each sends its headers, then all of its body that fits but 10 bytes
                sock = connect(server)
                sock.sendall(post_head("/v1/completions", limit))
                stalled.append(sock)
            # Round trips on connections accepted after theirs: the server has read the headers that
            # arrived before (a read that found a body behind its headers holds it: one read's worth).
            for _ in range(2):
                assert httpx.get(server.url + "/health", timeout=PATIENCE).status_code == 200
            for sock in stalled:
                sock.setblocking(False)
                try:
                    sock.send(b" " * (limit - 10))  # what the socket takes: a real uploader's stall
                except BlockingIOError:
                    pass
            time.sleep(1)  # what was sent reaches the server (no timing asserted: only more could arrive)
            held = client.get("/v1/memory").json()["live"]  # GETs need no body slot
        finally:
            for sock in stalled:
                sock.close()
        # The slots freed, a request that waited for none is served.
        served = client.post("/v1/completions", json={"model": "llama", "prompt": "hi", "max_tokens": 1})
        assert served.status_code == 200, served.text
    # Beside the two bodies the server reads at once (declared), the others hold their headers only.
    assert STALLED * limit > 24 << 20  # what reading them all would have held
    assert held["process_bytes"] - before["process_bytes"] < 8 << 20, (before, held)
    assert held["declared_bytes"] == before["declared_bytes"]
