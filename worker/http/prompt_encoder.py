"""The server's own tokenizer on two helper threads: prompts become token ids off the event loop, each
bounded in length before any tokenizing, and a long prompt never holds up a short one."""
from __future__ import annotations

import asyncio
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from vramledger.worker.http.errors import APIError
from vramledger.worker.http.openai_protocol import chat_text, checked_token_ids, single_prompt, text_token_ids
from vramledger.worker.http.prompt_bounds import PromptBound

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from vramledger.worker.http.request_models import ChatCompletionRequest
    from vramledger.worker.models.tokenizer import CheckpointTokenizer

SHORT_CHARS = 1 << 12  # a prompt (or a conversation's texts) this long at most takes the short lane
MARKUP_CHARS = 64  # what a chat template may add per message, counted toward the lane
# Requests parsed and tokenizing at once, as many with bodies of at most SHORT_CHARS bytes and with
# larger ones; the others wait holding their bytes only.
IN_STAGE = 4
# After a prompt of this many tokens, the heap its tokenizing freed goes back to the kernel: a
# refused prompt leaves nothing behind in RSS, and short prompts never pay for the trim.
RELEASE_AFTER_TOKENS = 1 << 12


def without_word_cache(tokenizer) -> None:
    """Turn off the cache of split words a fast BPE or Unigram tokenizer keeps for its lifetime (up to
    10,000 words of at most 256 bytes each). Across prompts of distinct long words it grew by
    55-70 MiB on the shipped tokenizer, all of it kept: memory that grows with the history of
    prompts, which the ledger's measurement of one prompt's peak cannot bound. Without it the shipped
    tokenizer takes about a fifth longer on code (1.06 ms against 0.87 for 1,110 tokens)."""
    resize = getattr(getattr(getattr(tokenizer, "_tokenizer", None), "model", None), "_resize_cache", None)
    if resize is not None:  # a slow (Python) tokenizer has none
        resize(0)


class PromptEncoder:
    """Encodes prompts on two lanes, one thread each: short prompts on one, long ones on the other, so
    a long prompt delays only the long ones behind it. Each text is first checked against the most the
    context can hold (prompt_bounds.py): a prompt that cannot fit is never tokenized. The engine
    thread decodes with its own tokenizer; this one only encodes, which is thread-safe."""

    def __init__(self) -> None:
        self._short = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer-short")
        self._long = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer-long")
        self.tokenizer: CheckpointTokenizer | PreTrainedTokenizerBase | None = None  # set once loaded
        self.vocab_size = 0
        self.bound: PromptBound | None = None  # None: the tokenizer may drop text, no bound from length
        # Held from parsing a request's body to its token ids: small bodies never wait for large ones.
        self._stages = (asyncio.Semaphore(IN_STAGE), asyncio.Semaphore(IN_STAGE))
        self.pending = 0  # requests waiting for or in tokenization: admission counts them as queued
        self._release_heap = lambda: None

    def load(self, model: str) -> None:
        """Load the tokenizer and warm both threads up (blocking: the engine thread calls it)."""
        from vramledger.worker.memory.device import release_free_heap
        from vramledger.worker.models.loader import load_config, load_tokenizer

        tokenizer = load_tokenizer(model)
        tokenizer.model_max_length = sys.maxsize  # lengths are checked here: no warning about long texts
        without_word_cache(tokenizer)
        # Token-id prompts must index the embedding and decode: both limits hold.
        vocab_size = min(len(tokenizer), load_config(model).vocab_size)
        # What the first requests would start once (each thread, its malloc arena, the tokenizer's
        # state) starts now, before the ledger takes the runtime: later growth is per request.
        for lane in (self._short, self._long):
            lane.submit(text_token_ids, "warm up", tokenizer, False).result()
        self.bound, self._release_heap = PromptBound.of(tokenizer), release_free_heap
        self.vocab_size, self.tokenizer = vocab_size, tokenizer

    def stage(self, body_bytes: int) -> asyncio.Semaphore:
        """The slots a request of this many bytes is parsed and tokenized in."""
        return self._stages[body_bytes > SHORT_CHARS]

    async def prompt(self, prompt: str | list[int] | list[str] | list[list[int]],
                     max_model_len: int) -> list[int]:
        """A completion prompt's token ids: 400 when it is empty, out of the vocabulary or cannot fit."""
        prompt = single_prompt(prompt)
        if not isinstance(prompt, str):
            return checked_token_ids(prompt, self.vocab_size, max_model_len)
        if self.bound is not None:
            self.bound.check(prompt, max_model_len, "prompt")
        return await self._run(len(prompt), self._encode, prompt, False)

    async def chat(self, body: ChatCompletionRequest, max_model_len: int) -> list[int]:
        """A conversation's token ids through the tokenizer's chat template; 400 when it cannot fit."""
        # str(): the request model's validator has joined a content's parts into one text.
        texts = [t for m in body.messages for t in (str(m.content), m.name or "")]
        if self.bound is not None:
            # The template writes every message: what their texts alone prove is refused now.
            if len(body.messages) > max_model_len - 1:
                raise APIError(400, f"{len(body.messages)} messages cannot fit in max_model_len "
                               f"{max_model_len}", param="messages", code="context_length_exceeded")
            self.bound.check_total(texts, max_model_len, "messages")
        length = sum(map(len, texts)) + MARKUP_CHARS * len(body.messages)
        return await self._run(length, self._encode_chat, body, max_model_len)

    async def _run(self, length: int, function, *args) -> list[int]:
        lane = self._short if length <= SHORT_CHARS else self._long
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(lane, function, *args)
        finally:
            self.pending -= 1

    # -- on the helper threads -----------------------------------------------------------------
    def _encode(self, text: str, chat: bool) -> list[int]:
        token_ids = text_token_ids(text, self.tokenizer, chat)
        if len(token_ids) >= RELEASE_AFTER_TOKENS:
            self._release_heap()
        return token_ids

    def _encode_chat(self, body: ChatCompletionRequest, max_model_len: int) -> list[int]:
        text = chat_text(body, self.tokenizer)
        if self.bound is not None:
            self.bound.check(text, max_model_len, "messages")
        return self._encode(text, True)

    def tokenize_on_both_lanes(self, long_text: str) -> list[list[int]]:
        """`long_text` on the long lane while the short lane tokenizes the most it takes, at once, as
        serving may: the most memory tokenizing takes."""
        both = threading.Barrier(2)

        def encode(text: str) -> list[int]:
            both.wait()
            return self._encode(text, False)

        short_text = long_text[:SHORT_CHARS]
        tasks = [self._short.submit(encode, short_text), self._long.submit(encode, long_text)]
        return [task.result() for task in tasks]

    def shutdown(self) -> None:
        self._short.shutdown(wait=False)
        self._long.shutdown(wait=False)
