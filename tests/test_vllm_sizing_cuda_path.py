"""Own-process sizing (VRAMLEDGER_VLLM_SIZING=own-process) against vLLM's own arithmetic, over vLLM
0.32's real worker code on the faked device (tests/vllm_cuda_path.py): a neighbour that allocates or
frees memory while vLLM profiles, two instances at 0.7 and 0.2 of one device started at the same
moment, and a process NVML cannot see. Needs the vLLM venv; skipped, saying so, without it."""
from __future__ import annotations

from pathlib import Path

import pytest
from test_vllm_plugin_cuda_path import pytestmark  # noqa: F401
from vllm_scenarios import ScenarioServer, finish

MiB = 1 << 20
GROWTH = 256 * MiB  # what the neighbour allocates (or frees) during the profile run


def blocks(result: dict) -> int:
    """The KV cache's blocks as allocated: those vLLM hands out and its null block."""
    kv = result["ledger"]["kv_cache"]
    return kv["blocks_total"] + kv["blocks_reserved"]


def entries(result: dict) -> dict:
    return {(e["component"], e["model"]): e for e in result["ledger"]["entries"]}


def in_budget(result: dict) -> int:
    return sum(e["bytes"] for e in result["ledger"]["entries"] if e["in_budget"])


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sizing")


# Every run the module's tests read but the pairs: (scenario, arguments, sizing).
RUNS = [("alone", (), "vllm"), ("neighbour", (), "vllm"), ("neighbour", (), "own-process"),
        ("neighbour_frees", (), "vllm"), ("neighbour_frees", (), "own-process"), ("unseen", (), "own-process"),
        ("pair_alone", ("--utilization", "0.7"), "vllm"), ("pair_alone", ("--utilization", "0.2"), "vllm"),
        ("alone", ("--utilization", "0.9"), "own-process"), ("alone", (), "own_process")]


@pytest.fixture(scope="module", autouse=True)
def started(cuda_path, tmp):
    """All of them started at once, so they go side by side; the tests read each as they need it."""
    for scenario, args, sizing in RUNS:
        cuda_path.start(scenario, *args, sizing=sizing)
    for sizing in ("own-process", "vllm"):
        start_pair(cuda_path, tmp, sizing)
    yield
    cuda_path.stop_unread()


@pytest.fixture(scope="module")
def alone(cuda_path):
    """The KV cache vLLM gets when nothing else moves on the device."""
    return cuda_path.result("alone")


def test_a_neighbour_growing_during_the_profile_costs_vllm_sizing_and_not_own_process(alone, cuda_path):
    vllm, own = cuda_path.result("neighbour"), cuda_path.result("neighbour", sizing="own-process")
    per_block = alone["ledger"]["kv_cache"]["bytes_per_block"]
    assert blocks(vllm) == blocks(alone) - GROWTH // per_block  # vLLM's arithmetic: the neighbour's, lost
    assert blocks(own) == blocks(alone)  # own-process: as if nobody moved, to the block
    sizing = own["ledger"]["sizing"]
    assert (sizing["requested"], sizing["ran"], sizing["fallback"]) == ("own-process", "own-process", None)
    assert sizing["vllm_charged_bytes"] - sizing["charged_bytes"] == sizing["kv_bytes_given_back"] == GROWTH
    assert sizing["charged_bytes"] == alone["ledger"]["sizing"]["charged_bytes"]
    # What was charged is in the entries: the non-torch memory is the process's own, and they add up.
    e = entries(own)
    assert (e["non_torch", ""]["scope"], e["non_torch", ""]["bytes"]) == ("process", 32 * MiB)
    assert in_budget(own) == own["ledger"]["budget"]["bytes"]
    # Run with vLLM's sizing, the ledger still shows what own-process sizing would have charged.
    shown = vllm["ledger"]["sizing"]
    assert (shown["ran"], shown["kv_bytes_given_back"]) == ("vllm", 0)
    assert shown["vllm_charged_bytes"] - shown["own_process_bytes"] == GROWTH


