"""The few memory primitives the worker needs, for CUDA and the CPU behind one interface."""
from __future__ import annotations

import ctypes
import gc
import logging
import os
import platform
import re

import psutil
import torch

from vramledger import nvml_devices
from vramledger.identity import in_host_pid_namespace, proc_status_field
from vramledger.ledger_document import DeviceKind
from vramledger.own_memory import OwnDeviceMemory, OwnMemoryUnseen
from vramledger.processes import ProcessMemory

log = logging.getLogger(__name__)

MiB = 1 << 20
# On the CPU every process holds some memory; only the ones big enough to matter are listed.
CPU_PROCESS_MIN_BYTES = 64 * MiB
# glibc serves allocations from this size on with their own mapping, returned to the kernel when
# freed. Its default threshold moves up (to 32 MiB) as large blocks are freed, after which freed
# tensors stay in the heap or not depending on history: a fixed one keeps RSS = live tensors,
# so a profiled step costs the same memory in every later run.
CPU_MMAP_THRESHOLD = 256 << 10
M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)


class Device:
    """One compute device and its memory counters."""

    kind: DeviceKind
    index: int
    torch_device: torch.device
    uuid: str | None
    name: str
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{self.kind}:{self.index} ({self.name})"

    def total_bytes(self) -> int: raise NotImplementedError
    def free_bytes(self) -> int: raise NotImplementedError
    def process_bytes(self) -> int: raise NotImplementedError
    def process_peak_bytes(self) -> int: raise NotImplementedError
    def other_processes(self) -> list[ProcessMemory]: raise NotImplementedError
    def torch_allocated_bytes(self) -> int: raise NotImplementedError
    def torch_reserved_bytes(self) -> int: raise NotImplementedError
    def torch_peak_allocated_bytes(self) -> int: raise NotImplementedError
    def reset_peak(self) -> bool: raise NotImplementedError  # False: the peak could not be reset
    def allocator_free_bytes(self) -> int: raise NotImplementedError  # held by the allocator, not in use
    def synchronize(self) -> None: raise NotImplementedError
    def empty_cache(self) -> None: raise NotImplementedError


