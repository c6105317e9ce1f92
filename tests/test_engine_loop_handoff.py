"""When the engine thread hands a step's outputs to the event loop: as the next step's kernel starts,
or at once where no kernel follows; every token arrives, in order."""
import asyncio
import time

import pytest

from vramledger.worker.config import EngineConfig
from vramledger.worker.engine.llm_engine import LLMEngine
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.http.engine_loop import EngineFailed, EngineLoop
from vramledger.worker.kernels import decoder_layers
from vramledger.worker.models import decoder_forward
from vramledger.worker.models.decoder_forward import DecoderForward

TOKENS = 6


def serve_one(model: str, events: list[str], monkeypatch) -> list:
    """One request of TOKENS tokens through an EngineLoop: what its stream received. `events` records,
    on the engine thread, each engine step's start, each start of the one-call kernel and each hand-off
    to the event loop (with its tokens)."""
    kernel = decoder_layers._kernel()
    assert kernel is not None, "the one-call kernel is not built on this machine"

    def recorded_kernel(*args):
        events.append("kernel")
        return kernel(*args)

    monkeypatch.setattr(decoder_layers, "_kernel", lambda: recorded_kernel)
    post = EngineLoop._post

    def recorded_post(self, callback, argument):
        if callback == self._deliver:
            events.append(f"post {sum(len(out.new_token_ids) for _, out in argument)}")
        post(self, callback, argument)

    monkeypatch.setattr(EngineLoop, "_post", recorded_post)
    step = LLMEngine.step

    def recorded_step(self, *args, **kwargs):
        events.append("step")
        return step(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "step", recorded_step)
    loop = EngineLoop(lambda: LLMEngine(EngineConfig(model=model, draft_model=None, max_model_len=64,
                                                     max_num_seqs=2, max_num_batched_tokens=64)))

    async def drive() -> list:
        loop.start(asyncio.get_running_loop())
        while not loop.ready:
            await asyncio.sleep(0.01)
        events.clear()  # the load's profile run called the kernel too
        stream = loop.submit("r", [5, 6, 7], SamplingParams(max_tokens=TOKENS, ignore_eos=True),
                             time.monotonic())
        items = [await asyncio.wait_for(stream.get(), 30)]
        while not isinstance(items[-1], EngineFailed) and not items[-1].finished:
            items.append(await asyncio.wait_for(stream.get(), 30))
        return items

    try:
        return asyncio.run(drive())
    finally:
        loop.stop()


def assert_every_token(outputs: list) -> None:
    assert sum(len(out.new_token_ids) for out in outputs) == TOKENS and outputs[-1].finished


@pytest.fixture
def spare_core(monkeypatch):
    """Cores beside every step's kernel threads (the tests' steps run on one): on a machine of one
    core no kernel leaves any, and none hands out outputs."""
    monkeypatch.setattr(decoder_forward, "CORES", 2)


def test_a_steps_outputs_go_out_as_the_next_kernel_starts_and_the_last_at_once(checkpoints, monkeypatch,
                                                                               spare_core):
    events: list[str] = []
    outputs = serve_one(checkpoints["llama"], events, monkeypatch)
    assert_every_token(outputs)
    # Each step's tokens go out inside the next step, just before its kernel starts; the last step's
    # as it ends, no step following it.
    assert events == ["step", "kernel"] + ["step", "post 1", "kernel"] * (TOKENS - 1) + ["post 1"]


def test_steps_without_the_kernel_hand_their_outputs_out_as_they_end(checkpoints, monkeypatch):
    monkeypatch.setattr(DecoderForward, "runs_on", lambda self, kv_cache, batch: False)  # torch's forward
    events: list[str] = []
    outputs = serve_one(checkpoints["llama"], events, monkeypatch)
    assert_every_token(outputs)
    assert events == ["step", "post 1"] * TOKENS


def test_a_kernel_on_every_core_leaves_the_outputs_to_the_steps_end(checkpoints, monkeypatch):
    """The event loop's work would wait for a core the kernel holds, and hold the kernel up."""
    monkeypatch.setattr(decoder_forward, "CORES", 1)
    events: list[str] = []
    outputs = serve_one(checkpoints["llama"], events, monkeypatch)
    assert_every_token(outputs)
    assert events == ["step", "kernel", "post 1"] * TOKENS


def test_a_failing_step_hands_out_the_tokens_made_before_it_first(checkpoints, monkeypatch, spare_core):
    """The third step raises: the second's tokens, held for its kernel, still reach the stream, then
    the failure."""
    steps = []
    real_step = LLMEngine.step

    def failing_step(self, *args, **kwargs):
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("a step broke")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "step", failing_step)
    events: list[str] = []
    items = serve_one(checkpoints["llama"], events, monkeypatch)
    assert [len(item.new_token_ids) for item in items[:-1]] == [1, 1] and isinstance(items[-1], EngineFailed)
    assert events == ["step", "kernel", "step", "post 1", "kernel", "step", "post 1"]
