"""This process's own memory on its device: RSS on the CPU, NVML's count for its pid on CUDA.

Never the device's free memory: a neighbour's allocations must not move it.
"""
from __future__ import annotations

import logging
import os

import psutil

from vramledger import nvml_devices
from vramledger.identity import host_pid

log = logging.getLogger("vllm.plugins.vramledger")


class OwnMemory:
    """Reads the bytes this process holds on one device; read() is None where the device cannot say."""

    def __init__(self, kind: str, index: int = 0, uuid: str | None = None):
        self.kind = kind
        self._process = psutil.Process()
        self._nvml = self._handle = None
        if kind == "cuda":
            self._nvml, self._handle = _nvml_handle(index, uuid)
        self._pids = {os.getpid(), host_pid()} - {None}  # NVML lists host pids

    @property
    def source(self) -> str | None:
        if self.kind == "cpu":
            return "rss"
        return "nvml" if self._handle is not None else None

    def read(self) -> int | None:
        if self.kind == "cpu":
            return self._process.memory_info().rss
        if self._handle is None:
            return None
        try:
            procs = nvml_devices.memory_by_pid(self._nvml, self._handle)
        except Exception as e:  # a lost GPU, an old driver: the entry is absent, vLLM runs on
            log.debug("vramledger: NVML cannot list the processes of the device: %s", e)
            return None
        used = [used for pid, used in procs.items() if pid in self._pids]
        known = [n for n in used if n is not None]
        if not used or len(known) < len(used):  # our pid is not visible to NVML, or the driver cannot say
            return None
        return sum(known)

    def device_name(self) -> str | None:
        if self._nvml is None or self._handle is None:
            return None
        try:
            return nvml_devices.text(self._nvml.nvmlDeviceGetName(self._handle))
        except Exception:
            return None

    def device_uuid(self) -> str | None:
        if self._nvml is None or self._handle is None:
            return None
        try:
            return nvml_devices.text(self._nvml.nvmlDeviceGetUUID(self._handle))
        except Exception:
            return None


def _nvml_handle(index: int, uuid: str | None):
    """(pynvml, handle of our device), matched by UUID where torch gives one; (None, None) without NVML."""
    try:
        try:
            import pynvml as nvml  # nvidia-ml-py
        except ImportError:
            from vllm.third_party import pynvml as nvml
        nvml.nvmlInit()
        return nvml, nvml_devices.find_handle(nvml, index, uuid)
    except Exception as e:
        log.warning("vramledger: NVML cannot say what this process holds on cuda:%d (%s); "
                    "the ledger has no runtime entry and no live process memory", index, e)
        return None, None
