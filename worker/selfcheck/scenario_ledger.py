"""Scenario 1, ledger vs device: a worker's declared total against the device's own view of its
process, at idle and at the peak of a load that fills the KV cache; the peak never above the budget."""
from __future__ import annotations

from vramledger.ledger_document import LedgerDocument
from vramledger.units import format_bytes
from vramledger.worker.selfcheck.context import Context
from vramledger.worker.selfcheck.load import LoadResult, fill_load
from vramledger.worker.selfcheck.report import Check, ScenarioResult
from vramledger.worker.selfcheck.view import settle
from vramledger.worker.selfcheck.workers import WorkerProcess, needed

TITLE = "ledger vs device"
GAP = 0.05  # the device's view may differ from the ledger by this share of the declared total
MIN_FILL = 0.95  # the load must have used this share of the KV blocks


def entry(ledger: LedgerDocument, component: str, model: str | None = None) -> int:
    return sum(e["bytes"] for e in ledger["entries"]
               if e["component"] == component and (model is None or e["model"] == model))


def gap_check(name: str, seen: int | None, expected: int, declared: int, what: str) -> Check:
    """seen within GAP x declared of expected; None (the device does not list the process) fails."""
    if seen is None:
        return Check.compare(name, False, "the device does not list the process",
                             f"{format_bytes(expected)} ±{GAP:.0%}", expected_bytes=expected)
    gap = (seen - expected) / declared
    return Check.compare(name, abs(gap) <= GAP, f"{format_bytes(seen)} ({gap:+.1%} of declared)",
                         f"{what} = {format_bytes(expected)} ±{GAP:.0%}", measured_bytes=seen,
                         expected_bytes=expected, declared_bytes=declared, gap=gap)


def idle_check(ctx: Context, worker: WorkerProcess, ledger: LedgerDocument, label: str = "") -> Check:
    """At idle the process holds everything it declared except the transient activation peak."""
    declared, activation = ledger["declared_bytes"], entry(ledger, "activation_peak")
    seen = settle(ctx.view, worker.pid)
    return gap_check(f"device view at idle{label}", seen, declared - activation, declared,
                     f"declared {format_bytes(declared)} - activation peak {format_bytes(activation)}")


def fill_check(load: LoadResult) -> Check:
    ok = load.max_fill >= MIN_FILL and not load.errors and load.completed == load.requests
    measured = (f"{load.max_blocks_used}/{load.blocks_total} blocks used, {load.completed}/{load.requests} "
                f"requests, {load.tokens} tokens in {load.seconds:.1f} s")
    if load.errors:
        measured += f"; {len(load.errors)} failed: {load.errors[0]}"
    return Check.compare("load fills the KV cache", ok, measured,
                         f">= {MIN_FILL:.0%} of the blocks, no errors", max_fill=load.max_fill,
                         tokens=load.tokens, seconds=load.seconds)


def budget_check(peak: int | None, budget: int, slack: float) -> Check:
    """The peak never above the budget (plus the device view's own noise, slack x budget)."""
    if peak is None:
        return Check.compare("peak within the budget", False, "the device does not list the process",
                             f"<= budget {format_bytes(budget)}", budget_bytes=budget)
    over = (peak - budget) / budget
    measured = f"{format_bytes(peak)} ({abs(over):.1%} {'over' if over > 0 else 'under'} the budget)"
    expected = f"<= budget {format_bytes(budget)}" + (f" +{slack:.0%} (RSS noise)" if slack else "")
    return Check.compare("peak within the budget", over <= slack, measured, expected, peak_bytes=peak,
                         budget_bytes=budget, over=over, slack=slack)


def peak_checks(ctx: Context, worker: WorkerProcess, ledger: LedgerDocument, result: ScenarioResult,
                gap: bool = True) -> LoadResult:
    """Run the fill load and add: the load filled the cache; the peak near the ledger; the peak <= budget."""
    s = ctx.scale
    watch = ctx.view.peak(worker.pid)
    try:
        load = fill_load(worker, s.max_num_seqs, s.max_model_len, ctx.vocab_size(), s.load_timeout)
    finally:
        peak = watch.stop()
    result.add(fill_check(load))
    declared, budget = ledger["declared_bytes"], needed(ledger["budget"]["bytes"], "budget.bytes")
    if gap:
        result.add(gap_check("device view at peak", peak, declared, declared, "declared"))
    result.add(budget_check(peak, budget, ctx.scale.peak_slack))
    return load


def run(ctx: Context, result: ScenarioResult) -> None:
    s = ctx.scale
    kv = s.fill_kv_bytes()
    ctx.say(f"scenario 1: a worker with the pair and a {format_bytes(kv)} KV cache")
    with ctx.worker("s1-worker", s.engine_flags(draft=True) + ["--kv-cache-memory", str(kv)]) as worker:
        ledger = worker.ledger()
        result.add(idle_check(ctx, worker, ledger))
        ctx.say(f"scenario 1: {s.max_num_seqs} requests to max_model_len {s.max_model_len}")
        peak_checks(ctx, worker, ledger, result)
