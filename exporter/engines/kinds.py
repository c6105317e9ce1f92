"""The kinds of engine the exporter watches: each adapter module declares one EngineKind as KIND.

A kind says everything the rest of the exporter needs to know about it: its command-line flag, its
value of the pod label vramledger.io/engine, how to recognise a server of that kind when it is watched
as another (the hint that names the right flag), how to build its adapter, and its row in the docs'
table of engines. The flags, the Kubernetes watch, those hints and the docs are generated from the
registered kinds, so a new kind is one module (and its tests, and its docs row).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vramledger.exporter.engines.base import Engine
from vramledger.exporter.engines.fetch import HttpClient
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.processes import Locator

POD_LABEL = "vramledger.io/engine"  # a pod's engine kind, for --kubernetes: the kind's name

# (url, client, errors, locator): the adapter of one server; locator None means "by its port".
AdapterFactory = Callable[[str, HttpClient, ErrorLog, "Locator | None"], Engine]


@dataclass(frozen=True)
class EngineKind:
    name: str  # vramledger_engine_info{kind} and the pod label vramledger.io/engine: <name>
    flag: str  # the exporter's command-line flag, "--vllm"
    title: str  # how messages and docs name one server of the kind: "a vLLM server"
    source: str  # vramledger_exporter_errors_total{source} of its adapter's faults
    adapter: AdapterFactory
    # Bytes that only this kind's GET /metrics text contains (a series name it always serves), to tell
    # a user who watches it under another kind's flag which flag to use; None where it serves no
    # /metrics of its own.
    signature: bytes | None
    declares: str  # docs/exporter.md's table: what it declares (weights, KV, graphs, budget, KV usage)
    takes_pid: bool = False  # whether its flag takes URL=PID, for a server whose port cannot be seen
    # docs/exporter.md's table: what the exporter can flag for it given what it declares (unaccounted
    # memory needs a declared total; "" where it flags nothing beyond its processes' attribution).
    flags: str = ""
    port: int = 8000  # the port its server listens on by default: a pod's, without a vramledger.io/port annotation
