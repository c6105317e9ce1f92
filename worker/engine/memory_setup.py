"""From measured memory to a KV cache size: profile, budget, check, record."""
from __future__ import annotations

from collections.abc import Callable

from vramledger.ledger_vocabulary import GROWTH_BEFORE_PROFILE, MEASURED_FROM_PROFILE
from vramledger.worker.config import EngineConfig
from vramledger.worker.engine.model_runner import ModelRunner
from vramledger.worker.engine.profile_run import (
    block_index,
    profile_blocks,
    request_states,
    run_prompt_alone,
    run_sampling_paths,
    run_varied,
    run_worst_case,
)
from vramledger.worker.memory.device import Device
from vramledger.worker.memory.ledger import Ledger
from vramledger.worker.memory.plan import (
    budget_bytes,
    check_free_memory,
    max_usable_kv_bytes,
    plan_kv_blocks,
)
from vramledger.worker.memory.profiler import MemorySnapshot, measure_held, profile_window


def plan_memory(runner: ModelRunner, config: EngineConfig, device: Device, ledger: Ledger,
                tokenizer=None, server_state: Callable[[], object] | None = None) -> int:
    """Measure the worst step, size the KV cache from the budget, and return its block count.

    server_state builds what a server in front of the engine holds for every request it may
    have in flight (worker/http/request_state.py); without a server that entry is 0.
    """
    c, k = config, config.num_speculative_tokens
    utilization = c.budget_utilization(device.kind)
    ledger.utilization, ledger.kv_cache_memory = utilization, c.kv_cache_memory
    ledger.max_model_len, ledger.num_speculative_tokens = c.max_model_len, k

    # The profile run writes into a scratch cache allocated outside the window: not activations.
    runner.allocate_kv_cache(profile_blocks(c))
    with profile_window(device) as window:
        run_worst_case(runner, c)
        run_prompt_alone(runner, c)
        run_sampling_paths(runner, c)
        window.mark()
        run_varied(runner, c)  # untrimmed, as serving runs: what the allocator cannot reuse
        runner.workspace.clear()  # serving grows it again, never past this run: an activation
    runner.kv.clear()
    device.empty_cache()
    now = MemorySnapshot.take(device)
    ledger.record("non_torch", max(window.non_torch_bytes, unexplained_growth(ledger, now)))
    ledger.record("activation_peak", window.activation_peak_bytes)
    ledger.record("allocator", window.allocator_bytes)
    per_block = runner.bytes_per_block()
    usable = max_usable_kv_bytes(c.max_num_seqs, c.max_model_len, c.block_size, per_block, k)
    # Host state the engine keeps per request, for max_num_seqs requests at their longest, and its
    # block pool's, for as many blocks as the KV cache can use, each holding a cached prefix.
    states = measure_held(device, lambda: (request_states(c, tokenizer, device.torch_device),
                                           block_index(c, usable // per_block)))
    ledger.record("sequence_state", states)
    # The server's work (tokenizing) frees what it needed: its peak counts.
    ledger.record("server", measure_held(device, server_state, peak=True) if server_state else 0)

    budget, kv = budget_bytes(device, utilization, c.kv_cache_memory, ledger.non_kv_bytes, usable)
    num_blocks = plan_kv_blocks(kv, per_block, c.block_size, c.max_model_len, k)
    # Whole blocks: less than a block left beyond the last one is not held, so declared == budget.
    # (A budget the KV cache cannot use, capped by max_num_seqs x max_model_len, stays as asked.)
    if budget - ledger.non_kv_bytes - num_blocks * per_block < per_block:
        budget = ledger.non_kv_bytes + num_blocks * per_block
    ledger.budget_bytes = budget
    check_free_memory(device, budget, utilization, ledger.foreign_at_start_processes,
                      free_bytes=ledger.free_at_start_bytes, own_bytes=ledger.bytes_of("runtime"))
    ledger.set_kv_cache(c.block_size, per_block, num_blocks)
    return num_blocks


def unexplained_growth(ledger: Ledger, now: MemorySnapshot) -> int:
    """What the process gained since start that neither torch nor an entry measured as growth
    explains (the profile run's lasting growth, what imports and loaders left behind). Raises
    RuntimeError when an entry recorded so far is neither declared as growth (GROWTH_BEFORE_PROFILE)
    nor one the plan measures itself (MEASURED_FROM_PROFILE, an earlier plan's): it would be counted
    again here."""
    undeclared = {e.component for e in ledger.entries} - {"runtime", *GROWTH_BEFORE_PROFILE, *MEASURED_FROM_PROFILE}
    if undeclared:
        raise RuntimeError(f"ledger entries {sorted(undeclared)} were measured before the profile run but are "
                           "not in ledger_vocabulary.GROWTH_BEFORE_PROFILE: non_torch would count them twice")
    # torch explains what it reserved, the weights among it (the weights alone where that reads less).
    explained = max(now.torch_reserved, ledger.bytes_of("weights")) \
        + sum(ledger.bytes_of(c) for c in GROWTH_BEFORE_PROFILE if c != "weights")
    return now.process - ledger.bytes_of("runtime") - explained
