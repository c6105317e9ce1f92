"""A stand-in worker whose GET /v1/memory is a ledger the reader refuses (argv[1] says how), to see
selfcheck's scenarios fail saying why: `serve_refused_ledger.py HOW --host H --port P [worker flags]`."""
from __future__ import annotations

import argparse
import json
import os
from http.server import BaseHTTPRequestHandler, HTTPServer

DOCUMENTS = {  # the fields the reader needs, and the one that is wrong
    "negative-budget": {"budget": {"bytes": -1, "utilization": None, "kv_cache_memory": None}},
    "no-budget": {"budget": {"bytes": None, "utilization": None, "kv_cache_memory": None}},
}


def document(how: str) -> dict:
    return {"version": 1, "worker": {"pid": os.getpid()}, "device": {"kind": "cpu"}, "declared_bytes": 0,
            "entries": [], **DOCUMENTS[how]}


class Handler(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        known = {"/health": b"ok", "/v1/memory": self.body}
        self.send_response(200 if self.path in known else 404)
        self.end_headers()
        self.wfile.write(known.get(self.path, b""))

    def log_message(self, *args) -> None:  # quiet: the test reads the scenario's result, not this log
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("how", choices=DOCUMENTS)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    args, _ = parser.parse_known_args()
    Handler.body = json.dumps(document(args.how)).encode()
    HTTPServer((args.host, args.port), Handler).serve_forever()
