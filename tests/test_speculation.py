"""The adaptive speculation policy, driven with given step costs and acceptance (no timings)."""
import random
from contextlib import contextmanager

import pytest

from vramledger.worker.engine.speculation import (
    FIRST_SAMPLES,
    MAX_PROBE_EVERY,
    PROBE_EVERY,
    PROBE_SHARE,
    Acceptance,
    AdaptiveSpeculation,
    Speculation,
    StepCosts,
    bucket,
    expected_tokens,
    speculation_policy,
)

K = 4


class Clock:
    """Time the test moves by hand: each step costs what the test says."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step_cost(draft: float, target: float, per_position: float):
    """Seconds per row of a decode step: k draft steps, then the target over k+1 positions."""
    return lambda k: k * draft + target + k * per_position


def drive(policy: AdaptiveSpeculation, clock: Clock, steps: int, batch: int, cost, alpha: float,
          rng: random.Random, read: float = 0.0, lag: list[int] | None = None, between: float = 0.0) -> list[int]:
    """Run the policy as the engine does; rows accept each proposal with probability alpha. With `read`,
    the draft reads what it missed as the engine's catch-up does: every row lags one token a plain step
    (lag[0], the request's tokens so far, kept across calls when given), and a proposing step first
    reads them all at `read` seconds a token, left out of its cost. `between`: the engine's seconds
    between steps (scheduling, outputs)."""
    chosen, lag = [], [0] if lag is None else lag
    for _ in range(steps):
        k = policy.start_step(batch, backlog=lambda: batch * lag[0])
        if k and read and lag[0]:
            with policy.catching_up() as tokens:
                clock.now += batch * lag[0] * read
                tokens.append(batch * lag[0])
            lag[0] = 0
        clock.now += batch * cost(k)
        accepted = None if k == 0 else [next((i for i in range(k) if rng.random() >= alpha), k)
                                        for _ in range(batch)]
        policy.finish_step(accepted)
        lag[0] += k == 0
        clock.now += between
        chosen.append(k)
    return chosen


@pytest.fixture
def policy():
    clock = Clock()
    return AdaptiveSpeculation(K, clock), clock


def longest_plain_run(chosen: list[int]) -> int:
    run = longest = 0
    for k in chosen:
        run = run + 1 if k == 0 else 0
        longest = max(longest, run)
    return longest


def test_expected_tokens_per_step():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_acceptance_estimate_counts_only_the_proposals_judged():
    rng, alpha = random.Random(0), 0.8
    estimate = Acceptance()
    for _ in range(200):
        estimate.observe(K, [next((i for i in range(K) if rng.random() >= alpha), K) for _ in range(8)])
    # accepted / proposed would read about 0.59 here: proposals after a rejection are never judged.
    assert estimate.rate == pytest.approx(alpha, abs=0.05)


def test_high_acceptance_and_a_cheap_draft_go_deep(policy):
    spec, clock = policy
    chosen = drive(spec, clock, 200, 1, step_cost(0.05, 1.0, 0.02), 0.9, random.Random(1))
    assert spec.current == K
    assert chosen[-100:].count(K) >= 90  # the rest are probes


def test_no_acceptance_turns_speculation_off(policy):
    spec, clock = policy
    chosen = drive(spec, clock, 200, 1, step_cost(0.05, 1.0, 0.02), 0.0, random.Random(2))
    assert spec.current == 0
    assert chosen[-100:].count(0) >= 80  # the rest: probes, and steps that keep the draft caught up


def test_an_expensive_draft_at_a_large_batch_runs_plain(policy):
    spec, clock = policy
    # Compute-bound: every verified position costs a target step; acceptance is good but not enough.
    drive(spec, clock, 300, 32, step_cost(0.3, 1.0, 1.0), 0.7, random.Random(3))
    assert spec.current == 0
    # The same acceptance at batch 1, where verifying more positions is nearly free: deep.
    drive(spec, clock, 300, 1, step_cost(0.1, 1.0, 0.02), 0.7, random.Random(3))
    assert spec.current == K


def test_k_comes_back_when_acceptance_recovers(policy):
    spec, clock = policy
    cost = step_cost(0.05, 1.0, 0.02)
    drive(spec, clock, 200, 4, cost, 0.0, random.Random(4))
    assert spec.current == 0
    drive(spec, clock, 200, 4, cost, 0.95, random.Random(4))
    assert spec.current == K


def test_k_never_exceeds_the_bound_and_proposals_never_stop_for_long(policy):
    spec, clock = policy
    chosen = []
    for batch, alpha in [(1, 0.0), (32, 0.0), (3, 0.5), (16, 0.99)]:
        chosen += drive(spec, clock, 150, batch, step_cost(0.2, 1.0, 0.3), alpha, random.Random(5))
    assert set(chosen) <= set(range(K + 1)) and set(chosen) == set(range(K + 1))


def test_probes_back_off_while_plain_wins_and_return_when_proposals_pay(policy):
    spec, clock = policy
    chosen = drive(spec, clock, 4000, 8, step_cost(0.05, 1.0, 0.02), 0.0, random.Random(9))
    proposing = [i for i, k in enumerate(chosen) if k][1 + FIRST_SAMPLES:]  # after the steps that first measure K
    # A probe of a k not measured yet is two steps (the first is warm-up); each probe wakes the dormant
    # draft (it reads every token since the last): rarer each time.
    starts = [i for i in proposing if i - 1 not in proposing]
    ends = [i for i in proposing if i + 1 not in proposing]
    assert all(end - start <= 1 for start, end in zip(starts, ends))
    assert [b - a for a, b in zip(ends, starts[1:])] == [64, 128, 256, 512] + [MAX_PROBE_EVERY] * 2
    assert spec.current == 0
    chosen = drive(spec, clock, 2 * MAX_PROBE_EVERY, 8, step_cost(0.05, 1.0, 0.02), 0.95, random.Random(9))
    assert spec.current == K
    # Awake, the draft is up to date: probes of other ks are cheap, and come every PROBE_EVERY steps again.
    assert 0 < chosen[-4 * PROBE_EVERY:].count(0) <= 4


@pytest.mark.parametrize("between, deep", [(0.0, False), (3.0, True)])
def test_the_engines_work_between_steps_counts_against_each_step(policy, between, deep):
    """Proposals cost more than they emit over the steps alone, but a step also pays for the engine's
    work around it (scheduling, outputs), which proposals spread over more tokens."""
    spec, clock = policy
    drive(spec, clock, 300, 1, step_cost(0.8, 1.0, 0.05), 0.8, random.Random(16), between=between)
    assert spec.current == (K if deep else 0)


def test_a_slow_first_step_is_not_taken_as_the_cost(policy):
    spec, clock = policy
    cost = step_cost(0.05, 1.0, 0.02)
    drive(spec, clock, 150, 1, lambda k: cost(k) * (1000 if k == 0 and clock.now < 10 else 1), 0.0,
          random.Random(6))
    assert spec.current == 0  # k=0's warm-up (1000x) is left out


def test_a_k_first_tried_is_measured_on_the_next_step_too(policy):
    """Its first step is warm-up, left out: the next step of that bucket runs the same k, while a
    dormant draft's probe has it caught up, rather than paying another catch-up a probe later."""
    spec, clock = policy
    chosen = drive(spec, clock, 2000, 8, step_cost(0.05, 1.0, 0.02), 0.0, random.Random(9))
    first = {k: chosen.index(k) for k in set(chosen)}
    assert set(first) == set(range(K + 1))
    assert all(chosen[i + 1] == k for k, i in first.items())
    assert all(spec.costs.known(bucket(8), k) for k in first)


def test_fixed_and_draftless_policies():
    fixed = speculation_policy("fixed", K)
    assert type(fixed) is Speculation
    assert [fixed.start_step(b) for b in (1, 8, 32)] == [K] * 3
    assert speculation_policy("adaptive", 0).start_step(1) == 0  # no draft: plain steps
    assert isinstance(speculation_policy("adaptive", K), AdaptiveSpeculation)


def test_probes_notice_when_a_step_gets_cheaper(policy):
    spec, clock = policy
    drive(spec, clock, 200, 8, step_cost(1.0, 1.0, 1.0), 0.8, random.Random(7))
    assert spec.current == 0
    # The load on the device changes: proposals become cheap; only steps that measure them can tell.
    # The estimates left them far behind plain: the dormant bucket probes at its longest interval.
    drive(spec, clock, MAX_PROBE_EVERY + 400, 8, step_cost(0.02, 1.0, 0.02), 0.8, random.Random(7))
    assert spec.current == K


def catch_up_share(spec: AdaptiveSpeculation, clock: Clock, steps: int, batch: int, cost, alpha: float,
                   read: float, lifetime: int) -> tuple[list[int], float]:
    """Steps of requests that each end after `lifetime` steps (a new one starts with nothing to read),
    and the share of all the time that went to the draft's catch-ups."""
    chosen, lag, catching = [], [0], [0.0]
    uncounted = spec.uncounted

    def timed():
        started = clock.now
        with uncounted() as body:
            yield body
        catching[0] += clock.now - started
    spec.uncounted = contextmanager(timed)
    start = clock.now
    for i in range(0, steps, lifetime):
        lag[0] = 0
        chosen += drive(spec, clock, min(lifetime, steps - i), batch, cost, alpha, random.Random(i), read, lag)
    return chosen, catching[0] / (clock.now - start)


@pytest.mark.parametrize("alpha", [0.3, 0.8])
def test_a_dormant_drafts_probes_spend_a_bounded_share_on_catching_up(policy, alpha):
    """Each probe of a dormant draft first reads every row's backlog (here a row's tokens cost the draft
    a tenth of its plain step): however far the rows lag, probes wait until the plain steps since the
    last one took PROBE_SHARE^-1 times that reading (fewer where proposals are far behind plain)."""
    spec, clock = policy
    cost = step_cost(0.5, 1.0, 1.0)  # plain wins by far at either acceptance
    # A short drive, as a benchmark's: probes backing off from every PROBE_EVERY steps alone would spend
    # about 6% of it catching up.
    chosen, share = catch_up_share(spec, clock, 400, 16, cost, alpha, read=0.1, lifetime=128)
    assert spec.current == 0 and share <= PROBE_SHARE
    chosen += catch_up_share(spec, clock, 3000, 16, cost, alpha, read=0.1, lifetime=128)[0]
    assert [i for i, k in enumerate(chosen) if k and i > 400]  # they still come, now and then
    cheap = catch_up_share(*policy_and_clock(), 3400, 16, cost, alpha, read=0.001, lifetime=128)[0]
    assert cheap.count(0) < chosen.count(0)  # cheap catch-ups: probes as often as they back off to


def policy_and_clock() -> tuple[AdaptiveSpeculation, Clock]:
    clock = Clock()
    return AdaptiveSpeculation(K, clock), clock


def test_a_dormant_bucket_probes_at_the_longest_interval_whatever_its_catch_up_costs(policy):
    """Rows that never end lag further every step: their catch-up never falls below its share of the
    plain steps since the last probe, yet a probe comes every MAX_PROBE_EVERY steps (costs may change)."""
    spec, clock = policy
    chosen = drive(spec, clock, 3 * MAX_PROBE_EVERY, 8, step_cost(1.0, 1.0, 1.0), 0.8, random.Random(7), read=1.0)
    probes = [i for i, k in enumerate(chosen) if k][1 + FIRST_SAMPLES:]  # after the steps that first measure K
    starts = [i for i in probes if i - 1 not in probes]
    assert len(starts) >= 2 and all(b - a >= MAX_PROBE_EVERY - 2 for a, b in zip(starts, starts[1:]))
    assert spec.current == 0


@pytest.mark.parametrize("prompt_per_token, proposes", [(0.25, True), (32.0, False)])
def test_the_drafts_reading_of_prompts_is_charged_to_proposals(policy, prompt_per_token, proposes):
    """Short prompts with long completions leave proposals ahead; long prompts with short ones do not,
    since the draft must read each prompt before proposing for it (here reading a token costs 0.1 of
    a plain step's time per row)."""
    spec, clock = policy
    spec.observe_read(1000, 1000 * 0.1)
    spec.observe_traffic(int(1000 * prompt_per_token), 1000)
    drive(spec, clock, 300, 8, step_cost(0.05, 1.0, 0.02), 0.8, random.Random(12))
    assert (spec.current == K) == proposes


def test_a_catch_up_teaches_the_reading_cost_per_token(policy):
    spec, clock = policy
    spec.start_step(1)
    with spec.catching_up() as read:
        clock.now += 3.0
        read.append(100)
        clock.now += 1.0
        read.append(300)
    spec.finish_step([0])
    spec.observe_traffic(4, 1)
    assert spec.reading.per_token() == pytest.approx(4.0 / 400 * 4)


def test_a_step_beside_prompt_chunks_runs_plain_and_leaves_the_draft_as_it_was(policy):
    spec, clock = policy
    drive(spec, clock, 10, 1, step_cost(0.05, 1.0, 0.02), 0.95, random.Random(13))
    assert spec.current == K
    assert spec.start_step(1, with_prompts=True) == 0
    spec.finish_step(None, measured=False)
    assert spec.current == K and spec.start_step(1) == K  # still awake
    assert spec.start_step(1, pinned=True, with_prompts=True) == K  # a seeded request keeps K
    fixed = speculation_policy("fixed", K)
    assert fixed.start_step(8, with_prompts=True) == K  # fixed always proposes


def test_steps_slowed_by_other_work_do_not_decide(policy):
    spec, clock = policy
    noise, cost = random.Random(8), step_cost(0.3, 1.0, 1.0)  # k=0 is best by far
    # Every third step on average runs up to 6x slower: a neighbour's work, whatever k the step had.
    drive(spec, clock, 400, 32, lambda k: cost(k) * (1 + 5 * noise.random() if noise.random() < 0.3 else 1),
          0.7, random.Random(8))
    assert spec.current == 0


def test_the_draft_catching_up_is_left_out_of_the_step_cost(policy):
    spec, clock = policy
    for _ in range(2):  # the first step of a (bucket, k) is warm-up, left out
        k = spec.start_step(1)
        with spec.uncounted():  # the draft reads what it missed while dormant
            clock.now += 100.0
        clock.now += 1.0
        spec.finish_step([k])
    assert spec.costs.estimate(0, K) == 1.0


def test_near_break_even_an_awake_draft_stays_awake_and_a_dormant_one_stays_dormant(policy):
    spec, clock = policy
    # At acceptance 0.8, k=1 promises 1.8 tokens for 1.68 plain steps: 1.07x plain's rate, the best k,
    # above STAY_GAIN and below MIN_GAIN.
    cost, alpha = step_cost(0.5, 1.0, 0.18), 0.8
    chosen = drive(spec, clock, 300, 8, cost, alpha, random.Random(10))
    assert spec.current == 1 and chosen[-100:].count(1) >= 80  # stopping would not pay
    drive(spec, clock, 300, 8, cost, 0.0, random.Random(10))
    assert spec.current == 0
    chosen = drive(spec, clock, 300, 8, cost, alpha, random.Random(10))
    assert spec.current == 0 and chosen[-100:].count(0) >= 95  # waking would not pay its catch-up


def test_a_new_batch_size_while_dormant_runs_plain_first_and_proposes_at_its_first_probe(policy):
    spec, clock = policy
    drive(spec, clock, 200, 8, step_cost(0.05, 1.0, 0.02), 0.0, random.Random(11))
    assert spec.current == 0
    # A proposal would wake the draft for every row: 32 new rows wait for their bucket's first probe.
    chosen = drive(spec, clock, 2 * PROBE_EVERY, 32, step_cost(0.05, 1.0, 0.02), 0.0, random.Random(11))
    assert PROBE_EVERY <= chosen.index(K) < PROBE_EVERY + 4  # two plain steps measure k=0 first


def test_a_step_whose_forward_carried_prompt_chunks_measures_no_cost(policy):
    spec, clock = policy
    for _ in range(3):  # plain steps that also prefilled: far slower than a plain step
        k = spec.start_step(1)
        clock.now += 100.0
        spec.finish_step(None if k == 0 else [0], measured=False)
    assert not spec.costs.known(bucket(1), 0) and not spec.costs.known(bucket(1), K)


def test_a_probe_that_wakes_the_draft_is_measured_on_its_second_step(policy):
    """The first step after a dormant spell pays for the draft's cold weights and cache: left out, the
    probe's k runs again and that step is its measure."""
    spec, clock = policy
    warm, last = step_cost(0.05, 1.0, 0.02), [0]

    def cost(k):
        cold = k and not last[0]
        last[0] = k
        return warm(k) * (100 if cold else 1)
    chosen = drive(spec, clock, 3000, 8, cost, 0.0, random.Random(14))
    assert spec.current == 0 and sum(1 for a, b in zip(chosen, chosen[1:]) if b and not a) >= 5  # probes
    measured = spec.costs._times[bucket(8)]
    assert all(max(times) < 2 for k, times in measured.items() if k)


def test_a_new_bucket_measures_each_end_several_steps_before_it_decides(policy):
    """One slow step (a neighbour's work) among a bucket's first measures does not put the draft to
    sleep where proposals pay."""
    spec, clock = policy
    cost, steps = step_cost(0.05, 1.0, 0.02), []

    def first_measured_k_step_slow(k):
        steps.append(k)
        return cost(k) * (10 if k and steps.count(k) == 2 else 1)  # the first after warm-up
    chosen = drive(spec, clock, 60, 8, first_measured_k_step_slow, 0.9, random.Random(15))
    n = 1 + FIRST_SAMPLES  # a warm-up step, then the measures
    assert chosen[:2 * n] == [K] * n + [0] * n
    assert spec.current == K and chosen[-10:].count(K) >= 9


def test_a_k_measured_once_is_compared_with_plain_over_as_few_steps():
    """Plain's fastest of 5 steps against a probe's one: the probe is compared with plain's latest step."""
    costs = StepCosts()
    for seconds in (0, 1.0, 1.0, 1.0, 1.0, 2.0):  # plain: a warm-up step, then the fastest of 5 is 1.0
        costs.observe(0, 0, seconds)
    for seconds in (0, 3.0):
        costs.observe(0, K, seconds)
    assert costs.estimate(0, K) / costs.estimate(0, 0) == 3.0
    assert costs.relative(0, K) == 1.5  # against plain's latest step (2.0)
