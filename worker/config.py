"""Engine and memory settings: one validated, frozen dataclass. Each field that is a command-line flag
carries its help, choices and the like in its metadata (`flag(...)`), and worker/cli.py builds the
flags from them, so a default, a help text or a list of choices is written once, here."""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vramledger.units import parse_size

ASSETS = Path(__file__).parent / "assets"
DEFAULT_MODEL = str(ASSETS / "tiny-coder-target")
DEFAULT_DRAFT_MODEL = str(ASSETS / "tiny-coder-draft")
# inductor generates kernels; dynamo's "eager" keeps the same graphs and guards and runs them with
# torch's ops: it checks in seconds that the models compile, without minutes of C++ builds.
COMPILE_BACKENDS = ("inductor", "eager")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: fp32 on CPU, bf16 (or fp16) on CUDA
SPECULATION = ("fixed", "adaptive")
BLOCK_SIZES = (8, 16, 32, 64, 128)
CUDA_DEFAULT_UTILIZATION = 0.9  # the budget's share of a GPU when memory_utilization is None
CPU_BATCHED_TOKENS, CUDA_BATCHED_TOKENS = 512, 2048  # max_num_batched_tokens when 0 (resolve_lengths)
MAX_DEFAULT_MODEL_LEN = 2048  # max_model_len when 0: the model's limit, at most this


@dataclass(frozen=True)
class Flag:
    """How a field is set on the command line: `--<field-name>` unless `name` says otherwise."""

    help: str | None = None  # may say "%(default)s": argparse writes the field's default there
    metavar: str | None = None
    choices: tuple | None = None
    parse: Callable[[str], Any] | None = None  # None: the field's own type
    name: str | None = None
    aliases: tuple[str, ...] = ()
    off: str | None = None  # a flag that switches the setting off (False, or None for an optional path)
    off_help: str | None = None


