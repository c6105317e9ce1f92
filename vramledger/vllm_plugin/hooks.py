"""Where the plugin listens in vLLM's worker: each call's original runs unchanged, then is noted.

The names it reaches are the running vLLM version's (vramledger/vllm_plugin/versions/). Every vLLM
worker (CPUWorker, the CUDA Worker and their kin) passes through WorkerBase.__init__; there each new
worker gets its own wrappers (instance attributes: the classes stay as they are) and the RPC method
the endpoint calls. Two names of vllm/v1/worker/gpu_worker.py are wrapped where that module looks
them up, request_memory (right after the start snapshot) and memory_profiling (vLLM's profile
result), because the worker keeps neither whole.
A hook that fails is logged and its entry left out of the ledger; vLLM never sees the error.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging

from vramledger.vllm_plugin.gate import vllm_version
from vramledger.vllm_plugin.own_memory import OwnMemory
from vramledger.vllm_plugin.rank_ledger import document, loaded_models
from vramledger.vllm_plugin.record import StartupRecord
from vramledger.vllm_plugin.sizing import FAILED, OWN_PROCESS, VLLM, size
from vramledger.vllm_plugin.versions import VllmNames, names_for

log = logging.getLogger("vllm.plugins.vramledger")

RPC_METHOD = "vramledger_ledger"  # the worker method GET /vramledger/memory reaches through collective_rpc
_names: VllmNames | None = None  # the running vLLM's, once installed
_active: list = []  # the worker whose wrapped call runs now: gpu_worker's helpers record into it


def install() -> None:
    """Wrap WorkerBase.__init__ so that every worker this process creates is recorded (idempotent).
    Only on a vLLM version the plugin was built for (the gate checked it)."""
    global _names
    if _names is not None:
        return
    version = vllm_version()
    names = names_for(version)
    if names is None:
        raise RuntimeError(f"vramledger: no hooks for vLLM {version}")
    module, cls = names.worker_base
    worker_base = getattr(importlib.import_module(module), cls)
    original = worker_base.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _guarded(None, "attach", attach, self)

    worker_base.__init__ = __init__
    _names = names


def attach(worker) -> None:
    """Give one worker its record, its wrappers and the RPC method that returns its ledger."""
    names = _version_names()
    _patch_gpu_worker_module(names)
    record = worker.vramledger_record = StartupRecord()
    setattr(worker, RPC_METHOD, lambda: document(worker, record))
    _wrap(worker, worker, names.init_device, after=_started)
    _wrap(worker, worker, names.size_kv_cache, before=_sizing, after=_sized)
    _wrap(worker, worker, names.allocate_kv_cache, before=_kv_cache_config)


# --- the worker's start-up calls, in vLLM's order ---
def _started(worker, record: StartupRecord, _result) -> None:
    if record.memory is None:  # no start snapshot went through request_memory: vLLM's CPU worker
        device = worker.device
        record.memory = OwnMemory(device.type, device.index or 0)
        record.process_at_start_bytes = record.read_own()
        if device.type == "cpu":
            node = _cpu_memory_node()
            record.total_bytes, record.free_at_start_bytes = node.total_memory, node.available_memory
    runner, capture = getattr(worker, "model_runner", None), _version_names().capture
    if runner is not None and hasattr(runner, capture):
        _wrap(worker, runner, capture, after=_captured, unless=_version_names().profile_only)


def _sizing(worker, record: StartupRecord) -> None:
    record.budget_models = frozenset(loaded_models(worker.model_runner))


def _sized(worker, record: StartupRecord, kv_bytes) -> None:
    record.kv_cache_sized_bytes = int(kv_bytes)
    if worker.cache_config.kv_cache_memory_bytes is not None:  # vLLM held itself to nothing else
        record.sized_by = "kv_cache_memory"
        return
    record.sized_by = "utilization"
    # The CUDA worker sizes against requested_memory, the CPU worker against requested_cpu_memory.
    budget = getattr(worker, "requested_memory", None) or getattr(worker, "requested_cpu_memory", None)
    record.budget_bytes = None if budget is None else int(budget)
    estimate = getattr(worker, "cudagraph_memory_estimate", None)
    if estimate is not None:
        from vllm import envs

        record.cuda_graph_estimate_bytes = int(estimate)
        record.cuda_graph_estimate_counted = bool(envs.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS and estimate)


def _kv_cache_config(worker, record: StartupRecord, kv_cache_config) -> None:
    record.blocks_total = int(kv_cache_config.num_blocks)
    record.block_size = int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)


def _captured(_worker, record: StartupRecord, nbytes) -> None:
    record.cuda_graph_bytes = int(nbytes or 0)  # the graphs kept: a capture only measuring is not noted


# --- gpu_worker's helpers, recorded into the worker that is starting ---
def _request_memory(original, init_snapshot, *args, **kwargs):
    requested = original(init_snapshot, *args, **kwargs)
    if _active:
        worker = _active[-1]
        _guarded(worker.vramledger_record, "the start snapshot", _start_snapshot, worker, init_snapshot)
    return requested


def _start_snapshot(worker, init_snapshot) -> None:
    record = worker.vramledger_record
    device = init_snapshot.device_
    record.memory = OwnMemory(device.type, device.index or 0, _torch_uuid(device))
    record.process_at_start_bytes = record.read_own()
    record.total_bytes, record.free_at_start_bytes = init_snapshot.total_memory, init_snapshot.free_memory


@contextlib.contextmanager
def _memory_profiling(original, baseline_snapshot, *args, **kwargs):
    with original(baseline_snapshot, *args, **kwargs) as result:
        yield result
    if _active:  # vLLM's worker reads the result next: recorded as vLLM measured it, then sized
        record = _active[-1].vramledger_record
        _guarded(record, "the memory profile", _profiled, record, result)
        _guarded(record, "own-process sizing", _size, record, result)


def _profiled(record: StartupRecord, result) -> None:
    now, start = record.read_own(), record.process_at_start_bytes
    growth = None if now is None or start is None else now - start
    record.profile = _version_names().profile_facts(result, growth)


def _size(record: StartupRecord, result) -> None:
    try:
        profile = record.profile
        if profile is None:
            raise RuntimeError("the memory profile was not recorded")
        size(record.sizing, profile, record.own_memory_unseen,
             functools.partial(_version_names().charge, result))
    except Exception as e:  # size() changes the result only once all is known: vLLM's figure stands
        record.sizing.ran = VLLM
        if record.sizing.requested == OWN_PROCESS:
            record.sizing.fall_back(FAILED, f"sizing failed ({type(e).__name__}: {e})")
        raise


def _patch_gpu_worker_module(names: VllmNames) -> None:
    gpu_worker = importlib.import_module(names.gpu_worker)
    for name, hook in ((names.start_snapshot, _request_memory), (names.profile, _memory_profiling)):
        original = getattr(gpu_worker, name)
        if not getattr(original, "_vramledger", False):
            wrapper = functools.wraps(original)(functools.partial(hook, original))
            setattr(wrapper, "_vramledger", True)
            setattr(gpu_worker, name, wrapper)


# --- plumbing ---
def _version_names() -> VllmNames:
    if _names is None:
        raise RuntimeError("vramledger: the hooks are not installed")
    return _names


def _wrap(worker, obj, name: str, before=None, after=None, unless=None) -> None:
    """Replace obj.name (the worker's or its runner's) on the instance by the original with notes around it:
    before(worker, record, *args), after(worker, record, result); none where unless(args, kwargs)."""
    original, record = getattr(obj, name), worker.vramledger_record

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if unless is not None and unless(args, kwargs):
            return original(*args, **kwargs)
        if before is not None:
            _guarded(record, name, before, worker, record, *args, **kwargs)
        _active.append(worker)
        try:
            result = original(*args, **kwargs)
        finally:
            _active.pop()
        if after is not None:
            _guarded(record, name, after, worker, record, result)
        return result

    setattr(obj, name, wrapper)


def _guarded(record: StartupRecord | None, what: str, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except Exception as e:  # the plugin must never break vLLM: the entry is left out instead
        message = f"vramledger: recording {what} failed ({type(e).__name__}: {e}); the ledger leaves it out"
        if record is not None:
            record.errors.append(message)
        log.warning(message)


def _cpu_memory_node():
    """The memory node vLLM's CPU worker sizes against, read as vLLM reads it."""
    cpu = importlib.import_module(_version_names().cpu_memory)
    return cpu.get_memory_node_info(cpu.get_allowed_cpu_list()[0].numa_node)


def _torch_uuid(device) -> str | None:
    try:
        import torch

        return str(torch.cuda.get_device_properties(device).uuid)
    except Exception:
        return None
