"""Snapshots, measurement windows and the ledger, with real memory and real second processes."""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import mem_hog
import psutil
import pytest
import torch
from test_device import FakeCuda, props, two_gpus
from torch import nn

from vramledger.identity import container_id_from
from vramledger.processes import ProcessMemory
from vramledger.worker.memory.device import CpuDevice, CudaDevice
from vramledger.worker.memory.ledger import Ledger, format_table, plot, summary_line
from vramledger.worker.memory.profiler import (
    MemorySnapshot,
    PeakSampler,
    measure_weights,
    profile_window,
    runtime_bytes,
)

MiB, GiB = 1 << 20, 1 << 30
LEDGER_DOC = Path(__file__).parents[1] / "docs" / "ledger.md"


@pytest.fixture(scope="module")
def cpu():
    return CpuDevice()


# --- profile windows on the CPU ---
def test_window_separates_transient_peak_from_lasting_growth(cpu):
    libc = mem_hog._libc()
    with profile_window(cpu) as result:
        kept = libc.malloc(256 * MiB)
        libc.memset(kept, 1, 256 * MiB)  # touched: resident
        transient = torch.ones(GiB // 4, dtype=torch.float32)  # 1 GiB, touched, then gone
        del transient
    try:
        assert result.non_torch_bytes == pytest.approx(256 * MiB, rel=0.05)
        assert result.activation_peak_bytes == pytest.approx(GiB, rel=0.05)
    finally:
        libc.free(kept)


def test_second_process_allocating_during_window_is_not_ours(cpu):
    with profile_window(cpu) as result:
        proc = mem_hog.start(GiB)  # the neighbour allocates while we profile
        try:
            hog_rss = psutil.Process(proc.pid).memory_info().rss
            seen_by_device = {p.pid for p in cpu.other_processes()}
        except BaseException:
            mem_hog.stop(proc)
            raise
    try:
        assert hog_rss >= 0.95 * GiB and proc.pid in seen_by_device
        assert proc.poll() is None, "the hog must still hold its memory when the window closes"
        assert result.non_torch_bytes < 64 * MiB
        assert result.activation_peak_bytes < 64 * MiB
    finally:
        mem_hog.stop(proc)


def test_foreign_memory_at_start_is_not_our_runtime(cpu):
    own_before = cpu.process_bytes()
    with mem_hog.hog(GiB) as proc:
        ledger = Ledger.at_start(cpu, "target", "draft")
        foreign = {p.pid: p for p in ledger.foreign_at_start_processes}
        assert foreign[proc.pid].bytes >= 0.95 * GiB
        assert ledger.foreign_at_start_bytes >= 0.95 * GiB
        assert ledger.bytes_of("runtime") < own_before + 64 * MiB
        assert cpu.process_bytes() < own_before + 64 * MiB


def test_peak_sampler_catches_a_transient_allocation(cpu):
    # The fallback where /proc/self/clear_refs cannot reset the kernel's high-water mark.
    libc = mem_hog._libc()
    sampler = PeakSampler(cpu).start()
    start = cpu.process_bytes()
    block = libc.malloc(256 * MiB)
    libc.memset(block, 1, 256 * MiB)
    time.sleep(0.05)
    libc.free(block)
    assert sampler.stop() >= start + 240 * MiB


def test_snapshot_and_runtime(cpu):
    snap = MemorySnapshot.take(cpu)
    assert snap.total >= snap.free > 0 and snap.process_peak >= snap.process > 0
    assert runtime_bytes(snap) == snap.process
    assert snap.torch_allocated == snap.torch_reserved == snap.torch_peak == 0


# --- weights ---
def _tied_model() -> nn.Module:
    model = nn.Sequential(nn.Embedding(4096, 2048), nn.LayerNorm(2048), nn.Linear(2048, 4096, bias=False))
    model[2].weight = model[0].weight  # tied: one storage
    model.register_buffer("table", torch.randn(1024, 1024))
    model.register_buffer("table_view", model.table[:16])  # a view: the same storage
    return model


def test_measure_weights_counts_parameters_and_buffers_once(cpu, caplog):
    with caplog.at_level(logging.WARNING):
        model, nbytes = measure_weights(cpu, _tied_model)
    assert nbytes == (4096 * 2048 + 2 * 2048 + 1024 * 1024) * 4
    assert "RSS grew" not in caplog.text  # the RSS delta agrees with the parameters


def test_measure_weights_warns_when_rss_disagrees(cpu, caplog):
    kept = []

    def load():
        kept.append(torch.ones(32 * MiB))  # 128 MiB the model does not own
        return nn.Linear(256, 256)

    with caplog.at_level(logging.WARNING):
        _, nbytes = measure_weights(cpu, load)
    assert nbytes == (256 * 256 + 256) * 4 and "RSS grew" in caplog.text
    with pytest.raises(TypeError, match="nn.Module"):
        measure_weights(cpu, lambda: "not a model")


# --- the CUDA arithmetic, on patched torch.cuda counters and a fake NVML ---
def test_cuda_window_and_weights(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cuda = FakeCuda(monkeypatch, props())
    nvml = two_gpus(ours=GiB)
    device = CudaDevice(0, nvml=nvml)

    def set_process_bytes(n):
        nvml.gpus[1]["procs"][0] = (nvml.gpus[1]["procs"][0][0], n)

    def load():
        cuda.allocate(3 * GiB)
        set_process_bytes(4 * GiB)
        return "model"

    assert measure_weights(device, load) == ("model", 3 * GiB)
    with profile_window(device) as result:
        cuda.allocate(2 * GiB)  # activations: allocated, then freed; reserved stays cached
        cuda.allocated -= 2 * GiB
        set_process_bytes(4 * GiB + 2 * GiB + 100 * MiB)  # + cached activations + 100 MiB of NCCL, cuBLAS
    assert result.activation_peak_bytes == 2 * GiB
    assert result.non_torch_bytes == 100 * MiB


# --- the ledger ---
def _ledger(device) -> Ledger:
    ledger = Ledger(device=device, total_bytes=16 * GiB, free_at_start_bytes=15 * GiB,
                    target_model="/models/target", draft_model="/models/draft",
                    budget_bytes=4 * GiB, max_model_len=1024, num_speculative_tokens=4)
    ledger.record("runtime", 300 * MiB)
    ledger.record("weights", GiB, "target")
    ledger.record("weights", GiB // 2, "draft")
    ledger.record("kernels", 0)
    ledger.record("compiled", 0)
    ledger.record("activation_peak", 100 * MiB)
    ledger.record("non_torch", 10 * MiB)
    ledger.record("allocator", 12 * MiB)
    ledger.record("sequence_state", 300 * 1024)
    ledger.record("server", 2 * MiB)
    ledger.set_kv_cache(block_size=16, bytes_per_block=MiB, blocks_total=2000)
    return ledger


def _shape(value):
    """The key structure of a JSON value: dict keys recursively, the first item of lists."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return None


def test_ledger_document_matches_docs(cpu):
    documented = json.loads(re.search(r"```json\n(.*?)```", LEDGER_DOC.read_text(), re.DOTALL).group(1))
    ledger = _ledger(cpu)
    ledger.foreign_at_start_processes = [ProcessMemory(999, "python", 1_900_000_000, "nvml")]
    doc = ledger.to_dict(process_bytes=5 * GiB, blocks_used=7, blocks_cached=3)
    assert _shape(doc) == _shape(documented)
    assert [e["component"] for e in doc["entries"]] == [e["component"] for e in documented["entries"]]
    assert doc["declared_bytes"] == sum(e["bytes"] for e in doc["entries"]) == doc["live"]["declared_bytes"]
    assert doc["kv_cache"] == {"block_size": 16, "bytes_per_block": MiB, "blocks_total": 2000,
                               "blocks_used": 7, "blocks_cached": 3, "blocks_free": 1990,
                               "capacity_tokens": 32000}
    assert doc["live"]["unaccounted_bytes"] == 5 * GiB - doc["declared_bytes"]
    json.dumps(doc)  # serialisable as is


def test_ledger_unaccounted_clamps_and_live_values(cpu):
    ledger = _ledger(cpu)
    assert ledger.to_dict(process_bytes=GiB)["live"]["unaccounted_bytes"] == 0
    doc = ledger.to_dict(blocks_used=42, blocks_cached=8)  # as the engine's snapshot gives them
    assert doc["kv_cache"]["blocks_used"] == 42 and doc["kv_cache"]["blocks_cached"] == 8
    assert doc["kv_cache"]["blocks_free"] == 2000 - 42 - 8
    assert doc["live"]["process_bytes"] > 0


def test_ledger_record_replaces_and_validates(cpu):
    ledger = _ledger(cpu)
    ledger.record("weights", 2 * GiB, "target")
    assert ledger.bytes_of("weights", "target") == 2 * GiB
    assert ledger.bytes_of("weights") == 2 * GiB + GiB // 2
    assert ledger.non_kv_bytes == ledger.declared_bytes - 2000 * MiB
    with pytest.raises(ValueError, match="unknown ledger component"):
        ledger.record("kv", 1)
    with pytest.raises(ValueError, match="negative"):
        ledger.record("non_torch", -1)


def test_ledger_reports(cpu, tmp_path):
    ledger = _ledger(cpu)
    table = format_table(ledger)
    assert "weights" in table and "draft" in table and "25.0%" in table  # 1 GiB of a 4 GiB budget
    assert "KV capacity: 32000 tokens" in table
    assert "maximum concurrency at max_model_len 1024: 30.77x" in table  # 2000 blocks / 65 per sequence
    line = summary_line(ledger)
    assert "\n" not in line and "weights[draft] 0.50" in line
    assert "sequence_state" in table and "0.3 " in table  # the MiB column shows what GiB rounds to 0
    path = tmp_path / "ledger.png"
    plot(ledger, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_plot_zoom_writes_every_entry_with_its_size(cpu, monkeypatch):
    from matplotlib.figure import Figure

    ledger = _ledger(cpu)
    texts = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: texts.extend(
        t.get_text() for ax in fig.axes for t in ax.texts))
    plot(ledger, "unused.png")
    for expected in ("300.0 MiB (7.3%)", "1.00 GiB (25.0%)", "12.0 MiB (0.3%)", "300.0 KiB (0.0%)",
                     "budget 4.00 GiB"):
        assert expected in texts, (expected, texts)


def test_container_id_from_cgroup_and_mountinfo():
    cid = "a" * 64
    assert container_id_from(f"0::/system.slice/docker-{cid}.scope\n") == cid
    assert container_id_from(f"12:memory:/kubepods/burstable/pod1234-5678/{cid}\n") == cid
    mountinfo = f"500 400 0:1 /var/lib/docker/containers/{cid}/hostname /etc/hostname"
    assert container_id_from("0::/\n", mountinfo) == cid
    assert container_id_from("4:memory:/process_api/50a10d2f3a974f01db5789a168538d10\n") is None


def test_cuda_load_leaves_no_temporaries_in_the_allocator_cache(monkeypatch, caplog):
    # A loader that fuses after loading: originals (2 GiB) + fused copy (2 GiB), originals freed.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cuda = FakeCuda(monkeypatch, props())
    device = CudaDevice(0, nvml=two_gpus(ours=GiB))

    def load():
        cuda.allocate(2 * GiB)
        cuda.allocate(2 * GiB)
        cuda.release(2 * GiB)
        return "model"

    assert measure_weights(device, load) == ("model", 2 * GiB)
    assert cuda.reserved == cuda.allocated == 2 * GiB  # the freed originals left the cache
    cuda.pinned = 512 * MiB  # a fragmented segment empty_cache cannot return

    def fragmented_load():
        cuda.allocate(GiB)
        cuda.reserved += 512 * MiB
        return "model"

    with caplog.at_level(logging.WARNING):
        assert measure_weights(device, fragmented_load) == ("model", GiB)
    assert "left 512.0 MiB reserved beyond" in caplog.text


def test_window_mark_separates_allocator_slack_from_the_activation_peak(cpu):
    libc = mem_hog._libc()
    with profile_window(cpu) as result:
        first = torch.ones(GiB // 16, dtype=torch.float32)  # the worst step: 256 MiB, then gone
        del first
        result.mark()
        stuck = libc.malloc(128 * MiB)  # other shapes: memory the allocator keeps but cannot reuse
        libc.memset(stuck, 1, 128 * MiB)
        again = torch.ones(GiB // 16, dtype=torch.float32)  # the worst step again, on top of it
        del again
        libc.free(stuck)
    assert result.activation_peak_bytes == pytest.approx(256 * MiB, rel=0.1)
    assert result.allocator_bytes == pytest.approx(128 * MiB, rel=0.1)
    assert result.non_torch_bytes < 32 * MiB


def test_cuda_allocator_slack_is_reserved_beyond_the_peak(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cuda = FakeCuda(monkeypatch, props())
    device = CudaDevice(0, nvml=two_gpus(ours=GiB))
    cuda.allocate(GiB)  # weights
    with profile_window(device) as result:
        cuda.allocate(2 * GiB)
        cuda.release(2 * GiB)
        result.mark()
        cuda.reserved += 300 * MiB  # segments split so that the next shapes needed new ones
    assert result.activation_peak_bytes == 2 * GiB
    assert result.allocator_bytes == 300 * MiB


def test_cpu_allocator_slack_counts_the_free_blocks_malloc_keeps(cpu):
    """Blocks freed between blocks still in use stay in malloc's heap: a later step may find their pages
    resident beside its own, so the window's allocator figure holds at least them."""
    libc = mem_hog._libc()
    block = 64 << 10  # under the pinned mmap threshold: in the heap
    with profile_window(cpu) as result:
        result.mark()
        blocks = [libc.malloc(block) for _ in range(512)]  # 32 MiB
        for b in blocks[::2]:  # every other one: none can merge with a free neighbour
            libc.free(b)
    try:
        assert result.allocator_bytes >= 15 * MiB
    finally:
        for b in blocks[1::2]:
            libc.free(b)