def test_a_neighbour_freeing_memory_during_the_profile_stops_only_vllm_sizing(alone, cuda_path):
    failed = cuda_path.start("neighbour_frees")
    _, err = failed.communicate()
    assert failed.returncode != 0 and "Error in memory profiling" in err  # vLLM's check on free memory
    own = cuda_path.result("neighbour_frees", sizing="own-process")
    assert blocks(own) == blocks(alone)
    sizing = own["ledger"]["sizing"]
    assert sizing["ran"] == "own-process" and sizing["kv_bytes_given_back"] == -GROWTH  # vLLM's would be negative


def test_nvml_not_seeing_the_process_falls_back_to_vllm_sizing_and_says_why_once(cuda_path):
    vllm, unseen = cuda_path.result("neighbour"), cuda_path.result("unseen", sizing="own-process")
    assert blocks(unseen) == blocks(vllm)  # vLLM's arithmetic ran: the neighbour's growth is charged
    sizing = unseen["ledger"]["sizing"]
    assert (sizing["requested"], sizing["ran"], sizing["fallback"]) == ("own-process", "vllm", "own_memory_unseen")
    assert "NVML does not list this process" in sizing["fallback_reason"]
    assert sizing["own_process_bytes"] is None and sizing["kv_bytes_given_back"] == 0
    said = [line for line in unseen["log"].splitlines() if "VRAMLEDGER_VLLM_SIZING=own-process asked for" in line]
    assert len(said) == 1 and "NVML does not list this process" in said[0]
    assert ("runtime", "") not in entries(unseen) and unseen["ledger"]["live"]["process_bytes"] is None


def start_pair(cuda_path: ScenarioServer, tmp: Path, sizing: str) -> list:
    """Two instances on one device, at 0.7 and 0.2, started together (tests/vllm_cuda_path.py "pair")."""
    shared = tmp / f"pair-{sizing}"
    shared.mkdir(exist_ok=True)  # the same folder, so the same run, when the test asks for it again
    return [cuda_path.start("pair", "--utilization", str(u), "--peer", str(shared), "--slot", str(slot),
                            sizing=sizing) for slot, u in enumerate((0.7, 0.2))]


def pair(cuda_path: ScenarioServer, tmp: Path, sizing: str) -> tuple[dict, dict]:
    runs = start_pair(cuda_path, tmp, sizing)
    try:
        return finish(runs[0]), finish(runs[1])
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()


def test_two_instances_starting_together_each_get_what_they_get_alone(cuda_path, tmp):
    big_alone, small_alone = (cuda_path.result("pair_alone", "--utilization", u) for u in ("0.7", "0.2"))
    big, small = pair(cuda_path, tmp, "own-process")
    for together, by_itself in ((big, big_alone), (small, small_alone)):
        assert together["ledger"]["sizing"]["ran"] == "own-process"
        assert abs(blocks(together) - blocks(by_itself)) <= 1
    # vLLM's arithmetic, the same start: each charges itself what the other grew by while it profiled
    # (its weights and non-torch memory; the activation peaks were freed before either measured).
    big_v, small_v = pair(cuda_path, tmp, "vllm")
    for together, by_itself, other in ((big_v, big_alone, small_v), (small_v, small_alone, big_v)):
        sizing, per_block = together["ledger"]["sizing"], by_itself["ledger"]["kv_cache"]["bytes_per_block"]
        other_growth = other["ledger"]["profile"]["process_growth_bytes"]
        assert sizing["vllm_charged_bytes"] - sizing["own_process_bytes"] == other_growth > 0
        assert blocks(together) == (by_itself["available"] - other_growth) // per_block


def test_vllm_checks_its_start_snapshot_against_the_budget_as_before(cuda_path):
    # The one check own-process sizing leaves as it is: free memory at start below the budget.
    proc = cuda_path.start("alone", "--utilization", "0.9", sizing="own-process")
    _, err = proc.communicate()
    assert proc.returncode != 0 and "less than desired GPU memory utilization" in err


def test_a_setting_that_is_neither_sizing_falls_back_and_says_so(alone, cuda_path):
    typo = cuda_path.result("alone", sizing="own_process")
    sizing = typo["ledger"]["sizing"]
    assert (sizing["ran"], sizing["fallback"]) == ("vllm", "bad_setting")
    assert "VRAMLEDGER_VLLM_SIZING='own_process' is not one of vllm, own-process" == sizing["fallback_reason"]
    assert blocks(typo) == blocks(alone)
