"""How big each scenario is on this device: models, lengths, KV sizes, neighbours, time limits.

On the CPU every size is small (the KV cache in MiB, set with --kv-cache-memory) so that a scenario
takes seconds; on CUDA the budgets are shares of the device and the neighbour scales with it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vramledger.units import GiB, MiB
from vramledger.worker.config import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL
from vramledger.worker.memory.plan import blocks_per_sequence
from vramledger.worker.models.packed_linear import packs
from vramledger.worker.selfcheck.checkpoints import ELEMENT_BYTES, kv_bytes_per_block, weight_bytes

# Scenario 3: the two workers' shares of the device (vLLM issue 55827: 0.7 + 0.2 started together).
PAIR_SHARES = (0.7, 0.2)
# On CUDA: the neighbour's share of the device, and what must stay free beside everything.
CUDA_NEIGHBOUR_SHARE, CUDA_MARGIN_SHARE = 0.04, 0.03


@dataclass
class Scale:
    """Every size the scenarios use, fixed before the first worker starts."""

    device: str  # what the workers get as --device: "cpu" or "cuda:N"
    kind: str  # "cpu" or "cuda"
    name: str  # "shipped" or "large"
    model: str
    draft_model: str
    element_bytes: int  # of the workers' dtype
    dtype: str = "auto"
    num_speculative_tokens: int = 4
    block_size: int = 16
    max_model_len: int = 512
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None  # None: the worker's default
    neighbour_bytes: int = 256 * MiB
    ready_timeout: float = 300.0
    load_timeout: float = 300.0
    threads: int | None = None  # OMP_NUM_THREADS for CPU workers (they share the cores)
    # How far the device's peak may pass the budget. On CUDA not at all: past it the GPU runs out. On
    # the CPU RSS also holds freed heap that malloc keeps; declared (allocator, server), it still came
    # to 0.04% over once in 5 runs: 1% until that is closed (docs/selfcheck.md).
    peak_slack: float = 0.0
    notes: list[str] = field(default_factory=list)

    # --- per-block and per-sequence sizes, from the checkpoints ---
    def block_bytes(self, draft: bool) -> int:
        models = (self.model, self.draft_model) if draft else (self.model,)
        return sum(kv_bytes_per_block(m, self.block_size, self.element_bytes) for m in models)

    def blocks_per_seq(self, draft: bool) -> int:
        k = self.num_speculative_tokens if draft else 0
        return blocks_per_sequence(self.max_model_len, self.block_size, k)

    def weight_bytes(self, path: str) -> int:
        """A model's weights as the workers hold them (packed: float32 on the CPU)."""
        packed = self.element_bytes == 4 and packs(self.kind, torch.float32)
        return weight_bytes(path, self.element_bytes, packed=packed)

    def usable_kv_bytes(self, draft: bool, max_num_seqs: int | None = None) -> int:
        """The most KV cache max_num_seqs sequences of max_model_len can use (the worker's cap)."""
        return (max_num_seqs or self.max_num_seqs) * self.blocks_per_seq(draft) * self.block_bytes(draft)

    # --- worker flags ---
    def engine_flags(self, draft: bool = True, max_num_seqs: int | None = None) -> list[str]:
        seqs = max_num_seqs or self.max_num_seqs
        flags = ["--device", self.device, "--model", self.model, "--dtype", self.dtype,
                 "--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len),
                 "--max-num-seqs", str(seqs), "--max-waiting", str(seqs), "--log-level", "WARNING"]
        if self.max_num_batched_tokens:
            flags += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if draft:
            return flags + ["--draft-model", self.draft_model,
                            "--num-speculative-tokens", str(self.num_speculative_tokens)]
        return flags + ["--no-draft"]

    def env(self) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(self.threads)} if self.threads else {}

    # --- scenario sizes ---
    def fill_kv_bytes(self) -> int:
        """Scenario 1: a KV cache a little smaller than max_num_seqs full sequences need, so a load
        of max_num_seqs sequences to max_model_len fills it (and preempts)."""
        return int(0.85 * self.usable_kv_bytes(draft=True))

    def no_draft_kv_bytes(self) -> int:
        """Scenario 2: the KV cache of the run without the draft, below the cap so it is the budget's."""
        return int(0.9 * self.usable_kv_bytes(draft=False))

    def pair_flags(self, total_bytes: int) -> list[list[str]]:
        """Scenario 3: the budget flags of the 0.7 and 0.2 workers."""
        if self.kind == "cpu":  # scaled: shares of what one worker's KV cache can use
            unit = self.usable_kv_bytes(draft=True)
            return [["--kv-cache-memory", f"{share * unit / MiB:.1f}MiB"] for share in PAIR_SHARES]
        flags = []
        for share in PAIR_SHARES:  # enough sequences that the KV cache takes the whole budget
            per_seq = self.blocks_per_seq(True) * self.block_bytes(True)
            seqs = max(self.max_num_seqs, math.ceil(share * total_bytes / per_seq) + 1)
            flags.append(["--memory-utilization", str(share), "--max-num-seqs", str(seqs)])
        return flags

    def pair_needs_free_bytes(self, total_bytes: int) -> int:
        """Free memory scenario 3 needs before it starts anything."""
        if self.kind == "cpu":  # two workers: weights, their KV caches, a GiB each for the rest
            weights = sum(self.weight_bytes(m) for m in (self.model, self.draft_model))
            return self.neighbour_bytes + 2 * (weights + self.usable_kv_bytes(True) + GiB)
        return int((sum(PAIR_SHARES) + CUDA_NEIGHBOUR_SHARE + CUDA_MARGIN_SHARE) * total_bytes)


