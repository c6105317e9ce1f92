"""Probes (GET /health, GET /metrics) stay out of a real server's access log unless --log-probes; every
other request is logged."""
from __future__ import annotations

import logging

import httpx
import pytest
from server_fixtures import Server

from vramledger.worker.http.access_log import ProbeFilter

pytestmark = pytest.mark.slow  # it starts workers (`make test-fast` leaves it out)


def access_lines(log: str, request: str) -> list[str]:
    return [line for line in log.splitlines() if f'"{request} HTTP/1.1"' in line]


def exercise(server: Server) -> str:
    """Probe, scrape and ask for the models twice each; the server's log after."""
    for _ in range(2):
        for path in ("/health", "/metrics?name[]=x", "/v1/models"):
            httpx.get(server.url + path).raise_for_status()
    return server.log_path.read_text()


def test_probes_are_left_out_by_default(spec_server):
    log = exercise(spec_server)
    assert len(access_lines(log, "GET /v1/models")) >= 2
    assert access_lines(log, "GET /health") == access_lines(log, "GET /metrics?name[]=x") == []


def test_log_probes_keeps_them(checkpoints, tmp_path):
    server = Server("probes", ["--model", checkpoints["llama"], "--no-draft", "--max-model-len", "64",
                               "--log-probes"], tmp_path / "probes.log")
    server.start()
    try:
        server.wait_ready()
        log = exercise(server)
    finally:
        server.stop()
    # wait_ready's probes as well: every answer it saw, 503s while loading included.
    assert len(access_lines(log, "GET /health")) == len(server.health_seen) + 2
    assert len(access_lines(log, "GET /metrics?name[]=x")) == len(access_lines(log, "GET /v1/models")) == 2


def test_the_filter_keeps_other_methods_and_lines_of_other_shapes():
    def record(*args) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 0, '%s - "%s %s HTTP/%s" %d', args, None)

    keep = ProbeFilter().filter
    assert not keep(record("127.0.0.1:1", "GET", "/health", "1.1", 503))
    assert keep(record("127.0.0.1:1", "POST", "/health", "1.1", 405))
    assert keep(record("127.0.0.1:1", "GET", "/healthz", "1.1", 404))
    assert keep(logging.LogRecord("uvicorn.access", logging.INFO, __file__, 0, "plain %s", ("/health",), None))
