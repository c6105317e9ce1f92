"""The plugin on vLLM's CUDA worker code, the device faked (tests/vllm_cuda_path.py): what vLLM's
memory profile measured for its process alone and from the device's free memory, and a draft model
loaded after vLLM sized its budget. Needs the vLLM venv; skipped, saying so, without it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest

from vramledger.ledger_document import SCHEMA_FILE
from vramledger.ledger_reading import parse_ledger

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import vllm_peer  # noqa: E402

pytestmark = [pytest.mark.slow,  # it starts vLLM's worker code in processes
              pytest.mark.skipif(vllm_peer.vllm_python() is None,
                                 reason="no vLLM venv (VLLM_VENV or .venv-vllm): run `make vllm-venv`")]
MiB, GiB = 1 << 20, 1 << 30
# What tests/vllm_cuda_path.py's device and stand-in runner do.
TOTAL, NEIGHBOUR_AT_START, CONTEXT = 4 * GiB, 512 * MiB, 300 * MiB
TARGET_W, DRAFT_W, ACTIVATIONS, WORKSPACES, GRAPHS = 8 * MiB, 2 * MiB, 64 * MiB, 32 * MiB, 16 * MiB
NEIGHBOUR_GROWTH = 256 * MiB


@pytest.fixture(scope="module", autouse=True)
def started(cuda_path):
    """Every run the module reads, started at once: they go side by side."""
    for scenario, sizing in (("neighbour", "vllm"), ("draft_after_profile", "vllm"), ("neighbour", "own-process"),
                             ("v2_runner", "vllm")):
        cuda_path.start(scenario, sizing=sizing)
    yield
    cuda_path.stop_unread()


@pytest.fixture(scope="module")
def neighbour(cuda_path):
    return cuda_path.result("neighbour")


@pytest.fixture(scope="module")
def draft_after_profile(cuda_path):
    return cuda_path.result("draft_after_profile")


def entries(ledger: dict) -> dict:
    return {(e["component"], e["model"]): e for e in ledger["entries"]}


def test_profile_entries_say_what_vllm_measured_for_itself_and_from_the_device(neighbour):
    ledger, device = neighbour["ledger"], neighbour["device"]
    e = entries(ledger)
    assert ledger["errors"] == [] and ledger["device"]["kind"] == "cuda"
    assert (e["runtime", ""]["bytes"], e["runtime", ""]["scope"]) == (CONTEXT, "process")  # NVML, own pid
    assert (e["weights", "target"]["bytes"], e["weights", "draft"]["bytes"]) == (TARGET_W, DRAFT_W)
    assert (e["activation_peak", ""]["bytes"], e["activation_peak", ""]["scope"]) == (ACTIVATIONS, "process")
    # vLLM's non-torch memory is the device's free memory minus torch's: the neighbour's growth during
    # the profile run is in it. The process's own growth over the same window is not.
    assert e["non_torch", ""]["scope"] == "device"
    assert e["non_torch", ""]["bytes"] == WORKSPACES + NEIGHBOUR_GROWTH
    profile = ledger["profile"]
    assert profile["non_torch_process_bytes"] == WORKSPACES
    assert profile["process_growth_bytes"] == TARGET_W + DRAFT_W + WORKSPACES
    assert profile["consumed_bytes"] == TARGET_W + DRAFT_W + WORKSPACES + NEIGHBOUR_GROWTH
    assert (e["cuda_graph", ""]["bytes"], e["cuda_graph", ""]["scope"]) == (GRAPHS, "device")
    assert profile["cuda_graph_estimate_counted"] and profile["cuda_graph_estimate_bytes"] == GRAPHS
    # The KV cache is what the worker allocated, in whole blocks of what vLLM found available.
    kv = ledger["kv_cache"]
    assert e["kv_cache", ""]["bytes"] == (kv["blocks_total"] + kv["blocks_reserved"]) * kv["bytes_per_block"] \
        == neighbour["available"]
    assert ledger["device"]["total_bytes"] == TOTAL
    assert ledger["device"]["free_at_start_bytes"] == TOTAL - NEIGHBOUR_AT_START - CONTEXT
    own = device["context"] + device["torch_reserved"] + device["non_torch"]
    assert ledger["live"]["process_bytes"] == own


def test_budget_counts_what_vllm_charged_it_and_nothing_else(neighbour):
    ledger = neighbour["ledger"]
    assert ledger["budget"]["sized_by"] == "utilization"
    assert ledger["budget"]["bytes"] == neighbour["requested_memory"] == TOTAL // 2
    e = entries(ledger)
    assert not e["runtime", ""]["in_budget"]  # held before vLLM's start snapshot
    assert all(e[k]["in_budget"] for k in e if k != ("runtime", ""))
    assert sum(x["bytes"] for x in ledger["entries"] if x["in_budget"]) == ledger["budget"]["bytes"]


def test_draft_loaded_after_vllm_sized_its_budget_is_outside_it(draft_after_profile):
    ledger = draft_after_profile["ledger"]
    e = entries(ledger)
    assert e["weights", "target"]["in_budget"] and not e["weights", "draft"]["in_budget"]
    assert e["weights", "draft"]["bytes"] == DRAFT_W
    in_budget = sum(x["bytes"] for x in ledger["entries"] if x["in_budget"])
    assert in_budget == ledger["budget"]["bytes"]  # the KV cache took the draft's share
    assert ledger["declared_bytes"] - ledger["budget"]["bytes"] == CONTEXT + DRAFT_W
    assert ledger["profile"]["non_torch_process_bytes"] == e["non_torch", ""]["bytes"]  # no neighbour


@pytest.fixture(scope="module")
def neighbour_own_process(cuda_path):
    return cuda_path.result("neighbour", sizing="own-process")


def test_the_recorded_ledgers_are_what_the_plugin_answers(neighbour, draft_after_profile, neighbour_own_process):
    # tests/data/vllm_ledger_cuda_*.json feed the exporter's tests: they must stay what the plugin says.
    for name, run in (("neighbour", neighbour), ("draft_after_profile", draft_after_profile),
                      ("neighbour_own_process", neighbour_own_process)):
        doc = json.loads((ROOT / "tests" / "data" / f"vllm_ledger_cuda_{name}.json").read_text())
        [recorded] = doc["ranks"]
        assert (doc["version"], doc["engine"]) == (1, "vllm")
        for key in ("entries", "budget", "declared_bytes", "kv_cache", "profile", "sizing", "device"):
            assert run["ledger"][key] == recorded[key], (name, key)


def test_the_plugins_ledgers_meet_the_shipped_schema(neighbour, draft_after_profile, neighbour_own_process):
    validator = jsonschema.Draft202012Validator(json.loads((ROOT / "vramledger" / SCHEMA_FILE).read_text()))
    for run in (neighbour, draft_after_profile, neighbour_own_process):
        assert [e.message for e in validator.iter_errors(run["ledger"])] == []
        assert parse_ledger(run["ledger"]) is run["ledger"]  # and a rank's ledger reads (ledger_reading.py)
        assert run["ledger"]["profile"] is not None  # the plugin-only parts, filled in


def test_a_graph_capture_only_measuring_is_not_the_graphs_memory(cuda_path):
    # vLLM's V2 runner estimates its graphs' memory with capture_model(profile_only=True) and throws
    # them away; only the capture that keeps them is the cuda_graph entry.
    run = cuda_path.result("v2_runner")
    before, after = entries(run["ledger_before_capture"]), entries(run["ledger"])
    assert run["ledger"]["errors"] == []
    assert ("cuda_graph", "") not in before  # the estimate's capture ran, and was not noted
    assert run["ledger_before_capture"]["profile"]["cuda_graph_estimate_bytes"] == GRAPHS
    assert (after["cuda_graph", ""]["bytes"], after["cuda_graph", ""]["in_budget"]) == (GRAPHS, True)
    kv = run["ledger"]["kv_cache"]  # every block allocated: those handed out and vLLM's null block
    assert run["device"]["torch_reserved"] - (kv["blocks_total"] + kv["blocks_reserved"]) * kv["bytes_per_block"] \
        == TARGET_W + DRAFT_W + GRAPHS  # one pool of graphs kept
