"""What the exporter needs from an inference engine, whatever its kind: one small interface.

An adapter reads one server per scrape and answers an EngineState: the host pids of its processes,
what it declares (a fixed number of bytes, its ledger per rank, or a share of each device it uses),
its KV cache usage and its identity; or it raises NotServing, saying which of the other lifecycle
states the server is in and why. Each kind is one module that declares its KIND (kinds.py); the
registry (registry.py) finds it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from vramledger.exporter.engines.ranks import RankLedger, ServerProcess
from vramledger.exporter.sources import HOST, DeviceMemory


@dataclass(frozen=True)
class EngineInfo:
    """vramledger_engine_info{kind, version, model}; "" where the engine does not say."""
    kind: str
    version: str = ""
    model: str = ""


@dataclass(frozen=True)
class ModelMemory:
    """One model an engine holds loaded (Ollama's /api/ps): its bytes on the GPUs it uses, and on the host."""
    model: str
    device_bytes: int
    host_bytes: int


@dataclass(frozen=True)
class EngineState:
    """One engine as read in one scrape; what it declares is the first of: declared_bytes, its ranks'
    ledgers, its loaded models, declared_share."""
    pids: frozenset[int]  # host pids of every process it runs (NVML reports host pids)
    info: EngineInfo
    kv_usage: float | None = None  # fraction of its KV cache in use, in [0, 1]
    declared_bytes: int | None = None  # a fixed declaration, whatever the device (a ledger's total)
    declared_share: float | None = None  # or a share of the total memory of each device it uses
    ranks: tuple[RankLedger, ...] = ()  # or its ledger per rank, each on its device (published too)
    # With its ranks: its other processes, each declaring host memory (vLLM's API server, engine core).
    processes: tuple[ServerProcess, ...] = ()
    # True where pids are only the engine's word: no process behind its port (or in its pod) could be
    # seen to check them against. Pids found there are the engine's before any such claim.
    claimed: bool = False
    models: tuple[ModelMemory, ...] = ()  # or the models it holds loaded, each declared (Ollama)
    token_capacity: int | None = None  # tokens its KV cache holds, where the engine says
    # Memory the engine reports of its runtime, by type (TensorRT-LLM's gpu, cpu, pinned): published, not
    # declared, as it is only part of what the engine holds.
    runtime_memory: tuple[tuple[str, int], ...] = ()

    def declared_on(self, device: DeviceMemory) -> int | None:
        """What it declares on one device; None when it declares nothing there."""
        if self.declared_bytes is not None:
            return self.declared_bytes
        if self.ranks:
            here = [r.declared_bytes for r in self.ranks if r.on(device)]
            if device.device == HOST:
                here += [p.bytes for p in self.processes]
            elif unplaced := [r.declared_bytes for r in self.ranks
                              if r.device_kind == "cuda" and r.device_uuid is None]:
                # A rank that cannot say its GPU (SGLang's never do) is on one of the GPUs the engine's
                # processes use, one rank each: the largest is what any of them may declare there, so
                # what is unaccounted on a GPU is never more than the truth.
                here.append(max(unplaced))
            return sum(here) if here else None
        if self.models:  # which of its GPUs holds which model the engine does not say: all of it on each
            return sum(m.host_bytes if device.device == HOST else m.device_bytes for m in self.models)
        if self.declared_share is not None and device.device != HOST:  # a GPU's share, never the host's
            return math.ceil(self.declared_share * device.total)  # vLLM's rounding (request_memory)
        return None

    def declared_total(self, used: list[DeviceMemory]) -> int | None:
        """All it declares: a fixed declaration or its ranks' as they are (with its other processes' where
        it uses the host), a share summed over the devices it uses (used); None when it declares nothing."""
        if self.declared_bytes is not None:
            return self.declared_bytes
        if self.ranks:  # the other processes' host memory where the host is read (the host reader)
            on_host = any(dev.device == HOST for dev in used)
            others = sum(p.bytes for p in self.processes) if on_host else 0
            return sum(r.declared_bytes for r in self.ranks) + others
        if self.models:  # its models on its GPUs, and on the host where the host is read
            on_host = any(dev.device == HOST for dev in used)
            return sum(m.device_bytes + (m.host_bytes if on_host else 0) for m in self.models)
        shares = [self.declared_on(dev) for dev in used]
        known = [share for share in shares if share is not None]
        return sum(known) if known and len(known) == len(shares) else None


class Status(str, Enum):
    """vramledger_engine_state{state}: where a watched engine is in its life."""
    SERVING = "serving"  # read as that kind of engine
    LOADING = "loading"  # it answered 503: loading its model, or otherwise not ready
    UNREACHABLE = "unreachable"  # no answer within the timeout: down, starting, or no such server
    WRONG = "wrong"  # it answered, but not as that kind of engine (counted as an error)


class NotServing(Exception):
    """The engine is not serving now: `status` says in which other state, the message why; `counted`
    whether it is a fault (vramledger_exporter_errors_total), not a state an engine passes through."""
    status: Status
    counted = False


class Loading(NotServing):
    status = Status.LOADING


class Unreachable(NotServing):
    status = Status.UNREACHABLE

    def __init__(self, message: str, counted: bool = False):
        super().__init__(message)
        self.counted = counted  # an answer begun but not finished in time: up, and failing


class Wrong(NotServing):
    status = Status.WRONG
    counted = True

    def __init__(self, message: str, wrong_kind: bool = False):
        super().__init__(message)
        self.wrong_kind = wrong_kind  # another kind of engine: the message names the flag to use


class Engine(Protocol):
    """One watched server: read() is called once per scrape, from a worker thread."""
    url: str
    kind: str  # vramledger_engine_info{kind}
    source: str  # vramledger_exporter_errors_total{source} of its faults

    def read(self) -> EngineState:
        """The server now, when it serves; raises NotServing otherwise."""
        ...

    def close(self) -> None: ...
