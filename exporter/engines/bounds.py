"""Physical bounds on what an engine says, checked before any of it becomes a sample.

An engine's answer is another process's word, and the exporter republishes it: a byte count no
memory could hold (10**400 does not even convert to a float, and would fail the whole exposition), a
pid the kernel never gives, a 600 KB label with newlines. Each is refused: that engine is wrong for the
scrape, its error counted, and nothing it said is published.
"""
from __future__ import annotations

import math

from vramledger.exporter.engines.base import EngineState
from vramledger.exporter.engines.ranks import RankLedger

# The bounds a ledger document's types carry, the same for what any engine says.
from vramledger.ledger_bounds import (
    MAX_BYTES,
    MAX_ENTRIES,
    MAX_LABEL,
    MAX_RANKS,
    MAX_TOKENS,
    PID_MAX,
    OutOfBounds,
    shown,
)

MAX_MODELS = 256  # models one engine holds loaded (each a series), and kinds of runtime memory it reports


def check_bytes(value: int | None, what: str) -> None:
    if value is not None and not 0 <= value <= MAX_BYTES:
        raise OutOfBounds(f"{what} {shown(value)} is beyond 0..{MAX_BYTES} (1 PiB)")


def is_pid(value: int) -> bool:
    return 0 < value <= PID_MAX


def check_label(value: str, what: str) -> None:
    if len(value) > MAX_LABEL or not value.isprintable():
        raise OutOfBounds(f"{what} {shown(value)} is no label value (at most {MAX_LABEL} printable characters, "
                          "no newline or control character)")


def check_fraction(value: float | None, what: str, low_open: bool = False) -> None:
    """A fraction in [0, 1] ((0, 1] with low_open); None passes."""
    if value is not None and not (math.isfinite(value) and (0 < value if low_open else 0 <= value) and value <= 1):
        raise OutOfBounds(f"{what} {shown(value)} is no fraction in {'(0' if low_open else '[0'}, 1]")


def check_count(value: int | None, most: int, what: str) -> None:
    if value is not None and not 0 <= value <= most:
        raise OutOfBounds(f"{what} {shown(value)} is beyond 0..{most}")


def check_state(state: EngineState) -> None:
    """Raises OutOfBounds for the first value of an engine's state beyond its bounds."""
    for pid in state.pids:
        if not is_pid(pid):
            raise OutOfBounds(f"pid {shown(pid)} is beyond the kernel's 1..{PID_MAX}")
    check_label(state.info.version, "version")
    check_label(state.info.model, "model")
    check_fraction(state.kv_usage, "KV cache usage")
    check_bytes(state.declared_bytes, "declared_bytes")
    check_fraction(state.declared_share, "declared share of the device", low_open=True)
    if len(state.ranks) > MAX_RANKS:
        raise OutOfBounds(f"{len(state.ranks)} ranks, beyond {MAX_RANKS}")
    for rank in state.ranks:
        _check_rank(rank)
    if len(state.processes) > MAX_RANKS:
        raise OutOfBounds(f"{len(state.processes)} other processes, beyond {MAX_RANKS}")
    for process in state.processes:
        if not is_pid(process.pid):
            raise OutOfBounds(f"{process.role} pid {shown(process.pid)} is beyond the kernel's 1..{PID_MAX}")
        check_bytes(process.bytes, f"{process.role} bytes")
    check_count(state.token_capacity, MAX_TOKENS, "token capacity")
    for what, listed in (("models", state.models), ("runtime memory types", state.runtime_memory)):
        if len(listed) > MAX_MODELS:
            raise OutOfBounds(f"{len(listed)} {what}, beyond {MAX_MODELS}")
    for model in state.models:
        check_label(model.model, "model")
        check_bytes(model.device_bytes, f"{model.model[:MAX_LABEL]}: bytes on its GPUs")
        check_bytes(model.host_bytes, f"{model.model[:MAX_LABEL]}: bytes on the host")
    for memory_type, size in state.runtime_memory:
        check_label(memory_type, "memory type")
        check_bytes(size, f"{memory_type[:MAX_LABEL]} runtime memory")


def _check_rank(rank: RankLedger) -> None:
    if not 0 <= rank.rank < MAX_RANKS:
        raise OutOfBounds(f"rank {shown(rank.rank)} is beyond 0..{MAX_RANKS - 1}")
    where = f"rank {rank.rank}:"
    check_label(rank.device_uuid or "", f"{where} device uuid")
    check_bytes(rank.declared_bytes, f"{where} declared_bytes")
    check_bytes(rank.budget_bytes, f"{where} budget")
    if rank.sizing is not None:
        check_label(rank.sizing.fallback, f"{where} sizing fallback")
        check_bytes(rank.sizing.vllm_charged_bytes, f"{where} vLLM's charge")
        check_bytes(rank.sizing.own_process_bytes, f"{where} its process's own charge")
        check_bytes(rank.sizing.charged_bytes, f"{where} the charge that ran")
    if len(rank.entries) > MAX_ENTRIES:
        raise OutOfBounds(f"{where} {len(rank.entries)} entries, beyond {MAX_ENTRIES}")
    for entry in rank.entries:
        check_label(entry.component, f"{where} component")
        check_label(entry.model, f"{where} model")
        check_bytes(entry.bytes, f"{where} {entry.component[:MAX_LABEL]} bytes")
