"""How long a prompt text can be and still fit: refused from its length alone, before any tokenizing.

A prompt fits when its tokens number at most max_model_len - 1 (one new token must fit too). No token
stands for more text than the longest one of the vocabulary (`per_token` units: bytes for byte-level
tokenizers, characters otherwise), so a text longer than per_token x (max_model_len - 1) units has
more tokens than fit, whatever they are. That holds only where the tokenizer keeps every unit of the
text: its normalizer and pre-tokenizer drop nothing, and every unit has a token (a byte-level
alphabet, byte fallback, or an unknown token per unknown character). For any other tokenizer
`PromptBound.of` gives None and prompts are tokenized whole (the body size limit bounds them).
"""
from __future__ import annotations

import json
import logging
import random
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, cast

from vramledger.worker.http.errors import APIError
from vramledger.worker.http.request_models import MAX_NAME_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS

log = logging.getLogger(__name__)
# Unicode normalizations (a first normalizer step) the bound applies itself before measuring.
UnicodeForm = Literal["NFC", "NFD", "NFKC", "NFKD"]
UNICODE_FORMS: tuple[UnicodeForm, ...] = ("NFC", "NFD", "NFKC", "NFKD")
# Pre-tokenizers that split the text without dropping any of it (unless told to remove matches).
KEEPS_TEXT = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}
# What a request body may need beside its prompt text, written any way JSON allows but padding:
ESCAPED_BYTES = 6  # per byte of text at most ("\u0001"); per character 12 (a surrogate pair)
PER_POSITION_BYTES = 128  # per token position: a token id or a message's punctuation, indented
SHORT_FIELDS_BYTES = 12 * (MAX_STOP_STRINGS * MAX_STOP_CHARS + 2 * MAX_NAME_CHARS) + (4 << 10)


@dataclass(frozen=True)
class PromptBound:
    """The most text one token stands for, in the units its tokenizer covers."""

    per_token: int
    in_bytes: bool  # byte-level tokenizers: UTF-8 bytes; the others: characters
    unicode_form: UnicodeForm | None = None  # the tokenizer normalizes to this form first

    @classmethod
    def of(cls, tokenizer) -> PromptBound | None:
        """The bound of a Hugging Face fast tokenizer, or None where its pipeline may drop text."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        spec = json.loads(backend.to_str())
        form, normalizer_ok = unicode_form(spec.get("normalizer"))
        steps = flatten(spec.get("pre_tokenizer"), "pretokenizers")
        model = spec.get("model") or {}
        if not (normalizer_ok and model.get("type") == "BPE" and all(keeps_text(s) for s in steps)):
            log.info("the tokenizer may drop text: prompts are tokenized whole (up to the body limit)")
            return None
        byte_level = any(s.get("type") == "ByteLevel" for s in steps)
        unknown_kept = model.get("unk_token") and not model.get("fuse_unk")  # one token per unknown character
        if not (byte_level or model.get("byte_fallback") or unknown_kept):
            log.info("the tokenizer drops characters it has no token for: prompts are tokenized whole")
            return None
        # Byte-level tokens spell one byte per character; added tokens match the text as written.
        longest = max(map(len, model.get("vocab") or {"": 0}))
        added = [t["content"] for t in spec.get("added_tokens") or []]
        longest_added = max((len(a.encode()) if byte_level else len(a) for a in added), default=0)
        return cls(max(longest, longest_added, 1), byte_level, form)

    def max_units(self, max_model_len: int) -> int:
        return self.per_token * (max_model_len - 1)

    def length(self, text: str) -> int:
        """The text's length in this bound's units, after the tokenizer's Unicode normalization."""
        if self.unicode_form is not None and not unicodedata.is_normalized(self.unicode_form, text):
            text = unicodedata.normalize(self.unicode_form, text)
        if not self.in_bytes or text.isascii():
            return len(text)
        return len(text.encode("utf-8"))

    def check(self, text: str, max_model_len: int, param: str) -> None:
        """400 when the text alone proves the prompt cannot fit max_model_len."""
        self.check_total([text], max_model_len, param)

    def check_total(self, texts: Iterable[str], max_model_len: int, param: str) -> None:
        """400 when these texts, all in one prompt, prove it cannot fit max_model_len."""
        if sum(map(self.length, texts)) > self.max_units(max_model_len):
            unit = "bytes" if self.in_bytes else "characters"
            raise APIError(400, f"the prompt is longer than {self.max_units(max_model_len)} {unit}, so it "
                           f"has more than the {max_model_len - 1} tokens that fit in max_model_len "
                           f"{max_model_len} (no token of this model stands for more than {self.per_token} "
                           f"{unit})", param=param, code="context_length_exceeded")


