"""vLLM 0.32's names: where the hooks listen, how its profile result is read and rewritten.

The profile result is vllm/utils/mem_utils.py's MemoryProfilingResult: `total_consumed` (free
memory at the start snapshot minus free memory after the profile), `non_torch_increase`,
`transient_peak_headroom`, `weights_memory`, `non_kv_cache_memory` (the charge before the KV cache)
and the snapshots `before_create`, `after_profile`. Both model runners are covered: the V1 runner's
`capture_model()` (vllm/v1/worker/gpu_model_runner.py) and the V2 runner's
`capture_model(*, profile_only=False)` (vllm/v1/worker/gpu/model_runner.py, the default where Triton
runs and the model's features allow), which vLLM's graph memory estimate also calls, with
`profile_only=True`, on graphs it throws away.
"""
from __future__ import annotations

from vramledger.vllm_plugin.record import ProfileFacts
from vramledger.vllm_plugin.versions import VllmNames
from vramledger.vllm_plugin.versions.source import Attributes, Function, Imported

WORKER_BASE = ("vllm.v1.worker.worker_base", "WorkerBase")
GPU_WORKER, CPU_WORKER = "vllm.v1.worker.gpu_worker", "vllm.v1.worker.cpu_worker"
START_SNAPSHOT, PROFILE = "request_memory", "memory_profiling"
MEM_UTILS, CPU_MEMORY = "vllm.utils.mem_utils", "vllm.utils.cpu_resource_utils"
V1_RUNNER, V2_RUNNER = "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"
RESULT_FIELDS = ("total_consumed", "non_torch_increase", "transient_peak_headroom", "weights_memory",
                 "non_kv_cache_memory", "before_create", "after_profile")
SNAPSHOT_FIELDS = ("torch_memory", "free_memory", "total_memory", "cuda_memory", "non_torch_memory", "device_")


def profile_facts(result, process_growth: int | None) -> ProfileFacts:
    return ProfileFacts(
        consumed_bytes=int(result.total_consumed),
        torch_increase_bytes=int(result.after_profile.torch_memory - result.before_create.torch_memory),
        non_torch_increase_bytes=int(result.non_torch_increase),
        peak_headroom_bytes=int(result.transient_peak_headroom),
        weights_bytes=int(result.weights_memory),
        non_kv_bytes=int(result.non_kv_cache_memory),
        process_growth_bytes=process_growth)


def charge(result, consumed: int, non_torch: int, non_kv: int) -> None:
    """What the worker's determine_available_memory reads after the profile: the charge
    (non_kv_cache_memory) and free memory after it, for its check that free memory did not grow, as
    if no other process had moved."""
    after = result.after_profile
    after.free_memory = result.before_create.free_memory - consumed
    after.cuda_memory = after.total_memory - after.free_memory
    after.non_torch_memory = after.cuda_memory - after.torch_memory
    result.total_consumed, result.non_torch_increase = consumed, non_torch
    result.non_kv_cache_memory = non_kv


def profile_only(args: tuple, kwargs: dict) -> bool:
    return bool(kwargs.get("profile_only", False))  # keyword-only in the V2 runner


NAMES = VllmNames(
    version="0.32", worker_base=WORKER_BASE, init_device="init_device",
    size_kv_cache="determine_available_memory", allocate_kv_cache="initialize_from_config",
    capture="capture_model", gpu_worker=GPU_WORKER, start_snapshot=START_SNAPSHOT, profile=PROFILE,
    cpu_memory=CPU_MEMORY, profile_facts=profile_facts, charge=charge, profile_only=profile_only,
    source=(
        Function(WORKER_BASE[0], f"{WORKER_BASE[1]}.__init__",
                 "(self, vllm_config: VllmConfig, local_rank: int, rank: int, distributed_init_method: str, "
                 "is_driver_worker: bool=False)"),
        Function(GPU_WORKER, "Worker.init_device", "(self)"),
        Function(GPU_WORKER, "Worker.determine_available_memory", "(self)"),
        Function(GPU_WORKER, "Worker.initialize_from_config", "(self, kv_cache_config: KVCacheConfig)"),
        Function(CPU_WORKER, "CPUWorker.determine_available_memory", "(self)"),
        Attributes(GPU_WORKER, "Worker", ("model_runner", "device", "requested_memory", "cudagraph_memory_estimate")),
        Attributes(CPU_WORKER, "CPUWorker", ("requested_cpu_memory",)),
        Imported(GPU_WORKER, START_SNAPSHOT, "vllm.v1.worker.utils"),
        Function("vllm.v1.worker.utils", START_SNAPSHOT,
                 "(init_snapshot: MemorySnapshot, cache_config: CacheConfig, external_weight_memory: int=0)"),
        Imported(GPU_WORKER, PROFILE, MEM_UTILS),
        Function(MEM_UTILS, PROFILE, "(baseline_snapshot: MemorySnapshot, weights_memory: int=0)"),
        Attributes(MEM_UTILS, "MemoryProfilingResult", RESULT_FIELDS),
        Attributes(MEM_UTILS, "MemorySnapshot", SNAPSHOT_FIELDS),
        Function(V1_RUNNER, "GPUModelRunner.capture_model", "(self)"),
        Function(V2_RUNNER, "GPUModelRunner.capture_model", "(self, *, profile_only: bool=False)"),
        Function(V1_RUNNER, "GPUModelRunner.get_model", "(self)"),
        Function(V1_RUNNER, "GPUModelRunner.get_draft_model", "(self)"),
        Function(V2_RUNNER, "GPUModelRunner.get_model", "(self)"),
        Function(V2_RUNNER, "GPUModelRunner.get_draft_model", "(self)"),
        Attributes("vllm.v1.kv_cache_interface", "KVCacheConfig", ("num_blocks", "kv_cache_groups")),
        Attributes("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", ("kv_cache_spec",)),
        Function(CPU_MEMORY, "get_memory_node_info", "(node_id: int=0)"),
        Function(CPU_MEMORY, "get_allowed_cpu_list", "()"),
    ))
