"""Selfcheck's scenario 6, two vLLM servers at 0.7 + 0.2 of one GPU started at once: on the CPU it is
skipped, saying why (never passed); its order of runs and its checks are tested over readings, since
vLLM sizes a KV cache from a memory profile only on a CUDA device. The readings are ledgers of the
plugin's shape: tests/data/vllm_ledger_cuda_neighbour_own_process.json, which the plugin wrote over
vLLM 0.32's worker code on the faked device (tests/vllm_cuda_path.py), with their blocks and sizing set
per case. It runs for real only on a GPU host with vLLM and the plugin installed."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from selfcheck_helpers import cpu_context

from vramledger.units import GiB
from vramledger.vllm_plugin.sizing import OWN_PROCESS, UNSEEN, VLLM
from vramledger.worker.selfcheck import scenario_vllm_pair as pair
from vramledger.worker.selfcheck.report import FAIL, INFO, PASS, SKIP, CannotRun, Check, ScenarioResult
from vramledger.worker.selfcheck.scale import PAIR_SHARES

RECORDED = json.loads((Path(__file__).resolve().parent / "data" / "vllm_ledger_cuda_neighbour_own_process.json")
                      .read_text())
BIG, SMALL = PAIR_SHARES


def ledger(blocks: int, ran: str = OWN_PROCESS, fallback: str | None = None, beyond: int = 0) -> dict:
    """The recorded ledger with `blocks` allocated, the sizing that ran, and what vLLM's arithmetic
    charged beyond the process's own memory."""
    doc = copy.deepcopy(RECORDED)
    rank = doc["ranks"][0]
    rank["kv_cache"]["blocks_total"] = blocks - rank["kv_cache"]["blocks_reserved"]
    sizing = rank["sizing"]
    sizing.update(requested=OWN_PROCESS if fallback or ran == OWN_PROCESS else VLLM, ran=ran, fallback=fallback,
                  fallback_reason="NVML does not list this process" if fallback else None,
                  vllm_charged_bytes=sizing["own_process_bytes"] + beyond)
    return doc


def outcomes(**by_share) -> dict[float, pair.Outcome]:
    """{BIG: ledger or failure text, SMALL: ...} as the scenario reads them."""
    shares = {"big": BIG, "small": SMALL}
    return {shares[k]: pair.Outcome(shares[k], failed=v) if isinstance(v, str) else
            pair.Outcome.from_ledger(shares[k], v) for k, v in by_share.items()}


ALONE = dict(big=ledger(9000), small=ledger(2500))


def checked(own: dict, arithmetic: dict, alone: dict = ALONE) -> tuple[ScenarioResult, dict[str, Check]]:
    result = ScenarioResult(6, pair.TITLE)
    pair.check_pair(result, outcomes(**alone), outcomes(**own), outcomes(**arithmetic))
    return result, {c.name: c for c in result.checks}


def test_own_process_pair_within_a_block_of_alone_passes_and_vllms_arithmetic_is_only_shown():
    result, got = checked(own=dict(big=ledger(8999), small=ledger(2500)),
                          arithmetic=dict(big=ledger(8900, VLLM, beyond=100 * 16384), small="exited: ValueError: "
                                          "Error in memory profiling"))
    assert result.status == PASS
    judged = {name: c.status for name, c in got.items() if c.status != INFO}
    assert set(judged.values()) == {PASS} and len(judged) == 2 + 1 + 2 * len(PAIR_SHARES)
    assert got[f"KV cache at {BIG:g} (own-process, together)"].measured == "8999 blocks (-1 against alone)"
    shown = got[f"vLLM's arithmetic at {BIG:g} (together)"]
    assert shown.status == INFO and shown.measured.startswith("8900 blocks (-100 against alone); charged 1.6 MiB")
    assert "Error in memory profiling" in got[f"vLLM's arithmetic at {SMALL:g} (together)"].measured


