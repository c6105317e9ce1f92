"""This process's own memory on its device: RSS on the CPU, NVML's count for its pid on CUDA
(vramledger/own_memory.py, the reader the worker uses too).

Never the device's free memory: a neighbour's allocations must not move it. Where NVML cannot see
this process, read() raises OwnMemoryUnseen (the reader's one failure): the ledger leaves the figure
out, saying why.
"""
from __future__ import annotations

import psutil

from vramledger.own_memory import OwnDeviceMemory, OwnMemoryUnseen

__all__ = ["OwnMemory", "OwnMemoryUnseen"]


class OwnMemory:
    """The bytes this process holds on one device ("cpu" or "cuda")."""

    def __init__(self, kind: str, index: int = 0, uuid: str | None = None):
        self.kind = kind
        self._process = psutil.Process()
        self._device = OwnDeviceMemory.open(_pynvml(), index, uuid) if kind == "cuda" else None

    @property
    def source(self) -> str | None:
        """What read() gives: "rss", "nvml", or None where NVML has no device to read."""
        if self._device is None:
            return "rss"
        return "nvml" if self._device.handle is not None else None

    def read(self) -> int:
        """Bytes held now; raises OwnMemoryUnseen where NVML cannot see this process."""
        if self._device is None:
            return self._process.memory_info().rss
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
