"""The memory budget, the KV cache size, and the startup checks that explain a plan that cannot work."""
from __future__ import annotations

import logging
import math

from vramledger.processes import ProcessMemory
from vramledger.units import GiB, format_bytes
from vramledger.worker.memory.device import Device

log = logging.getLogger(__name__)

# The CPU shares the host with everything else: without a utilization, take a modest KV cache.
CPU_DEFAULT_KV_BYTES = 2 * GiB


class MemoryPlanError(RuntimeError):
    """The memory settings cannot work on this device; the message says what to change."""


def blocks_per_sequence(max_model_len: int, block_size: int, num_speculative_tokens: int = 0) -> int:
    """KV blocks one sequence needs at its longest: verification writes k slots past the end."""
    return -(-(max_model_len + num_speculative_tokens) // block_size)


def max_usable_kv_bytes(max_num_seqs: int, max_model_len: int, block_size: int, bytes_per_block: int,
                        num_speculative_tokens: int = 0) -> int:
    """The most KV cache the scheduler can ever fill: max_num_seqs sequences of max_model_len."""
    per_seq = blocks_per_sequence(max_model_len, block_size, num_speculative_tokens)
    return max_num_seqs * per_seq * bytes_per_block


def budget_bytes(device: Device, utilization: float | None, kv_cache_memory: int | None,
                 non_kv_bytes: int, max_usable_kv_bytes: int) -> tuple[int, int]:
    """Return (budget, kv_bytes): the memory the worker may hold and the part left for the KV cache.

    utilization: as EngineConfig.budget_utilization resolves it; None only on the CPU without one."""
    if kv_cache_memory is not None:
        kv = min(kv_cache_memory, max_usable_kv_bytes)
        return non_kv_bytes + kv, kv
    if utilization is None:
        if device.kind != "cpu":
            raise ValueError(f"a budget on {device} needs a utilization (EngineConfig.budget_utilization)")
        kv = min(CPU_DEFAULT_KV_BYTES, max_usable_kv_bytes)
        return non_kv_bytes + kv, kv
    total = device.total_bytes()
    budget = int(total * utilization)
    if budget < non_kv_bytes:
        raise MemoryPlanError(_below_non_kv_message(device, total, utilization, budget, non_kv_bytes))
    kv = budget - non_kv_bytes
    if kv > max_usable_kv_bytes:
        log.info("KV cache capped at %s: max_num_seqs x max_model_len cannot use more "
                 "(%s of the budget stays unused)", format_bytes(max_usable_kv_bytes),
                 format_bytes(kv - max_usable_kv_bytes))
    return budget, min(kv, max_usable_kv_bytes)


def _below_non_kv_message(device: Device, total: int, utilization: float, budget: int, non_kv: int) -> str:
    needed = math.ceil(non_kv / total * 1000) / 1000
    message = (f"The memory budget of {format_bytes(budget)} (--memory-utilization {utilization:g} x "
               f"{format_bytes(total)} on {device}) is {format_bytes(non_kv - budget)} below the "
               f"{format_bytes(non_kv)} the worker holds before "
               f"any KV cache (runtime, weights of every model, activation peak, non-torch memory, "
               f"allocator slack, per-sequence state, the server's requests in flight). ")
    if needed > 1:
        return message + ("Even --memory-utilization 1.0 cannot hold it: use smaller models, a lower "
                          "--max-num-seqs / --max-num-batched-tokens (smaller activation peak), "
                          "or a larger device.")
    return message + (f"Raise --memory-utilization by at least {needed - utilization:.3f} to {needed:.3f} "
                      f"(more, to leave room for the KV cache), or size the KV cache with --kv-cache-memory.")


def check_free_memory(device: Device, budget: int, utilization: float | None,
                      foreign_processes: list[ProcessMemory], free_bytes: int | None = None,
                      own_bytes: int = 0) -> None:
    """Raise MemoryPlanError when the device's free memory (at start) cannot hold the budget.

    free_bytes: free memory at start (default: now); own_bytes: memory this process already
    held then (the runtime), which the budget includes.
    """
    free = device.free_bytes() if free_bytes is None else free_bytes
    available = free + own_bytes
    if available >= budget:
        return
    total = device.total_bytes()
    held = f" (+ {format_bytes(own_bytes)} this process already holds)" if own_bytes else ""
    if utilization is not None:
        requested = f"--memory-utilization {utilization:g} ({format_bytes(budget)} of {format_bytes(total)})"
        fix = f"Lower --memory-utilization to at most {math.floor(available / total * 100) / 100:.2f}"
    else:
        requested = f"the budget of {format_bytes(budget)} (memory before the KV cache + the KV cache)"
        fix = f"Lower --kv-cache-memory by at least {format_bytes(budget - available)}"
    others = "; ".join(f"pid {p.pid} ({p.name}) {'?' if p.bytes is None else format_bytes(p.bytes)}"
                       for p in foreign_processes)
    holders = (f"Other processes hold memory on this device: {others}." if others else
               "No other process is visible (they may run in another container or pid namespace).")
    raise MemoryPlanError(f"Free memory on {device} at start is {format_bytes(free)} of "
                          f"{format_bytes(total)}{held}, "
                          f"less than {requested}. {holders} {fix}, or stop the other processes, "
                          f"or use another device.")


def plan_kv_blocks(kv_bytes: int, bytes_per_block: int, block_size: int, max_model_len: int,
                   num_speculative_tokens: int = 0) -> int:
    """Return how many KV blocks kv_bytes holds; raise MemoryPlanError if not one full sequence."""
    if bytes_per_block <= 0 or block_size <= 0 or max_model_len <= 0:
        raise ValueError("bytes_per_block, block_size and max_model_len must be positive")
    k = num_speculative_tokens
    per_seq = blocks_per_sequence(max_model_len, block_size, k)
    if kv_bytes <= 0:
        raise MemoryPlanError(
            f"No memory is left for the KV cache: the budget is {format_bytes(-kv_bytes)} below the memory "
            f"the worker holds before it. Raise --memory-utilization, or set --kv-cache-memory to at least "
            f"{format_bytes(per_seq * bytes_per_block)} (one sequence of --max-model-len {max_model_len}).")
    num_blocks = kv_bytes // bytes_per_block
    if num_blocks >= per_seq:
        return num_blocks
    lookahead = f" plus {k} speculative lookahead slots" if k else ""
    message = (f"The KV cache ({format_bytes(kv_bytes)} = {num_blocks} blocks of {block_size} tokens, "
               f"{format_bytes(bytes_per_block)} each) cannot hold one sequence of --max-model-len "
               f"{max_model_len}"
               f"{lookahead} ({per_seq} blocks). ")
    largest = num_blocks * block_size - k
    if largest >= 1:
        message += (f"The largest --max-model-len that fits is {largest}: lower --max-model-len to at most "
                    f"{largest}, or ")
    else:
        message += "Not even a one-token sequence fits: "
    message += (f"give the KV cache at least {format_bytes((per_seq - num_blocks) * bytes_per_block)} more "
                f"(raise --memory-utilization or --kv-cache-memory)")
    if k and num_blocks * block_size >= max_model_len:
        message += f", or lower --num-speculative-tokens to at most {num_blocks * block_size - max_model_len}"
    raise MemoryPlanError(message + ".")
