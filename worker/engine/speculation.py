"""How many tokens the draft proposes each decode step: fixed, or the k that pays best now.

Adaptive speculation follows Leviathan et al. (2023): with a per-token acceptance rate a,
k proposals emit (1 - a^(k+1)) / (1 - a) tokens per row, and the step costs k draft steps
plus a target step over k+1 positions (k=0: a plain target step). The policy measures that
cost itself, as the time of whole decode steps per row (on the clock the engine gives: wall time, or
the engine thread's CPU time where one thread runs the steps), for each k and batch-size bucket,
and picks the k in 0..K with the most expected tokens per second.

The draft reads a prompt only when a step proposes for its request (the engine catches it up), so
its reading is charged to proposals: per token they emit, the seconds the draft takes to read a token
times the prompt tokens the traffic brings per generated token. Long prompts with short completions
leave the draft nothing to gain. A step that carries prompt chunks decodes plain: its rows ride the
chunks' forward almost free, where proposals would need forwards of their own.

While plain steps win, the draft lies dormant: it reads no tokens, and only a step that proposes
catches it up (the engine). Probes then cost that catch-up, every row's backlog: they grow rarer
while plain keeps winning, and a dormant bucket's probe waits until the plain steps since its last
one took 1/PROBE_SHARE times its catch-up's estimated time (four times that while its estimates leave
proposals far behind plain), so probes cost a bounded share of the time wherever rows lag far.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager

PROBE_EVERY = 32  # steps of a bucket between probes of another k: costs drift with context and load
PROBE_BACKOFF = 2  # while plain wins, each probe waits this many times longer than the last,
MAX_PROBE_EVERY = 1024  # up to this many steps: a dormant draft's probe reads every token since the last
CATCH_UP_AFTER = 16  # tokens a draft may lag for its first proposal to read them (the profile runs it);
# further behind, it catches up first
COST_WINDOW = 5  # step times kept per (bucket, k): a slow step (contention, warm-up) is outlived
MIN_GAIN = 1.1  # a dormant draft wakes only when proposals promise this many times plain's tokens per
# second: waking costs its catch-up, and near break-even the estimates' noise (costs measured minutes
# apart, at other context lengths) decides, and loses.
STAY_GAIN = 1.03  # awake, proposals go on while they promise this much: stopping and waking again would
# pay the catch-up
PROBE_SHARE = 0.03  # a dormant bucket's probe reads every row's backlog: it waits until that reading is at
# most this share of the time its plain steps took since its last probe
PROBE_HOPE = 0.9  # estimates that leave proposals below this much of plain's rate: far behind
FAR_SHARE = PROBE_SHARE / 4  # the share where they are far behind: only a change in acceptance (live) or
# in cost could wake the draft
FIRST_SAMPLES = 3  # steps a bucket first measures at each end (K, plain) before it decides
PLAIN_SAMPLE = 4  # plain steps timed: one in this many, once a bucket has its measure
ACCEPTANCE_HALF_LIFE = 128  # proposals judged: older verdicts weigh half as much after this many
TRAFFIC_HALF_LIFE = 4096  # tokens (prompt and generated): older traffic weighs half as much after this many


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one row emits on average with k proposals at per-token acceptance alpha."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def bucket(batch_size: int) -> int:
    """Batch sizes share costs by power of two: 1, 2, 3-4, 5-8, 9-16, ..."""
    return (batch_size - 1).bit_length()


class Acceptance:
    """A live estimate of the per-token acceptance rate, from the verified proposals."""

    def __init__(self):
        self.accepted = self.judged = 0.0

    @property
    def rate(self) -> float | None:
        return self.accepted / self.judged if self.judged else None

    def observe(self, k: int, num_accepted: list[int]) -> None:
        # A row accepting n of k had min(n + 1, k) proposals judged: those after a rejection never were.
        judged = sum(min(n + 1, k) for n in num_accepted)
        keep = 0.5 ** (judged / ACCEPTANCE_HALF_LIFE)
        self.accepted = keep * self.accepted + sum(num_accepted)
        self.judged = keep * self.judged + judged


class Reading:
    """Seconds the draft takes per token it reads (catch-up), and prompt tokens per generated token in
    the traffic: what reading prompts adds to each token proposals emit."""

    def __init__(self):
        self.seconds = self.read = 0.0  # the draft's catch-up forwards
        self.prompt = self.generated = 0.0  # the engine's steps

    def observe_read(self, tokens: int, seconds: float) -> None:
        keep = 0.5 ** (tokens / TRAFFIC_HALF_LIFE)
        self.seconds, self.read = keep * self.seconds + seconds, keep * self.read + tokens

    def observe_traffic(self, prompt_tokens: int, generated_tokens: int) -> None:
        keep = 0.5 ** ((prompt_tokens + generated_tokens) / TRAFFIC_HALF_LIFE)
        self.prompt = keep * self.prompt + prompt_tokens
        self.generated = keep * self.generated + generated_tokens

    def per_token(self) -> float:
        """Seconds of the draft's prompt reading per generated token (0 until both are seen)."""
        if not self.read or not self.generated:
            return 0.0
        return self.seconds / self.read * self.prompt / self.generated


