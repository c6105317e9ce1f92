"""The rejection sampler emits the target's distribution, whatever the draft proposes."""
import torch

from worker.engine.sampler import RowParams, exponential_noise
from worker.engine.sampling_params import SamplingParams
from worker.engine.spec_decode import verify

V, N = 8, 60_000
# Each frequency has a standard error of at most sqrt(0.25 / N) = 0.002; 0.01 is five of them.
BOUND = 0.01


def distributions(seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(2, V, generator=gen) ** 3
    q = torch.rand(1, V, generator=gen) ** 3
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def frequencies(tokens):
    return torch.bincount(tokens, minlength=V).float() / len(tokens)


def run_verify(p, q, seed):
    torch.manual_seed(seed)
    rows = RowParams([SamplingParams(temperature=1.0)] * N, [None] * N, torch.device("cpu"))
    draft = (q.expand(N, V) / exponential_noise(V, N, [None] * N, torch.device("cpu"))).argmax(-1)
    return draft, *verify(draft[:, None], q.expand(N, 1, V), p.expand(N, 2, V), rows)


def test_emitted_tokens_follow_the_target_not_the_draft():
    p, q = distributions(0)
    assert (p[0] - q[0]).abs().max() > 5 * BOUND  # the test can tell p from q
    draft, num_accepted, tokens = run_verify(p, q, seed=1)
    first = tokens[:, 0]
    assert (frequencies(first) - p[0]).abs().max() < BOUND
    # The same check on the draft's own samples fails: they follow q.
    assert (frequencies(draft) - p[0]).abs().max() > BOUND
    assert (frequencies(draft) - q[0]).abs().max() < BOUND
    # Acceptance happens at the theoretical rate sum(min(p, q)).
    expected_rate = torch.minimum(p[0], q[0]).sum()
    assert abs(num_accepted.float().mean() - expected_rate) < BOUND
    # After an accepted proposal the bonus token follows the target's next distribution.
    bonus = tokens[num_accepted == 1, 1]
    assert (frequencies(bonus) - p[1]).abs().max() < 3 * BOUND


def test_greedy_rows_accept_exactly_while_draft_equals_target_argmax():
    p = torch.tensor([[[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]])  # argmax 1, 0, 2
    q = torch.full((1, 2, 3), 1 / 3)
    rows = RowParams([SamplingParams(temperature=0)], [None], torch.device("cpu"))
    n, tokens = verify(torch.tensor([[1, 2]]), q, p, rows)
    assert n.tolist() == [1] and tokens[0, :2].tolist() == [1, 0]
    n, tokens = verify(torch.tensor([[1, 0]]), q, p, rows)
    assert n.tolist() == [2] and tokens[0].tolist() == [1, 0, 2]
