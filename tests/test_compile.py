"""--compile: the engine's compiled forwards give the eager tokens and never compile while serving.

The backend here is dynamo's "eager": the graphs and guards a compiled engine keeps, through the
opaque cache write, without AOTAutograd and minutes of C++ builds (aot_eager doubled this test's
time). bench/compile_forward.py checks inductor's logits against eager (largest difference).
"""
import pytest
import torch

from vramledger.worker.config import EngineConfig
from vramledger.worker.engine.llm_engine import LLMEngine
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.models.compiled import compile_model
from vramledger.worker.models.loader import load_model

pytestmark = pytest.mark.slow  # it starts processes (`make test-fast` leaves it out)

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
# Varied on purpose: a one-token prompt, short and longer ones, alone and batched.
PROMPTS = [[7], [5, 6, 7], list(range(3, 40)), [9, 9], list(range(50, 61))]


def test_compiled_speculation_gives_eager_plain_tokens_without_compiling_while_serving(checkpoints):
    config = dict(model=checkpoints["llama"], max_model_len=128, max_num_seqs=4)
    fast = LLMEngine(EngineConfig(draft_model=checkpoints["llama-draft"], speculation="adaptive",
                                  compile=True, compile_backend="eager", **config))
    with torch.compiler.set_stance("fail_on_recompile"):  # a shape no warm-up graph fits raises here
        alone = fast.generate(PROMPTS[:1], GREEDY)
        batched = fast.generate(PROMPTS, GREEDY)
    plain = LLMEngine(EngineConfig(draft_model=None, **config))
    assert [t for t, _, _ in alone + batched] == [t for t, _, _ in plain.generate(PROMPTS[:1] + PROMPTS, GREEDY)]
    assert fast.stats.draft_tokens > 0  # the draft really proposed
    ledger = fast.ledger
    assert ledger.bytes_of("compiled") > 0 and ledger.bytes_of("kernels") == 0  # nothing packed: inductor packs
    assert ledger.declared_bytes == ledger.budget_bytes


def test_compiling_a_packed_model_is_refused_with_the_reason(checkpoints):
    packed = load_model(checkpoints["llama"], torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="pack=False"):
        compile_model(packed)
