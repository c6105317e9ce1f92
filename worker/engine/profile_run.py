"""The heaviest step the engine will ever run, through the engine's own step code, and the state it
keeps per request, for measuring."""
from __future__ import annotations

import torch

from vramledger.worker.config import EngineConfig
from vramledger.worker.engine.block_manager import BlockManager
from vramledger.worker.engine.detokenizer import IncrementalText, text_decoder
from vramledger.worker.engine.model_runner import ModelRunner
from vramledger.worker.engine.outputs import EngineStats
from vramledger.worker.engine.plain_forward import plain_forward
from vramledger.worker.engine.row_sampling import RowSampling
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.engine.sequence import Sequence
from vramledger.worker.engine.speculation import CATCH_UP_AFTER, speculation_policy
from vramledger.worker.engine.speculative_step import SpeculativeStep
from vramledger.worker.engine.step_context import StepContext

# Sampling with top-k and top-p takes the most memory (a sort of the vocabulary).
WORST_PARAMS = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
# The other ways a row samples, each its own code: a temperature alone (the C kernels draw_tokens.c and
# verify_tokens.c), greedy, a seeded row's own generator, and penalties (a history of every row's
# tokens). Serving runs them too: the code and the scratch they bring in count before the KV cache is
# sized, or serving's peak passes it (by up to 0.5 MiB of 575 with the shipped pair).
OTHER_PARAMS = (SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
                SamplingParams(temperature=1.0, seed=0, presence_penalty=0.5, repetition_penalty=1.1))


def profile_blocks(config: EngineConfig) -> int:
    """Scratch blocks the run writes into: every row shares one longest-sequence table."""
    return config.max_blocks_per_seq


