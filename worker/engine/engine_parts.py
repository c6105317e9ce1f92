"""Loading what an engine serves with, and checking it: tokenizer, models, kernels, compiled steps,
the memory plan and the KV cache it sizes. Each part is timed as a start-up phase."""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vramledger.worker.config import EngineConfig
from vramledger.worker.engine.memory_setup import plan_memory
from vramledger.worker.engine.model_runner import ModelRunner
from vramledger.worker.engine.startup import StartupPhases
from vramledger.worker.memory.device import Device, get_device
from vramledger.worker.memory.ledger import Ledger, format_table, summary_line
from vramledger.worker.memory.profiler import collecting_only_new_objects, measure_held, measure_weights
from vramledger.worker.models.llama import CausalLM
from vramledger.worker.models.loader import (
    ModelLoadError,
    load_config,
    load_model,
    load_tokenizer,
    same_tokenizer_files,
)

log = logging.getLogger(__name__)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# (config with its lengths resolved, tokenizer, device) -> what a server holds for its requests in flight
ServerState = Callable[[EngineConfig, object, torch.device], object]


@dataclass
class EngineParts:
    """An engine's parts once loaded: its settings with the lengths the target allows, the ledger
    (complete), and the runner with its KV cache of num_blocks blocks."""

    config: EngineConfig
    device: Device
    startup: StartupPhases
    tokenizer: Any  # the checkpoint's (models/tokenizer.py) or transformers'
    ledger: Ledger
    runner: ModelRunner
    num_blocks: int
    eos_token_ids: set[int]
    vocab_size: int


def load_engine_parts(config: EngineConfig, server_state: ServerState | None = None) -> EngineParts:
    """Load and measure everything the engine serves with; server_state is measured into the ledger's
    `server` entry (worker/http/request_state.py)."""
    device = get_device(config.device)
    if device.kind == "cpu" and config.cpu_threads:  # before the profile: it measures serving's threads
        torch.set_num_threads(config.cpu_threads)
    for path in filter(None, (config.model, config.draft_model)):
        load_config(path)  # a bad path or architecture fails before anything is loaded
    startup = StartupPhases()  # each phase logged; the server publishes them once it serves
    with startup.phase("tokenizer"):
        tokenizer = load_tokenizer(config.model)
        if config.draft_model:
            check_same_tokenizer(tokenizer, config)
    ledger = Ledger.at_start(device, config.model, config.draft_model)
    with collecting_only_new_objects():
        target, draft = load_models(config, device, startup, ledger)
        config = config.resolve_lengths(target.config.max_position_embeddings, device.kind)
        runner = ModelRunner(target, draft, config.block_size, device.torch_device)
        if device.kind == "cpu" and config.cpu_prompt_threads not in (None, config.cpu_threads):
            runner.prompt_threads = config.cpu_prompt_threads  # before the profile: it measures them
        prepare_steps(runner, config, device, startup, ledger)
        held_by_server = None if server_state is None else functools.partial(
            server_state, config, tokenizer, device.torch_device)
        with startup.phase("memory_profile"):
            num_blocks = plan_memory(runner, config, device, ledger, tokenizer, held_by_server)
        with startup.phase("kv_cache"):
            runner.allocate_kv_cache(num_blocks)
    log.info(summary_line(ledger))
    log.debug("memory ledger:\n%s", format_table(ledger))
    return EngineParts(config, device, startup, tokenizer, ledger, runner, num_blocks,
                       eos_ids(tokenizer, target.config), target.config.vocab_size)


def load_models(config: EngineConfig, device: Device, startup: StartupPhases,
                ledger: Ledger) -> tuple[CausalLM, CausalLM | None]:
    """The target and the draft (None without one), each one's weights measured into the ledger."""
    dtype = device.dtype if config.dtype == "auto" else TORCH_DTYPES[config.dtype]
    pack = not config.compile  # inductor packs plain weights itself (compiled.py)

    def load(role: str, path: str) -> CausalLM:
        with startup.phase(f"weights_{role}"):
            model, nbytes = measure_weights(device, lambda: load_model(path, dtype, device.torch_device, pack))
        ledger.record("weights", nbytes, model=role)
        return model

    target = load("target", config.model)
    draft = load("draft", config.draft_model) if config.draft_model else None
    if draft is not None and draft.config.vocab_size != target.config.vocab_size:
        raise ModelLoadError(f"draft vocab_size {draft.config.vocab_size} differs from the "
                             f"target's {target.config.vocab_size}")
    return target, draft


def prepare_steps(runner: ModelRunner, config: EngineConfig, device: Device, startup: StartupPhases,
                  ledger: Ledger) -> None:
    """Build the kernels and (with --compile) the compiled steps, each measured into the ledger: both
    before the profile, which then measures the steps serving runs."""
    with startup.phase("kernels"):
        # They stay in oneDNN's cache for the process's life: what it grew by is theirs.
        ledger.record("kernels", measure_held(device, runner.warm_kernels))
    ledger.record("compiled", 0)
    if config.compile:
        with startup.phase("compile"):
            ledger.record("compiled", measure_held(device, lambda: runner.compile(config.compile_backend)))


def eos_ids(tokenizer, model_config) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(model_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def check_same_tokenizer(target_tok, config: EngineConfig) -> None:
    """The draft's tokenizer must be the target's: same files need no second load to compare."""
    assert config.draft_model is not None
    if same_tokenizer_files(config.model, config.draft_model):
        return
    draft_tok = load_tokenizer(config.draft_model)
    if target_tok.get_vocab() != draft_tok.get_vocab() or target_tok.eos_token_id != draft_tok.eos_token_id:
        raise ModelLoadError(f"the draft model's tokenizer ({config.draft_model}) differs from the "
                             f"target's ({config.model}); speculative decoding needs the same tokenizer "
                             "(use --no-draft to serve without a draft)")
