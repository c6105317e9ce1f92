"""Engine and memory settings: one validated dataclass."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
DEFAULT_MODEL = str(ASSETS / "tiny-coder-target")
DEFAULT_DRAFT_MODEL = str(ASSETS / "tiny-coder-draft")
# inductor generates kernels; dynamo's "eager" keeps the same graphs and guards and runs them with
# torch's ops: it checks in seconds that the models compile, without minutes of C++ builds.
COMPILE_BACKENDS = ("inductor", "eager")


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass
class EngineConfig:
    """Everything the engine needs to load models, size its KV cache and batch requests."""

    model: str = DEFAULT_MODEL
    draft_model: str | None = DEFAULT_DRAFT_MODEL
    num_speculative_tokens: int = 4  # K: every step's k with --speculation fixed, the upper bound with adaptive
    speculation: str = "adaptive"  # k in 0..K per step by measured cost; fixed: always K (for comparison)
    device: str = "auto"
    dtype: str = "auto"  # auto: fp32 on CPU, bf16 (or fp16) on CUDA
    block_size: int = 16
    max_model_len: int = 0  # 0: the model's max_position_embeddings, at most 2048 (resolve_lengths)
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 0  # prompt tokens a step; 0: 512 on the CPU, else 2048
    prefix_caching: bool = True  # reuse the KV blocks of prompts that start alike (block_manager.py)
    memory_utilization: float | None = None  # None: 0.9 on CUDA; on CPU the KV cache is capped at 2 GiB
    kv_cache_memory: int | None = None  # bytes; overrides memory_utilization
    seed: int = 0
    cpu_threads: int | None = None  # threads of a step on the CPU; None: torch's own (every core)
    # Threads of a step of one prompt alone (no other request in it) on the CPU; None: cpu_threads'.
    cpu_prompt_threads: int | None = None
    compile: bool = False  # torch.compile both models at startup (worker/models/compiled.py)
    compile_backend: str = "inductor"  # one of COMPILE_BACKENDS

    def __post_init__(self):
        if self.draft_model is None or self.num_speculative_tokens == 0:
            self.draft_model, self.num_speculative_tokens = None, 0
        _check(self.num_speculative_tokens >= 0, "num_speculative_tokens must be >= 0")
        _check(self.num_speculative_tokens <= 16, "num_speculative_tokens must be <= 16")
        _check(self.speculation in ("fixed", "adaptive"),
               f"speculation must be fixed or adaptive, not {self.speculation!r}")
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"),
               f"dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        _check(self.block_size in (8, 16, 32, 64, 128), "block_size must be one of 8, 16, 32, 64, 128")
        _check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _check(self.max_num_batched_tokens >= 0, "max_num_batched_tokens must be >= 1 (or 0: the default)")
        _check(self.max_model_len == 0 or self.max_model_len >= 2, "max_model_len must be >= 2 (or 0: the model's)")
        if self.memory_utilization is not None:
            _check(0 < self.memory_utilization <= 1 and math.isfinite(self.memory_utilization),
                   "memory_utilization must be in (0, 1]")
        _check(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory must be > 0")
        _check(self.cpu_threads is None or self.cpu_threads >= 1, "cpu_threads must be >= 1")
        _check(self.cpu_prompt_threads is None or self.cpu_prompt_threads >= 1, "cpu_prompt_threads must be >= 1")
        _check(self.compile_backend in COMPILE_BACKENDS,
               f"compile_backend must be one of {COMPILE_BACKENDS}, not {self.compile_backend!r}")

    def resolve_lengths(self, model_max_positions: int, device_kind: str = "cuda") -> None:
        """Fill max_model_len and max_num_batched_tokens once the model's limit and the device are known."""
        if not self.max_model_len:
            self.max_model_len = min(model_max_positions, 2048)
        _check(self.max_model_len <= model_max_positions,
               f"max_model_len {self.max_model_len} exceeds the model's "
               f"max_position_embeddings {model_max_positions}")
        if not self.max_num_batched_tokens:
            # Longer prompts are prefilled in chunks. On the CPU a prefill's tokens cost the same in chunks
            # of 512 as of 2048 (bench/prefill.py), and running streams wait a quarter as long.
            self.max_num_batched_tokens = 512 if device_kind == "cpu" else 2048

    @property
    def max_blocks_per_seq(self) -> int:
        # Verification writes k draft slots past the last committed token.
        return -(-(self.max_model_len + self.num_speculative_tokens) // self.block_size)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
