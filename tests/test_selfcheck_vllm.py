"""Selfcheck's scenario 5, vLLM's own ledger: its checks against recorded ledgers of the plugin on vLLM's
CUDA worker code (tests/data/vllm_ledger_cuda_*.json, from tests/vllm_cuda_path.py), and every reason it
is skipped, said. It runs for real only on a GPU host with vLLM and the plugin installed."""
from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import pytest
from selfcheck_helpers import cpu_context

from vramledger.ledger_reading import LedgerError
from vramledger.worker.selfcheck import scenario_vllm
from vramledger.worker.selfcheck.report import FAIL, PASS, CannotRun, ScenarioResult

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import vllm_peer  # noqa: E402

MiB = 1 << 20
DATA = ROOT / "tests" / "data"
# What tests/vllm_cuda_path.py's stand-in runner loads for the target and the draft.
STAND_IN_WEIGHTS = {"target": 8 * MiB, "draft": 2 * MiB}


def checked(name: str) -> dict[str, str]:
    """Scenario 5's checks of a recorded ledger, the device's view of the rank being what NVML told it."""
    doc = scenario_vllm.server_ledger(json.loads((DATA / f"vllm_ledger_cuda_{name}.json").read_text()))
    rank = doc["ranks"][0]
    result = ScenarioResult(5, scenario_vllm.TITLE)
    kv = rank["kv_cache"]  # vLLM's num_gpu_blocks: the blocks it hands out and its null block
    scenario_vllm.check_ledger(result, doc, kv["blocks_total"] + kv["blocks_reserved"], rank["live"]["process_bytes"],
                               STAND_IN_WEIGHTS, rank["budget"]["utilization"])
    return {c.name: c.status for c in result.checks}


def test_a_neighbour_charged_at_start_fails_and_shows_in_the_process_view():
    got = checked("neighbour")
    # vLLM counted the neighbour's 256 MiB as its own non-torch memory: its ledger is that much above
    # what NVML sees of its process.
    assert got.pop("no neighbour charged") == FAIL and got.pop("device view at idle") == FAIL
    assert set(got.values()) == {PASS}, got


def test_a_draft_loaded_after_the_budget_fails():
    got = checked("draft_after_profile")
    assert got.pop("draft in the budget") == FAIL
    assert set(got.values()) == {PASS}, got


def test_a_document_that_is_no_ledger_is_refused_naming_the_route_and_the_field():
    doc = json.loads((DATA / "vllm_ledger_cuda_neighbour.json").read_text())
    doc["ranks"][0]["kv_cache"]["bytes_per_block"] = -1
    with pytest.raises(LedgerError, match=r"vLLM's GET /vramledger/memory is no ledger: .*bytes_per_block"):
        scenario_vllm.server_ledger(doc)


def test_on_the_cpu_it_is_skipped_saying_why(tmp_path):
    ctx = cpu_context(tmp_path)
    with pytest.raises(CannotRun, match="needs a GPU: vLLM's CPU build runs no memory profile"):
        scenario_vllm.run(ctx, ScenarioResult(5, scenario_vllm.TITLE))
    assert ctx.procs.started == []


def test_without_vllm_it_is_skipped_saying_how_to_name_it():
    gpu_host = SimpleNamespace(view=SimpleNamespace(kind="cuda"), vllm_python=None)  # this Python: no vLLM
    with pytest.raises(CannotRun, match="vLLM is not installed for this Python: .* --vllm-python"):
        scenario_vllm.run(gpu_host, ScenarioResult(5, scenario_vllm.TITLE))


def test_the_plugin_must_be_there_in_this_version_on_a_supported_vllm():
    points = {"vllm.general_plugins": ["vramledger"], "vllm.endpoint_plugins": ["vramledger"]}
    good = {"vllm": "0.32.0", "plugin": "0.1.0", "entry_points": points}
    scenario_vllm.check_environment("vllm-python", good, "0.1.0")  # nothing to say
    for found, why in (({"plugin": None}, "not installed for vllm-python"),
                       ({"entry_points": {**points, "vllm.endpoint_plugins": []}}, "not installed"),
                       ({"plugin": "0.0.9"}, "has vramledger 0.0.9, this selfcheck is 0.1.0"),
                       ({"vllm": "0.99.0"}, "vLLM 0.99.0 is not a version this plugin was built for")):
        with pytest.raises(CannotRun, match=why):
            scenario_vllm.check_environment("vllm-python", good | found, "0.1.0")


@pytest.mark.skipif(vllm_peer.vllm_python() is None, reason="no vLLM venv (VLLM_VENV or .venv-vllm)")
def test_the_probe_reads_a_real_vllm_environment():
    found = scenario_vllm.probe(str(vllm_peer.vllm_python()))
    assert found["vllm"] == "0.32.0"
    assert ("vramledger" in found["entry_points"]["vllm.general_plugins"]) == (found["plugin"] is not None)
    if vllm_peer.plugin_installed(vllm_peer.vllm_python()):  # `make test` installed this checkout there
        assert found["plugin"] == version("vramledger")