def flag(default: Any, help: str | None = None, **how: Any) -> Any:
    """A field's default, and how the command line sets it (the `flag` of its metadata)."""
    return field(default=default, metadata={"flag": Flag(help=help, **how)})


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to load models, size its KV cache and batch requests. Frozen: what
    the engine derives (resolve_lengths) is a new config, so the server's copy never changes under it."""

    model: str = flag(DEFAULT_MODEL, "target checkpoint directory (default: shipped pair)")
    draft_model: str | None = flag(DEFAULT_DRAFT_MODEL, "draft checkpoint directory", off="--no-draft",
                                   off_help="plain decoding, no draft model")
    # K: every step's k with --speculation fixed, the upper bound with adaptive
    num_speculative_tokens: int = flag(4, "draft tokens per step: the upper bound with adaptive speculation "
                                          "(default %(default)s)", metavar="K")
    # k in 0..K per step by measured cost; fixed: always K (for comparison)
    speculation: str = flag("adaptive", "adaptive (default): k in 0..K each step, by measured acceptance and "
                                        "step costs; fixed: always K", choices=SPECULATION)
    device: str = flag("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = flag("auto", choices=DTYPES)
    block_size: int = flag(16, choices=BLOCK_SIZES)
    max_model_len: int = flag(0, "longest prompt + output in tokens (default: the model's limit, at most "
                                 f"{MAX_DEFAULT_MODEL_LEN})", metavar="N")
    max_num_seqs: int = flag(16, metavar="N")
    max_num_batched_tokens: int = flag(0, f"prompt tokens one step computes beside its decoding requests (default "
                                          f"{CPU_BATCHED_TOKENS} on the CPU, else {CUDA_BATCHED_TOKENS}); longer "
                                          "prompts are prefilled in chunks, and running requests get a token "
                                          "every step", metavar="N")
    # reuse the KV blocks of prompts that start alike (block_manager.py)
    prefix_caching: bool = flag(True, off="--no-prefix-caching",
                                off_help="compute every prompt whole (by default a prompt that starts like an "
                                         "earlier one reuses its cached KV blocks)")
    # None: CUDA_DEFAULT_UTILIZATION on CUDA; on CPU the KV cache is capped at 2 GiB
    memory_utilization: float | None = flag(None, "budget as a share of device memory (default "
                                                  f"{CUDA_DEFAULT_UTILIZATION} on CUDA)", metavar="F",
                                            aliases=("--gpu-memory-utilization",))
    kv_cache_memory: int | None = flag(None, "explicit KV cache size, e.g. 2GiB (overrides --memory-utilization)",
                                       metavar="SIZE", parse=parse_size)  # bytes
    seed: int = 0
    # threads of a step on the CPU; None: torch's own (every core). The CLI's default: cli.thread_settings
    cpu_threads: int | None = flag(None, "threads of a step on the CPU (default: OMP_NUM_THREADS when set, else "
                                         "every core but one, left to the server's HTTP and tokenizer threads, "
                                         "and every core for a step that prefills one prompt with no other "
                                         "request in it); small steps run on one", metavar="N")
    # Threads of a step of one prompt alone (no other request in it) on the CPU; None: cpu_threads'.
    cpu_prompt_threads: int | None = None
    # torch.compile both models at startup (worker/models/compiled.py)
    compile: bool = flag(False, "compile both models with torch.compile (inductor) at startup (minutes); the "
                                "ledger's `compiled` entry holds what it costs. Not faster on the CPU so far "
                                "(docs/benchmarks.md)")
    compile_backend: str = flag("inductor", "with --compile: inductor (default) generates kernels; eager keeps "
                                            "dynamo's graphs and guards and runs them with torch's ops (checks "
                                            "in seconds that the models compile)", choices=COMPILE_BACKENDS)

    def __post_init__(self):
        if self.draft_model is None or self.num_speculative_tokens == 0:  # one way to say "no draft"
            object.__setattr__(self, "draft_model", None)
            object.__setattr__(self, "num_speculative_tokens", 0)
        _check(self.num_speculative_tokens >= 0, "num_speculative_tokens must be >= 0")
        _check(self.num_speculative_tokens <= 16, "num_speculative_tokens must be <= 16")
        _check(self.speculation in SPECULATION, f"speculation must be {_either(SPECULATION)}, not {self.speculation!r}")
        _check(self.dtype in DTYPES, f"dtype must be {_either(DTYPES)}, not {self.dtype!r}")
        _check(self.block_size in BLOCK_SIZES, f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}")
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

    def resolve_lengths(self, model_max_positions: int, device_kind: str = "cuda") -> EngineConfig:
        """This config with max_model_len and max_num_batched_tokens filled in, once the model's limit
        and the device are known."""
        max_model_len = self.max_model_len or min(model_max_positions, MAX_DEFAULT_MODEL_LEN)
        _check(max_model_len <= model_max_positions,
               f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {model_max_positions}")
        # Longer prompts are prefilled in chunks. On the CPU a prefill's tokens cost the same in chunks
        # of 512 as of 2048 (bench/prefill.py), and running streams wait a quarter as long.
        batched = self.max_num_batched_tokens or (CPU_BATCHED_TOKENS if device_kind == "cpu" else CUDA_BATCHED_TOKENS)
        return replace(self, max_model_len=max_model_len, max_num_batched_tokens=batched)

    def budget_utilization(self, device_kind: str) -> float | None:
        """The budget's share of the device: memory_utilization, else CUDA_DEFAULT_UTILIZATION on CUDA;
        None where no share sizes it (kv_cache_memory given, or the CPU's default KV cache)."""
        if self.memory_utilization is not None or self.kv_cache_memory is not None or device_kind == "cpu":
            return self.memory_utilization
        return CUDA_DEFAULT_UTILIZATION

    @property
    def max_blocks_per_seq(self) -> int:
        # Verification writes k draft slots past the last committed token.
        return -(-(self.max_model_len + self.num_speculative_tokens) // self.block_size)


def _either(names: tuple[str, ...]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
