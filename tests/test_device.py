"""Device primitives: the CPU for real, the CUDA logic on a fake pynvml and patched torch.cuda counters."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import mem_hog
import psutil
import pytest
import torch

from vramledger.identity import host_pid, in_host_pid_namespace
from vramledger.processes import ProcessMemory
from vramledger.worker.memory.device import CpuDevice, CudaDevice, get_device

MiB, GiB = 1 << 20, 1 << 30
NEIGHBOUR_PID = 999_999


# --- fakes: the NVML library and torch.cuda's counters (no GPU here) ---
class FakeNvml:
    """The pynvml functions CudaDevice calls, over a list of GPUs {uuid, bus_id, procs}."""

    class NVMLError(Exception):
        pass

    def __init__(self, gpus, fail_init=False):
        self.gpus, self.fail_init = gpus, fail_init

    def nvmlInit(self):
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def _find(self, key, value):
        for i, gpu in enumerate(self.gpus):
            if gpu[key] == value:
                return i
        raise self.NVMLError("Not Found")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return self._find("uuid", uuid)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):
        return self._find("bus_id", bus_id)

    def nvmlDeviceGetUUID(self, handle):
        return self.gpus[handle]["uuid"]

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.gpus[handle]["procs"]]

    def nvmlSystemGetProcessName(self, pid):
        return b"/usr/bin/neighbour" if pid == NEIGHBOUR_PID else b"python"


class FakeCuda:
    """torch.cuda's memory counters for one or two fake GPUs."""

    def __init__(self, monkeypatch, props, count=2, total=80 * GiB):
        self.props, self.total, self.free = props, total, total
        self.allocated = self.reserved = self.peak = self.pinned = 0
        for name, fn in dict(
                is_available=lambda: True, device_count=lambda: count,
                get_device_properties=lambda i: self.props,
                mem_get_info=lambda i=None: (self.free, self.total),
                memory_allocated=lambda i=None: self.allocated, memory_reserved=lambda i=None: self.reserved,
                max_memory_allocated=lambda i=None: self.peak, reset_peak_memory_stats=self._reset_peak,
                synchronize=lambda i=None: None, empty_cache=self.empty_cache).items():
            monkeypatch.setattr(torch.cuda, name, fn)

    def empty_cache(self):
        # The caching allocator returns its unused segments; fragmented ones (`pinned`) stay.
        self.reserved = self.allocated + self.pinned

    def _reset_peak(self, i=None):
        self.peak = self.allocated

    def allocate(self, nbytes):
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)

    def release(self, nbytes):
        self.allocated -= nbytes  # the segment stays reserved (cached) until empty_cache


def gpu(uuid, bus_id, procs=()):
    return {"uuid": uuid, "bus_id": bus_id, "procs": list(procs)}


def props(uuid="bbbb-2222", bus=0x3B, major=9):
    return SimpleNamespace(name="NVIDIA H100", major=major, total_memory=80 * GiB, uuid=uuid,
                           pci_bus_id=bus, pci_domain_id=0, pci_device_id=0)


def two_gpus(ours=3 * GiB, neighbour=2 * GiB):
    """Our process and a neighbour on the second GPU; only a stranger on the first."""
    return FakeNvml([gpu("GPU-aaaa-1111", "00000000:1A:00.0", [(4242, GiB)]),
                     gpu("GPU-bbbb-2222", "00000000:3B:00.0",
                         [(os.getpid(), ours), (NEIGHBOUR_PID, neighbour)])])


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return FakeCuda(monkeypatch, props())


# --- CUDA logic ---
def test_cuda_maps_torch_device_to_nvml_by_uuid_and_reads_own_pid(fake_cuda):
    device = CudaDevice(0, nvml=two_gpus())
    assert device.uuid == "GPU-bbbb-2222"
    assert device.process_bytes() == 3 * GiB
    assert device.process_peak_bytes() == 3 * GiB
    assert device.other_processes() == [ProcessMemory(NEIGHBOUR_PID, "neighbour", 2 * GiB, "nvml")]


