"""A real HTTP server on a real socket answering as an engine that cannot run here (no GPU), with the
exact shapes of that engine's own routes (tests/engine_shapes.py says where each comes from).

    python tests/fake_engines.py ROUTES_FILE [--children N] [--host 127.0.0.1]
    LAUNCHER tests/fake_engines.py --launch SHARDS -- PYTHON tests/fake_engines.py ROUTES_FILE ...

ROUTES_FILE is JSON, {path: {"status": 200, "type": "application/json", "body": "..."}}, looked at on
each request (parsed again where it is a new file, as FakeEngine.serve replaces it), so a test changes
what the engine answers (a model loading, a restart's 503) by writing it anew; a path it lacks answers
404. The server starts N child processes first, as SGLang's schedulers or Ollama's runners are
children of the process on its port, then prints "port P children A B" (the
children's pids); everything exits when its stdin closes. With --launch, run through a link named as
an engine's launcher (TGI's text-generation-launcher), it starts that server and SHARDS sibling processes,
as the launcher starts TGI's router and shards.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).parent


def launch(server: list[str], shards: int) -> None:
    """As text-generation-launcher: starts the server (the router) and its shards, siblings; prints the
    server's line with the shards' pids; everything exits when stdin closes."""
    router = subprocess.Popen(server, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    kids = [subprocess.Popen([server[0], "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
            for _ in range(shards)]
    print(router.stdout.readline().strip(), "shards", *(k.pid for k in kids), "router", router.pid, flush=True)
    sys.stdin.read()
    for proc in (router, *kids):
        proc.stdin.close()
        proc.wait()


class Answers:
    """The routes file's answers, {path: (status, type, body bytes)}, parsed again only once the file
    is another: FakeEngine.serve replaces it whole, so a new file is a new inode, and the one parsed is
    held open so that no new file can be given its inode."""

    def __init__(self, routes: Path):
        self._routes = routes
        self._lock = threading.Lock()
        self._held: io.BufferedReader | None = None
        self._answers: dict[str, tuple[int, str, bytes]] = {}

    def current(self) -> dict[str, tuple[int, str, bytes]]:
        with self._lock:
            if self._held is None or os.stat(self._routes).st_ino != os.fstat(self._held.fileno()).st_ino:
                fresh = self._routes.open("rb")
                table = json.loads(fresh.read())
                self._answers = {path: (route.get("status", 200), route.get("type", "application/json"),
                                        route["body"].encode()) for path, route in table.items()}
                if self._held is not None:
                    self._held.close()
                self._held = fresh
            return self._answers


def serve(routes: Path, children: int, host: str) -> None:
    answers = Answers(routes)
    kids = [subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
            for _ in range(children)]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the engines' servers
        disable_nagle_algorithm = True

        def do_GET(self):
            status, kind, data = answers.current().get(self.path, (404, "text/plain", b""))
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print("port", server.server_address[1], "children", *(k.pid for k in kids), flush=True)
    sys.stdin.read()
    for kid in kids:
        kid.stdin.close()
        kid.wait()
    server.shutdown()


class FakeEngine:
    """One fake engine process: its URL, its pid and its children's, and what it answers."""

    def __init__(self, spawn, tmp_path: Path, routes: dict, children: int = 0, host: str = "127.0.0.1",
                 launcher: str | None = None, shards: int = 0):
        """launcher: the server started by a parent process of that executable name, beside `shards`
        sibling processes (TGI's text-generation-launcher, its router and shards)."""
        self.routes_file = tmp_path / f"routes-{os.urandom(4).hex()}.json"
        self.serve(routes)
        server = [sys.executable, str(HERE / "fake_engines.py"), str(self.routes_file),
                  "--children", str(children), "--host", host]
        if launcher is not None:  # the name the kernel gives the process is its executable's
            named = tmp_path / launcher
            named.symlink_to(sys.executable)
            server = [str(named), str(HERE / "fake_engines.py"), "--launch", str(shards), "--", *server]
        self.proc = spawn(server, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        from test_exporter_host import read_line  # here: the server process itself needs none of it
        line = read_line(self.proc).split()
        assert line[:1] == ["port"] and line[2:3] == ["children"], line
        self.port = int(line[1])
        rest = line[3:line.index("shards")] if launcher is not None else line[3:]
        self.children = [int(pid) for pid in rest]
        self.shards = [int(pid) for pid in line[line.index("shards") + 1:-2]] if launcher is not None else []
        self.url = f"http://127.0.0.1:{self.port}"
        self.launcher = self.proc.pid if launcher is not None else None
        self.pid = int(line[-1]) if launcher is not None else self.proc.pid  # the one behind the port

    def serve(self, routes: dict) -> None:
        """Answer these routes from now on: {path: body} (JSON when not a str), or {path: (status, body)}."""
        table = {}
        for path, answer in routes.items():
            status, body = answer if isinstance(answer, tuple) else (200, answer)
            text = body if isinstance(body, str) else json.dumps(body)
            table[path] = {"status": status, "body": text,
                           "type": "text/plain; version=0.0.4" if isinstance(body, str) else "application/json"}
        fresh = self.routes_file.with_suffix(".new")
        fresh.write_text(json.dumps(table))
        fresh.replace(self.routes_file)  # whole, never half-written under a request

    @property
    def tree(self) -> frozenset[int]:
        """Every process of the fake: the launcher's, where it has one."""
        launcher = [] if self.launcher is None else [self.launcher, *self.shards]
        return frozenset([*launcher, self.pid, *self.children])


# What kind_routes' fakes give as their KV cache usage: SGLang's and llama.cpp's own ratio, TGI's batch
# tokens (over its max_batch_total_tokens), TensorRT-LLM's used and free blocks (used over used + free).
SGLANG_TOKEN_USAGE, LLAMACPP_KV_RATIO, TGI_BATCH_TOKENS, TRITON_BLOCKS = 0.25, 0.5, 8192, (3, 6237)


def kind_routes() -> list[tuple[object, dict]]:
    """What a serving engine of each kind that cannot run here answers, with the EngineKind that watches it."""
    import engine_shapes as shapes  # here: the server process itself needs none of it

    from vramledger.exporter.engines import llamacpp, ollama, sglang, tgi, triton
    used, free = TRITON_BLOCKS
    return [(sglang.KIND, {"/get_server_info": shapes.sglang_server_info(shapes.sglang_memory()),
                           "/metrics": shapes.sglang_metrics(SGLANG_TOKEN_USAGE)}),
            (ollama.KIND, {"/api/ps": shapes.ollama_ps(shapes.ollama_model()),
                           "/api/version": shapes.ollama_version()}),
            (llamacpp.KIND, {"/health": shapes.LLAMACPP_OK, "/props": shapes.llamacpp_props(),
                             "/metrics": shapes.llamacpp_metrics(LLAMACPP_KV_RATIO)}),
            (tgi.KIND, {"/info": shapes.tgi_info(), "/metrics": shapes.tgi_metrics(TGI_BATCH_TOKENS)}),
            (triton.KIND, {"/metrics": shapes.triton_metrics(used=used, free=free)})]


def every_kind(spawn, tmp_path: Path) -> list[tuple[object, FakeEngine]]:
    """One serving fake engine of each kind that cannot run here, with the EngineKind that watches it."""
    return [(kind, FakeEngine(spawn, tmp_path, answers, children=1)) for kind, answers in kind_routes()]


ENGINE_PREFIX = "vramledger_engine_"  # the exporter's per-engine families, labelled engine=URL
PROCESS = "vramledger_device_process_memory_bytes"


def of_engine(values: dict, url: str) -> dict[tuple[str, tuple], float]:
    """One engine's series out of test_exporter_nvml.split_samples' values: {(family without its prefix,
    its other labels): value}; its info series left out (its labels are read from the state instead)."""
    out = {}
    for (name, labels), value in values.items():
        rest = dict(labels)
        if name.startswith(ENGINE_PREFIX) and rest.pop("engine", None) == url and not name.endswith("_info"):
            out[name.removeprefix(ENGINE_PREFIX), tuple(sorted(rest.items()))] = value
    return out


def kind_of(values: dict, url: str) -> str:
    """The kind vramledger_engine_info gives the engine at url."""
    [info] = [dict(labels) for (name, labels) in values
              if name == ENGINE_PREFIX + "info" and dict(labels).get("engine") == url]
    return info["kind"]


def owned(values: dict, url: str) -> dict[int, float]:
    """{pid: bytes} of the device processes attributed to the engine at url."""
    return {int(dict(labels)["pid"]): value for (name, labels), value in values.items()
            if name == PROCESS and dict(labels).get("engine") == url}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--launch"]:
        launch(sys.argv[4:], int(sys.argv[2]))  # --launch SHARDS -- SERVER...
        sys.exit()
    parser = argparse.ArgumentParser()
    parser.add_argument("routes", type=Path)
    parser.add_argument("--children", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    serve(args.routes, args.children, args.host)
