"""Scenario 2, the draft's memory is in the budget: the same budget with and without the draft. The KV cache
shrinks by the draft's weights plus the draft's share of every block; then the draft run under full
load stays inside its budget. The draft's size comes from its checkpoint, not from the ledger."""
from __future__ import annotations

from vramledger.ledger_document import LedgerDocument
from vramledger.units import format_bytes
from vramledger.worker.selfcheck.checkpoints import kv_bytes_per_block
from vramledger.worker.selfcheck.context import Context
from vramledger.worker.selfcheck.report import Check, ScenarioResult
from vramledger.worker.selfcheck.scenario_ledger import entry, peak_checks
from vramledger.worker.selfcheck.workers import WorkerProcess, needed

TITLE = "the draft's memory is in the budget"
TOLERANCE = 0.02


def non_kv_bytes(ledger: LedgerDocument) -> int:
    """Every entry but the KV cache and the draft's weights: what differs between the two runs in these
    is the draft's other costs (its activations, its loader, allocator and per-sequence state)."""
    return sum(e["bytes"] for e in ledger["entries"]
               if e["component"] != "kv_cache" and (e["component"], e["model"]) != ("weights", "draft"))


def within(measured: float, expected: float, tolerance: float = TOLERANCE) -> bool:
    return abs(measured - expected) <= tolerance * abs(expected)


def run(ctx: Context, result: ScenarioResult) -> None:
    s = ctx.scale
    kv_plain = s.no_draft_kv_bytes()
    ctx.say(f"scenario 2: without the draft, a {format_bytes(kv_plain)} KV cache sets the budget")
    plain_flags = s.engine_flags(draft=False) + ["--kv-cache-memory", str(kv_plain)]
    with ctx.worker("s2-no-draft", plain_flags) as plain:
        base = plain.ledger()
    budget = needed(base["budget"]["bytes"], "budget.bytes")
    share = budget / needed(base["device"]["total_bytes"], "device.total_bytes")
    ctx.say(f"scenario 2: with the draft, the same budget {format_bytes(budget)} "
            f"(--memory-utilization {share:.6g})")
    with ctx.worker("s2-draft", s.engine_flags(draft=True) + ["--memory-utilization", repr(share)]) as spec:
        check_draft_run(ctx, result, base, spec)


def check_draft_run(ctx: Context, result: ScenarioResult, base: LedgerDocument, spec: WorkerProcess) -> None:
    s, budget = ctx.scale, needed(base["budget"]["bytes"], "budget.bytes")
    mine = spec.ledger()
    mine_budget = needed(mine["budget"]["bytes"], "budget.bytes")

    # What the draft should cost, from its checkpoint and config.
    draft_weights = s.weight_bytes(s.draft_model)
    target_block = kv_bytes_per_block(s.model, s.block_size, s.element_bytes)
    draft_block = kv_bytes_per_block(s.draft_model, s.block_size, s.element_bytes)
    result.add(Check.compare("same budget", within(mine_budget, budget, 0.001), format_bytes(mine_budget),
                             f"{format_bytes(budget)} (the run without the draft)",
                             budget_bytes=mine_budget, expected_bytes=budget))
    declared_weights = entry(mine, "weights", "draft")
    result.add(Check.compare("draft weights in the ledger", within(declared_weights, draft_weights),
                             format_bytes(declared_weights),
                             f"{format_bytes(draft_weights)} (checkpoint) ±{TOLERANCE:.0%}",
                             measured_bytes=declared_weights, expected_bytes=draft_weights))
    block = mine["kv_cache"]["bytes_per_block"]
    result.add(Check.compare("KV bytes per block", within(block, target_block + draft_block),
                             format_bytes(block),
                             f"target {format_bytes(target_block)} + draft {format_bytes(draft_block)}",
                             measured_bytes=block, expected_bytes=target_block + draft_block))

    # Same budget: the KV cache loses the draft's weights and its other measured costs, and what is
    # left is split into blocks that hold the draft's layers too.
    other = non_kv_bytes(mine) - non_kv_bytes(base)
    left = entry(base, "kv_cache") + (mine_budget - budget) - draft_weights - other
    expected_blocks = left / (target_block + draft_block)
    blocks = mine["kv_cache"]["blocks_total"]
    result.add(Check.compare(
        "KV blocks with the draft", within(blocks, expected_blocks),
        f"{blocks} blocks (without the draft: {base['kv_cache']['blocks_total']})",
        f"({format_bytes(entry(base, 'kv_cache'))} KV - {format_bytes(draft_weights)} draft weights - "
        f"{format_bytes(other)} other draft costs) / {format_bytes(target_block + draft_block)} = "
        f"{expected_blocks:.1f} ±{TOLERANCE:.0%}",
        measured_blocks=blocks, expected_blocks=expected_blocks,
        blocks_without_draft=base["kv_cache"]["blocks_total"], draft_weights_bytes=draft_weights,
        other_draft_bytes=other))

    ctx.say(f"scenario 2: full load on the draft run ({s.max_num_seqs} requests to {s.max_model_len})")
    peak_checks(ctx, spec, mine, result, gap=False)
