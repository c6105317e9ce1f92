"""Device readers: NVML on NVIDIA GPUs, the host (psutil) for engines on the CPU, behind one interface."""
from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Protocol

import psutil

from vramledger import nvml_devices
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.procfs import ProportionalSizes, pids, read_rss, read_start, read_start_rss
from vramledger.processes import ProcessMemory
from vramledger.units import MiB

log = logging.getLogger(__name__)

HOST = "host"  # the device label of the host reader


@dataclass(frozen=True)
class DeviceMemory:
    """One device as its reader sees it; processes is None when they could not be listed."""
    device: str  # metric label: "0", "0/1" for a MIG instance, "host"
    uuid: str
    name: str
    total: int
    used: int
    free: int
    reserved: int | None
    processes: tuple[ProcessMemory, ...] | None


class Source(Protocol):
    """What the collector needs from a device reader."""
    name: str

    def read(self, keep_pids: frozenset[int] = frozenset()) -> list[DeviceMemory]: ...

    def close(self) -> None: ...


class SourceUnavailable(RuntimeError):
    """The backend cannot run on this machine (no library, no driver, no permission)."""


class NvmlSource:
    """Reads every GPU, or every MIG instance of a MIG-enabled GPU, through NVML."""
    name = "nvml"

    def __init__(self, nvml, errors: ErrorLog):
        self._nvml = nvml
        self._errors = errors
        self._no_memory_v2: set[str] = set()  # uuids whose driver lacks nvmlDeviceGetMemoryInfo_v2
        self._names: dict[int, str] = {}

    @classmethod
    def open(cls, errors: ErrorLog) -> NvmlSource:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError as e:
            raise SourceUnavailable(f"NVML unavailable: nvidia-ml-py is not installed ({e})") from e
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise SourceUnavailable(f"NVML unavailable: {e} ({type(e).__name__})") from e
        return cls(nvml, errors)

    def read(self, keep_pids: frozenset[int] = frozenset()) -> list[DeviceMemory]:
        # NVML lists every compute process, so keep_pids (a host-reader need) is not used.
        devices: list[DeviceMemory] = []
        for index in range(self._nvml.nvmlDeviceGetCount()):
            try:
                devices.extend(self._read_gpu(index))
            except self._nvml.NVMLError as e:  # one lost GPU must not hide the others
                self._errors.record(self.name, type(e).__name__, f"GPU {index}: {e}")
        seen = {p.pid for d in devices for p in d.processes or ()}
        self._names = {pid: name for pid, name in self._names.items() if pid in seen}
        return devices

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass

    def _read_gpu(self, index: int) -> list[DeviceMemory]:
        handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
        if not self._mig_enabled(handle):
            return [self._read_device(handle, str(index))]
        # Per-process memory lives on the MIG instances; the parent would count it twice.
        return [self._read_device(mig, f"{index}/{slot}") for slot, mig in self._mig_devices(handle)]

    def _mig_enabled(self, handle) -> bool:
        nvml = self._nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError as e:
            if e.value in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                return False  # most GPUs have no MIG: not an error
            raise
        return current == nvml.NVML_DEVICE_MIG_ENABLE

    def _mig_devices(self, handle):
        nvml = self._nvml
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                yield slot, nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nvml.NVMLError as e:
                if e.value != nvml.NVML_ERROR_NOT_FOUND:  # NOT_FOUND: an empty slot
                    raise

    def _read_device(self, handle, label: str) -> DeviceMemory:
        uuid = self._nvml.nvmlDeviceGetUUID(handle)
        total, used, free, reserved = self._memory(handle, uuid)
        return DeviceMemory(label, uuid, self._nvml.nvmlDeviceGetName(handle), total, used, free,
                            reserved, self._processes(handle, label))

    def _memory(self, handle, uuid: str) -> tuple[int, int, int, int | None]:
        nvml = self._nvml
        if uuid not in self._no_memory_v2 and hasattr(nvml, "nvmlMemory_v2"):
            try:
                m = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
                return m.total, m.used, m.free, m.reserved
            except nvml.NVMLError as e:
                if e.value not in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                                   nvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH):
                    raise
                # Counted once: the answer will not change until the driver does.
                self._errors.record(self.name, type(e).__name__, f"{uuid}: no v2 memory info, "
                                    "reserved memory unknown")
                self._no_memory_v2.add(uuid)
        m = nvml.nvmlDeviceGetMemoryInfo(handle)  # v1: used includes the reserved memory
        return m.total, m.used, m.free, None

    def _processes(self, handle, label: str) -> tuple[ProcessMemory, ...] | None:
        try:
            used = nvml_devices.memory_by_pid(self._nvml, handle)
        except self._nvml.NVMLError as e:
            self._errors.record(self.name, type(e).__name__, f"device {label}: cannot list processes: {e}")
            return None
        return tuple(ProcessMemory(pid, self._process_name(pid), b, "nvml") for pid, b in used.items())

    def _process_name(self, pid: int) -> str:
        if pid not in self._names:
            try:
                name = os.path.basename(self._nvml.nvmlSystemGetProcessName(pid))
            except self._nvml.NVMLError:
                name = _psutil_name(pid)
            self._names[pid] = name
        return self._names[pid]


