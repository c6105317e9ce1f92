"""What one vLLM worker measured while it started, kept for its ledger."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vramledger.vllm_plugin.own_memory import OwnMemory, OwnMemoryUnseen
from vramledger.vllm_plugin.sizing import Sizing

log = logging.getLogger("vllm.plugins.vramledger")


@dataclass
class ProfileFacts:
    """vLLM's memory profile (vllm/utils/mem_utils.py memory_profiling), with our process's own growth."""

    consumed_bytes: int  # free memory at the start snapshot minus free memory after the profile (device)
    torch_increase_bytes: int  # torch's reserved memory, start snapshot to after the profile (process)
    non_torch_increase_bytes: int  # the rest of consumed_bytes (device)
    peak_headroom_bytes: int  # torch's peak allocated above what stays allocated (process)
    weights_bytes: int  # vLLM's measurement of its loads, all models together (process)
    non_kv_bytes: int  # what vLLM charged its budget before the KV cache
    process_growth_bytes: int | None  # what this process grew by over the same window (NVML), None unknown

    @property
    def non_torch_process_bytes(self) -> int | None:
        """Our own non-torch growth over the window: non_torch_increase_bytes without the neighbours'."""
        growth = self.process_growth_bytes
        return None if growth is None else growth - self.torch_increase_bytes


@dataclass
class StartupRecord:
    """Facts a worker measured at start-up; the ledger reads what vLLM still holds when it is asked."""

    memory: OwnMemory | None = None  # set once the worker knows its device
    process_at_start_bytes: int | None = None  # when vLLM took its start snapshot
    total_bytes: int | None = None
    free_at_start_bytes: int | None = None
    # What vLLM sized its KV cache against: "utilization" (a budget), "kv_cache_memory" (a size given).
    sized_by: str | None = None
    budget_bytes: int | None = None
    budget_models: frozenset[str] = frozenset()  # models loaded when vLLM measured for its budget
    kv_cache_sized_bytes: int | None = None  # what vLLM's sizing returned for the KV cache
    profile: ProfileFacts | None = None
    cuda_graph_estimate_bytes: int | None = None
    cuda_graph_estimate_counted: bool = False  # the estimate was taken from the KV cache's share
    cuda_graph_bytes: int | None = None  # the free memory the capture took (device)
    block_size: int = 0
    blocks_total: int = 0
    sizing: Sizing = field(default_factory=Sizing.from_environment)
    own_memory_unseen: str | None = None  # why NVML could not see this process, the first time it could not
    errors: list[str] = field(default_factory=list)  # a hook that failed: its entry stays absent

    def read_own(self) -> int | None:
        """This process's memory now; None (the reason kept, and logged once) where it cannot be seen."""
        if self.memory is None:
            return None
        try:
            return self.memory.read()
        except OwnMemoryUnseen as e:
            if self.own_memory_unseen is None:
                self.own_memory_unseen = str(e)
                log.warning("vramledger: %s; the ledger leaves out what it would read there (the runtime entry, "
                            "the process's growth, its live memory)", e)
            return None
