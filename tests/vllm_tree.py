"""A real process tree shaped like a vLLM server's, for tests where a GPU vLLM cannot run here.

    python tests/vllm_tree.py METRICS_FILE [--ledger LEDGER_FILE] [--ranks N] [--host 127.0.0.1]
                              [--version 0.32.0] [--engine-dead]

The API server process listens on a free port and serves METRICS_FILE (a /metrics text recorded
from a real vLLM) at /metrics, {"version": ...} at /version and, given LEDGER_FILE (a document
recorded from the vLLM plugin), that at /vramledger/memory, as vLLM with the plugin enabled does
(404 without it, as vLLM without the plugin); /health answers 200 with no body, or 503 with
--engine-dead, as vLLM's API server does once its engine core has died
(vllm/entrypoints/serve/instrumentator/health.py); it starts an engine-core child,
which starts N rank children, as vLLM does with tensor parallelism N. It prints "port P" once the
whole tree is up, and everything exits when its stdin closes.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def child(ranks: int) -> None:
    """engine core (ranks > 0: starts its ranks) or one rank: waits for stdin to close."""
    procs = [subprocess.Popen([sys.executable, __file__, "--child", "0"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(ranks)]
    for proc in procs:
        proc.stdout.readline()
    print("up", flush=True)
    sys.stdin.read()
    for proc in procs:
        proc.stdin.close()
        proc.wait()


def serve(metrics: Path, ranks: int, host: str, version: str, ledger: Path | None = None,
          engine_dead: bool = False) -> None:
    bodies = {"/metrics": ("text/plain; version=0.0.4", metrics.read_bytes()),
              "/version": ("application/json", json.dumps({"version": version}).encode()),
              "/health": ("text/plain", b"")}
    if ledger is not None:
        bodies["/vramledger/memory"] = ("application/json", ledger.read_bytes())

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's and the worker's uvicorn,
        disable_nagle_algorithm = True  # and TCP_NODELAY as theirs: a reply's parts are not held back

        def do_GET(self):
            kind, body = bodies.get(self.path, ("text/plain", b""))
            code = 503 if engine_dead and self.path == "/health" else 200
            self.send_response(code if self.path in bodies else 404)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    core = subprocess.Popen([sys.executable, __file__, "--child", str(ranks)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    core.stdout.readline()
    print("port", server.server_address[1], flush=True)
    sys.stdin.read()
    core.stdin.close()
    core.wait()
    server.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("metrics", nargs="?", type=Path)
    parser.add_argument("--ledger", type=Path, default=None)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--version", default="0.32.0")
    parser.add_argument("--engine-dead", action="store_true")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
    else:
        serve(args.metrics, args.ranks, args.host, args.version, args.ledger, args.engine_dead)
