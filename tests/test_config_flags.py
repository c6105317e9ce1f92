"""EngineConfig is frozen (what the engine derives is a new config), and the worker's engine flags are
built from its fields: each flag's default, choices and help are the field's, written once."""
from __future__ import annotations

import dataclasses

import pytest

from vramledger.units import GiB
from vramledger.worker.cli import build_parser, engine_config, thread_settings
from vramledger.worker.config import (
    CPU_BATCHED_TOKENS,
    CUDA_BATCHED_TOKENS,
    CUDA_DEFAULT_UTILIZATION,
    DTYPES,
    MAX_DEFAULT_MODEL_LEN,
    EngineConfig,
)

FLAGGED = {f.name for f in dataclasses.fields(EngineConfig) if "flag" in f.metadata}
# Every flag set away from its default, and the field each one reaches.
SET = (["--model", "/m/target", "--draft-model", "/m/draft", "--num-speculative-tokens", "2",
        "--speculation", "fixed", "--device", "cpu", "--dtype", "bfloat16", "--block-size", "32",
        "--max-model-len", "100", "--max-num-seqs", "3", "--max-num-batched-tokens", "64", "--no-prefix-caching",
        "--memory-utilization", "0.5", "--kv-cache-memory", "1GiB", "--cpu-threads", "2", "--compile",
        "--compile-backend", "eager"],
       dict(model="/m/target", draft_model="/m/draft", num_speculative_tokens=2, speculation="fixed", device="cpu",
            dtype="bfloat16", block_size=32, max_model_len=100, max_num_seqs=3, max_num_batched_tokens=64,
            prefix_caching=False, memory_utilization=0.5, kv_cache_memory=GiB, cpu_threads=2, compile=True,
            compile_backend="eager"))


def parse(*argv: str) -> EngineConfig:
    return engine_config(build_parser().parse_args(["profile", *argv]))


def action(flag: str):
    profile = build_parser()._subparsers._group_actions[0].choices["profile"]
    return next(a for a in profile._actions if flag in a.option_strings)


def test_no_flags_give_the_fields_defaults():
    assert parse() == EngineConfig(**thread_settings(None))


def test_every_flag_reaches_its_field():
    argv, expected = SET
    assert set(expected) == FLAGGED  # a new flagged field is set here too
    config = parse(*argv)
    assert {name: getattr(config, name) for name in expected} == expected


def test_fields_without_a_flag_are_set_in_code_only():
    assert {f.name for f in dataclasses.fields(EngineConfig)} - FLAGGED == {"seed", "cpu_prompt_threads"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["profile", "--seed", "3"])


def test_the_off_switches_and_the_alias():
    plain = parse("--no-draft")
    assert (plain.draft_model, plain.num_speculative_tokens) == (None, 0)
    with pytest.raises(SystemExit):  # one or the other
        parse("--no-draft", "--draft-model", "/m/draft")
    assert parse("--gpu-memory-utilization", "0.3").memory_utilization == 0.3


def test_choices_and_defaults_in_the_help_are_the_fields():
    assert tuple(action("--dtype").choices) == DTYPES
    with pytest.raises(SystemExit):
        parse("--dtype", "int8")
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["profile"].format_help().split())
    assert f"(default {EngineConfig.num_speculative_tokens})" in help_text
    assert f"(default {CUDA_DEFAULT_UTILIZATION} on CUDA)" in help_text
    selfcheck = build_parser()._subparsers._group_actions[0].choices["selfcheck"]
    assert tuple(next(a for a in selfcheck._actions if "--dtype" in a.option_strings).choices) == DTYPES


def test_frozen_and_resolve_lengths_returns_a_new_config():
    config = EngineConfig(max_num_seqs=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_model_len = 64  # type: ignore[misc]
    on_cpu = config.resolve_lengths(4096, "cpu")
    assert (on_cpu.max_model_len, on_cpu.max_num_batched_tokens) == (MAX_DEFAULT_MODEL_LEN, CPU_BATCHED_TOKENS)
    assert config.resolve_lengths(512, "cuda").max_num_batched_tokens == CUDA_BATCHED_TOKENS
    assert config.resolve_lengths(512).max_model_len == 512  # the model's limit, below the cap
    assert (config.max_model_len, config.max_num_batched_tokens) == (0, 0)  # the original is untouched
    assert dataclasses.replace(on_cpu, max_num_seqs=2) == on_cpu  # everything else carried over
    given = EngineConfig(max_model_len=100, max_num_batched_tokens=64).resolve_lengths(4096, "cpu")
    assert (given.max_model_len, given.max_num_batched_tokens) == (100, 64)
    with pytest.raises(ValueError, match="max_model_len 100 exceeds the model's max_position_embeddings 64"):
        EngineConfig(max_model_len=100).resolve_lengths(64)


def test_the_default_utilization_is_resolved_once_in_the_config():
    assert EngineConfig().budget_utilization("cuda") == CUDA_DEFAULT_UTILIZATION
    assert EngineConfig().budget_utilization("cpu") is None  # the CPU's default KV cache
    assert EngineConfig(memory_utilization=0.4).budget_utilization("cpu") == 0.4
    assert EngineConfig(kv_cache_memory=GiB).budget_utilization("cuda") is None


def test_the_engine_resolves_its_own_copy_and_hands_it_to_the_server_state(checkpoints):
    """The server keeps the config it built; the engine and the requests-in-flight measurement (the
    ledger's `server` entry) use the engine's, its lengths resolved from the model."""
    from vramledger.worker.engine.llm_engine import LLMEngine

    config = EngineConfig(model=checkpoints["llama"], draft_model=None, max_num_seqs=2, device="cpu")
    seen = []
    engine = LLMEngine(config, lambda resolved, tokenizer, device: seen.append(resolved))
    assert (config.max_model_len, config.max_num_batched_tokens) == (0, 0)
    assert seen == [engine.config] and engine.config.max_model_len > 0
    assert engine.config == config.resolve_lengths(engine.config.max_model_len, "cpu")