class StepCosts:
    """Seconds per row of a decode step with k proposals, per batch-size bucket."""

    def __init__(self) -> None:
        self._seen: set[tuple[int, int]] = set()
        self._times: dict[int, dict[int, deque[float]]] = {}
        self._fastest: dict[int, dict[int, float]] = {}  # min of each window, kept as steps come
        self.unmeasured: tuple[int, int] | None = None  # (bucket, k) of the latest step, when discarded

    def observe(self, bucket_: int, k: int, seconds_per_row: float) -> None:
        self.unmeasured = None
        if (bucket_, k) not in self._seen:  # a first step pays for warm-up (allocations, compilation)
            self.leave_out(bucket_, k)
            return
        window = self._times.setdefault(bucket_, {}).setdefault(k, deque(maxlen=COST_WINDOW))
        fastest = self._fastest.setdefault(bucket_, {})
        dropped = window[0] if len(window) == COST_WINDOW else None
        window.append(seconds_per_row)
        if k not in fastest or seconds_per_row <= fastest[k]:
            fastest[k] = seconds_per_row
        elif dropped == fastest[k]:
            fastest[k] = min(window)

    def leave_out(self, bucket_: int, k: int) -> None:
        """A step that paid for more than its k (warm-up) is no measure: the next of its bucket runs k."""
        self._seen.add((bucket_, k))
        self.unmeasured = (bucket_, k)

    def known(self, bucket_: int, k: int) -> bool:
        return k in self._times.get(bucket_, {})

    def count(self, bucket_: int, k: int) -> int:
        """Steps measured in the window (at most COST_WINDOW)."""
        return len(self._times.get(bucket_, {}).get(k, ()))

    def relative(self, bucket_: int, k: int) -> float:
        """k's cost over plain's, each the fastest of as many latest steps as both have measured: the
        fastest of many steps is lower than that of few, and a k that a dormant bucket's probe measured
        once would otherwise lose to plain's many steps by that alone."""
        times = self._times[bucket_]
        n = min(len(times.get(k, ())), len(times.get(0, ())))
        if not n:
            return self.estimate(bucket_, k) / self.estimate(bucket_, 0)
        return min(list(times[k])[-n:]) / min(list(times[0])[-n:])

    def estimate(self, bucket_: int, k: int) -> float:
        """The measured cost, or a line between the nearest measured k below and above.

        Contention with other work only ever adds time: the fastest recent step is the cost.
        """
        times = self._fastest[bucket_]
        if k in times:
            return times[k]
        below = max((j for j in times if j < k), default=None)
        above = min((j for j in times if j > k), default=None)
        if below is None or above is None:  # no measure on one side: the nearest there is
            return times[min(times, key=lambda j: abs(j - k))]
        return times[below] + (times[above] - times[below]) * (k - below) / (above - below)


class ProbeSchedule:
    """When a bucket next tries a k other than the best: every PROBE_EVERY steps while it
    proposes; while plain wins, PROBE_BACKOFF times longer after each probe, up to MAX_PROBE_EVERY
    steps. A dormant draft's probe first reads every token since the last one: only requests that
    end before it is caught up save the draft its work, so the interval soon outgrows them, and a
    probe whose catch-up would cost more than its share waits (defer)."""

    def __init__(self):
        self.step = self.count = 0  # decode steps and probes so far
        self.last = 0  # the step of the latest probe
        self.next = self.interval = PROBE_EVERY

    def due(self, best: int) -> bool:
        """Whether a probe is due at this step (counted); take() it where it runs."""
        self.step += 1
        if best and self.interval > PROBE_EVERY:  # awake again: probes are cheap once more
            self.next, self.interval = min(self.next, self.step + PROBE_EVERY), PROBE_EVERY
        return self.step >= self.next

    def take(self, best: int) -> None:
        self.interval = min(PROBE_BACKOFF * self.interval, MAX_PROBE_EVERY) if best == 0 else PROBE_EVERY
        self.next, self.count, self.last = self.step + self.interval, self.count + 1, self.step

    def since(self) -> int:
        """Steps since the latest probe (or since the bucket's first)."""
        return self.step - self.last

    def defer(self, steps: int) -> None:
        """The due probe waits until `steps` steps after the latest one."""
        self.next = max(self.next, self.last + steps)


