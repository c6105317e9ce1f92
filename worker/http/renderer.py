"""The response documents of a generation request, whole or chunk by chunk, in OpenAI's shapes.

Plain dicts, not the pydantic models of response_models.py: a chunk is built per token on the hot
path, and the schema models only document those shapes.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vramledger.worker.engine.outputs import TokenLogprob

    # One choice run to its end: text, token ids, finish reason, logprobs (when asked for).
    Choice = tuple[str, list[int], str | None, list[TokenLogprob] | None]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


LOGPROB_FLOOR = -9999.0  # JSON has no -infinity


class ResponseRenderer:
    """The id, object kind, creation time and model every response and chunk of a request carries,
    and each choice's state across chunks (role sent, logprob text offset)."""

    def __init__(self, request_id: str, chat: bool, model: str, return_token_ids: bool,
                 num_logprobs: int | None = None):
        self.request_id, self.chat, self.model = request_id, chat, model
        self.return_token_ids = return_token_ids
        self.num_logprobs = num_logprobs
        self.created = int(time.time())
        self._role_sent: set[int] = set()
        self._offsets: dict[int, int] = {}

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, index: int, logprobs: list[TokenLogprob] | None) -> dict | None:
        """A choice's `logprobs` for some of its tokens, in the OpenAI shape."""
        if self.num_logprobs is None or logprobs is None:
            return None
        if self.chat:
            return {"content": [{"token": lp.text, "logprob": max(lp.logprob, LOGPROB_FLOOR),
                                 "bytes": list(lp.text.encode()),
                                 "top_logprobs": [{"token": text, "logprob": max(v, LOGPROB_FLOOR),
                                                   "bytes": list(text.encode())} for _, text, v in lp.top]}
                                for lp in logprobs]}
        offset, offsets = self._offsets.get(index, 0), []
        for lp in logprobs:
            offsets.append(offset)
            offset += len(lp.text)
        self._offsets[index] = offset
        # The legacy shape lists the chosen token among the alternatives, as OpenAI does.
        tops = [{**{text: max(v, LOGPROB_FLOOR) for _, text, v in lp.top}, lp.text: max(lp.logprob, LOGPROB_FLOOR)}
                for lp in logprobs]
        return {"tokens": [lp.text for lp in logprobs],
                "token_logprobs": [max(lp.logprob, LOGPROB_FLOOR) for lp in logprobs],
                "top_logprobs": tops, "text_offset": offsets}

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None, index: int = 0,
              logprobs: list[TokenLogprob] | None = None, usage_so_far: dict | None = None) -> dict:
        """One server-sent event's document for one choice's new text."""
        if self.chat:
            delta = {"content": text}
            if index not in self._role_sent:
                delta = {"role": "assistant", "content": text}
                self._role_sent.add(index)
            choice = {"index": index, "delta": delta, "logprobs": self.logprobs(index, logprobs),
                      "finish_reason": finish_reason}
            doc = self._head("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text, "logprobs": self.logprobs(index, logprobs),
                      "finish_reason": finish_reason}
            doc = self._head("text_completion")
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        doc["choices"] = [choice]
        if usage_so_far is not None:
            doc["usage"] = usage_so_far
        return doc

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        doc = self._head("chat.completion.chunk" if self.chat else "text_completion")
        doc.update(choices=[], usage=usage(prompt_tokens, completion_tokens))
        return doc

    def response(self, choices: list[Choice], prompt_tokens: int) -> dict:
        """The whole (non-streaming) response: one (text, token ids, finish reason, logprobs) per choice."""
        rendered = []
        for index, (text, token_ids, finish_reason, logprobs) in enumerate(choices):
            if self.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": text},
                          "logprobs": self.logprobs(index, logprobs), "finish_reason": finish_reason}
            else:
                choice = {"index": index, "text": text, "logprobs": self.logprobs(index, logprobs),
                          "finish_reason": finish_reason}
            if self.return_token_ids:
                choice["token_ids"] = token_ids
            rendered.append(choice)
        doc = self._head("chat.completion" if self.chat else "text_completion")
        doc.update(choices=rendered, usage=usage(prompt_tokens, sum(len(c[1]) for c in choices)))
        return doc
