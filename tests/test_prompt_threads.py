"""A step of one prompt alone (no other request in it) runs on the prompt threads, every other step on
the engine's; the memory profile runs prefill steps on them too, and the text does not change."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from vramledger.worker.config import EngineConfig
from vramledger.worker.engine.llm_engine import LLMEngine
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.kernels import decoder_layers
from vramledger.worker.models import decoder_forward
from vramledger.worker.models.decoder_forward import DecoderForward

needs_kernel = pytest.mark.skipif(not decoder_layers.available(), reason="no AVX-512 or AVX2, or no C compiler here")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(3, 40)), list(range(50, 70)), list(range(80, 95)), list(range(100, 130))]


@pytest.fixture
def step_threads(monkeypatch):
    """Each one-call forward's threads, in order; every step large enough to take more than one."""
    seen: list[int] = []
    threads = DecoderForward.threads

    def spy(self, batches):
        seen.append(threads(self, batches))
        return seen[-1]

    monkeypatch.setattr(DecoderForward, "threads", spy)
    monkeypatch.setattr(decoder_forward, "ONE_THREAD_WORK", 0)
    kept = torch.get_num_threads()
    yield seen
    torch.set_num_threads(kept)  # the engine set the process's


def engine(checkpoints, prompt_threads: int | None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=checkpoints["llama"], draft_model=checkpoints["llama-draft"],
                                  max_model_len=128, max_num_seqs=4, cpu_threads=1, cpu_prompt_threads=prompt_threads))


def serve(engine: LLMEngine, seen: list[int]) -> tuple[list[set[int]], list[list[int]]]:
    """The threads of three steps: a prompt alone, a prompt beside it decoding, two prompts that arrive
    together at an idle engine; and every request's tokens."""
    tokens: dict[str, list[int]] = defaultdict(list)

    def step() -> set[int]:
        seen.clear()
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        return set(seen)

    def to_the_end() -> None:
        while engine.has_unfinished_requests():
            step()

    ids = [engine.add_request(PROMPTS[0], GREEDY)]
    alone = step()
    ids.append(engine.add_request(PROMPTS[1], GREEDY))
    beside = step()
    to_the_end()
    ids += [engine.add_request(p, GREEDY) for p in PROMPTS[2:]]
    burst = step()
    to_the_end()
    return [alone, beside, burst], [tokens[i] for i in ids]


@needs_kernel
def test_only_a_step_of_one_prompt_alone_runs_on_the_prompt_threads(checkpoints, step_threads):
    two = engine(checkpoints, prompt_threads=2)
    assert 2 in step_threads  # the profile ran prefill steps on them
    (alone, beside, burst), tokens = serve(two, step_threads)
    assert alone == {2}
    assert beside == {1}  # a prompt's chunk beside a stream: the engine's threads
    assert burst == {1}  # prompts that arrive together: their clients may still be sending

    step_threads.clear()
    one = engine(checkpoints, prompt_threads=None)
    assert set(step_threads) == {1}  # no step of its profile took more
    steps, same_tokens = serve(one, step_threads)
    assert steps == [{1}] * 3
    assert same_tokens == tokens  # one thread and two give the same bits
