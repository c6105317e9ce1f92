"""draw_tokens.c: one C call for the plain sampling step, checked against the law it must follow."""
import pytest
import torch

from vramledger.worker.engine import sampler
from vramledger.worker.engine.sampler import RowParams, draw, inverse_cdf, probabilities, propose
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.kernels import draw_tokens
from vramledger.worker.kernels.draw_tokens import draw_tokens as run_kernel

needs_kernel = pytest.mark.skipif(not draw_tokens.available(),
                                  reason="draw_tokens.c needs AVX-512 or AVX2 and a C compiler")


@needs_kernel
@pytest.mark.parametrize("vocab", [5, 37, 2048])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_a_grid_of_uniforms_lands_on_each_token_in_proportion_to_its_probability(vocab, temperature):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(1, vocab, generator=g) * 3
    steps = 20000
    u = (torch.arange(steps, dtype=torch.float32) + 0.5) / steps
    tokens = run_kernel(logits.expand(steps, vocab).contiguous(), torch.full((steps,), temperature), u)
    counts = torch.bincount(tokens, minlength=vocab).float() / steps
    expected = (logits[0] / temperature).softmax(-1)
    assert (counts - expected).abs().max() <= 2 / steps + 1e-5
    assert torch.all(tokens[1:] >= tokens[:-1])  # the inverse of a cumulative distribution


@needs_kernel
def test_it_draws_the_torch_paths_token_for_almost_every_uniform():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 2048, generator=g) * 4
    u = torch.rand(64, generator=g)
    temperature = torch.full((64,), 0.8)
    torch_tokens = inverse_cdf((logits / 0.8).softmax(-1), u[:, None])
    assert (run_kernel(logits, temperature, u) == torch_tokens).float().mean() >= 0.98


@needs_kernel
def test_a_token_of_weight_zero_is_never_drawn_at_either_end():
    logits = torch.tensor([[float("-inf"), 1.0, float("-inf"), 2.0, float("-inf")]] * 4)
    u = torch.tensor([0.0, 0.5, torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item(), 0.999999])
    assert run_kernel(logits, torch.ones(4), u).tolist() == [1, 3, 3, 3]


@needs_kernel
def test_a_rows_token_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 300, generator=g)
    temperature, u = torch.rand(9, generator=g) + 0.5, torch.rand(9, generator=g)
    batched = run_kernel(logits, temperature, u)
    alone = [run_kernel(logits[i:i + 1].clone(), temperature[i:i + 1].clone(), u[i:i + 1].clone()).item()
             for i in range(9)]
    assert batched.tolist() == alone


def test_rows_the_kernel_does_not_take_keep_the_torch_path(monkeypatch):
    monkeypatch.setattr(draw_tokens, "_kernel", lambda: pytest.fail("the kernel ran"))
    logits = torch.randn(3, 50)
    greedy = RowParams([SamplingParams(temperature=0)] * 3, [None] * 3, torch.device("cpu"))
    assert draw(logits, greedy).tolist() == logits.argmax(-1).tolist()
    for params in (SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0, top_p=0.5),
                   SamplingParams(temperature=1.0, repetition_penalty=1.2)):
        rows = RowParams([params] * 3, [None] * 3, torch.device("cpu"),
                         history=object() if params.repetition_penalty != 1.0 else None)
        monkeypatch.setattr(sampler, "sample", lambda probs, rows: "torch path")
        monkeypatch.setattr(sampler, "probabilities", lambda logits, rows: None)
        assert draw(logits, rows) == "torch path"


@needs_kernel
def test_a_seeded_row_draws_the_same_token_alone_and_in_a_batch():
    logits = torch.randn(4, 2048, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.0, seed=7)] + [SamplingParams(temperature=1.0)] * 3

    def rows(n):
        return RowParams(params[:n], [torch.Generator().manual_seed(7)] + [None] * (n - 1), torch.device("cpu"))

    assert draw(logits[:1], rows(1)).item() == draw(logits, rows(4))[0].item()


@needs_kernel
def test_a_draft_step_gets_the_probabilities_its_tokens_were_drawn_from():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 2051, generator=g) * 3  # a vocabulary that ends mid-vector
    temperature, u = torch.rand(6, generator=g) + 0.5, torch.rand(6, generator=g)
    probs = torch.full_like(logits, float("nan"))
    tokens = run_kernel(logits, temperature, u, probs=probs)
    assert torch.allclose(probs, (logits / temperature[:, None]).softmax(-1), rtol=1e-4, atol=1e-7)
    assert torch.allclose(probs.sum(-1), torch.ones(6), atol=1e-5)
    assert tokens.tolist() == run_kernel(logits, temperature, u).tolist()  # the same draws as without


def test_draft_rows_the_kernel_does_not_take_get_torchs_probabilities(monkeypatch):
    monkeypatch.setattr(draw_tokens, "_kernel", lambda: pytest.fail("the kernel ran"))
    logits, cpu = torch.randn(3, 50), torch.device("cpu")
    greedy = RowParams([SamplingParams(temperature=0)] * 3, [None] * 3, cpu)
    q, tokens = propose(logits, greedy)
    assert torch.equal(q, probabilities(logits, greedy)) and tokens.tolist() == logits.argmax(-1).tolist()
    top_k = RowParams([SamplingParams(temperature=0.7, top_k=5)] * 3, [None] * 3, cpu)
    q, tokens = propose(logits, top_k)
    assert torch.equal(q, probabilities(logits, top_k)) and q[torch.arange(3), tokens].gt(0).all()