def body_limit(bound: PromptBound | None, max_model_len: int, cap: int) -> int:
    """The most bytes the body of a request that fits max_model_len needs: its prompt text (or its
    messages' texts) at the bound, escaped at worst, a token id or a message per position, and the
    short fields; `cap` where it is less, or where the tokenizer has no bound."""
    if bound is None:
        return cap
    per_unit = ESCAPED_BYTES * (1 if bound.in_bytes else 2)
    return min(cap, per_unit * bound.max_units(max_model_len) + PER_POSITION_BYTES * max_model_len
               + SHORT_FIELDS_BYTES)


def chars_that_pass(bound: PromptBound | None, max_model_len: int, max_body_bytes: int, utf8_bytes: int) -> int:
    """How many characters of `utf8_bytes` bytes each a prompt may have: those that fit the body and
    pass the bound."""
    chars = max_body_bytes // utf8_bytes
    if bound is not None:
        chars = min(chars, bound.max_units(max_model_len) // (utf8_bytes if bound.in_bytes else 1))
    return chars


def longest_text(bound: PromptBound | None, max_model_len: int, max_body_bytes: int) -> str:
    """The prompt text that passes the bound (or fits the body) and makes the most tokens."""
    return costliest_text(chars_that_pass(bound, max_model_len, max_body_bytes, 4))


def ledger_texts(bound: PromptBound | None, max_model_len: int, max_body_bytes: int) -> list[str]:
    """The prompt texts the ledger tokenizes, one after another, for the most memory tokenizing takes:
    longest_text (the most tokens) and mixed_two_byte_text (the shipped tokenizer's costliest)."""
    return [longest_text(bound, max_model_len, max_body_bytes),
            mixed_two_byte_text(bound, max_model_len, max_body_bytes)]


def mixed_two_byte_text(bound: PromptBound | None, max_model_len: int, max_body_bytes: int) -> str:
    """Random characters of U+0080-U+07FF (2 bytes each in UTF-8: letters, marks and symbols of many
    scripts mixed), as many as pass the bound (or fit the body). On the shipped tokenizer it takes
    about half as much memory again to tokenize as longest_text's, with as many tokens."""
    rng = random.Random(0)
    chars = chars_that_pass(bound, max_model_len, max_body_bytes, 2)
    text = "".join(chr(rng.randrange(0x80, 0x800)) for _ in range(chars))
    while bound is not None and (excess := bound.length(text) - bound.max_units(max_model_len)) > 0:
        text = text[:-1 - excess // 3]  # the tokenizer's normalization lengthened it
    return text


def costliest_text(chars: int) -> str:
    """Random private-use characters of the supplementary planes: 4 bytes each in a Python string and
    in UTF-8, and no vocabulary merges them, so a tokenizer makes one token per byte."""
    rng = random.Random(0)
    return "".join(chr(rng.randrange(0xF0000, 0x10FFFE)) for _ in range(chars))


def flatten(step: dict | None, key: str) -> list[dict]:
    """A normalizer's or pre-tokenizer's steps, a Sequence unrolled."""
    if step is None:
        return []
    if step.get("type") == "Sequence":
        return [s for inner in step.get(key, []) for s in flatten(inner, key)]
    return [step]


def unicode_form(normalizer: dict | None) -> tuple[UnicodeForm | None, bool]:
    """(the Unicode form the normalizer applies first, whether no step of it can shorten the text)."""
    steps = flatten(normalizer, "normalizers")
    form: UnicodeForm | None = None
    if steps and steps[0].get("type") in UNICODE_FORMS:
        form = cast(UnicodeForm, steps.pop(0)["type"])
    for step in steps:
        kind = step.get("type")
        if kind == "Prepend":
            continue
        if kind == "Replace" and "String" in step.get("pattern", {}):
            pattern, content = step["pattern"]["String"], step.get("content", "")
            if pattern and len(content.encode()) >= len(pattern.encode()) and len(content) >= len(pattern):
                continue
        return form, False
    return form, True


def keeps_text(step: dict) -> bool:
    return step.get("type") in KEEPS_TEXT and step.get("behavior") != "Removed"
