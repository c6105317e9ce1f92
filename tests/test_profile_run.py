"""The profile run steps the engine's own step code at the heaviest shapes the engine runs, whatever k the
policy picks: what a step holds is measured."""
import pytest
import torch

from vramledger.worker.config import EngineConfig
from vramledger.worker.engine.model_runner import ModelRunner
from vramledger.worker.engine.profile_run import prefill_shapes, profile_blocks, run_worst_case
from vramledger.worker.engine.speculation import CATCH_UP_AFTER
from vramledger.worker.models.loader import load_model


@pytest.mark.parametrize("speculation, behind", [("fixed", 2), ("adaptive", CATCH_UP_AFTER)])
def test_decode_step_proposes_k_after_the_longest_catch_up(checkpoints, speculation, behind):
    cpu = torch.device("cpu")
    config = EngineConfig(model=checkpoints["llama"], draft_model=checkpoints["llama-draft"], max_model_len=64,
                          max_num_seqs=3, num_speculative_tokens=3, speculation=speculation)
    config = config.resolve_lengths(64)
    runner = ModelRunner(load_model(config.model, torch.float32, cpu),
                         load_model(config.draft_model, torch.float32, cpu), config.block_size, cpu)
    runner.allocate_kv_cache(profile_blocks(config))
    calls, forward, forward_parts, inside = [], runner.forward, runner.forward_parts, []

    def record(name, rows, *args, prefill=False, **kw):
        if not inside:  # not a part of a recorded forward_parts
            calls.append((name, len(rows), len(rows[0]), prefill))
        return forward(name, rows, *args, prefill=prefill, **kw)

    def record_parts(name, parts):
        calls.append((name, "parts", [(len(rows), len(rows[0]), prefill) for rows, *_, prefill in parts]))
        inside.append(name)
        try:
            return forward_parts(name, parts)
        finally:
            inside.pop()

    runner.forward, runner.forward_parts = record, record_parts
    run_worst_case(runner, config)
    # The target's prefills with the rows decoding beside them (as many as may run with them), the
    # draft's prefills, and then the decode step.
    shapes = prefill_shapes(runner, config, 64)
    prefills = [call for call in calls if call[1] == "parts" or call[-1]]
    assert prefills == [c for (rows, width, _) in shapes for c in (
        ("target", "parts", [(rows, width, True)] + ([(3 - rows, 1, False)] if rows < 3 else [])),
        ("draft", rows, width, True))]
    decode = [call[:3] for call in calls if call not in prefills]
    # A plain step runs the target alone; a step that proposes again first feeds the draft what it missed
    # (the bonus token, or after plain steps what its catch-up left), then proposes k-1 more, then verifies k+1.
    assert decode == [("draft", 3, behind), ("draft", 3, 1), ("draft", 3, 1), ("target", 3, 4)]


def test_every_prefill_step_of_serving_fits_the_profiled_shapes(checkpoints):
    """Chunks and cache hits make prefill rows that start past position 0: the profile runs the
    widest such step (as many rows as may run, at the longest context), and serving's prefill
    steps never pass the token budget the profile's steps fill."""
    from vramledger.worker.engine.llm_engine import LLMEngine
    from vramledger.worker.engine.sampling_params import SamplingParams

    config = EngineConfig(model=checkpoints["llama"], draft_model=checkpoints["llama-draft"],
                          max_model_len=96, max_num_seqs=6, max_num_batched_tokens=32)
    engine = LLMEngine(config)
    shapes = prefill_shapes(engine.runner, config, 96)
    assert shapes[:2] == [(1, 32, 0), (6, 5, 91)]  # from position 0; the most rows at the longest context
    assert all(rows * width <= 32 and start + width <= 96 for rows, width, start in shapes)
    steps, schedule = [], engine.scheduler.schedule

    def schedule_and_record():
        batch = schedule()
        if batch is not None and batch.prefill:
            steps.append([(s.num_cached, c) for s, c in zip(batch.prefill, batch.chunks)])
        return batch

    engine.scheduler.schedule = schedule_and_record
    shared = list(range(1, 40))
    prompts = [list(range(100, 180)), list(range(200, 270))]
    prompts += [shared + [300 + i] * (i + 1) for i in range(6)]
    engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for rows in steps:
        assert len(rows) * max(c for _, c in rows) <= 32 and len(rows) <= 6
        assert all(start + c <= 96 for start, c in rows)
    assert any(start > 0 for rows in steps for start, _ in rows)  # chunks and cache hits ran
    assert engine.blocks.hit_tokens > 0