class Speculation:
    """Fixed k: every decode step proposes K tokens. Subclasses choose per step."""

    plain_beside_prompts = False  # fixed proposes K even where prompt chunks share the step

    def __init__(self, max_k: int, clock: Callable[[], float] = time.perf_counter):
        self.max_k = max_k
        self.current = max_k  # the k chosen for the latest step, probes aside (a metric)
        self.clock = clock
        self._step: tuple[int, int, float | None] | None = None
        self.backlog: Callable[[], int] | None = None  # the step's, from start_step
        self._ended: float | None = None  # when the latest step ended, where it was timed
        self._uncounted = 0.0

    @property
    def awake(self) -> bool:
        """Whether the draft reads as it goes (the latest step proposed): dormant, it catches up later."""
        return self.current > 0

    def start_step(self, batch_size: int, pinned: bool = False, with_prompts: bool = False,
                   backlog: Callable[[], int] | None = None) -> int:
        """The k of the decode step about to run (K when pinned; 0 beside prompt chunks where the policy
        says so, the draft's state unchanged); its time runs until finish_step. `backlog` counts the
        tokens the draft would read before proposing for these rows (asked only for a dormant probe)."""
        self.backlog = backlog
        if pinned:
            k = self.max_k
        elif with_prompts and self.plain_beside_prompts:
            k = 0
        else:
            k = self.choose(batch_size)
        # A step timed None: its time is not read (a clock that counts CPU time costs a system call).
        started = self.clock() if self.timed(batch_size, k) else None
        if started is not None and self._ended is not None:
            self.observe_between(started - self._ended)
        self._step, self._uncounted, self._ended = (batch_size, k, started), 0.0, None
        return k

    def timed(self, batch_size: int, k: int) -> bool:
        """Whether the step about to run is timed: fixed k learns nothing from its steps."""
        return False

    @contextmanager
    def uncounted(self):
        """Leaves the work inside out of the step's cost: the draft catching up on the tokens of
        earlier plain steps is owed to how long it lay dormant, not to this step's k."""
        started = self.clock()
        try:
            yield
        finally:
            self._uncounted += self.clock() - started

    @contextmanager
    def catching_up(self):
        """Uncounted work of the draft reading tokens; add each forward's tokens to the list it gives:
        their time per token is the draft's reading cost."""
        tokens: list[int] = []
        started = self.clock()
        with self.uncounted():
            yield tokens
        if sum(tokens):
            self.observe_read(sum(tokens), self.clock() - started)

    def observe_read(self, tokens: int, seconds: float) -> None:
        pass

    def observe_traffic(self, prompt_tokens: int, generated_tokens: int) -> None:
        """A step's prompt tokens prefilled and tokens generated."""

    def finish_step(self, num_accepted: list[int] | None, measured: bool = True) -> None:
        """Accepted proposals per row (None for a plain step) of the step start_step began; `measured`:
        its time is its decoding's (not where prompts' chunks shared its forward)."""
        if self._step is None:
            raise RuntimeError("finish_step without start_step")
        batch_size, k, started = self._step
        if measured and started is not None:
            self._ended = self.clock()
            self.observe(batch_size, k, self._ended - started - self._uncounted, num_accepted)

    def observe_between(self, seconds: float) -> None:
        """The time from one timed step's end to the next one's start: the engine's work between steps."""

    def choose(self, batch_size: int) -> int:
        """The k of a step no rule above fixed (start_step); `self.backlog` is the step's."""
        return self.max_k

    def observe(self, batch_size: int, k: int, seconds: float, num_accepted: list[int] | None) -> None:
        pass


