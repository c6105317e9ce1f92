"""`python -m vramledger.worker selfcheck` on the CPU: the whole run passes but for vLLM's scenario, which needs a
GPU and says so; each seed scenario fails on the worker it exists to catch; whatever happens, every
process it started is gone afterwards."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from selfcheck_helpers import DraftLeftOutLauncher, HoldingLauncher, cpu_context
from test_device import FakeNvml, fake_cuda, gpu  # noqa: F401 (fake_cuda: a fixture)

from vramledger.worker import cli
from vramledger.worker.config import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL
from vramledger.worker.memory.profiler import module_tensor_bytes
from vramledger.worker.models.loader import load_model
from vramledger.worker.selfcheck import processes, scenario_draft, scenario_ledger, scenario_neighbours
from vramledger.worker.selfcheck import run as selfcheck_run
from vramledger.worker.selfcheck.checkpoints import (
    LARGE_SHAPES,
    build_random_checkpoint,
    kv_bytes_per_block,
    weight_bytes,
)
from vramledger.worker.selfcheck.processes import Processes, wait_until
from vramledger.worker.selfcheck.report import (
    FAIL,
    PASS,
    SKIP,
    CannotRun,
    Check,
    ScenarioResult,
    exit_code,
    format_table,
    to_json,
)
from vramledger.worker.selfcheck.scale import PAIR_SHARES, make_scale
from vramledger.worker.selfcheck.view import DeviceView, SampledPeak

pytestmark = pytest.mark.slow  # it starts processes (`make test-fast` leaves it out)

ROOT = Path(__file__).resolve().parent.parent
MiB, GiB = 1 << 20, 1 << 30


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def checks(result: ScenarioResult) -> dict[str, str]:
    return {c.name: c.status for c in result.checks}


# --- the real thing, on the CPU ----------------------------------------------------------------
def test_selfcheck_passes_on_the_cpu_but_for_vllm_and_leaves_no_process(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "vramledger.worker", "selfcheck", "--device", "cpu", "--json",
                           "--workdir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    doc = json.loads(proc.stdout)
    table = format_table([ScenarioResult(s["number"], s["title"], [Check(**c) for c in s["checks"]],
                                         s["skipped"], s["error"]) for s in doc["scenarios"]])
    assert proc.returncode == 3, f"{table}\n{proc.stderr[-3000:]}"  # a scenario skipped is never passed
    assert [(s["number"], s["status"]) for s in doc["scenarios"]] == [(n, PASS) for n in (1, 2, 3, 4)] + [
        (5, SKIP), (6, SKIP)]
    assert not doc["passed"] and doc["summary"] == "4 passed, 0 failed, 2 skipped"
    assert doc["scenarios"][4]["skipped"].startswith("needs a GPU: vLLM's CPU build runs no memory profile")
    assert doc["scenarios"][5]["skipped"].startswith("needs a CUDA device, and there is none here")
    assert doc["scenarios"][5]["checks"] == []  # a skip line, with no check that could read as passed
    names = {p["name"] for p in doc["processes"]}
    assert {"s1-worker", "s2-no-draft", "s2-draft", "s3-neighbour", "s4-exporter"} <= names
    assert all(gone(p["pid"]) for p in doc["processes"]), doc["processes"]
    by_number = {s["number"]: s for s in doc["scenarios"]}
    fill = next(c for c in by_number[1]["checks"] if c["name"] == "load fills the KV cache")
    assert fill["values"]["max_fill"] >= 0.95
    blocks = next(c for c in by_number[2]["checks"] if c["name"] == "KV blocks with the draft")
    assert blocks["values"]["draft_weights_bytes"] > 4 * MiB  # the shipped draft, read from its checkpoint


def run_scenario(tmp_path, launcher, number: int, scenario, **lengths: int):
    """One scenario on the CPU with the given worker launcher (at the default scale unless `lengths`
    say otherwise); its result and context."""
    ctx = cpu_context(tmp_path, launcher, **lengths)
    result = ScenarioResult(number, scenario.TITLE)
    with ctx.procs:
        selfcheck_run.attempt(ctx, result, lambda: scenario.run(ctx, result))
    return result, ctx


def test_a_worker_holding_memory_outside_its_ledger_fails_scenario_1(tmp_path):
    # Half the default lengths, a quarter of the tokens to load: 64 MiB off the ledger shows at any size.
    result, ctx = run_scenario(tmp_path, HoldingLauncher(mib=64), 1, scenario_ledger, max_model_len=256,
                               max_num_seqs=4)
    assert result.status == FAIL, format_table([result])
    got = checks(result)
    assert got["device view at idle"] == FAIL and got["device view at peak"] == FAIL
    assert got["peak within the budget"] == FAIL
    assert got["load fills the KV cache"] == PASS  # the load did its part: the ledger is what failed
    assert all(gone(p.pid) for p in ctx.procs.started)


def test_a_plan_that_leaves_the_draft_out_fails_scenario_2(tmp_path):
    result, ctx = run_scenario(tmp_path, DraftLeftOutLauncher(), 2, scenario_draft)
    assert result.status == FAIL, format_table([result])
    got = checks(result)
    assert got["same budget"] == PASS and got["draft weights in the ledger"] == PASS
    assert got["KV bytes per block"] == FAIL and got["KV blocks with the draft"] == FAIL
    blocks = next(c for c in result.checks if c.name == "KV blocks with the draft").values
    assert blocks["measured_blocks"] > 1.1 * blocks["expected_blocks"]
    assert all(gone(p.pid) for p in ctx.procs.started)


def test_sigterm_mid_run_stops_every_process_it_started(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "vramledger.worker", "selfcheck", "--device", "cpu",
                             "--workdir", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    me = psutil.Process(proc.pid)
    wait_until(lambda: [c for c in me.children(recursive=True) if "serve" in " ".join(c.cmdline())], 120,
               "selfcheck to start its first worker", proc)  # SIGTERM comes while that worker loads
    started = me.children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert all(gone(c.pid) for c in started), [c.pid for c in started if not gone(c.pid)]


# --- the parts, without workers ------------------------------------------------------------------
def test_closing_gives_the_processes_one_timeout_between_them(tmp_path, monkeypatch):
    given = []
    real = processes.stop_group
    monkeypatch.setattr(processes, "stop_group", lambda popen, timeout, name: given.append(timeout) or
                        real(popen, timeout, name))
    ignore_term = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print('ready', flush=True); time.sleep(300)")
    with Processes(tmp_path) as procs:
        stubborn = [procs.start(f"stubborn-{i}", [sys.executable, "-c", ignore_term]) for i in range(3)]
        wait_until(lambda: all("ready" in p.log_tail() for p in stubborn), 30, "three ready lines", interval=0.05)
        procs.close(timeout=2.0)
    # The first waits out the timeout; the others, SIGTERMed at the same moment, get only what is left
    # (at least a second), not a timeout each.
    assert given[0] <= 2.0 and given[1:3] == [1.0, 1.0], given
    assert all(gone(p.pid) for p in stubborn)


def test_processes_stop_whole_groups_and_kill_what_ignores_sigterm(tmp_path):
    pid_file = tmp_path / "grandchild"
    with Processes(tmp_path) as procs:
        shell = procs.start("shell", ["sh", "-c", f"sleep 300 & echo $! > {pid_file}; wait"])
        ignore_term = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                       "print('ready', flush=True); time.sleep(300)")
        stubborn = procs.start("stubborn", [sys.executable, "-c", ignore_term])
        wait_until(lambda: pid_file.exists() and pid_file.read_text().strip() and "ready" in stubborn.log_tail(),
                   10, "the grandchild's pid and the stubborn child's ready line", interval=0.05)
        grandchild = int(pid_file.read_text())
        procs.stop(stubborn, timeout=1)
        assert gone(stubborn.pid)
    assert gone(shell.pid) and gone(grandchild)


def test_exit_codes_table_and_json():
    ok = ScenarioResult(1, "a", [Check("x", "1", "1", PASS)])
    bad = ScenarioResult(2, "b", [Check("y", "2", "1", FAIL)])
    skipped = ScenarioResult(3, "c", skipped="no GPU")
    stopped = ScenarioResult(4, "d", [Check("z", "1", "1", PASS)], error="worker exited")
    assert exit_code([ok]) == 0
    assert exit_code([ok, skipped]) == 3  # skipped is never passed
    assert exit_code([ok, bad, skipped]) == 1 and exit_code([stopped]) == 1
    assert [r.status for r in (ok, bad, skipped, stopped)] == [PASS, FAIL, SKIP, FAIL]
    table = format_table([ok, bad, skipped, stopped])
    assert "SKIP" in table and "no GPU" in table and "worker exited" in table
    assert table.splitlines()[-1] == "selfcheck: 1 passed, 2 failed, 1 skipped (scenarios)"
    doc = json.loads(to_json([ok, skipped], {"device": "cpu"}))
    assert doc["passed"] is False and doc["exit_code"] == 3
    assert [s["status"] for s in doc["scenarios"]] == [PASS, SKIP]


def test_scenarios_after_a_failure_are_skipped_unless_keep_going(tmp_path, monkeypatch):
    ran = []

    def failing(ctx, result):
        ran.append(1)
        result.add(Check("x", "2", "1", FAIL))

    monkeypatch.setattr(scenario_ledger, "run", failing)
    monkeypatch.setattr(scenario_draft, "run", lambda ctx, result: ran.append(2))
    def no_room(ctx):
        raise CannotRun("no room")

    monkeypatch.setattr(scenario_neighbours, "set_up", no_room)
    ctx = cpu_context(tmp_path)
    results = selfcheck_run.run_scenarios(ctx)
    assert ran == [1] and [r.status for r in results] == [FAIL, SKIP, SKIP, SKIP, SKIP, SKIP]
    assert "scenario 1 failed" in results[1].skipped and "scenario 1 failed" in results[5].skipped
    ran.clear()
    results = selfcheck_run.run_scenarios(ctx, keep_going=True)
    assert ran == [1, 2] and [r.status for r in results] == [FAIL, SKIP, SKIP, SKIP, SKIP, SKIP]
    assert results[4].skipped.startswith("needs a GPU") and results[5].skipped.startswith("needs a CUDA device")
    assert results[2].skipped == "no room" and "no room" in results[3].skipped


def test_scenario_3_is_skipped_saying_why_when_the_device_has_no_room(tmp_path, monkeypatch):
    ctx = cpu_context(tmp_path)
    monkeypatch.setattr(ctx.view, "free_bytes", lambda: 100 * MiB)
    with pytest.raises(CannotRun, match="100.0 MiB is free"):
        scenario_neighbours.set_up(ctx)
    assert ctx.procs.started == []


def test_sizes_read_from_the_checkpoints_match_the_loaded_models():
    for path, layers in ((DEFAULT_MODEL, 8), (DEFAULT_DRAFT_MODEL, 1)):
        model = load_model(path, torch.float32, torch.device("cpu"))
        # the model also holds its rotary buffers
        # the tied head's packed copy counted too (float32 on the CPU)
        assert weight_bytes(path, 4, packed=True) == pytest.approx(module_tensor_bytes(model), abs=1024)
        assert weight_bytes(path, 4) == pytest.approx(module_tensor_bytes(load_model(
            path, torch.float32, torch.device("cpu"), pack=False)), abs=1024)
        assert kv_bytes_per_block(path, 16, 4) == 4 * torch.Size(model.kv_cache_shape(16)).numel()
        assert kv_bytes_per_block(path, 16, 2) == layers * 2 * 4 * 32 * 16 * 2


def test_large_random_checkpoints_load_and_are_built_once(tmp_path):
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    path = build_random_checkpoint(tmp_path / "t", DEFAULT_MODEL, shape, seed=0)
    model = load_model(str(path), torch.bfloat16, torch.device("cpu"))
    assert weight_bytes(path, 2) == pytest.approx(module_tensor_bytes(model), abs=1024)
    assert model.config.architectures == ["Qwen2ForCausalLM"] and model.config.vocab_size == 2048
    stamp = [p.stat().st_mtime_ns for p in sorted(path.glob("*.safetensors"))]
    build_random_checkpoint(tmp_path / "t", DEFAULT_MODEL, shape, seed=0)
    assert [p.stat().st_mtime_ns for p in sorted(path.glob("*.safetensors"))] == stamp


def test_scale_large_builds_the_pair_and_sizes_from_it(tmp_path, monkeypatch):
    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}
    monkeypatch.setitem(LARGE_SHAPES, "target", tiny)
    monkeypatch.setitem(LARGE_SHAPES, "draft", {**tiny, "num_hidden_layers": 1})
    pair = selfcheck_run.large_models(str(tmp_path), "cpu")
    assert [p.name for p in pair] == ["large-target", "large-draft"]
    scale = make_scale("cuda", "cuda:0", 80 * GiB, 2, scale="large", large_models=pair)
    assert (scale.model, scale.draft_model, scale.max_num_seqs) == (str(pair[0]), str(pair[1]), 64)
    # bf16 KV: 2 x layers x 2 kv heads x 16 head dim x 2 bytes per token, 16 tokens a block
    assert scale.block_bytes(draft=True) == 16 * 2 * (2 + 1) * 2 * 16 * 2


# --- the CUDA path's logic, on the CPU ------------------------------------------------------------
def test_cuda_scale_takes_shares_of_the_device_and_uncaps_the_kv_cache():
    total = 80 * GiB
    scale = make_scale("cuda", "cuda:0", total, 2)
    assert scale.neighbour_bytes == int(0.04 * total) and scale.peak_slack == 0
    for share, flags in zip(PAIR_SHARES, scale.pair_flags(total), strict=True):
        assert flags[:2] == ["--memory-utilization", str(share)]
        seqs = int(flags[flags.index("--max-num-seqs") + 1])
        assert scale.usable_kv_bytes(True, seqs) >= share * total  # the budget, not the cap, sizes it
    assert scale.pair_needs_free_bytes(total) > (sum(PAIR_SHARES) + 0.04) * total
    assert scale.fill_kv_bytes() < scale.usable_kv_bytes(True)  # the load must fill it
    cpu = make_scale("cpu", "cpu", 24 * GiB, 4)
    assert [f[0] for f in cpu.pair_flags(24 * GiB)] == ["--kv-cache-memory"] * 2


def test_cuda_view_reads_nvml_per_process_and_samples_the_peak(fake_cuda):  # noqa: F811
    from vramledger.worker.memory.device import CudaDevice

    other = 424_242
    nvml = FakeNvml([gpu("GPU-bbbb-2222", "00000000:3B:00.0", [(other, 5 * GiB)])])
    view = DeviceView(CudaDevice(0, nvml=nvml))
    assert view.kind == "cuda" and view.process_bytes(other) == 5 * GiB
    assert view.process_bytes(1) is None
    watch = view.peak(other)
    assert isinstance(watch, SampledPeak)
    nvml.gpus[0]["procs"] = [(other, 7 * GiB)]
    time.sleep(0.3)
    nvml.gpus[0]["procs"] = [(other, 6 * GiB)]
    assert watch.stop() == 7 * GiB


def test_selfcheck_on_a_missing_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli.main(["selfcheck", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
