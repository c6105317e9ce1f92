"""A fake pynvml (nvidia-ml-py) for the exporter tests: exactly the calls the exporter makes.

No GPU here, so the NVML library is the one thing faked. A scenario is a list of FakeGpu; install it
where the exporter imports it:  monkeypatch.setitem(sys.modules, "pynvml", FakePynvml([...])).
Semantics follow NVML: v1 memory "used" includes the reserved memory, v2 splits it out; a lost GPU
fails every call on its handle; an empty MIG slot answers NOT_FOUND; a GPU without MIG answers
NOT_SUPPORTED to the MIG mode query; usedGpuMemory is None when the driver cannot say.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from types import SimpleNamespace

GiB = 1 << 30
MiB = 1 << 20

NVML_SUCCESS = 0
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_UNKNOWN = 999
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
nvmlMemory_v2 = 0x02000028

_MESSAGES = {
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument", NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions", NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found", NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH: "Argument version mismatch", NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """As in pynvml: NVMLError(code) builds the subclass for that code, with .value = code."""
    _by_code: dict[int, type] = {}

    def __new__(cls, value):
        if cls is NVMLError:
            cls = NVMLError._by_code.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, *args):
        super().__init__(*args)

    def __str__(self):
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")


def _error_class(name: str, code: int) -> type:
    cls = type(name, (NVMLError,), {"__new__": lambda c, *a: NVMLError.__new__(c, code)})
    NVMLError._by_code[code] = cls
    return cls


NVMLError_InvalidArgument = _error_class("NVMLError_InvalidArgument", NVML_ERROR_INVALID_ARGUMENT)
NVMLError_NotSupported = _error_class("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NoPermission = _error_class("NVMLError_NoPermission", NVML_ERROR_NO_PERMISSION)
NVMLError_NotFound = _error_class("NVMLError_NotFound", NVML_ERROR_NOT_FOUND)
NVMLError_DriverNotLoaded = _error_class("NVMLError_DriverNotLoaded", NVML_ERROR_DRIVER_NOT_LOADED)
NVMLError_LibraryNotFound = _error_class("NVMLError_LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)
NVMLError_FunctionNotFound = _error_class("NVMLError_FunctionNotFound", NVML_ERROR_FUNCTION_NOT_FOUND)
NVMLError_GpuIsLost = _error_class("NVMLError_GpuIsLost", NVML_ERROR_GPU_IS_LOST)


@dataclass
class FakeProcess:
    """A compute process; used=None is what the driver answers when it cannot say."""
    pid: int
    name: str
    used: int | None


@dataclass
class FakeGpu:
    """A GPU or a MIG instance. mig: None = no MIG support; a list of slots (None = empty) = enabled."""
    uuid: str
    total: int = 80 * GiB
    allocated: int = 0  # what NVML v2 calls "used"
    reserved: int = 0
    processes: list[FakeProcess] = field(default_factory=list)
    name: str = "NVIDIA H100 80GB HBM3"
    mig: list[FakeGpu | None] | None = None
    lost: bool = False
    memory_v2: bool = True
    process_error: int | None = None  # NVML code the process list fails with


def proc(pid: int, name: str, gib: float | None) -> FakeProcess:
    return FakeProcess(pid, name, None if gib is None else int(gib * GiB))


class FakePynvml(types.ModuleType):
    """The pynvml module as the exporter sees it, over a list of FakeGpu."""

    def __init__(self, gpus: list[FakeGpu], init_error: int | None = None):
        super().__init__("pynvml")
        self.gpus = gpus
        self.init_error = init_error
        self.initialised = False

    # Constants and exceptions, as module attributes.
    NVMLError = NVMLError
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NOT_FOUND = NVML_ERROR_NOT_FOUND
    NVML_ERROR_FUNCTION_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    NVML_DEVICE_MIG_ENABLE = NVML_DEVICE_MIG_ENABLE
    nvmlMemory_v2 = nvmlMemory_v2

    def nvmlInit(self):
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self):
        self.initialised = False

    def nvmlDeviceGetCount(self):
        self._check_init()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._check_init()
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._alive(self.gpus[index])

    def nvmlDeviceGetUUID(self, handle):
        return self._alive(handle).uuid

    def nvmlDeviceGetName(self, handle):
        return self._alive(handle).name

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        gpu = self._alive(handle)
        free = gpu.total - gpu.allocated - gpu.reserved
        if version is None:
            return SimpleNamespace(total=gpu.total, free=free, used=gpu.allocated + gpu.reserved)
        if not gpu.memory_v2:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        return SimpleNamespace(version=version, total=gpu.total, reserved=gpu.reserved, free=free,
                               used=gpu.allocated)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        gpu = self._alive(handle)
        if gpu.process_error is not None:
            raise NVMLError(gpu.process_error)
        return [SimpleNamespace(pid=p.pid, usedGpuMemory=p.used, gpuInstanceId=0xFFFFFFFF,
                                computeInstanceId=0xFFFFFFFF) for p in gpu.processes]

    def nvmlSystemGetProcessName(self, pid):
        for gpu in self._all_gpus():
            for p in gpu.processes:
                if p.pid == pid:
                    return p.name
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetMigMode(self, handle):
        gpu = self._alive(handle)
        if gpu.mig is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return [NVML_DEVICE_MIG_ENABLE, NVML_DEVICE_MIG_ENABLE]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle):
        return len(self._alive(handle).mig or [])

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, index):
        slots = self._alive(handle).mig or []
        if not 0 <= index < len(slots):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if slots[index] is None:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return slots[index]

    def _check_init(self):
        if not self.initialised:
            raise NVMLError(1)  # NVML_ERROR_UNINITIALIZED

    def _alive(self, gpu: FakeGpu) -> FakeGpu:
        self._check_init()
        if gpu.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return gpu

    def _all_gpus(self):
        for gpu in self.gpus:
            yield gpu
            yield from (slot for slot in gpu.mig or [] if slot is not None)