class AdaptiveSpeculation(Speculation):
    """Per step, the k in 0..K with the most expected tokens per second of step."""

    plain_beside_prompts = True

    def __init__(self, max_k: int, clock: Callable[[], float] = time.perf_counter):
        super().__init__(max_k, clock)
        self.acceptance = Acceptance()
        self.costs = StepCosts()
        self.reading = Reading()
        self._waking: tuple[int, int] | None = None  # (bucket, k) of a probe that wakes the draft
        self._between: deque[float] = deque(maxlen=COST_WINDOW)
        self._plain_steps = 0
        self._probes: dict[int, ProbeSchedule] = {}

    def choose(self, batch_size: int) -> int:
        b, K = bucket(batch_size), self.max_k
        if self.costs.unmeasured is not None and self.costs.unmeasured[0] == b:
            return self.costs.unmeasured[1]  # again, now: a probe's draft is caught up for this step alone
        probes = self._probes.setdefault(b, ProbeSchedule())
        # Both ends are measured first (K also measures acceptance): the costs between are interpolated.
        # Awake, K goes first, then plain, FIRST_SAMPLES steps each (one step's noise would decide);
        # dormant, plain does, and K waits for the bucket's first probe, as waking costs.
        known_k = self.costs.known(b, K)
        if self.awake and self.costs.count(b, K) < FIRST_SAMPLES:
            return K
        if self.costs.count(b, 0) < (FIRST_SAMPLES if known_k else 1):
            return 0
        if not known_k:
            return self._probe(b, batch_size, probes, 0, [K], PROBE_SHARE) if probes.due(0) else 0
        rate = self._rates(b, batch_size)
        best = self._best(rate)
        if probes.due(best):  # each other k in turn, so no estimate goes stale
            hopeful = max(rate[k] for k in range(1, K + 1)) >= PROBE_HOPE * rate[0]
            k = self._probe(b, batch_size, probes, best, [k for k in range(K + 1) if k != best],
                            PROBE_SHARE if hopeful else FAR_SHARE)
            if k != best:
                return k
        self.current = best
        return best

    def _probe(self, b: int, batch_size: int, probes: ProbeSchedule, best: int, others: list[int],
               share: float) -> int:
        """The k of a due probe, or `best` while it waits: a dormant draft's probe first reads every row's
        backlog, and runs only once the bucket's plain steps since its last probe took 1/share times
        that reading's estimated time."""
        if not self.awake:
            needed = self._steps_paying_for(b, batch_size, share)
            if probes.since() < needed:
                probes.defer(needed)
                return best
        probes.take(best)
        k = others[probes.count % len(others)]
        if not self.awake:  # the draft's weights and cache are cold: the next step measures it
            self._waking = (b, k)
        return k

    def _steps_paying_for(self, b: int, batch_size: int, share: float) -> int:
        """Plain steps of this batch whose time, times `share`, is a catch-up of the rows' backlog (0
        until the draft's reading cost is measured, or where no backlog is given); at most
        MAX_PROBE_EVERY: rows that never end lag further every step, and costs may change."""
        if self.backlog is None or not self.reading.read:
            return 0
        catch_up = self.backlog() * self.reading.seconds / self.reading.read
        plain = max(self.costs.estimate(b, 0) * batch_size, 1e-12)
        return min(MAX_PROBE_EVERY, math.ceil(catch_up / (share * plain)))

    def timed(self, batch_size: int, k: int) -> bool:
        """Every step that proposes; of plain steps, those a bucket has no measure of yet and one in
        PLAIN_SAMPLE otherwise (their cost moves slowly; timing one costs a clock read a step)."""
        if k:
            return True
        self._plain_steps += 1
        return self._plain_steps % PLAIN_SAMPLE == 0 or self.costs.count(bucket(batch_size), 0) < FIRST_SAMPLES \
            or self.costs.unmeasured == (bucket(batch_size), 0)

    def _rates(self, b: int, batch_size: int) -> dict[int, float]:
        """Expected tokens per second per row for each k, the draft's prompt reading charged to proposals
        and the engine's work between steps (scheduling, outputs; the least of the latest) to every step."""
        alpha, read = self.acceptance.rate or 0.0, self.reading.per_token()
        plain = self.costs.estimate(b, 0)
        between = min(self._between) / batch_size if self._between else 0.0
        rate = {0: 1 / (plain + between)}
        for k in range(1, self.max_k + 1):
            tokens = expected_tokens(alpha, k)
            rate[k] = tokens / (plain * self.costs.relative(b, k) + between + tokens * read)
        return rate

    def _best(self, rate: dict[int, float]) -> int:
        best = max(rate, key=lambda k: rate[k])
        return best if rate[best] >= (STAY_GAIN if self.awake else MIN_GAIN) * rate[0] else 0

    def observe_read(self, tokens: int, seconds: float) -> None:
        self.reading.observe_read(tokens, seconds)

    def observe_between(self, seconds: float) -> None:
        self._between.append(seconds)

    def observe_traffic(self, prompt_tokens: int, generated_tokens: int) -> None:
        self.reading.observe_traffic(prompt_tokens, generated_tokens)

    def observe(self, batch_size: int, k: int, seconds: float, num_accepted: list[int] | None) -> None:
        if self._waking == (bucket(batch_size), k):  # left out as a first step is; choose() runs k again
            self._waking = None
            self.costs.leave_out(bucket(batch_size), k)
        else:
            self.costs.observe(bucket(batch_size), k, seconds / batch_size)
        if k and num_accepted is not None:
            self.acceptance.observe(k, num_accepted)


def speculation_policy(mode: str, max_k: int, clock: Callable[[], float] = time.perf_counter) -> Speculation:
    """The policy the engine asks for k: --speculation fixed|adaptive, K the upper bound; `clock` times
    its steps."""
    return AdaptiveSpeculation(max_k, clock) if mode == "adaptive" and max_k else Speculation(max_k, clock)