def prefill_shapes(runner: ModelRunner, config: EngineConfig, longest: int) -> list[tuple[int, int, int]]:
    """(rows, tokens a row, first position) of the prefill steps that hold the most memory: each is
    max_num_batched_tokens wide (padded rows cost the same). Rows from position 0 (a prompt's
    first chunk, over its own tokens); and chunks that end at `longest` after a cached prefix or
    earlier chunks: as many rows as may run, and, when chunks that wide are too wide to read
    their context in place, the most rows of those (each layer gathers their context)."""
    budget, seqs = config.max_num_batched_tokens, config.max_num_seqs
    width = min(longest, budget)
    shapes = [(max(1, min(seqs, budget // width)), width, 0)]
    if longest > 1:
        rows = min(seqs, budget)
        width = min(longest - 1, budget // rows)
        shapes.append((rows, width, longest - width))
        width = runner.narrowest_gathered_chunk(longest)
        if width < longest and width <= budget:
            shapes.append((min(seqs, budget // width), width, longest - width))
    return shapes


class ProfileStep:
    """The engine's own step code (plain_forward, SpeculativeStep) over rows made up for the profile.

    Rows share one scratch block table: keys and values land on the same scratch slots, which
    costs nothing in activations and keeps the scratch cache small. They sample with WORST_PARAMS;
    the block pool (no prefix cache), the counters and the policy are scratch.
    """

    def __init__(self, runner: ModelRunner, config: EngineConfig):
        self.runner, self.config = runner, config
        self.table = list(range(profile_blocks(config)))
        vocab_size = runner.models["target"].config.vocab_size
        self.context = StepContext(runner, BlockManager(len(self.table), config.block_size, caching=False),
                                   EngineStats(num_speculative_tokens=config.num_speculative_tokens),
                                   RowSampling(runner.device, config.seed, set(), vocab_size))
        self.speculative = SpeculativeStep(self.context, config.max_num_batched_tokens)
        self.policy = speculation_policy("fixed", config.num_speculative_tokens)  # learns nothing

    def rows(self, count: int, length: int, cached: int, draft_cached: int = 0,
             params: SamplingParams = WORST_PARAMS) -> list[Sequence]:
        """`count` rows of `length` tokens (one list, shared), `cached` of them in the target's cache and
        `draft_cached` in the draft's, sampling with `params`."""
        tokens = [1] * length
        rows = []
        for i in range(count):
            seq = Sequence(f"profile-{i}", tokens, params, block_table=self.table)
            seq.num_cached, seq.num_draft_cached = cached, draft_cached
            self.context.sampling.add(seq)  # a seeded row's generator
            rows.append(seq)
        return rows

    def prefill(self, rows: int, width: int, start: int, beside: int = 0, longest: int = 0) -> None:
        """A step's prefill: `rows` chunks of `width` tokens from `start`, and `beside` rows decoding at
        position longest - 1 in the target's forward; then the draft's catch-up reading chunks as wide."""
        plain_forward(self.context, self.rows(rows, start + width, start), [width] * rows,
                      self.rows(beside, longest, longest - 1))
        if "draft" in self.runner.models:  # each row's last token is its first proposal's to read
            self.speculative.read(self.rows(rows, start + width + 1, start + width, draft_cached=start))

    def decode(self, batch: int, longest: int, params: SamplingParams = WORST_PARAMS) -> None:
        """A decode step of `batch` rows at context `longest`: plain, or k proposals verified."""
        k = self.config.num_speculative_tokens
        if k == 0:
            plain_forward(self.context, [], [], self.rows(batch, longest, longest - 1, params=params))
            return
        # The first draft step reads the bonus token and the token before it or, with adaptive
        # speculation, what a draft behind after plain steps has not caught up on (further behind, its
        # catch-up runs as prefill chunks, the shapes of the prefill steps).
        behind = min(longest, CATCH_UP_AFTER if self.config.speculation == "adaptive" else 2)
        self.speculative(self.rows(batch, longest, longest - 1, draft_cached=longest - behind, params=params), k,
                         self.policy)


@torch.inference_mode()
def run_worst_case(runner: ModelRunner, config: EngineConfig, longest: int | None = None,
                   batch: int | None = None) -> None:
    """The prefill steps that hold the most memory, the target's with as many rows decoding beside
    them as may run (one forward where the runner fuses them), then a full decode step at the
    longest context: k draft steps then k + 1 verified positions at every row. `longest` and `batch`
    shrink the step (for run_varied)."""
    step = ProfileStep(runner, config)
    longest = longest or config.max_model_len
    for rows, width, start in prefill_shapes(runner, config, longest):
        step.prefill(rows, width, start, min(batch or config.max_num_seqs, config.max_num_seqs - rows), longest)
    step.decode(batch or config.max_num_seqs, longest)


@torch.inference_mode()
def run_sampling_paths(runner: ModelRunner, config: EngineConfig) -> None:
    """A decode step of every row for each other way a row samples (OTHER_PARAMS), and a prefill step whose
    chunks are not all their prompt's last (those rows draw nothing): less memory than the worst
    steps, but code and scratch of their own that stay once serving has run them."""
    step = ProfileStep(runner, config)
    context = min(config.max_model_len, 2 * CATCH_UP_AFTER)  # what sampling holds depends on rows, not context
    for params in OTHER_PARAMS:
        step.decode(config.max_num_seqs, context, params)
    plain_forward(step.context, step.rows(2, 2, 0), [1, 2], [])


@torch.inference_mode()
def run_prompt_alone(runner: ModelRunner, config: EngineConfig) -> None:
    """The prefill steps again with no row decoding beside them, on the threads of a step of one
    prompt alone (ModelRunner.prompt_alone): the scratch of every one of those threads counts.
    Nothing to run where they are the other steps' threads."""
    if runner.prompt_threads is None:
        return
    step = ProfileStep(runner, config)
    with runner.prompt_alone():
        for rows, width, start in prefill_shapes(runner, config, config.max_model_len):
            step.prefill(rows, width, start)


# This pass is most of the profile's time. Each round runs the steps of the three other shapes, then
# the worst step once: the blocks they freed that it cannot reuse raise its peak. On the CPU one round
# does: what malloc holds free after it counts too (profile_window), more than later rounds added to the
# peak (0.2-0.5 MiB of the shipped pair's, 2048 tokens x 16 rows), and with one round no run of
# bench/profiler_accuracy.py --goals passed its budget (20 of 20, margin 2.1-4.8 MiB). On CUDA the
# allocator entry is torch's cached segments beyond the peak, which grow round by round: three rounds.
VARIED_ROUNDS, CPU_VARIED_ROUNDS = 3, 1
VARIED_SHAPES = ((1, 2), (3, 4), (1, 4))  # (numerator, denominator) of the longest context and batch


def run_varied(runner: ModelRunner, config: EngineConfig) -> None:
    """Steps of other shapes, as serving mixes them (prompts and batches of other sizes), then the
    worst step, for several rounds: freed blocks of earlier steps that cannot serve the next
    ones raise the peak, a little more each round until the heap settles."""
    for _ in range(CPU_VARIED_ROUNDS if runner.device.type == "cpu" else VARIED_ROUNDS):
        for num, den in VARIED_SHAPES:
            run_worst_case(runner, config, longest=max(2, config.max_model_len * num // den),
                           batch=max(1, config.max_num_seqs * num // den))
        run_worst_case(runner, config)


def request_states(config: EngineConfig, tokenizer, device: torch.device, count: int | None = None) -> list[tuple]:
    """What the engine keeps per request, for `count` (default max_num_seqs) requests at max_model_len.

    Token ids are fresh Python ints, as the tokenizer and the sampler hand them out; each
    request also holds its decoded text, its block table, its blocks' prefix-cache hashes and its
    own generator.
    """
    vocab = max(2, getattr(tokenizer, "vocab_size", 0) or 2)
    half = config.max_model_len // 2
    decode = text_decoder(tokenizer) if tokenizer is not None else None
    states = []
    for i in range(config.max_num_seqs if count is None else count):
        ids = torch.randint(1, vocab, (config.max_model_len,), generator=torch.Generator().manual_seed(i))
        seq = Sequence(f"profile-{i}", ids[:half].tolist(), WORST_PARAMS)
        seq.output_token_ids = ids[half:].tolist()
        seq.block_table = list(range(config.max_blocks_per_seq))
        if config.prefix_caching:
            seq.block_hashes = [hash((i, b)) for b in range(config.max_model_len // config.block_size)]
        text = IncrementalText(decode, []) if decode is not None else None
        if text is not None:
            text.update(seq.output_token_ids)
        states.append((seq, text, torch.Generator(device).manual_seed(i)))
    return states


def block_index(config: EngineConfig, num_blocks: int) -> BlockManager:
    """A pool of num_blocks blocks, each holding a cached prefix: the prefix cache's host state at
    its largest (every block registered)."""
    pool = BlockManager(num_blocks, config.block_size, config.prefix_caching)
    seq = Sequence("profile-index", [], WORST_PARAMS)
    seq.block_hashes = [hash(("profile-index", b)) for b in range(num_blocks)]  # as if its tokens filled them
    pool.allocate(seq, num_blocks * config.block_size)
    seq.num_cached = num_blocks * config.block_size
    pool.commit(seq)
    pool.free(seq)
    return pool
