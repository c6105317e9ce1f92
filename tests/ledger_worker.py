"""A stand-in worker for the exporter tests: a real process that holds memory and serves its ledger.

    python tests/ledger_worker.py [--model-mib N] [--container-id ID] [--port P] [--loading-seconds S]

Allocates and touches N MiB (its "weights"), declares everything it holds at that point, prints
"port <n>" once it listens on 127.0.0.1, and serves:
  GET  /v1/memory         the ledger (docs/ledger.md), device kind "cpu", live block from its RSS
  GET  /health            {"status": "ok"}
  GET  /metrics           vramledger_serving_info, as the worker serves it
  POST /test/hold?mib=N   test-only: allocate N MiB more that the ledger does not declare
With --loading-seconds it listens first and "loads" (sleeps, then allocates) that long, answering
as the worker does meanwhile: /health 503 {"status": "loading"}, /v1/memory 503 code "model_loading".
Standard library only, so it starts fast and needs nothing from the project.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def touched(n_bytes: int) -> bytearray:
    # Every page written, so the allocation is resident (a zeroed buffer could stay unmapped).
    return bytearray(b"\x01") * n_bytes


def host_memory() -> tuple[int, int]:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"], info["MemAvailable"]


class LedgerWorker:
    """The memory this process holds, and the ledger that declares part of it."""

    def __init__(self, model_mib: int, container_id: str | None):
        runtime = rss_bytes()
        self.weights = touched(model_mib * MiB)
        self.undeclared: list[bytearray] = []
        rest = max(0, rss_bytes() - runtime - len(self.weights))
        total, available = host_memory()
        self.doc = {
            "version": 1,
            "worker": {"pid": os.getpid(), "host_pid": None, "container_id": container_id,
                       "hostname": socket.gethostname()},
            "models": {"target": "ledger-worker", "draft": None},
            "device": {"kind": "cpu", "index": 0, "uuid": None, "name": "cpu",
                       "total_bytes": total, "free_at_start_bytes": available},
            "budget": {"bytes": len(self.weights), "utilization": None, "kv_cache_memory": 0},
            "entries": [
                {"component": "runtime", "model": "", "bytes": runtime},
                {"component": "weights", "model": "target", "bytes": len(self.weights)},
                {"component": "activation_peak", "model": "", "bytes": 0},
                {"component": "non_torch", "model": "", "bytes": rest},
                {"component": "kv_cache", "model": "", "bytes": 0},
            ],
            "foreign_at_start": {"bytes": max(0, total - available - runtime), "processes": []},
            "kv_cache": {"block_size": 16, "bytes_per_block": 0, "blocks_total": 0, "blocks_used": 0,
                         "capacity_tokens": 0},
        }
        self.doc["declared_bytes"] = sum(e["bytes"] for e in self.doc["entries"])

    def ledger(self) -> dict:
        process, declared = rss_bytes(), self.doc["declared_bytes"]
        return self.doc | {"live": {"process_bytes": process, "declared_bytes": declared,
                                    "unaccounted_bytes": max(0, process - declared),
                                    "measured_at": time.time()}}

    def hold(self, mib: int) -> dict:
        self.undeclared.append(touched(mib * MiB))
        return {"held_mib": sum(len(b) for b in self.undeclared) // MiB, "rss_bytes": rss_bytes()}


INFO = b'vramledger_serving_info{model="ledger-worker",draft_model="",device="cpu",version="0.1.0"} 1.0\n'
LOADING = {"message": "the model is still loading", "type": "server_error", "param": None,
           "code": "model_loading"}


def make_handler(loaded: list[LedgerWorker]):
    """Routes over the worker once loaded (loaded[0]); the worker's 503 answers before."""
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's and the worker's uvicorn,
        disable_nagle_algorithm = True  # and TCP_NODELAY as theirs: a reply's parts are not held back

        def do_GET(self):
            path = urlparse(self.path).path
            if path == "/metrics":
                self._send(200, INFO, "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/health" and loaded:
                self._json(200, {"status": "ok"})
            elif path == "/health":
                self._json(503, {"status": "loading", "error": LOADING})
            elif path == "/v1/memory" and loaded:
                self._json(200, loaded[0].ledger())
            elif path == "/v1/memory":
                self._json(503, {"error": LOADING})
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self):
            url = urlparse(self.path)
            if url.path == "/test/hold" and loaded:
                self._json(200, loaded[0].hold(int(parse_qs(url.query).get("mib", ["0"])[0])))
            else:
                self._json(404, {"error": "not found"})

        def _json(self, status: int, body: dict):
            self._send(status, json.dumps(body).encode(), "application/json")

        def _send(self, status: int, data: bytes, kind: str):
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # quiet: the tests read stdout for the port
            pass

    return Handler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-mib", type=int, default=64)
    p.add_argument("--container-id", default=None)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--loading-seconds", type=float, default=0.0)
    args = p.parse_args()
    loaded: list[LedgerWorker] = []

    def load() -> None:
        time.sleep(args.loading_seconds)
        loaded.append(LedgerWorker(args.model_mib, args.container_id))

    if not args.loading_seconds:
        load()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(loaded))
    if args.loading_seconds:
        threading.Thread(target=load, daemon=True).start()
    print(f"port {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
