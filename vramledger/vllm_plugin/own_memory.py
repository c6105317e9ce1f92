"""This process's own memory on its device: its PSS on the CPU (vramledger/procfs.py, as the exporter's
host reader observes it; its RSS where PSS cannot be read), NVML's count for its pid on CUDA
(vramledger/own_memory.py, the reader the worker uses too).

Never the device's free memory: a neighbour's allocations must not move it. Where NVML cannot see
this process, read() raises OwnMemoryUnseen (the reader's one failure): the ledger leaves the figure
out, saying why.
"""
from __future__ import annotations

import os

from vramledger.own_memory import OwnDeviceMemory, OwnMemoryUnseen
from vramledger.procfs import read_pss, read_rss

__all__ = ["OwnMemory", "OwnMemoryUnseen"]


class OwnMemory:
    """The bytes this process holds on one device ("cpu" or "cuda")."""

    def __init__(self, kind: str, index: int = 0, uuid: str | None = None):
        self.kind = kind
        self._pid = os.getpid()
        self._device = OwnDeviceMemory.open(_pynvml(), index, uuid) if kind == "cuda" else None
        # The host's measure, chosen once: PSS where this kernel gives it (4.14 on), else RSS.
        self._host_measure = "pss" if read_pss(self._pid) is not None else "rss"

    @property
    def source(self) -> str | None:
        """What read() gives: "pss" (or "rss"), "nvml", or None where NVML has no device to read."""
        if self._device is None:
            return self._host_measure
        return "nvml" if self._device.handle is not None else None

    def read(self) -> int:
        """Bytes held now; raises OwnMemoryUnseen where NVML cannot see this process."""
        if self._device is None:
            held = (read_pss if self._host_measure == "pss" else read_rss)(self._pid)
            if held is None:  # our own /proc entry: there unless /proc is unmounted meanwhile
                raise OwnMemoryUnseen("/proc does not show this process")
            return held
        return self._device.read()

    def device_name(self) -> str | None:
        return self._device.device_name() if self._device is not None else None

    def device_uuid(self) -> str | None:
        return self._device.device_uuid() if self._device is not None else None


def _pynvml():
    """nvidia-ml-py's module, else the copy vLLM vendors; None where neither imports."""
    try:
        import pynvml
    except ImportError:
        try:
            from vllm.third_party import pynvml
        except ImportError:
            return None
    return pynvml