def test_cuda_falls_back_to_pci_bus_id_then_visible_devices(fake_cuda, monkeypatch, caplog):
    fake_cuda.props = props(uuid=None, bus=0x3B)
    assert CudaDevice(0, nvml=two_gpus()).process_bytes() == 3 * GiB
    fake_cuda.props = props(uuid=None, bus=None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")  # CUDA accepts a unique UUID prefix
    assert CudaDevice(0, nvml=two_gpus()).uuid == "GPU-bbbb-2222"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    with caplog.at_level(logging.WARNING):
        assert CudaDevice(0, nvml=two_gpus()).process_bytes() == 3 * GiB
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in caplog.text


def test_cuda_estimates_when_nvml_cannot_say_per_process_memory(fake_cuda, caplog):
    fake_cuda.free = 80 * GiB - 7 * GiB  # 5 GiB ours + 2 GiB the neighbour's
    with caplog.at_level(logging.WARNING):
        device = CudaDevice(0, nvml=two_gpus(ours=None))
        assert device.process_bytes() == 5 * GiB  # device used minus what NVML attributes to others
    assert "gives no per-process memory" in caplog.text and "estimated" in caplog.text


def test_cuda_estimates_when_our_pid_is_not_listed(fake_cuda, caplog):
    nvml = FakeNvml([gpu("GPU-bbbb-2222", "00000000:3B:00.0", [(NEIGHBOUR_PID, 2 * GiB)])])
    fake_cuda.free = 80 * GiB - 7 * GiB
    with caplog.at_level(logging.WARNING):
        assert CudaDevice(0, nvml=nvml).process_bytes() == 5 * GiB
    assert "does not list this process" in caplog.text


def test_cuda_without_nvml_estimates_and_lists_no_processes(fake_cuda, caplog):
    fake_cuda.free = 70 * GiB
    fake_cuda.reserved = 4 * GiB
    with caplog.at_level(logging.WARNING):
        device = CudaDevice(0, nvml=FakeNvml([], fail_init=True))
        assert device.process_bytes() == 10 * GiB
        assert device.other_processes() == []
    assert "NVML is not available" in caplog.text
    assert device.uuid == "GPU-bbbb-2222"  # from torch's properties


def test_cuda_torch_counters_and_dtype(fake_cuda):
    device = CudaDevice(0, nvml=two_gpus())
    fake_cuda.allocate(GiB)
    assert (device.torch_allocated_bytes(), device.torch_reserved_bytes()) == (GiB, GiB)
    assert device.reset_peak() and device.torch_peak_allocated_bytes() == GiB
    assert device.dtype == torch.bfloat16 and device.torch_device == torch.device("cuda", 0)
    fake_cuda.props = props(major=7)  # V100: no native bf16
    assert CudaDevice(0, nvml=two_gpus()).dtype == torch.float16


def test_get_device_cuda_specs(fake_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", two_gpus())
    assert get_device("auto").kind == "cuda"
    assert get_device(" CUDA ").index == 0
    assert get_device("cuda:1").index == 1
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        get_device("cuda:2")


# --- CPU, for real ---
def test_get_device_cpu_and_bad_specs():
    assert get_device("cpu").kind == "cpu"
    if not torch.cuda.is_available():
        assert get_device("auto").kind == "cpu"
        with pytest.raises(ValueError, match="CUDA is not available"):
            get_device("cuda:0")
    for bad in ("gpu", "cuda:x", "cuda:-1", ""):
        with pytest.raises(ValueError, match="invalid device"):
            get_device(bad)


def test_cpu_counters():
    device = CpuDevice()
    assert (device.kind, device.index, device.uuid, device.dtype) == ("cpu", 0, None, torch.float32)
    assert device.total_bytes() >= device.free_bytes() > 0
    rss = psutil.Process().memory_info().rss
    assert abs(device.process_bytes() - rss) < 64 * MiB
    assert device.process_peak_bytes() >= device.process_bytes() - 64 * MiB
    assert device.torch_allocated_bytes() == device.torch_reserved_bytes() == 0
    assert device.torch_peak_allocated_bytes() == 0


def test_cpu_reset_peak_lowers_the_high_water_mark():
    device = CpuDevice()
    libc = mem_hog._libc()
    block = libc.malloc(256 * MiB)
    libc.memset(block, 1, 256 * MiB)
    libc.free(block)  # above malloc's mmap threshold: returned to the kernel at once
    assert device.process_peak_bytes() >= device.process_bytes() + 200 * MiB
    assert device.reset_peak(), "/proc/self/clear_refs is not writable here"
    assert device.process_peak_bytes() < device.process_bytes() + 32 * MiB


def test_cpu_other_processes_holds_the_neighbour_not_us():
    device = CpuDevice()
    before = device.process_bytes()
    with mem_hog.hog(GiB) as proc:
        others = {p.pid: p for p in device.other_processes()}
        assert os.getpid() not in others
        assert others[proc.pid].bytes >= 0.95 * GiB
        assert device.process_bytes() - before < 64 * MiB


def test_host_pid():
    if in_host_pid_namespace():
        assert host_pid() == os.getpid()
    assert host_pid() is None or host_pid() > 0


PINNED_THRESHOLD_CHILD = """
import torch
from vramledger.worker.memory.device import CpuDevice
MiB = 1 << 20
cpu = CpuDevice()
cpu.empty_cache()
before = cpu.process_bytes()
for n in (32 * MiB, 8 * MiB, 4 * MiB):  # glibc's own threshold would grow past the smaller ones
    block = torch.ones(n // 4)
    del block
print(cpu.process_bytes() - before)
"""


def test_cpu_device_pins_the_mmap_threshold_so_freed_tensors_leave_rss():
    # A fresh process: in a test worker, threads other tests left behind move RSS by megabytes.
    out = subprocess.run([sys.executable, "-c", PINNED_THRESHOLD_CHILD], capture_output=True, text=True,
                         timeout=120, check=True)
    assert int(out.stdout.split()[-1]) < 2 * MiB
