"""One vLLM rank's ledger, in the vocabulary of the worker's GET /v1/memory (docs/ledger.md, docs/vllm.md).

Start-up facts come from the rank's record; what vLLM holds (weights, KV cache) and the process's
memory are read when the ledger is asked for. An entry vLLM's backend does not know is absent.
"""
from __future__ import annotations

import platform
import time

from vramledger.identity import ProcessIdentity
from vramledger.ledger_document import (
    Component,
    DeviceDoc,
    EntryDoc,
    KvCacheDoc,
    LedgerDocument,
    ModelsDoc,
    ProfileDoc,
    Scope,
)
from vramledger.ledger_vocabulary import COMPONENTS, LEDGER_VERSION, SCOPE_DEVICE, SCOPE_PROCESS
from vramledger.vllm_plugin.record import StartupRecord
from vramledger.vllm_plugin.sizing import OWN_PROCESS, own_charge
from vramledger.vllm_plugin.tensors import model_bytes, storage_bytes

_identity: ProcessIdentity | None = None
NULL_BLOCKS = 1  # BlockPool.__init__ takes the first free block as its null block, for good


def document(worker, record: StartupRecord) -> LedgerDocument:
    """The rank's ledger as JSON-ready data (sent back through vLLM's collective_rpc)."""
    entries = _entries(worker, record)
    declared = sum(e["bytes"] for e in entries)
    process = record.read_own()
    kv = next((e["bytes"] for e in entries if e["component"] == "kv_cache"), 0)
    cache_config = worker.cache_config
    return {
        "version": LEDGER_VERSION,
        "engine": "vllm",
        "rank": worker.rank,
        "local_rank": worker.local_rank,
        "worker": _process_identity().to_dict(),
        "models": _model_names(worker),
        "device": _device(worker, record),
        "budget": {"bytes": record.budget_bytes, "utilization": cache_config.gpu_memory_utilization,
                   "kv_cache_memory": cache_config.kv_cache_memory_bytes, "sized_by": record.sized_by},
        "entries": entries,
        "declared_bytes": declared,
        "kv_cache": _kv_cache(record, kv),
        "profile": _profile(record),
        "sizing": record.sizing.to_dict(),
        "live": {"process_bytes": process, "process_source": record.memory.source if record.memory else None,
                 "declared_bytes": declared,
                 "unaccounted_bytes": None if process is None else max(0, process - declared),
                 "measured_at": time.time()},
        "errors": list(record.errors),
    }


def _entries(worker, record: StartupRecord) -> list[EntryDoc]:
    budgeted = record.sized_by == "utilization"
    cuda = record.memory is not None and record.memory.kind == "cuda"
    entries: list[EntryDoc] = []

    def add(component: Component, nbytes: int, scope: Scope, in_budget: bool, model: str = "") -> None:
        entries.append({"component": component, "model": model, "bytes": int(nbytes), "scope": scope,
                        "in_budget": in_budget if budgeted else None})

    if record.process_at_start_bytes is not None:
        # CUDA: held before vLLM's start snapshot, outside its budget; the CPU worker's budget
        # subtracts the whole RSS, this included.
        add("runtime", record.process_at_start_bytes, SCOPE_PROCESS, in_budget=not cuda)
    seen: set = set()  # a tensor both models share is the target's
    for name, model in loaded_models(worker.model_runner).items():
        held, counted = model_bytes(model, seen), name in record.budget_models
        add("weights", held.weights, SCOPE_PROCESS, in_budget=counted, model=name)
        if held.kernel_copies:
            add("kernels", held.kernel_copies, SCOPE_PROCESS, in_budget=counted, model=name)
    if record.profile is not None:
        add("activation_peak", record.profile.peak_headroom_bytes, SCOPE_PROCESS, in_budget=True)
        p = record.profile
        own = own_charge(p.torch_increase_bytes, p.process_growth_bytes) if record.sizing.ran == OWN_PROCESS else None
        if own is not None:  # what was charged: this process's own
            add("non_torch", own[1], SCOPE_PROCESS, in_budget=True)
        else:
            add("non_torch", record.profile.non_torch_increase_bytes, SCOPE_DEVICE, in_budget=True)
    if record.cuda_graph_bytes is not None:
        add("cuda_graph", record.cuda_graph_bytes, SCOPE_DEVICE, in_budget=record.cuda_graph_estimate_counted)
    if record.blocks_total:
        add("kv_cache", storage_bytes(worker.model_runner.kv_caches, set()), SCOPE_PROCESS, in_budget=True)
    return sorted(entries, key=lambda e: COMPONENTS.index(e["component"]))


def _kv_cache(record: StartupRecord, kv_bytes: int) -> KvCacheDoc:
    """The KV cache's blocks as vLLM's scheduler counts them: it keeps one block back, never handed out
    (vllm/v1/core/block_pool.py: the null block, which vllm:kv_cache_usage_perc does not count)."""
    reserved = min(NULL_BLOCKS, record.blocks_total)
    usable = record.blocks_total - reserved
    return {"block_size": record.block_size,
            "bytes_per_block": kv_bytes // record.blocks_total if record.blocks_total else 0,
            "blocks_total": usable, "blocks_reserved": reserved,
            "capacity_tokens": usable * record.block_size,
            "sized_bytes": record.kv_cache_sized_bytes}


def loaded_models(runner) -> dict:
    """The models a runner holds now, by ledger name: "target", and "draft" when it speculates with one."""
    models = {}
    if getattr(runner, "model", None) is not None:  # set by load_model
        models["target"] = runner.get_model()
    draft = runner.get_draft_model() if hasattr(runner, "get_draft_model") else None
    if draft is not None:
        models["draft"] = draft
    return models


def _profile(record: StartupRecord) -> ProfileDoc | None:
    p = record.profile
    if p is None:
        return None
    return {"consumed_bytes": p.consumed_bytes, "torch_increase_bytes": p.torch_increase_bytes,
            "non_torch_increase_bytes": p.non_torch_increase_bytes,
            "peak_headroom_bytes": p.peak_headroom_bytes, "weights_bytes": p.weights_bytes,
            "non_kv_bytes": p.non_kv_bytes, "process_growth_bytes": p.process_growth_bytes,
            "non_torch_process_bytes": p.non_torch_process_bytes,
            "cuda_graph_estimate_bytes": record.cuda_graph_estimate_bytes,
            "cuda_graph_estimate_counted": record.cuda_graph_estimate_counted}


def _model_names(worker) -> ModelsDoc:
    speculative = worker.vllm_config.speculative_config
    draft = getattr(speculative, "draft_model_config", None) if speculative is not None else None
    return {"target": worker.model_config.model, "draft": getattr(draft, "model", None)}


def _device(worker, record: StartupRecord) -> DeviceDoc:
    device = worker.device
    memory = record.memory
    name = memory.device_name() if memory is not None else None
    return {"kind": device.type, "index": device.index or 0,
            "uuid": memory.device_uuid() if memory is not None else None,
            "name": name or (platform.machine() if device.type == "cpu" else str(device)),
            "total_bytes": record.total_bytes, "free_at_start_bytes": record.free_at_start_bytes}


def _process_identity() -> ProcessIdentity:
    global _identity
    if _identity is None:
        _identity = ProcessIdentity.current()
    return _identity
