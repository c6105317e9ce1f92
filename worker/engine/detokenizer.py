"""Incremental text for streaming, with stop strings held back until they are decided."""
from __future__ import annotations


class IncrementalText:
    """Decodes a request's output tokens and hands out only text that is final."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""
        self.emitted = 0

    def update(self, output_token_ids: list[int], check_stop: bool = True) -> bool:
        """Re-decode the output; True when a stop string appeared (text is cut before it)."""
        self.text = self.tokenizer.decode(output_token_ids, skip_special_tokens=True)
        for s in self.stop if check_stop else ():
            at = self.text.find(s, max(0, self.emitted - len(s)))
            if at != -1:
                self.text = self.text[:at]
                return True
        return False

    def delta(self, final: bool) -> str:
        """New text since the last call; unfinished characters and stop prefixes wait."""
        end = len(self.text)
        if not final:
            while end > self.emitted and self.text[end - 1] == "\ufffd":
                end -= 1  # a multi-byte character split across tokens
            for s in self.stop:
                for n in range(min(len(s) - 1, end - self.emitted), 0, -1):
                    if self.text[end - n:end] == s[:n]:
                        end -= n
                        break
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out


class TokenTexts:
    """Each token's own text (for logprobs), decoded once per token id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text
