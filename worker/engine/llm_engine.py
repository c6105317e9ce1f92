"""The engine: step() = schedule -> propose -> verify -> sample -> account."""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable

import torch

from vramledger.ledger_document import LedgerDocument
from vramledger.worker.config import EngineConfig
from vramledger.worker.engine.block_manager import BlockManager
from vramledger.worker.engine.detokenizer import IncrementalText, TokenTexts, text_decoder
from vramledger.worker.engine.memory_setup import plan_memory
from vramledger.worker.engine.model_runner import ModelRunner
from vramledger.worker.engine.outputs import EngineStats, RequestOutput, TokenLogprob
from vramledger.worker.engine.penalties import History
from vramledger.worker.engine.sampler import RowParams, draw, propose, top_logprobs
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.engine.scheduler import Scheduler
from vramledger.worker.engine.sequence import Sequence
from vramledger.worker.engine.snapshot import EngineSnapshot, publishes
from vramledger.worker.engine.spec_decode import verify_logits
from vramledger.worker.engine.speculation import CATCH_UP_AFTER, speculation_policy
from vramledger.worker.engine.startup import StartupPhases
from vramledger.worker.memory.device import get_device
from vramledger.worker.memory.ledger import Ledger, format_table, summary_line
from vramledger.worker.memory.profiler import collecting_only_new_objects, measure_held, measure_weights
from vramledger.worker.models.llama import CausalLM
from vramledger.worker.models.loader import (
    ModelLoadError,
    load_config,
    load_model,
    load_tokenizer,
    same_tokenizer_files,
)

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine:
    """Continuous-batching speculative decoding over one paged KV cache."""

    def __init__(self, config: EngineConfig,
                 server_state: Callable[[EngineConfig, object, torch.device], object] | None = None):
        """server_state(config, tokenizer, device) builds what a server in front holds for its requests
        in flight (config with its lengths resolved), measured into the ledger's `server` entry
        (worker/http/request_state.py)."""
        self.config = config
        self.device = get_device(config.device)
        self.dtype = self.device.dtype if config.dtype == "auto" else DTYPES[config.dtype]
        if self.device.kind == "cpu" and config.cpu_threads:  # before the profile: it measures serving's threads
            torch.set_num_threads(config.cpu_threads)
        for path in filter(None, (config.model, config.draft_model)):
            load_config(path)  # a bad path or architecture fails before anything is loaded
        self.startup = StartupPhases()  # each phase logged; the server publishes them once it serves
        with self.startup.phase("tokenizer"):
            self.tokenizer = load_tokenizer(config.model)
            if config.draft_model:
                check_same_tokenizer(self.tokenizer, config)
        self.ledger = Ledger.at_start(self.device, config.model, config.draft_model)
        with collecting_only_new_objects():
            target = self._load("target", config.model)
            draft = self._load("draft", config.draft_model) if config.draft_model else None
            if draft is not None and draft.config.vocab_size != target.config.vocab_size:
                raise ModelLoadError(f"draft vocab_size {draft.config.vocab_size} differs from the "
                                     f"target's {target.config.vocab_size}")
            config = self.config = config.resolve_lengths(target.config.max_position_embeddings, self.device.kind)
            self.runner = ModelRunner(target, draft, config.block_size, self.device.torch_device)
            if self.device.kind == "cpu" and config.cpu_prompt_threads not in (None, config.cpu_threads):
                self.runner.prompt_threads = config.cpu_prompt_threads  # before the profile: it measures them
            with self.startup.phase("kernels"):
                # They stay in oneDNN's cache for the process's life: what it grew by is theirs.
                self.ledger.record("kernels", measure_held(self.device, self.runner.warm_kernels))
            self.ledger.record("compiled", 0)
            if config.compile:  # before the profile, so that it measures compiled steps
                with self.startup.phase("compile"):
                    self.ledger.record("compiled", measure_held(
                        self.device, lambda: self.runner.compile(config.compile_backend)))
            held_by_server = None if server_state is None else functools.partial(
                server_state, config, self.tokenizer, self.device.torch_device)
            with self.startup.phase("memory_profile"):
                self.num_blocks = plan_memory(self.runner, config, self.device, self.ledger, self.tokenizer,
                                              held_by_server)
            with self.startup.phase("kv_cache"):
                self.runner.allocate_kv_cache(self.num_blocks)
        log.info(summary_line(self.ledger))
        log.debug("memory ledger:\n%s", format_table(self.ledger))
        self.blocks = BlockManager(self.num_blocks, config.block_size, config.prefix_caching)
        self.max_k = config.num_speculative_tokens
        # Every decode step may propose up to K tokens: the scheduler reserves slots for K.
        # On the CPU a forward costs about 1 ms besides its tokens (9 tokens of the shipped target's
        # prefill): prompts share a step only up to 64 tokens. A GPU reads every weight each forward.
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens, self.max_k,
                                   self.runner.attention_span(), 64 if self.device.kind == "cpu" else None)
        # On one CPU thread a step's work is the engine thread's own: its CPU time is the step's cost, which
        # the host's other processes (a client beside the server, neighbours) do not inflate as they do
        # wall time, at random, one step and one k more than another.
        one_thread = self.device.kind == "cpu" and torch.get_num_threads() == 1
        self.speculation = speculation_policy(config.speculation, self.max_k,
                                              time.thread_time if one_thread else time.perf_counter)
        self.stats = EngineStats(num_speculative_tokens=self.max_k, current_speculative_tokens=self.max_k)
        self.eos_token_ids = eos_ids(self.tokenizer, target.config)
        self.vocab_size = target.config.vocab_size
        self._token_texts = TokenTexts(self.tokenizer)
        self._decode_text = text_decoder(self.tokenizer)
        self._seqs: dict[str, Sequence] = {}
        self._text: dict[str, IncrementalText] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._shared_generator = torch.Generator(self.device.torch_device).manual_seed(config.seed)
        self._ids = itertools.count()
        self._last_rows: tuple[list[Sequence], RowParams] | None = None
        self.publish_snapshot()

    def _load(self, role: str, path: str) -> CausalLM:
        pack = not self.config.compile  # inductor packs plain weights itself (compiled.py)
        device = self.device.torch_device
        with self.startup.phase(f"weights_{role}"):
            model, nbytes = measure_weights(self.device, lambda: load_model(path, self.dtype, device, pack))
        self.ledger.record("weights", nbytes, model=role)
        return model

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
        if params.seed is not None:  # its own generator: its draws do not depend on its batch
            self._generators[request_id] = torch.Generator(self.device.torch_device).manual_seed(params.seed)
        self._text[request_id] = IncrementalText(self._decode_text, params.stop)
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
        k = self.speculation.start_step(len(batch.decode), pinned=seeded, with_prompts=bool(batch.prefill))
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
            tokens, accepted, decoded = self._decode_speculative(batch.decode, k)
            outputs += self._postprocess(batch.decode, tokens, decoded)
            self.speculation.finish_step(accepted)
        self.speculation.observe_traffic(sum(batch.chunks), self.stats.generation_tokens - generated)
        self.stats.current_speculative_tokens = self.speculation.current
        return outputs

    def _rows(self, seqs: list[Sequence]) -> RowParams:
        """The batch's sampling settings; those of the last step when its rows are the same requests
        and no row has a history (a request's settings never change; a history does every step)."""
        params, outputs = [s.params for s in seqs], [s.output_token_ids for s in seqs]
        if History.needed(params, outputs):
            history = History(params, [s.prompt_token_ids for s in seqs], outputs, self.eos_token_ids,
                              self.vocab_size, self.device.torch_device)
            return RowParams(params, self._row_generators(seqs), self.device.torch_device, history,
                             self._shared_generator)
        last = self._last_rows
        if last is None or len(last[0]) != len(seqs) or any(a is not b for a, b in zip(last[0], seqs)):
            # The rows are held, so that an identity compared next step is never another request's.
            last = self._last_rows = (list(seqs), RowParams(params, self._row_generators(seqs),
                                                            self.device.torch_device, None, self._shared_generator))
        return last[1]

    def _row_generators(self, seqs: list[Sequence]) -> list[torch.Generator | None]:
        return [self._generators.get(s.request_id) for s in seqs]

    def _logprobs(self, seqs: list[Sequence], logits: torch.Tensor, tokens: torch.Tensor) -> list:
        """Per row, the target's log-probabilities of tokens [B, P] under logits [B, P, V] (None: not asked)."""
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        out: list[list[TokenLogprob] | None] = [None] * len(seqs)
        if not want:
            return out
        P, text = tokens.shape[1], self._token_texts
        rows = torch.tensor(want, device=logits.device)
        asked = {i: seqs[i].params.logprobs or 0 for i in want}
        chosen, ids, values = top_logprobs(logits[rows].flatten(0, 1), tokens[rows].flatten(), max(asked.values()))
        for r, i in enumerate(want):
            n = asked[i]
            out[i] = [TokenLogprob(t, text(t), chosen[r * P + j],
                                   [(a, text(a), v) for a, v in zip(ids[r * P + j][:n], values[r * P + j][:n])])
                      for j, t in enumerate(tokens[i].tolist())]
        return out

    def _plain(self, prefill: list[Sequence], chunks: list[int],
               decode: list[Sequence]) -> tuple[list[Sequence], list[list[int]], list]:
        """Each prefill row's next chunk of prompt and each decode row's next token, in one target
        forward: the rows whose prompt this completes and the decode rows draw a token. Returns those
        rows, their tokens and logprobs."""
        starts = [s.num_cached for s in prefill]
        rows = [s.tokens_from(n, n + c) for s, n, c in zip(prefill, starts, chunks)]
        tables = [s.block_table for s in prefill]
        parts = [(rows, starts, tables, 1, True)] if prefill else []
        if decode:
            parts.append(([[s.last_token_id] for s in decode], [len(s) - 1 for s in decode],
                          [s.block_table for s in decode], 1, False))
        parted = [part[:, 0] for part in self.runner.forward_parts("target", parts)]
        done = [i for i, (s, c) in enumerate(zip(prefill, chunks)) if s.num_cached + c == len(s)]
        if prefill:  # the draft reads prompts only when a step proposes for them (_draft_catch_up)
            for s, c in zip(prefill, chunks):
                self.stats.prompt_tokens += c
                s.num_cached += c
                s.prefilled = s.num_cached == len(s)
                if not s.prefilled:
                    self.blocks.commit(s)  # its full blocks are reusable before its prefill ends
            if len(done) < len(prefill):
                parted[0] = parted[0][torch.tensor(done, dtype=torch.long, device=parted[0].device)]
        for s in decode:
            s.num_cached = len(s)
        seqs = [prefill[i] for i in done] + decode
        if not seqs:
            return [], [], []
        logits = parted[0] if len(parted) == 1 else torch.cat(parted)
        tokens = draw(logits, self._rows(seqs))
        return seqs, [[t] for t in tokens.tolist()], self._logprobs(seqs, logits[:, None], tokens[:, None])

    def _draft_catch_up(self, seqs: list[Sequence]) -> None:
        """The draft reads what it has not (its requests' prompts, the tokens of steps that did not
        propose; no logits), where a row lags more than CATCH_UP_AFTER tokens: up to its last token,
        which its first proposal reads, in prompt chunks within the prefill's token budget. Rows that
        share cached blocks read them once: one writes a block, the others skip it. Its time is left
        out of the step's cost; the policy learns from it what the draft's reading costs a token."""
        with self.speculation.catching_up() as read:
            while rows := self._behind_the_target(seqs):
                width = max(1, self.config.max_num_batched_tokens // len(rows))
                starts = [s.num_draft_cached for s in rows]
                chunks = [min(width, len(s) - 1 - n) for s, n in zip(rows, starts)]
                self.runner.forward("draft", [s.tokens_from(n, n + c) for s, n, c in zip(rows, starts, chunks)],
                                    starts, [s.block_table for s in rows], 0, prefill=True)
                read.append(sum(chunks))
                for s, c in zip(rows, chunks):
                    s.num_draft_cached += c
                    self.blocks.commit(s)  # marks its full blocks drafted, for the rows that share them

    def _behind_the_target(self, seqs: list[Sequence]) -> list[Sequence]:
        """The rows whose draft lags more than CATCH_UP_AFTER tokens, one per block it writes next:
        rows that share that block wait, then skip it."""
        rows: dict[int, Sequence] = {}
        for s in seqs:
            block = self.blocks.skip_drafted(s)
            if len(s) - s.num_draft_cached > CATCH_UP_AFTER:
                rows.setdefault(block, s)
        return list(rows.values())

    def _decode_speculative(self, seqs: list[Sequence], k: int) -> tuple[list[list[int]], list[int], list]:
        self._draft_catch_up(seqs)
        B, dev = len(seqs), self.device.torch_device
        lens = [len(s) for s in seqs]
        tables = self.runner.block_tables([s.block_table for s in seqs])
        rp = self._rows(seqs)
        # Propose: k draft steps; the first also reads the tokens the draft has not seen
        # (the bonus token, or the last of a catch-up).
        rows = [s.tokens_from(s.num_draft_cached) for s in seqs]
        starts = [s.num_draft_cached for s in seqs]
        feed = None
        draft_probs: list[torch.Tensor] = []
        draft_tokens: list[torch.Tensor] = []
        for i in range(k):
            logits = self.runner.forward("draft", rows, starts, tables, 1, input_ids=feed)[:, 0]
            q, d = propose(logits, rp, torch.stack(draft_tokens, 1) if draft_tokens else None)  # [B, V], [B]
            draft_probs.append(q)
            draft_tokens.append(d)
            rows, starts, feed = [[0]] * B, [n + i for n in lens], d[:, None]
        drafts = torch.stack(draft_tokens, 1)  # [B, k]
        # Verify: the target scores the last token and the k proposals in one forward.
        last = torch.tensor([s.last_token_id for s in seqs], device=dev)[:, None]
        logits = self.runner.forward("target", [[0] * (k + 1)] * B, [n - 1 for n in lens], tables,
                                     k + 1, input_ids=torch.cat([last, drafts], 1))  # [B, k+1, V]
        num_accepted, tokens = verify_logits(drafts, torch.stack(draft_probs, 1), logits, rp)
        accepted = num_accepted.tolist()
        emitted = [row[:n + 1] for row, n in zip(tokens.tolist(), accepted)]
        # Roll back: only the accepted proposals' keys and values stay valid.
        for s, n, length in zip(seqs, accepted, lens):
            s.num_cached = length + n
            s.num_draft_cached = min(length + k - 1, length + n)
            s.num_draft_tokens += k
            s.num_accepted_tokens += n
        self.stats.record_verification(accepted, k)
        return emitted, accepted, self._logprobs(seqs, logits, tokens)

    def _postprocess(self, seqs: list[Sequence], new_tokens: list[list[int]], logprobs: list) -> list[RequestOutput]:
        outputs = []
        for s, tokens, lp in zip(seqs, new_tokens, logprobs):
            if s.first_token_time is None:
                s.first_token_time = time.monotonic()
            appended, reason = self._append(s, tokens)
            self.stats.generation_tokens += len(appended)
            text = self._text[s.request_id]
            out_ids = s.output_token_ids
            if reason == "stop" and out_ids[-1] in s.params.stop_token_ids:
                out_ids = out_ids[:-1]  # a stop token's text is not part of the completion
            if text.update(out_ids, check_stop=len(out_ids) >= s.params.min_tokens) and reason is None:
                reason = "stop"
            s.num_cached = min(s.num_cached, len(s) - 1)
            s.num_draft_cached = min(s.num_draft_cached, len(s) - 1)
            self.blocks.commit(s)  # before a finished request's blocks are freed: they stay cached
            if reason is not None:
                self.scheduler.finish(s, reason)
            else:
                self.blocks.trim(s, len(s))
            outputs.append(RequestOutput(
                s.request_id, appended, text.delta(final=reason is not None), reason is not None, reason,
                s.num_prompt_tokens, len(s.output_token_ids), s.num_draft_tokens, s.num_accepted_tokens,
                lp[:len(appended)] if lp is not None else None, s.first_scheduled_time))
            if reason is not None:
                self._forget(s)
        return outputs

    def _append(self, s: Sequence, tokens: list[int]) -> tuple[list[int], str | None]:
        """Append tokens one by one until one of them finishes the request."""
        appended = []
        for t in tokens:
            s.output_token_ids.append(t)
            appended.append(t)
            if len(s.output_token_ids) > s.params.min_tokens and (
                    t in s.params.stop_token_ids or (t in self.eos_token_ids and not s.params.ignore_eos)):
                return appended, "stop"
            if len(s.output_token_ids) >= s.params.max_tokens or len(s) >= self.config.max_model_len:
                return appended, "length"
        return appended, None

    def _forget(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        self._text.pop(seq.request_id, None)
        self._generators.pop(seq.request_id, None)

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


def eos_ids(tokenizer, model_config) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(model_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def check_same_tokenizer(target_tok, config: EngineConfig) -> None:
    """The draft's tokenizer must be the target's: same files need no second load to compare."""
    assert config.draft_model is not None
    if same_tokenizer_files(config.model, config.draft_model):
        return
    draft_tok = load_tokenizer(config.draft_model)
    if target_tok.get_vocab() != draft_tok.get_vocab() or target_tok.eos_token_id != draft_tok.eos_token_id:
        raise ModelLoadError(f"the draft model's tokenizer ({config.draft_model}) differs from the "
                             f"target's ({config.model}); speculative decoding needs the same tokenizer "
                             "(use --no-draft to serve without a draft)")
