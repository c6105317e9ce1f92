"""A step's tokens into its outputs: each request's tokens appended until one finishes it, its new
text, its blocks committed to the prefix cache or freed."""
from __future__ import annotations

import time
from collections.abc import Callable

from vramledger.worker.engine.detokenizer import IncrementalText, text_decoder
from vramledger.worker.engine.outputs import RequestOutput
from vramledger.worker.engine.scheduler import Scheduler
from vramledger.worker.engine.sequence import Sequence
from vramledger.worker.engine.step_context import StepContext


class Postprocess:
    """Turns rows and their new tokens into RequestOutputs, and finishes the requests they end."""

    def __init__(self, step: StepContext, scheduler: Scheduler, tokenizer, max_model_len: int,
                 forget: Callable[[Sequence], None]):
        """forget(seq) drops what the engine keeps for a finished request."""
        self.step = step
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.forget = forget
        self._decode_text = text_decoder(tokenizer)
        self.texts: dict[str, IncrementalText] = {}  # each request's text so far

    def track(self, seq: Sequence) -> None:
        self.texts[seq.request_id] = IncrementalText(self._decode_text, seq.params.stop)

    def __call__(self, seqs: list[Sequence], new_tokens: list[list[int]], logprobs: list) -> list[RequestOutput]:
        outputs = []
        stats, blocks = self.step.stats, self.step.blocks
        for s, tokens, lp in zip(seqs, new_tokens, logprobs):
            if s.first_token_time is None:
                s.first_token_time = time.monotonic()
            appended, reason = self._append(s, tokens)
            stats.generation_tokens += len(appended)
            text = self.texts[s.request_id]
            out_ids = s.output_token_ids
            if reason == "stop" and out_ids[-1] in s.params.stop_token_ids:
                out_ids = out_ids[:-1]  # a stop token's text is not part of the completion
            if text.update(out_ids, check_stop=len(out_ids) >= s.params.min_tokens) and reason is None:
                reason = "stop"
            s.num_cached = min(s.num_cached, len(s) - 1)
            s.num_draft_cached = min(s.num_draft_cached, len(s) - 1)
            blocks.commit(s)  # before a finished request's blocks are freed: they stay cached
            if reason is not None:
                self.scheduler.finish(s, reason)
            else:
                blocks.trim(s, len(s))
            outputs.append(RequestOutput(
                s.request_id, appended, text.delta(final=reason is not None), reason is not None, reason,
                s.num_prompt_tokens, len(s.output_token_ids), s.num_draft_tokens, s.num_accepted_tokens,
                lp[:len(appended)] if lp is not None else None, s.first_scheduled_time))
            if reason is not None:
                self.forget(s)
        return outputs

    def _append(self, s: Sequence, tokens: list[int]) -> tuple[list[int], str | None]:
        """Append tokens one by one until one of them finishes the request."""
        appended = []
        eos_token_ids = self.step.sampling.eos_token_ids
        for t in tokens:
            s.output_token_ids.append(t)
            appended.append(t)
            if len(s.output_token_ids) > s.params.min_tokens and (
                    t in s.params.stop_token_ids or (t in eos_token_ids and not s.params.ignore_eos)):
                return appended, "stop"
            if len(s.output_token_ids) >= s.params.max_tokens or len(s) >= self.max_model_len:
                return appended, "length"
        return appended, None
