"""The budget, the KV cache size and the startup checks, with the messages users read."""
from __future__ import annotations

import mem_hog
import pytest
from test_device import FakeCuda, props, two_gpus

from vramledger.worker.config import EngineConfig
from vramledger.worker.memory.device import CpuDevice, CudaDevice
from vramledger.worker.memory.plan import (
    CPU_DEFAULT_KV_BYTES,
    MemoryPlanError,
    blocks_per_sequence,
    budget_bytes,
    check_free_memory,
    max_usable_kv_bytes,
    plan_kv_blocks,
)

MiB, GiB = 1 << 20, 1 << 30
UNLIMITED = 1 << 50


@pytest.fixture(scope="module")
def cpu():
    return CpuDevice()


# --- budget ---
def test_explicit_kv_cache_memory(cpu):
    assert budget_bytes(cpu, None, 3 * GiB, GiB, UNLIMITED) == (4 * GiB, 3 * GiB)
    # the explicit size overrides the utilization, and is capped by what can be used
    assert budget_bytes(cpu, 0.5, 3 * GiB, GiB, 2 * GiB) == (3 * GiB, 2 * GiB)


def test_cpu_default_never_above_2_gib_of_kv(cpu):
    assert budget_bytes(cpu, None, None, 5 * GiB, UNLIMITED) == (5 * GiB + CPU_DEFAULT_KV_BYTES, 2 * GiB)
    assert budget_bytes(cpu, None, None, GiB, 300 * MiB) == (GiB + 300 * MiB, 300 * MiB)


def test_cpu_with_utilization(cpu):
    budget, kv = budget_bytes(cpu, 0.5, None, GiB, UNLIMITED)
    assert budget == int(cpu.total_bytes() * 0.5) and kv == budget - GiB
    assert budget_bytes(cpu, 0.5, None, GiB, 100 * MiB) == (budget, 100 * MiB)  # KV capped by max usable


def test_cuda_default_utilization(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    FakeCuda(monkeypatch, props(), total=80 * GiB)
    device = CudaDevice(0, nvml=two_gpus())
    default = EngineConfig().budget_utilization("cuda")  # the one place it is resolved
    assert budget_bytes(device, default, None, 10 * GiB, UNLIMITED) == (72 * GiB, 62 * GiB)
    assert budget_bytes(device, 0.5, None, 10 * GiB, 8 * GiB) == (40 * GiB, 8 * GiB)
    with pytest.raises(ValueError, match="needs a utilization"):  # unresolved: refused, never guessed
        budget_bytes(device, None, None, 10 * GiB, UNLIMITED)


def test_budget_below_non_kv_says_how_much_to_raise(cpu):
    total = cpu.total_bytes()
    with pytest.raises(MemoryPlanError) as error:
        budget_bytes(cpu, 0.01, None, int(total * 0.2), UNLIMITED)
    message = str(error.value)
    assert "--memory-utilization 0.01" in message and "before any KV cache" in message
    assert "Raise --memory-utilization by at least 0.190 to 0.200" in message
    assert "--kv-cache-memory" in message
    with pytest.raises(MemoryPlanError, match="Even --memory-utilization 1.0 cannot hold it"):
        budget_bytes(cpu, 0.9, None, total + GiB, UNLIMITED)


def test_max_usable_kv_bytes():
    assert blocks_per_sequence(1024, 16, 4) == 65  # 1028 slots
    assert max_usable_kv_bytes(8, 1024, 16, MiB, 4) == 8 * 65 * MiB


# --- free memory at start ---
def test_free_memory_below_budget_names_the_other_processes(cpu):
    with mem_hog.hog(GiB) as proc:
        others = cpu.other_processes()
        free = cpu.free_bytes()
        budget = free + 2 * GiB
        with pytest.raises(MemoryPlanError) as error:
            check_free_memory(cpu, budget, budget / cpu.total_bytes(), others, free_bytes=free)
    message = str(error.value)
    assert f"pid {proc.pid} (python" in message and "GiB" in message
    assert "Free memory on cpu:0" in message and "Lower --memory-utilization to at most" in message
    check_free_memory(cpu, GiB, 0.01, others)  # fits: no error
    check_free_memory(cpu, free + GiB, None, [], free_bytes=free, own_bytes=2 * GiB)  # ours counts


def test_free_memory_message_for_explicit_budget(cpu):
    with pytest.raises(MemoryPlanError) as error:
        check_free_memory(cpu, 10 * GiB, None, [], free_bytes=7 * GiB, own_bytes=GiB)
    message = str(error.value)
    assert "Lower --kv-cache-memory by at least 2.00 GiB" in message
    assert "No other process is visible" in message


# --- KV blocks ---
def test_plan_kv_blocks():
    assert plan_kv_blocks(100 * MiB + 5, MiB, 16, 1024, 4) == 100
    with pytest.raises(MemoryPlanError, match="No memory is left for the KV cache"):
        plan_kv_blocks(-GiB, MiB, 16, 1024, 0)
    with pytest.raises(ValueError):
        plan_kv_blocks(GiB, 0, 16, 1024, 0)


def test_kv_that_cannot_hold_one_sequence_names_the_largest_max_model_len():
    with pytest.raises(MemoryPlanError) as error:
        plan_kv_blocks(50 * MiB, MiB, 16, 1024, 4)  # 50 blocks = 800 slots < 1028
    message = str(error.value)
    assert "cannot hold one sequence of --max-model-len 1024 plus 4 speculative lookahead slots" in message
    assert "The largest --max-model-len that fits is 796" in message
    assert "15.0 MiB more" in message  # 65 - 50 blocks


def test_kv_short_only_by_the_lookahead_suggests_fewer_speculative_tokens():
    with pytest.raises(MemoryPlanError) as error:
        plan_kv_blocks(64 * MiB, MiB, 16, 1022, 4)  # 1024 slots: 1022 fit, 1026 do not
    assert "lower --num-speculative-tokens to at most 2" in str(error.value)
