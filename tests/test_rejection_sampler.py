"""The rejection sampler emits the target's distribution, whatever the draft proposes."""
import torch

from vramledger.worker.engine.penalties import History
from vramledger.worker.engine.sampler import RowParams, inverse_cdf, probabilities, row_draws, sample
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.engine.spec_decode import verify

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
    draft = sample(q.expand(N, V).contiguous(), rows)
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


def test_penalised_target_and_draft_keep_rejection_sampling_exact():
    """Penalties and min_tokens applied to draft and target alike: the output follows the penalised target."""
    gen = torch.Generator().manual_seed(5)
    target_logits = torch.randn(2, V, generator=gen) * 1.5  # positions 0 and 1 of a verification
    draft_logits = torch.randn(1, V, generator=gen) * 1.5
    params = SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.5,
                            repetition_penalty=1.3, min_tokens=4, max_tokens=16)
    prompt, output, eos = [3, 4], [1, 1, 2], {0}  # one more token before end-of-text (0) may come

    def history(n):
        return History([params] * n, [prompt] * n, [output] * n, eos, V, torch.device("cpu"))

    one = history(1)
    p0 = one.adjust(target_logits[:1]).softmax(-1)[0]
    assert p0[0] == 0  # end-of-text is held back at the first position
    assert (p0 - target_logits[0].softmax(-1)).abs().max() > 5 * BOUND  # the penalties matter here

    torch.manual_seed(2)
    rows = RowParams([params] * N, [None] * N, torch.device("cpu"), history(N))
    q = probabilities(draft_logits.expand(N, V), rows)  # [N, V]
    draft = sample(q, rows)
    adjusted = rows.history.adjust_positions(target_logits.expand(N, 2, V), draft[:, None])
    p = probabilities(adjusted.flatten(0, 1), rows.expand(2)).view(N, 2, V)
    num_accepted, tokens = verify(draft[:, None], q[:, None], p, rows)

    assert (frequencies(tokens[:, 0]) - p0).abs().max() < BOUND
    # The bonus token after an accepted proposal x follows the target penalised with x counted too,
    # where end-of-text is allowed again.
    x = torch.mode(draft[num_accepted == 1]).values.item()
    bonus = tokens[(num_accepted == 1) & (draft == x), 1]
    p1 = one.adjust(target_logits[1:], torch.tensor([[x]])).softmax(-1)[0]
    assert p1[0] > 0 and (p1 - one.adjust(target_logits[1:]).softmax(-1)[0]).abs().max() > 5 * BOUND
    assert (frequencies(bonus) - p1).abs().max() < 5 * (0.25 / len(bonus)) ** 0.5


def test_seeded_rows_draw_from_their_own_generator_the_others_in_one_call():
    cpu, seeded = torch.device("cpu"), SamplingParams(temperature=1.0, seed=7)
    gen = lambda seed: torch.Generator().manual_seed(seed)  # noqa: E731
    uniform = lambda t, g: t.uniform_(generator=g)  # noqa: E731
    mixed = RowParams([seeded, SamplingParams(temperature=1.0)] * 2, [gen(7), None, gen(7), None], cpu,
                      shared=gen(0))
    out = row_draws((5,), mixed, cpu, uniform)
    own = torch.empty(5).uniform_(generator=gen(7))
    assert torch.equal(out[0], own) and torch.equal(out[2], own)  # its own stream, whatever the batch
    alone = row_draws((5,), RowParams([seeded], [gen(7)], cpu, shared=gen(1)), cpu, uniform)
    assert torch.equal(alone[0], own)
    batched = torch.empty(4, 5).uniform_(generator=gen(0))  # the unseeded rows: one draw for all rows
    assert torch.equal(out[1], batched[1]) and torch.equal(out[3], batched[3])


def test_inverse_cdf_never_draws_a_zero_weight_even_at_the_edges():
    weights = torch.tensor([[0.0, 0.25, 0.0, 0.0, 0.75, 0.0]] * 4 + [[0.0, 3.0, 0.0, 1.0, 0.0, 0.0]])
    edge = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))  # the largest float below 1
    u = torch.tensor([[0.0], [0.2499], [0.25], [edge], [edge]])
    assert inverse_cdf(weights, u).tolist() == [1, 1, 4, 4, 3]  # unnormalized rows scale u by their sum


def min_p_reference(logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
    """vLLM's and HF's min-p, written out: after temperature, drop what is below min_p x the top probability."""
    probs = (logits / temperature).softmax(-1)
    kept = torch.where(probs >= min_p * probs.max(-1, keepdim=True).values, probs, torch.zeros_like(probs))
    return kept / kept.sum(-1, keepdim=True)


def test_min_p_target_and_draft_keep_rejection_sampling_exact():
    """min_p filters the draft and the target alike: the emitted tokens follow the target's min-p distribution."""
    gen = torch.Generator().manual_seed(12)  # a pair whose filtered supports overlap
    target_logits = torch.randn(2, V, generator=gen) * 1.5
    draft_logits = torch.randn(1, V, generator=gen) * 1.5
    params = SamplingParams(temperature=0.8, min_p=0.2)
    p0, p1 = min_p_reference(target_logits, 0.8, 0.2)
    unfiltered = (target_logits[0] / 0.8).softmax(-1)
    dropped = p0 == 0
    assert dropped.any() and unfiltered[dropped].sum() > 5 * BOUND  # the filter matters here
    q_ref = min_p_reference(draft_logits, 0.8, 0.2)[0]
    assert ((q_ref > 0) & dropped).any()  # the draft proposes tokens the target's filter drops

    torch.manual_seed(3)
    rows = RowParams([params] * N, [None] * N, torch.device("cpu"))
    q = probabilities(draft_logits.expand(N, V), rows)
    assert torch.allclose(q[0], q_ref, atol=1e-6)
    draft = sample(q, rows)
    p = probabilities(target_logits.expand(N, 2, V).flatten(0, 1), rows.expand(2)).view(N, 2, V)
    num_accepted, tokens = verify(draft[:, None], q[:, None], p, rows)

    first = frequencies(tokens[:, 0])
    assert (first - p0).abs().max() < BOUND
    assert first[dropped].sum() == 0  # a dropped token is never emitted, though the draft proposed some
    assert abs(num_accepted.float().mean() - torch.minimum(p0, q_ref).sum()) < BOUND
    bonus = frequencies(tokens[num_accepted == 1, 1])
    assert (bonus - p1).abs().max() < 5 * (0.25 / int((num_accepted == 1).sum())) ** 0.5
