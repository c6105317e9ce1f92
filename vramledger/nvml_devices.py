"""NVML as the worker, the exporter and the vLLM plugin read it: which NVML device a CUDA device is,
and what each process holds on it. Callers pass the pynvml module (or the tests' fake of it)."""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def text(value: bytes | str) -> str:
    """NVML's strings: bytes from older bindings, str from newer ones."""
    return value.decode() if isinstance(value, bytes) else str(value)


def uuid_spellings(uuid: str | None) -> list[str]:
    """NVML's spellings of a device UUID as torch gives it (torch drops the GPU-/MIG- prefix)."""
    if not uuid:
        return []
    return [uuid] if uuid.startswith(("GPU-", "MIG-")) else ["GPU-" + uuid, "MIG-" + uuid]


def find_handle(nvml, index: int, uuid: str | None = None, pci_bus_id: str | None = None):
    """The NVML handle of CUDA device `index` (CUDA's numbering): by its UUID, else its PCI bus id,
    else its CUDA_VISIBLE_DEVICES entry (an NVML index or a unique UUID prefix). Raises LookupError
    (or NVML's error) when none of them names a device."""
    for spelling in uuid_spellings(uuid):
        try:
            return nvml.nvmlDeviceGetHandleByUUID(spelling)
        except Exception:  # noqa: BLE001 - the other spelling, or the next way, may find it
            pass
    if pci_bus_id is not None:
        try:
            return nvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id)
        except Exception:  # noqa: BLE001 - CUDA_VISIBLE_DEVICES may still name it
            pass
    return _visible_device(nvml, index)


def _visible_device(nvml, index: int):
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return nvml.nvmlDeviceGetHandleByIndex(index)
    entries = [e.strip() for e in visible.split(",")]
    if index >= len(entries):
        raise LookupError(f"CUDA_VISIBLE_DEVICES={visible!r} has no entry {index}")
    entry = entries[index]
    if entry.startswith(("GPU-", "MIG-")):  # CUDA accepts unique UUID prefixes
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        matches = [h for h in handles if text(nvml.nvmlDeviceGetUUID(h)).startswith(entry)]
        if len(matches) != 1:
            raise LookupError(f"CUDA_VISIBLE_DEVICES entry {entry!r} matches {len(matches)} NVML devices")
        return matches[0]
    if os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        # CUDA's default order (fastest first) can differ from NVML's PCI order.
        log.warning("mapping cuda:%d to NVML index %s assumes CUDA_DEVICE_ORDER=PCI_BUS_ID", index, entry)
    return nvml.nvmlDeviceGetHandleByIndex(int(entry))


def memory_by_pid(nvml, handle) -> dict[int, int | None]:
    """Device memory each process holds, by host pid; None where the driver cannot say. Compute
    processes (a pid listed once per context is summed), then display processes not among them.
    Raises NVML's error when the compute processes cannot be listed."""
    used: dict[int, int | None] = {}
    for info in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
        before, mem = used.get(info.pid, 0), info.usedGpuMemory
        used[info.pid] = None if before is None or mem is None else before + mem
    try:
        graphics = nvml.nvmlDeviceGetGraphicsRunningProcesses(handle)
    except Exception:  # noqa: BLE001 - no display processes, or a driver without the call
        graphics = []
    for info in graphics:
        used.setdefault(info.pid, info.usedGpuMemory)
    return used
