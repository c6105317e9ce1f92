"""The engine: step() = schedule -> propose -> verify -> sample -> account."""
from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import Callable

import torch

from vramledger.ledger_document import LedgerDocument
from vramledger.worker.config import EngineConfig
from vramledger.worker.engine.block_manager import BlockManager
from vramledger.worker.engine.engine_parts import ServerState, load_engine_parts
from vramledger.worker.engine.outputs import EngineStats, RequestOutput
from vramledger.worker.engine.plain_forward import plain_forward
from vramledger.worker.engine.postprocess import Postprocess
from vramledger.worker.engine.row_sampling import RowSampling
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.engine.scheduler import Scheduler
from vramledger.worker.engine.sequence import Sequence
from vramledger.worker.engine.snapshot import EngineSnapshot, publishes
from vramledger.worker.engine.speculation import speculation_policy
from vramledger.worker.engine.speculative_step import SpeculativeStep
from vramledger.worker.engine.step_context import StepContext
from vramledger.worker.memory.device import Device


class LLMEngine:
    """Continuous-batching speculative decoding over one paged KV cache."""

    def __init__(self, config: EngineConfig, server_state: ServerState | None = None):
        """server_state(config, tokenizer, device) builds what a server in front holds for its requests
        in flight (config with its lengths resolved), measured into the ledger's `server` entry
        (worker/http/request_state.py)."""
        parts = load_engine_parts(config, server_state)
        self.config = config = parts.config
        self.device, self.startup, self.tokenizer = parts.device, parts.startup, parts.tokenizer
        self.ledger, self.runner, self.num_blocks = parts.ledger, parts.runner, parts.num_blocks
        self.vocab_size = parts.vocab_size
        self.blocks = BlockManager(self.num_blocks, config.block_size, config.prefix_caching)
        self.max_k = config.num_speculative_tokens
        # Every decode step may propose up to K tokens: the scheduler reserves slots for K.
        # On the CPU a forward costs about 1 ms besides its tokens (9 tokens of the shipped target's
        # prefill): prompts share a step only up to 64 tokens. A GPU reads every weight each forward.
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens, self.max_k,
                                   self.runner.attention_span(), 64 if self.device.kind == "cpu" else None)
        self.speculation = speculation_policy(config.speculation, self.max_k, step_clock(self.device))
        self.stats = EngineStats(num_speculative_tokens=self.max_k, current_speculative_tokens=self.max_k)
        self.sampling = RowSampling(self.device.torch_device, config.seed, parts.eos_token_ids, self.vocab_size,
                                    self.tokenizer)
        step = StepContext(self.runner, self.blocks, self.stats, self.sampling)
        self.speculative_step = SpeculativeStep(step, config.max_num_batched_tokens)
        self._plain = functools.partial(plain_forward, step)
        self._postprocess = Postprocess(step, self.scheduler, self.tokenizer, config.max_model_len, self._forget)
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.publish_snapshot()

    def publish_snapshot(self) -> None:
        """Hand other threads the engine's counts (snapshot.py): one assignment, atomic in CPython."""
        self.snapshot = EngineSnapshot.of(self.scheduler, self.blocks, self.stats)

    def memory_report(self, snapshot: EngineSnapshot | None = None) -> LedgerDocument:
        """The ledger document of docs/ledger.md: its blocks from `snapshot` (the latest published when
        None), the process's memory measured now. The ledger itself is complete once the engine loads."""
        snapshot = self.snapshot if snapshot is None else snapshot
        return self.ledger.to_dict(blocks_used=snapshot.blocks_used, blocks_cached=snapshot.blocks_cached)

    def on_compute(self, callback: Callable[[], None]) -> None:
        """`callback` runs as each step's one-call kernel starts (ModelRunner.on_compute)."""
        self.runner.on_compute(callback)

    # -- requests ---------------------------------------------------------------------
    @publishes
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, group: str = "") -> str:
        """Queue a request; `group` names the request it is one choice of (the scheduler never lets
        one request's choices take every running slot)."""
        params = params or SamplingParams()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:  # out of range, the embedding reads garbage
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; max_model_len is "
                             f"{self.config.max_model_len} (the prompt and at least one new token must fit)")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, token_ids, params, group=group)
        self.sampling.add(seq)
        self._postprocess.track(seq)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    @publishes
    def abort_request(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None:
            self.scheduler.finish(seq, "abort")
            self._forget(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step ---------------------------------------------------------------------
    @publishes
    def step(self, early: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """One step's outputs. `early`, when given, receives the outputs of a speculative step's prompt
        chunks before its proposals and verification run: their first tokens need not wait for them."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        if not batch.decode:
            # One prompt alone gets its own threads (ModelRunner.prompt_alone says why); a burst of
            # prompts comes from clients that may still be sending, which take a core.
            with self.runner.prompt_alone() if len(batch.prefill) == 1 else contextlib.nullcontext():
                computed = self._plain(batch.prefill, batch.chunks, [])
            generated = self.stats.generation_tokens
            outputs = self._postprocess(*computed)
            self.speculation.observe_traffic(sum(batch.chunks), self.stats.generation_tokens - generated)
            return outputs
        # A seeded sampled request draws its random numbers per proposal: it keeps one k (K) so its
        # text depends on the seed only, never on the load.
        seeded = any(s.params.seed is not None and not s.params.greedy for s in batch.decode)
        k = self.speculation.start_step(len(batch.decode), pinned=seeded, with_prompts=bool(batch.prefill),
                                        backlog=lambda: self.speculative_step.backlog(batch.decode))
        generated = self.stats.generation_tokens
        if k == 0:
            # Chunks and decode rows in one forward: the step's time is not a plain step's cost.
            outputs = self._postprocess(*self._plain(batch.prefill, batch.chunks, batch.decode))
            self.speculation.finish_step(None, measured=not batch.prefill)
        else:
            with self.speculation.uncounted():  # the chunks' forward is not the proposals' cost
                outputs = self._postprocess(*self._plain(batch.prefill, batch.chunks, []))
                if early is not None and outputs:
                    early(outputs)
                    outputs = []
            tokens, accepted, decoded = self.speculative_step(batch.decode, k, self.speculation)
            outputs += self._postprocess(batch.decode, tokens, decoded)
            self.speculation.finish_step(accepted)
        self.speculation.observe_traffic(sum(batch.chunks), self.stats.generation_tokens - generated)
        self.stats.current_speculative_tokens = self.speculation.current
        return outputs

    def _forget(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        self._postprocess.texts.pop(seq.request_id, None)
        self.sampling.forget(seq.request_id)

    # -- convenience ------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[tuple[list[int], str, str | None]]:
        """Run prompts to completion: (token ids, text, finish reason) per prompt, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        texts: dict[str, list[str]] = {i: [] for i in ids}
        reasons: dict[str, str | None] = dict.fromkeys(ids)
        while self.has_unfinished_requests():
            for out in self.step():
                tokens[out.request_id].extend(out.new_token_ids)
                texts[out.request_id].append(out.text)
                reasons[out.request_id] = out.finish_reason
        return [(tokens[i], "".join(texts[i]), reasons[i]) for i in ids]


def step_clock(device: Device) -> Callable[[], float]:
    """What times the speculation policy's steps. On one CPU thread a step's work is the engine thread's
    own: its CPU time is the step's cost, which the host's other processes (a client beside the server,
    neighbours) do not inflate as they do wall time, at random, one step and one k more than another."""
    one_thread = device.kind == "cpu" and torch.get_num_threads() == 1
    return time.thread_time if one_thread else time.perf_counter
