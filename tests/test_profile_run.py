"""The profile run's decode step is the heaviest one the engine runs, whatever k the policy picks."""
import pytest
import torch

from worker.config import EngineConfig
from worker.engine.model_runner import ModelRunner
from worker.engine.profile_run import prefill_shapes, profile_blocks, run_worst_case
from worker.engine.speculation import CATCH_UP_CHUNK
from worker.models.loader import load_model


@pytest.mark.parametrize("speculation, behind", [("fixed", 2), ("adaptive", CATCH_UP_CHUNK)])
def test_decode_step_proposes_k_after_the_longest_catch_up(checkpoints, speculation, behind):
    cpu = torch.device("cpu")
    config = EngineConfig(model=checkpoints["llama"], draft_model=checkpoints["llama-draft"], max_model_len=64,
                          max_num_seqs=3, num_speculative_tokens=3, speculation=speculation)
    config.resolve_lengths(64)
    runner = ModelRunner(load_model(config.model, torch.float32, cpu),
                         load_model(config.draft_model, torch.float32, cpu), config.block_size, cpu)
    runner.allocate_kv_cache(profile_blocks(config))
    calls, forward = [], runner.forward
    runner.forward = lambda name, rows, *args, **kw: calls.append((name, len(rows), len(rows[0]))) or \
        forward(name, rows, *args, **kw)
    run_worst_case(runner, config)
    decode = calls[2 * len(prefill_shapes(runner, config, 64)):]  # after the target's and the draft's prefills
    # A plain step runs the target alone; a step that proposes again first feeds the draft what it missed
    # (the bonus token, or after plain steps what its catch-up left), then proposes k-1 more, then verifies k+1.
    assert decode == [("draft", 3, behind), ("draft", 3, 1), ("draft", 3, 1), ("target", 3, 4)]
