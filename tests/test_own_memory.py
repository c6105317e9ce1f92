"""The one reader of a process's own device memory (vramledger/own_memory.py), over the fake NVML
(tests/fake_pynvml.py): a number where NVML lists this pid with its memory, OwnMemoryUnseen saying
why everywhere else, never an estimate."""
from __future__ import annotations

import os
import re

import pytest
from fake_pynvml import NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_NOT_SUPPORTED, FakeGpu, FakePynvml, MiB, proc

from vramledger.own_memory import OwnDeviceMemory, OwnMemoryUnseen, own_pids

NEIGHBOUR = 999_999


def reader(*gpus: FakeGpu, index: int = 0, init_error: int | None = None) -> OwnDeviceMemory:
    return OwnDeviceMemory.open(FakePynvml(list(gpus), init_error=init_error), index)


def gpu(*procs, **kwargs) -> FakeGpu:
    return FakeGpu("GPU-aaaa", processes=list(procs), **kwargs)


def test_reads_nvml_count_for_its_own_pid_only():
    own = reader(gpu(proc(os.getpid(), "python", 0.75), proc(NEIGHBOUR, "neighbour", 2.0)))
    assert own.read() == 768 * MiB
    assert own.others(own.processes()) == {NEIGHBOUR: 2 << 30}
    assert (own.device_uuid(), own.device_name()) == ("GPU-aaaa", "NVIDIA H100 80GB HBM3")


def test_a_pid_listed_for_two_contexts_is_summed():
    one = proc(os.getpid(), "python", 0.25)
    assert reader(gpu(one, proc(os.getpid(), "python", 0.5))).read() == 768 * MiB


def lost_after_open(device: FakeGpu) -> OwnDeviceMemory:
    own = reader(device)
    device.lost = True  # fell off the bus while the process ran
    return own


@pytest.mark.parametrize("setup, why", [
    (lambda: reader(gpu(proc(NEIGHBOUR, "neighbour", 2.0))), "does not list this process"),
    (lambda: reader(gpu(proc(os.getpid(), "python", None))), "no per-process memory"),  # MIG
    (lambda: reader(gpu(proc(os.getpid(), "python", 1.0), process_error=NVML_ERROR_NOT_SUPPORTED)),
     "cannot list the device's processes"),
    (lambda: lost_after_open(gpu(proc(os.getpid(), "python", 1.0))), "cannot list the device's processes"),
    (lambda: reader(gpu(), init_error=NVML_ERROR_DRIVER_NOT_LOADED), "NVML is not available (Driver Not Loaded)"),
    (lambda: reader(gpu(), index=3), "cannot map cuda:3 to an NVML device"),
    (lambda: OwnDeviceMemory.open(None, 0), "NVML is not available (no pynvml)"),
], ids=["other-namespace", "mig", "no-process-list", "lost", "no-driver", "no-such-device", "no-pynvml"])
def test_a_process_nvml_cannot_see_is_said_distinctly(setup, why, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(OwnMemoryUnseen, match=re.escape(why)):
        setup().read()


def test_own_pids_are_this_process_and_its_host_pid():
    assert os.getpid() in own_pids()
    assert len(own_pids()) in (1, 2)
