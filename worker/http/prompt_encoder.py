"""The server's own tokenizer, run on one helper thread: prompts become token ids off the event loop."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from worker.http.openai_protocol import chat_token_ids, prompt_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from worker.http.request_models import ChatCompletionRequest


class PromptEncoder:
    """Encodes prompts on one helper thread: a long prompt never stalls the other streams, and the
    tokenizer is never used from two threads at once (the engine thread decodes with its own)."""

    def __init__(self):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self.tokenizer: PreTrainedTokenizerBase | None = None  # set once loaded
        self.vocab_size = 0

    def load(self, model: str) -> None:
        """Load the tokenizer and warm the thread up (blocking: the engine thread calls it)."""
        from worker.models.loader import load_config, load_tokenizer

        tokenizer = load_tokenizer(model)
        # Token-id prompts must index the embedding and decode: both limits hold.
        vocab_size = min(len(tokenizer), load_config(model).vocab_size)
        # What the first request would start once (the thread, its arena, the tokenizer's pool)
        # starts now, before the ledger takes the runtime: later growth is per request.
        self._thread.submit(prompt_token_ids, "warm up", tokenizer, vocab_size).result()
        self.vocab_size, self.tokenizer = vocab_size, tokenizer

    async def prompt(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        """A completion prompt's token ids (400 when it is empty or out of the vocabulary)."""
        return await self._run(prompt_token_ids, prompt, self.tokenizer, self.vocab_size)

    async def chat(self, body: ChatCompletionRequest) -> list[int]:
        """A conversation's token ids through the tokenizer's chat template."""
        return await self._run(chat_token_ids, body, self.tokenizer)

    async def _run(self, function, *args) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._thread, function, *args)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False)
