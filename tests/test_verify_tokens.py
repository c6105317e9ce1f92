"""verify_tokens.c: sampled rows verified from the target's logits in one C call, checked against
the law it must follow and against the torch path on the same uniforms."""
import pytest
import torch
from test_rejection_sampler import BOUND, N, V, distributions, frequencies

from vramledger.worker.engine.sampler import RowParams, inverse_cdf, sample
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.engine.spec_decode import verify_logits
from vramledger.worker.kernels import verify_tokens

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(not verify_tokens.available(),
                                  reason="verify_tokens.c needs AVX-512 or AVX2 and a C compiler")


@needs_kernel
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_emitted_tokens_follow_the_target_at_the_theoretical_acceptance_rate(temperature):
    p, q = distributions(0)
    torch.manual_seed(1)
    rows = RowParams([SamplingParams(temperature=temperature)] * N, [None] * N, CPU)
    draft = sample(q.expand(N, V).contiguous(), rows)
    logits = p.log() * temperature  # softmax(logits / temperature) is p
    num_accepted, tokens = verify_logits(draft[:, None], q.expand(N, 1, V), logits.expand(N, 2, V), rows)
    assert (frequencies(tokens[:, 0]) - p[0]).abs().max() < BOUND
    assert abs(num_accepted.float().mean() - torch.minimum(p[0], q[0]).sum()) < BOUND
    bonus = tokens[num_accepted == 1, 1]  # after an accepted proposal: the target's next distribution
    assert (frequencies(bonus) - p[1]).abs().max() < 3 * BOUND


@needs_kernel
def test_it_accepts_and_emits_what_the_torch_path_does_from_the_same_uniforms(monkeypatch):
    g = torch.Generator().manual_seed(3)
    B, k, vocab = 512, 4, 2051  # a vocabulary that ends mid-vector
    logits = torch.randn(B, k + 1, vocab, generator=g) * 2
    q = ((logits[:, :k] + torch.randn(B, k, vocab, generator=g)) / 0.8).softmax(-1)  # a draft that half agrees
    draft = inverse_cdf(q.flatten(0, 1), torch.rand(B * k, 1, generator=g)).view(B, k)

    def run():
        rows = RowParams([SamplingParams(temperature=0.8)] * B, [None] * B, CPU,
                         shared=torch.Generator().manual_seed(9))
        return verify_logits(draft, q, logits, rows)

    c_accepted, c_tokens = run()
    monkeypatch.setattr(verify_tokens, "_kernel", lambda: None)
    accepted, tokens = run()
    assert {0, k} <= set(accepted.tolist())  # rejections and the bonus both ran
    same = c_accepted == accepted
    assert same.float().mean() >= 0.98
    emitted = [torch.equal(c_tokens[b, :n + 1], tokens[b, :n + 1]) for b, n in enumerate(accepted.tolist()) if same[b]]
    assert sum(emitted) >= 0.98 * len(emitted)


def test_rows_the_kernel_does_not_take_keep_the_torch_path(monkeypatch):
    monkeypatch.setattr(verify_tokens, "_kernel", lambda: pytest.fail("the kernel ran"))
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0]]])  # argmax 1, 0, 2
    greedy = RowParams([SamplingParams(temperature=0)], [None], CPU)
    n, tokens = verify_logits(torch.tensor([[1, 0]]), torch.full((1, 2, 3), 1 / 3), logits, greedy)
    assert n.tolist() == [2] and tokens[0].tolist() == [1, 0, 2]
