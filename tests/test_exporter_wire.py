"""The engines' HTTP answers read off a real socket as http.client reads the same bytes: the same status,
body and keep-alive, or the same exception class, for answers well and badly framed, received whole or a
few bytes at a time."""
from __future__ import annotations

import http.client
import io
import itertools
import socket
import threading
import time

import pytest

from vramledger.exporter.engines import wire
from vramledger.exporter.engines.wire import MAX_BODY, _Receiver, read_answer, request

STATUS_LINES = [b"HTTP/1.1 200 OK", b"HTTP/1.0 200 OK", b"HTTP/1.1 204 No Content", b"HTTP/1.1 404",
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK", b"HTTP/2 200", b"HTTP/1.1 abc", b"SSH-2.0-OpenSSH_9.6",
                b"", b"HTTP/1.1 99 Low", b"HTTP/1.1"]
HEADERS = [[], ["Content-Length: {n}"], ["Content-Length: {n}", "Connection: close"], ["Transfer-Encoding: chunked"],
           ["content-length:   {n}  "], ["CONTENT-LENGTH: {n}", "Content-Length: 999"],
           ["X-A: 1", " continued", "Content-Length: {n}"], ["Content-Length: {n}", "no header", "Connection: close"],
           ["Connection: keep-alive", "Content-Length: {n}"], ["Content-Length: -1"], ["Content-Length: x{n}"],
           ["Content-Length: {n}", "From me"], [": empty", "Content-Length: {n}"], ["Keep-Alive: 5", "Content-Length: {n}"],
           ["Transfer-Encoding: Chunked", "Content-Length: 2"], ["Transfer-Encoding: gzip", "Content-Length: {n}"]]
BODIES = [b"", b"hello", b"a\r\n\r\nHTTP/1.1 200 OK\r\n"]


def chunked(body: bytes, style: int) -> bytes:
    if style == 0:
        return (b"%x\r\n" % len(body) + body + b"\r\n" if body else b"") + b"0\r\n\r\n"
    if style == 1:  # an extension and a trailer
        return b"%x;ext=1\r\n" % len(body) + body + b"\r\n0\r\nTrailer: x\r\n\r\n"
    if style == 2:
        return b"zz\r\n"  # no chunk size
    return b"%x\r\n" % (len(body) + 5) + body  # cut short


def answers():
    for status, headers, body, newline in itertools.product(STATUS_LINES, HEADERS, BODIES, [b"\r\n", b"\n"]):
        lines = [h.format(n=len(body)).encode() for h in headers]
        styles = range(4) if any(b"chunked" in line.lower() for line in lines) else [None]
        for style in styles:
            payload = body if style is None else chunked(body, style)
            yield status + newline + b"".join(line + newline for line in lines) + newline + payload


class _Bytes:
    """What http.client reads the same bytes from."""

    def __init__(self, data: bytes):
        self._data = data

    def makefile(self, mode):
        return io.BufferedReader(io.BytesIO(self._data))


def http_client_reads(data: bytes):
    response = http.client.HTTPResponse(_Bytes(data))  # type: ignore[arg-type]
    try:
        response.begin()
        if response.length is not None and not response.chunked:
            if response.length > MAX_BODY:
                return "TooLarge"
            return response.status, response.read(), response.will_close
        body = b""
        while piece := response.read(65536):
            body += piece
        return response.status, body, response.will_close
    except Exception as e:  # noqa: BLE001 - its class is what is compared
        return type(e).__name__


def wire_reads(data: bytes):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        sender = threading.Thread(target=lambda: (theirs.sendall(data), theirs.shutdown(socket.SHUT_WR)))
        sender.start()
        try:
            answer = read_answer(_Receiver(ours, time.monotonic() + 60))
            return answer.status, answer.body, answer.will_close
        except Exception as e:  # noqa: BLE001
            return type(e).__name__
        finally:
            sender.join()


@pytest.mark.parametrize("receive", [1, 7, 64 << 10])
def test_every_answer_reads_as_http_client_reads_it(monkeypatch, receive):
    monkeypatch.setattr(wire, "RECEIVE", receive)
    cases = list(answers())
    assert len(cases) > 1000
    differ = [(data, wire_reads(data), http_client_reads(data)) for data in cases]
    differ = [case for case in differ if case[1] != case[2]]
    assert not differ, differ[:3]


def test_bounds_on_lines_headers_and_bodies():
    long_line = b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70000 + b"\r\n\r\n"
    many = b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 101 + b"\r\n"
    said = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1)
    for data, raised in ((long_line, "LineTooLong"), (many, "HTTPException"), (said, "TooLarge")):
        assert wire_reads(data) == raised
        assert http_client_reads(data) == raised
    endless = b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * (MAX_BODY + 1)
    assert wire_reads(endless) == "TooLarge"


def test_the_request_is_built_once_per_url_and_refuses_what_no_request_line_carries():
    server, head = request("http://[::1]:8000/metrics?x=1")
    assert server == ("http", "::1", 8000)
    assert head == b"GET /metrics?x=1 HTTP/1.1\r\nHost: [::1]:8000\r\nAccept-Encoding: identity\r\n\r\n"
    assert request("https://engine/v1")[1].startswith(b"GET /v1 HTTP/1.1\r\nHost: engine\r\n")
    with pytest.raises(http.client.InvalidURL):
        request("http://127.0.0.1:8000/a b")
