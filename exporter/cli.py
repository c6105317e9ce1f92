"""Command line of the sidecar: python -m vramledger.exporter --worker URL ... --vllm URL[=PID] ..., one flag per
registered engine kind (exporter/engines/registry.py)."""
from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading

from prometheus_client import CollectorRegistry, start_http_server

from vramledger.exporter.collector import ExporterCollector
from vramledger.exporter.discovery import DiscoveredEngines
from vramledger.exporter.engines import Engines, EngineSet, parse_engine_arg
from vramledger.exporter.engines.kinds import POD_LABEL, EngineKind
from vramledger.exporter.engines.registry import kinds
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.kubernetes import PodDirectory
from vramledger.exporter.sources import SourceUnavailable, open_source
from vramledger.units import parse_size

log = logging.getLogger("vramledger.exporter")
STARTUP_WAIT = 2.0  # seconds the first read may delay the start, whatever --engine-timeout


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0: {text}")
    return value


def _engine_arg(kind: EngineKind):
    def check(text: str) -> str:
        try:
            parse_engine_arg(kind, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
        return text
    return check


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One repeatable flag per registered kind; its values are args.<flag without dashes>."""
    for kind in kinds():
        pid = (("; its processes are found by the port it listens on, or from PID (its API server) when "
                "the exporter cannot see that socket (another network namespace)") if kind.takes_pid else "")
        p.add_argument(kind.flag, action="append", default=[], metavar="URL[=PID]" if kind.takes_pid else "URL",
                       type=_engine_arg(kind), dest=_dest(kind),
                       help=f"base URL of {kind.title}, read each scrape (repeatable; an OpenAI base URL "
                            f"ending in /v1 means its server){pid}; what it declares: docs/exporter.md")


def _dest(kind: EngineKind) -> str:
    return kind.flag.lstrip("-").replace("-", "_")


def given_engines(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each registered kind's name -> the values of its flag."""
    return {kind.name: getattr(args, _dest(kind)) for kind in kinds()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vramledger.exporter", description=(
        "vramledger sidecar: joins device memory with what each engine declares."))
    _add_engine_flags(p)
    p.add_argument("--kubernetes", action="store_true",
                   help="in a cluster: also watch the engines of this node (NODE_NAME) that the API "
                        f"lists, by the pod label {POD_LABEL} ({', '.join(k.name for k in kinds())}), and name each "
                        "process's namespace, pod and container (docs/kubernetes.md)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve /metrics on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=9400, help="port to serve /metrics on; 0 picks a free one")
    p.add_argument("--backend", choices=("auto", "nvml", "host"), default="auto",
                   help="device reader: nvml (NVIDIA), host (psutil), auto = nvml when it starts, else host")
    p.add_argument("--min-process-memory", type=parse_size, default=64 << 20, metavar="SIZE",
                   help="host reader: list processes holding at least this much (default 64MiB)")
    p.add_argument("--max-processes", type=_positive_int, default=32, metavar="N",
                   help="process series per device; smaller foreign ones are summed as pid=\"other\"")
    p.add_argument("--engine-timeout", type=_positive_float, default=1.0, metavar="SECONDS",
                   help="how long a scrape waits for the engines, read all at once "
                        "(default 1.0); one that has not answered by then is unreachable for that scrape, and "
                        "each GET of an engine must be whole within it, connect to last byte")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    given = given_engines(args)
    for kind in kinds():
        for text in given[kind.name]:
            url, pid = parse_engine_arg(kind, text)
            shown = text if pid is None else text.rpartition("=")[0]
            if url != shown.rstrip("/"):
                log.info("%s is an OpenAI API base URL: watching its server, %s", shown, url)
    errors = ErrorLog()
    try:
        source = open_source(args.backend, errors, args.min_process_memory)
    except SourceUnavailable as e:
        print(f"exporter: {e}; is the NVIDIA driver installed and the GPU visible? "
              "(--backend auto falls back to the host reader)", file=sys.stderr)
        return 1
    try:
        engines = Engines.open(given, args.engine_timeout, errors)
    except ValueError as e:
        print(f"exporter: {e}", file=sys.stderr)
        source.close()
        return 2
    try:
        refuse_wrong_kinds(engines)
    except ValueError as e:
        print(f"exporter: {e}", file=sys.stderr)
        engines.close()
        source.close()
        return 2
    pods = None
    if args.kubernetes:
        try:
            pods = PodDirectory.connect(os.environ.get("NODE_NAME", ""), errors)
        except Exception as e:  # noqa: BLE001 - no NODE_NAME, no service account and no kubeconfig
            print(f"exporter: --kubernetes: {e}", file=sys.stderr)
            engines.close()
            source.close()
            return 1
    watched: EngineSet = engines if pods is None else DiscoveredEngines(pods, engines, args.engine_timeout, errors)
    registry = CollectorRegistry()
    registry.register(ExporterCollector(source, watched, errors, max_processes=args.max_processes, pods=pods))
    # Startup objects (imports, clients) never die: freezing them keeps full collections, and so
    # scrape latency spikes, small.
    gc.freeze()
    try:
        server, _thread = start_http_server(args.port, addr=args.host, registry=registry)
    except OSError as e:  # in use, or an address this host does not have
        print(f"exporter: cannot listen on {args.host}:{args.port}: {e.strerror or e} "
              "(another exporter there? choose another --port)", file=sys.stderr)
        watched.close()
        source.close()
        return 2
    host, port = server.server_address[:2]
    if not watched.urls and pods is None:
        log.warning("no engine given (%s): serving device metrics only", ", ".join(k.flag for k in kinds()))
    log.info("%s reader, %s; listening on http://%s:%d/metrics", source.name,
             ", ".join(f"{len(urls)} {name}" for name, urls in given.items()), host, port)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    watched.close()
    source.close()
    return 0


def refuse_wrong_kinds(engines: Engines) -> None:
    """A first read: an engine given under another kind's flag (a --worker that is a vLLM server, say) is
    refused, naming the right flag.

    An engine that is down, or slower than STARTUP_WAIT, is not refused: it is watched, and says what
    it is once it answers.
    """
    for reading in engines.read(min(engines.timeout, STARTUP_WAIT)).values():
        if reading.wrong_kind:
            raise ValueError(reading.reason)


def run() -> None:
    """`python -m vramledger.exporter` and the vramledger-exporter script: main(), then exit at once rather than
    after joining the engine readers' threads (one stuck on an engine that never answers would hold a
    stopping exporter for its whole --engine-timeout)."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