HELD = 64 << 20  # bytes: far above this small pair's own activation peak


def test_memory_a_new_part_of_the_step_holds_is_measured_with_no_change_to_the_profile(checkpoints, monkeypatch):
    """The profile runs the engine's own SpeculativeStep: what a new part of its verification holds is in
    the activation peak the plan records, though profile_run knows nothing of it (on the CPU the peak is
    the kernel's resident high-water mark, so the held tensor is filled: its pages are resident)."""
    from vramledger.worker.engine.memory_setup import plan_memory
    from vramledger.worker.engine.speculative_step import SpeculativeStep
    from vramledger.worker.memory.device import get_device
    from vramledger.worker.memory.ledger import Ledger

    cpu = get_device("cpu")
    config = EngineConfig(model=checkpoints["llama"], draft_model=checkpoints["llama-draft"], max_model_len=64,
                          max_num_seqs=4, num_speculative_tokens=3, kv_cache_memory=1 << 20).resolve_lengths(64, "cpu")
    runner = ModelRunner(load_model(config.model, torch.float32, cpu.torch_device),
                         load_model(config.draft_model, torch.float32, cpu.torch_device), config.block_size,
                         cpu.torch_device)

    def activation_peak() -> int:
        ledger = Ledger.at_start(cpu, config.model, config.draft_model)
        plan_memory(runner, config, cpu, ledger)
        return ledger.bytes_of("activation_peak")

    before = activation_peak()
    verify, held = SpeculativeStep.verify, []

    def verify_holding(self, *args):
        scratch = torch.ones(HELD // 4)  # float32, filled: resident while the target verifies
        held.append(scratch.nbytes)
        return verify(self, *args)

    monkeypatch.setattr(SpeculativeStep, "verify", verify_holding)
    after = activation_peak()
    assert before < HELD <= after
    assert held  # by the profile's own SpeculativeStep


def test_the_profile_samples_every_way_serving_does(checkpoints, monkeypatch):
    """Code and scratch of each way to sample stay once serving has run them: the profile runs each
    before the KV cache is sized (the C kernels of temperature-only rows, greedy rows, a seeded row's
    own generator, penalties), and a prefill step whose chunks are not all their prompt's last."""
    from vramledger.worker.engine import profile_run, row_sampling
    from vramledger.worker.kernels import draw_tokens, verify_tokens

    cpu = torch.device("cpu")
    config = EngineConfig(model=checkpoints["llama"], draft_model=checkpoints["llama-draft"], max_model_len=64,
                          max_num_seqs=3, num_speculative_tokens=3).resolve_lengths(64)
    runner = ModelRunner(load_model(config.model, torch.float32, cpu),
                         load_model(config.draft_model, torch.float32, cpu), config.block_size, cpu)
    runner.allocate_kv_cache(profile_blocks(config))
    seen = []

    def counting(module, name):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **kw: seen.append(name) or original(*a, **kw))

    counting(draw_tokens, "draw_tokens")
    counting(verify_tokens, "verify_tokens")
    counting(row_sampling.History, "__init__")
    profile_run.run_worst_case(runner, config)
    assert not {"draw_tokens", "verify_tokens", "__init__"} & set(seen)  # the worst step samples top-k/top-p
    index, forward = [], profile_run.plain_forward

    def recording(step, prefill, chunks, decode):
        index.append([s.num_cached + c < len(s) for s, c in zip(prefill, chunks)])
        return forward(step, prefill, chunks, decode)

    monkeypatch.setattr(profile_run, "plain_forward", recording)
    seen.clear()
    profile_run.run_sampling_paths(runner, config)
    assert {"draw_tokens", "verify_tokens", "__init__"} <= set(seen)  # __init__: a History
    assert [True, False] in index  # one chunk ends its prompt, one does not
    assert any(p.greedy for p in profile_run.OTHER_PARAMS) and any(p.seed is not None for p in profile_run.OTHER_PARAMS)
