"""What this process holds on one NVIDIA device, from NVML's count for its own pid: the one reader
the worker and the vLLM plugin share.

Never the device's free memory, which moves when a neighbour allocates. Where NVML cannot see this
process (no NVML, a device it cannot map, a pid namespace NVML's host pids are not in, MIG or a
driver that gives no per-process memory), read() raises OwnMemoryUnseen saying why: the caller
decides what stands in (the worker estimates, and says so; the vLLM plugin leaves the figure out and
sizes as vLLM does). Nothing here logs or estimates.
"""
from __future__ import annotations

import os

from vramledger import nvml_devices
from vramledger.identity import host_pid


class OwnMemoryUnseen(Exception):
    """NVML cannot say what this process holds on the device; str() says why."""


def own_pids() -> frozenset[int]:
    """This process's pids as NVML may list them: its own, and its pid on the host (NVML lists host pids)."""
    return frozenset(pid for pid in (os.getpid(), host_pid()) if pid is not None)


class OwnDeviceMemory:
    """Reads NVML's count for this process on one device. Build it with open(); it never raises there."""

    def __init__(self, nvml, handle, unseen: str | None = None, pids: frozenset[int] | None = None):
        self.nvml, self.handle = nvml, handle
        self.pids = own_pids() if pids is None else pids
        self.unseen = unseen  # why there is no handle to read (None with one)

    @classmethod
    def open(cls, nvml, index: int, uuid: str | None = None, pci_bus_id: str | None = None) -> OwnDeviceMemory:
        """The reader of CUDA device `index` (NVML initialised here); one that raises on read() where
        NVML or the device cannot be had. nvml is the pynvml module, None where it cannot be imported."""
        if nvml is None:
            return cls(None, None, "NVML is not available (no pynvml)")
        try:
            nvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - no driver, no library: every reading says so
            return cls(None, None, f"NVML is not available ({e})")
        try:
            return cls(nvml, nvml_devices.find_handle(nvml, index, uuid, pci_bus_id))
        except Exception as e:  # noqa: BLE001 - NVML's error or a LookupError: no device to read
            return cls(nvml, None, f"cannot map cuda:{index} to an NVML device ({e})")

    def processes(self) -> dict[int, int | None]:
        """Memory by host pid of every process on the device (None where the driver cannot say)."""
        if self.handle is None:
            raise OwnMemoryUnseen(self.unseen or "no NVML device")
        try:
            return nvml_devices.memory_by_pid(self.nvml, self.handle)
        except Exception as e:  # noqa: BLE001 - a lost GPU, an old driver
            raise OwnMemoryUnseen(f"NVML cannot list the device's processes ({e})") from e

    def read(self) -> int:
        """Bytes this process holds on the device; raises OwnMemoryUnseen where NVML cannot say."""
        return self.own_of(self.processes())

    def own_of(self, procs: dict[int, int | None]) -> int:
        """This process's bytes in a listing of processes(); raises OwnMemoryUnseen where it is not there."""
        mine = [used for pid, used in procs.items() if pid in self.pids]
        if not mine:
            raise OwnMemoryUnseen(f"NVML does not list this process (pid {', '.join(map(str, sorted(self.pids)))}; "
                                  "another pid namespace?)")
        if any(used is None for used in mine):
            raise OwnMemoryUnseen("NVML gives no per-process memory on this device (MIG, or the driver "
                                  "cannot say)")
        return sum(used for used in mine if used is not None)

    def others(self, procs: dict[int, int | None]) -> dict[int, int | None]:
        """The other processes of a listing of processes()."""
        return {pid: used for pid, used in procs.items() if pid not in self.pids}

    def device_uuid(self) -> str | None:
        """The device's NVML UUID ("GPU-..." or "MIG-..."), None where NVML cannot say."""
        return self._device_text("nvmlDeviceGetUUID")

    def device_name(self) -> str | None:
        return self._device_text("nvmlDeviceGetName")

    def _device_text(self, call: str) -> str | None:
        if self.handle is None:
            return None
        try:
            return nvml_devices.text(getattr(self.nvml, call)(self.handle))
        except Exception:  # noqa: BLE001 - a lost GPU: the name is only shown
            return None
