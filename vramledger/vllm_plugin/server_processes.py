"""The vLLM server's processes besides its ranks, each declaring the host memory it held when the server
became ready.

A vLLM server is a process tree: the API server (where GET /vramledger/memory runs), its engine core
(the scheduler; on vLLM's CPU build, and with tensor parallelism, it starts the ranks as processes of
their own), and helpers such as multiprocessing's resource tracker. None of them but the ranks keeps a
ledger, yet each holds host memory: the interpreter, torch, vLLM, the tokenizer. The API server
measures its whole tree once, when the endpoint's state is set up: after the engine core has started
its ranks and they have allocated their KV caches, before the server takes its first request. Each
process (but the ranks, whose ledgers say what they hold) declares what it held then, measured as the
exporter's host reader observes it (PSS; RSS where PSS cannot be read). What one grows by after that
is in no declaration: it shows as unaccounted memory, as a leak should.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import get_args

import psutil

from vramledger.ledger_document import ServerProcessDoc, ServerRole
from vramledger.ledger_vocabulary import SCOPE_PROCESS
from vramledger.procfs import host_memory, read_start

API_SERVER, ENGINE_CORE, OTHER = get_args(ServerRole)  # ledger_vocabulary.SERVER_ROLES, as types
READY = "ready"  # when a declaration was measured: once the server was ready, before its first request
# The process title vLLM's engine core sets (vllm/v1/engine/core.py; EngineCore_DP<n> with data parallelism).
ENGINE_CORE_TITLE = "VLLM::EngineCore"


@dataclass(frozen=True)
class AtReady:
    """One process of the server as it was when the server became ready."""

    pid: int
    started: int  # read_start(): with the pid, which process it is (pids are reused)
    name: str
    role: ServerRole
    bytes: int
    measure: str  # "pss", or "rss" where PSS cannot be read
    at: float


def role(pid: int, name: str, api_server_pid: int) -> ServerRole:
    if pid == api_server_pid:
        return API_SERVER
    return ENGINE_CORE if name.startswith(ENGINE_CORE_TITLE) else OTHER


def at_ready() -> tuple[AtReady, ...]:
    """This process and every process below it, each with the host memory it holds now."""
    me = psutil.Process()
    now, found = time.time(), []
    for proc in (me, *me.children(recursive=True)):
        held, started = host_memory(proc.pid), read_start(proc.pid)
        try:
            name = proc.name()
        except psutil.Error:  # exited meanwhile: nothing to declare
            continue
        if held is not None and started is not None:
            found.append(AtReady(proc.pid, started, name, role(proc.pid, name, os.getpid()), *held, now))
    return tuple(found)


def declarations(snapshot: Iterable[AtReady], rank_pids: frozenset[int]) -> list[ServerProcessDoc]:
    """What the processes of the snapshot declare, but for the ranks and those gone since: each one's
    memory at ready, and what it holds now beside it."""
    out: list[ServerProcessDoc] = []
    for p in snapshot:
        if p.pid in rank_pids or read_start(p.pid) != p.started:
            continue
        now = host_memory(p.pid)
        out.append({"role": p.role, "pid": p.pid, "name": p.name, "bytes": p.bytes, "measure": p.measure,
                    "scope": SCOPE_PROCESS, "measured": READY, "measured_at": p.at,
                    "live_bytes": None if now is None else now[0]})
    return out