def get_device(spec: str = "auto") -> Device:
    """Return the device for "auto", "cpu", "cuda" or "cuda:N"."""
    text = str(spec).strip().lower()
    if text == "auto":
        return CudaDevice(0) if torch.cuda.is_available() else CpuDevice()
    if text == "cpu":
        return CpuDevice()
    match = re.fullmatch(r"cuda(?::(\d+))?", text)
    if match is None:
        raise ValueError(f"invalid device {spec!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise ValueError(f"device {spec!r} requested, but CUDA is not available "
                         f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
                         f"use --device cpu or auto")
    index = int(match.group(1) or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device {spec!r} requested, but only {count} CUDA device(s) are visible "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return CudaDevice(index)


class CpuDevice(Device):
    """The host: memory is the process RSS, the peak is the kernel's VmHWM."""

    def __init__(self):
        self.kind, self.index, self.uuid = "cpu", 0, None
        self.torch_device = torch.device("cpu")
        self.name = _cpu_model_name()
        self.dtype = torch.float32
        self._process = psutil.Process()
        self._warned_no_reset = False
        fix_mmap_threshold()

    def total_bytes(self) -> int:
        return psutil.virtual_memory().total

    def free_bytes(self) -> int:
        # "available" counts reclaimable page cache as free, as the kernel does when we allocate.
        return psutil.virtual_memory().available

    def process_bytes(self) -> int:
        return self._process.memory_info().rss

    def process_peak_bytes(self) -> int:
        return _proc_status_bytes("VmHWM") or self.process_bytes()

    def other_processes(self) -> list[ProcessMemory]:
        found = []
        for proc in psutil.process_iter(["pid", "name", "memory_info"]):
            info = proc.info
            if info["pid"] == self._process.pid or info["memory_info"] is None:
                continue
            if info["memory_info"].rss >= CPU_PROCESS_MIN_BYTES:
                found.append(ProcessMemory(info["pid"], info["name"] or "?", info["memory_info"].rss, "rss"))
        return sorted(found, key=lambda p: -(p.bytes or 0))

    # Tensors live in ordinary process memory: torch has no separate counters on the CPU.
    def torch_allocated_bytes(self) -> int: return 0
    def torch_reserved_bytes(self) -> int: return 0
    def torch_peak_allocated_bytes(self) -> int: return 0

    def reset_peak(self) -> bool:
        # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError as e:
            if not self._warned_no_reset:
                log.warning("cannot reset the RSS high-water mark (/proc/self/clear_refs: %s); "
                            "peaks are sampled instead", e)
                self._warned_no_reset = True
            return False

    def synchronize(self) -> None:
        pass

    def allocator_free_bytes(self) -> int:
        return heap_free_bytes()

    def empty_cache(self) -> None:
        gc.collect()
        release_free_heap()


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _proc_status_bytes(field: str) -> int | None:
    value = proc_status_field(field)  # "1692 kB"
    return int(value.split()[0]) * 1024 if value else None


def _load_libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_libc = _load_libc()


def release_free_heap() -> None:
    """Hand the heap's free pages back to the kernel (glibc's malloc_trim, every arena): freed small
    blocks otherwise stay in malloc's arenas, and in RSS, until reused."""
    if _libc is not None and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_mallinfo2 = getattr(_libc, "mallinfo2", None)  # glibc >= 2.33
if _mallinfo2 is not None:
    _mallinfo2.restype = _Mallinfo2


def heap_free_bytes() -> int:
    """Bytes malloc holds free in its arenas, every thread's (glibc's mallinfo2; 0 where there is
    none): freed blocks a later allocation may reuse, their pages resident until then."""
    return int(_mallinfo2().fordblks) if _mallinfo2 is not None else 0


def fix_mmap_threshold(nbytes: int = CPU_MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold (no dynamic growth); False where there is no glibc."""
    if _libc is None or not hasattr(_libc, "mallopt"):
        return False
    return bool(_libc.mallopt(M_MMAP_THRESHOLD, nbytes))


class CudaDevice(Device):
    """An NVIDIA GPU: process memory from NVML for our own pid, tensors from torch's allocator."""

    def __init__(self, index: int, nvml=None):
        props = torch.cuda.get_device_properties(index)
        self.kind, self.index, self.name = "cuda", index, props.name
        self.torch_device = torch.device("cuda", index)
        # bf16 is native from Ampere (sm_80) on; earlier GPUs only emulate it, slowly.
        self.dtype = torch.bfloat16 if props.major >= 8 else torch.float16
        torch.cuda.mem_get_info(index)  # creates the CUDA context now, so "runtime" includes it
        self._warned: set[str] = set()
        self._own = OwnDeviceMemory.open(_import_nvml(nvml), index, _torch_uuid(props), _pci_bus_id(props))
        self.uuid = self._own.device_uuid() or next(iter(nvml_devices.uuid_spellings(_torch_uuid(props))), None)

    def total_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.index)[1]

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.index)[0]

    def process_bytes(self) -> int:
        procs: dict[int, int | None] = {}
        try:
            procs = self._own.processes()
            return self._own.own_of(procs)
        except OwnMemoryUnseen as e:  # the worker needs a number: it estimates, and says so once
            return self._estimated_process_bytes(procs, str(e))

    def process_peak_bytes(self) -> int:
        return self.process_bytes()

    def other_processes(self) -> list[ProcessMemory]:
        try:
            others = self._own.others(self._own.processes())
        except OwnMemoryUnseen:
            return []  # process_bytes() says why, once
        found = [ProcessMemory(pid, self._process_name(pid), used, "nvml") for pid, used in others.items()]
        return sorted(found, key=lambda p: -(p.bytes or 0))

    def torch_allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.index)

    def torch_reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.index)

    def torch_peak_allocated_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.index)

    def reset_peak(self) -> bool:
        torch.cuda.reset_peak_memory_stats(self.index)
        return True

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def allocator_free_bytes(self) -> int:
        return self.torch_reserved_bytes() - self.torch_allocated_bytes()

    def empty_cache(self) -> None:
        gc.collect()
        torch.cuda.empty_cache()

    # --- NVML ---
    def _process_name(self, pid: int) -> str:
        try:
            return os.path.basename(nvml_devices.text(self._own.nvml.nvmlSystemGetProcessName(pid))) or "?"
        except Exception:
            pass
        try:  # NVML reports host pids: only trust psutil for pids of our own namespace
            return psutil.Process(pid).name() if in_host_pid_namespace() else "?"
        except Exception:
            return "?"

    def _estimated_process_bytes(self, procs: dict[int, int | None], reason: str) -> int:
        # Device used memory minus what NVML attributes to others: includes memory of
        # processes NVML cannot attribute (the neighbour problem this worker exists to avoid).
        self._warn_once("estimate", "%s; process memory on cuda:%d is estimated from cudaMemGetInfo "
                        "(device used minus attributed processes) and may include other processes",
                        reason, self.index)
        free, total = torch.cuda.mem_get_info(self.index)
        others = sum(used or 0 for pid, used in procs.items() if pid not in self._own.pids)
        return max(self.torch_reserved_bytes(), total - free - others)

    def _warn_once(self, key: str, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)


def _import_nvml(nvml):
    """The pynvml module (nvidia-ml-py), None where it is not installed."""
    if nvml is not None:
        return nvml
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _pci_bus_id(props) -> str | None:
    if getattr(props, "pci_bus_id", None) is None:
        return None
    return "%08X:%02X:%02X.0" % (getattr(props, "pci_domain_id", 0) or 0, props.pci_bus_id,
                                 getattr(props, "pci_device_id", 0) or 0)


def _torch_uuid(props) -> str | None:
    return str(getattr(props, "uuid", "") or "") or None