class HostSource:
    """Reads host memory and the processes above a size threshold (for engines on the CPU).

    A process's memory is its PSS where /proc/<pid>/smaps_rollup can be read (so that pages shared
    between processes count once in their sum), its RSS otherwise; each series says which
    (measure="pss" or "rss").
    """
    name = "host"

    def __init__(self, errors: ErrorLog, min_process_bytes: int = 64 * MiB,
                 sizes: ProportionalSizes | None = None):
        self._errors = errors
        self._min_process_bytes = min_process_bytes
        self._own_pid = os.getpid()
        self._sizes = sizes or ProportionalSizes()
        self._names: dict[int, tuple[int, str]] = {}  # pid -> (start, name) of the listed processes

    def read(self, keep_pids: frozenset[int] = frozenset()) -> list[DeviceMemory]:
        vm = psutil.virtual_memory()
        found: dict[int, tuple[int, int]] = {}  # pid -> (start, RSS)
        for pid in pids():
            if pid == self._own_pid:
                continue
            if pid in keep_pids:  # listed whatever its size: its start and RSS in one read
                known = read_start_rss(pid)  # None when the process exited meanwhile
                if known is not None:
                    found[pid] = known
                continue
            rss = read_rss(pid)
            # RSS bounds PSS: a process below the threshold by RSS is below it by PSS too.
            if rss is None or rss < self._min_process_bytes:
                continue
            start = read_start(pid)
            if start is not None:
                found[pid] = (start, rss)
        pss = self._sizes.sizes(found)
        processes = []
        for pid, (start, rss) in found.items():
            proportional = pss[pid]
            size, measure = (rss, "rss") if proportional is None else (proportional, "pss")
            if size >= self._min_process_bytes or pid in keep_pids:
                processes.append(ProcessMemory(pid, self._name(pid, start), size, measure))
        self._names = {p.pid: self._names[p.pid] for p in processes}
        # used = total - available, so that used + free = total as on a GPU.
        return [DeviceMemory(HOST, "", "host", vm.total, vm.total - vm.available, vm.available, None,
                             tuple(processes))]

    def _name(self, pid: int, start: int) -> str:
        # psutil's name (the command line's where the kernel's is cut at 15 characters), once per process.
        if self._names.get(pid, (None,))[0] != start:
            self._names[pid] = (start, _psutil_name(pid))
        return self._names[pid][1]

    def close(self) -> None:
        pass


def _psutil_name(pid: int, proc: psutil.Process | None = None) -> str:
    try:
        return (proc or psutil.Process(pid)).name()
    except psutil.Error:
        return ""


def open_source(backend: str, errors: ErrorLog, min_process_bytes: int = 64 * MiB) -> Source:
    """The reader for --backend: auto tries NVML and falls back to the host."""
    if backend == "host":
        return HostSource(errors, min_process_bytes)
    try:
        return NvmlSource.open(errors)
    except SourceUnavailable as e:
        if backend == "nvml":
            raise
        log.warning("%s; falling back to the host reader (--backend host)", e)
        return HostSource(errors, min_process_bytes)