@pytest.mark.parametrize("own, failing", [
    (dict(big=ledger(8998), small=ledger(2500)), {f"KV cache at {BIG:g} (own-process, together)"}),
    (dict(big=ledger(9000), small=ledger(2500, VLLM, fallback=UNSEEN)),
     {f"sizing at {SMALL:g} (own-process, together)"}),
    (dict(big=ledger(9000), small="exited: RuntimeError: CUDA out of memory"),
     {"both start (own-process)", f"KV cache at {SMALL:g} (own-process, together)",
      f"sizing at {SMALL:g} (own-process, together)"}),
], ids=["two-blocks-short", "fell-back", "one-did-not-start"])
def test_what_own_process_sizing_must_do_fails_when_it_does_not(own, failing):
    result, got = checked(own=own, arithmetic=dict(big=ledger(9000, VLLM), small=ledger(2500, VLLM)))
    assert result.status == FAIL
    assert {name for name, c in got.items() if c.status == FAIL} == failing


def test_without_the_reference_run_alone_it_fails():
    result, got = checked(own=dict(big=ledger(9000), small=ledger(2500)),
                          arithmetic=dict(big=ledger(9000, VLLM), small=ledger(2500, VLLM)),
                          alone=dict(big=ledger(9000), small="timed out after 900 s waiting for its /health"))
    assert {name for name, c in got.items() if c.status == FAIL} == {
        f"alone at {SMALL:g}", f"KV cache at {SMALL:g} (own-process, together)"}


def test_a_ledger_with_hook_errors_is_no_reading():
    doc = ledger(9000)
    doc["ranks"][0]["errors"] = ["initialize_from_config: KeyError 'kv'"]
    assert pair.Outcome.from_ledger(BIG, doc).failed == (
        "its ledger has 1 rank(s), hook errors: initialize_from_config: KeyError 'kv'")


def test_only_shown_figures_are_not_a_pass():
    result = ScenarioResult(6, pair.TITLE, [Check.shown("figure", "1", "shown")])
    assert result.status == SKIP


class FakeServers:
    """Stands in for the vLLM servers (they need a GPU): answers each run with the recorded ledger."""

    def __init__(self, ctx):
        self.calls: list[tuple[tuple[float, ...], str]] = []
        FakeServers.made = self

    def together(self, shares, sizing):
        self.calls.append((shares, sizing))
        return {share: pair.Outcome.from_ledger(share, ledger(int(10000 * share))) for share in shares}


def gpu_view(free_share: float, total: int = 80 * GiB) -> SimpleNamespace:
    """The scenario's device interface (kind, total, free) as a GPU with `free_share` of it free."""
    return SimpleNamespace(kind="cuda", total_bytes=lambda: total, free_bytes=lambda: int(free_share * total))


def test_on_the_cpu_it_is_skipped_saying_why_and_starts_nothing(tmp_path):
    ctx = cpu_context(tmp_path)
    never = lambda ctx: pytest.fail("no server may be started on the CPU")  # noqa: E731
    with pytest.raises(CannotRun, match="needs a CUDA device, and there is none here: two vLLM servers share"):
        pair.run(ctx, ScenarioResult(6, pair.TITLE), servers=never)
    assert ctx.procs.started == []


def test_a_gpu_without_room_for_both_budgets_is_skipped_saying_how_much():
    room = sum(PAIR_SHARES) + pair.CONTEXT_SHARE
    with pytest.raises(CannotRun, match=r"needs .* free on cuda:0 \(the budgets 0.7 \+ 0.2 of it .*\); .* is free"):
        pair.preconditions(gpu_view(room - 0.01), "cuda:0")
    pair.preconditions(gpu_view(room), "cuda:0")  # enough: nothing to say


def test_with_room_it_runs_each_alone_then_both_at_once_with_each_sizing(tmp_path):
    ctx = SimpleNamespace(view=gpu_view(0.99), scale=SimpleNamespace(device="cuda:0"), say=lambda message: None)
    result = ScenarioResult(6, pair.TITLE)
    pair.run(ctx, result, servers=FakeServers)
    assert FakeServers.made.calls == [((BIG,), OWN_PROCESS), ((SMALL,), OWN_PROCESS),
                                      (PAIR_SHARES, OWN_PROCESS), (PAIR_SHARES, VLLM)]
    assert result.status == PASS  # the same blocks alone and together: what own-process sizing promises