def make_scale(kind: str, device: str, total_bytes: int, element_bytes: int, *, scale: str = "shipped",
               model: str | None = None, draft_model: str | None = None, dtype: str = "auto",
               num_speculative_tokens: int = 4, block_size: int = 16, max_model_len: int | None = None,
               max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
               large_models: tuple[Path, Path] | None = None) -> Scale:
    """The sizes for this device; explicit models and lengths win over the scale's defaults."""
    if dtype != "auto":
        element_bytes = ELEMENT_BYTES[dtype]
    notes = []
    if scale == "large":
        assert large_models is not None
        default_model, default_draft = (str(p) for p in large_models)
        notes.append("random Qwen2-shaped models (--scale large): weights are noise, output is gibberish")
    else:
        default_model, default_draft = DEFAULT_MODEL, DEFAULT_DRAFT_MODEL
    s = Scale(device=device, kind=kind, name=scale, model=model or default_model,
              draft_model=draft_model or default_draft, element_bytes=element_bytes, dtype=dtype,
              num_speculative_tokens=num_speculative_tokens, block_size=block_size, notes=notes)
    if kind == "cpu":
        # Small enough for seconds per scenario on two cores; one thread per worker, since several
        # workers and the load share the cores (more threads than cores slow every step tenfold).
        s.max_model_len, s.max_num_seqs = max_model_len or 512, max_num_seqs or 8
        # One prompt a prefill step keeps the activations (and the heap they fragment) small next to
        # the process: with 2048-token prefills the peak RSS under load moves by +-5% from run to run.
        s.max_num_batched_tokens = max_num_batched_tokens or s.max_model_len
        s.neighbour_bytes = 256 * MiB
        s.threads = int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS") else 1
        s.ready_timeout = s.load_timeout = 300.0
        s.peak_slack = 0.01
    else:
        s.max_model_len = max_model_len or 2048
        s.max_num_seqs = max_num_seqs or (64 if scale == "large" else 256)
        s.max_num_batched_tokens = max_num_batched_tokens
        s.neighbour_bytes = int(CUDA_NEIGHBOUR_SHARE * total_bytes)
        s.ready_timeout, s.load_timeout = 600.0, 600.0
    return s
