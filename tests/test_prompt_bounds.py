"""The length bound that refuses a prompt before tokenizing: sound on real tokenizers of each kind the
worker loads, absent where a tokenizer may drop text, and the body limit it implies holds every request
that fits."""
from __future__ import annotations

import json
import math
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from vramledger.worker.http.errors import APIError
from vramledger.worker.http.prompt_bounds import PromptBound, body_limit, longest_text
from vramledger.worker.http.request_models import (
    MAX_NAME_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    CompletionRequest,
)
from vramledger.worker.models.loader import load_tokenizer

SHIPPED = "worker/assets/tiny-coder-target"
CORPUS = ["def f(x):\n    return x + 1\n", "hello world, the quick brown fox", "          indented",
          "naïve café — 東京 😀"] * 40
BYTE_TOKENS = [f"<0x{i:02X}>" for i in range(256)]


def fast(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def byte_level(normalizer=None) -> PreTrainedTokenizerFast:
    """GPT-2 / Llama 3 style (Qwen2's with NFC first)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return fast(tok)


def sentencepiece_style() -> PreTrainedTokenizerFast:
    """Llama 2 / Mistral style: spaces become ▁, characters without a token fall back to their bytes."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<|endoftext|>", *BYTE_TOKENS], show_progress=False))
    return fast(tok)


def texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces = [" " * 40, "def f(x):\n", "<|endoftext|>", "naïve", "東京", "😀", "e\u0301",
              "\u1100\u1161\u11a8", "\x00\x01", chr(0xF0000), "\t\t", "x" * 30]
    return ["".join(rng.choice(pieces) for _ in range(rng.randrange(1, 200))) for _ in range(60)] + pieces


@pytest.mark.parametrize("make", [lambda: load_tokenizer(SHIPPED), byte_level,
                                  lambda: byte_level(normalizers.NFC()), sentencepiece_style],
                         ids=["shipped", "byte-level", "byte-level-nfc", "sentencepiece-style"])
def test_no_token_stands_for_more_than_the_bound(make):
    tokenizer = make()
    bound = PromptBound.of(tokenizer)
    assert bound is not None
    for text in texts(seed=1):
        tokens = tokenizer.encode(text, add_special_tokens=False)
        assert len(tokens) >= math.ceil(bound.length(text) / bound.per_token), (text, bound)


def test_the_shipped_pair_counts_bytes_and_its_longest_token():
    tokenizer = load_tokenizer(SHIPPED)
    bound = PromptBound.of(tokenizer)
    assert bound.in_bytes and bound.unicode_form is None
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False)
    assert bound.per_token == max(map(len, vocab)) == 32  # 32 spaces: one byte per byte-level character
    assert PromptBound.of(sentencepiece_style()).in_bytes is False
    assert PromptBound.of(byte_level(normalizers.NFC())).unicode_form == "NFC"


def test_a_text_past_the_bound_is_refused_and_really_does_not_fit():
    tokenizer, max_model_len = load_tokenizer(SHIPPED), 64
    bound = PromptBound.of(tokenizer)
    longest = " " * bound.max_units(max_model_len)  # the longest token, max_model_len - 1 times
    bound.check(longest, max_model_len, "prompt")  # may fit: it is tokenized
    assert len(tokenizer.encode(longest, add_special_tokens=False)) == max_model_len - 1
    with pytest.raises(APIError) as refused:
        bound.check(longest + " ", max_model_len, "prompt")
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"
    assert len(tokenizer.encode(longest + " ", add_special_tokens=False)) > max_model_len - 1
    # Bytes, not characters: 4-byte characters reach the bound four times sooner.
    with pytest.raises(APIError):
        bound.check(chr(0xF0000) * (bound.max_units(max_model_len) // 4 + 1), max_model_len, "prompt")


def test_composed_text_is_measured_as_the_tokenizer_normalizes_it():
    bound = PromptBound.of(byte_level(normalizers.NFC()))
    decomposed = "e\u0301" * 100  # 300 bytes; NFC makes it 100 x "é", 200 bytes
    assert bound.length(decomposed) == 200


@pytest.mark.parametrize("change", [
    lambda tok: setattr(tok, "pre_tokenizer", pre_tokenizers.Whitespace()),  # drops the spaces
    lambda tok: setattr(tok, "normalizer", normalizers.Strip()),
    lambda tok: setattr(tok, "normalizer",
                        normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])),
    lambda tok: setattr(tok, "pre_tokenizer", pre_tokenizers.Split(" ", behavior="removed")),
], ids=["whitespace-split", "strip", "lowercase", "split-removed"])
def test_no_bound_where_the_tokenizer_may_drop_text(change):
    tokenizer = byte_level()
    change(tokenizer.backend_tokenizer)
    assert PromptBound.of(tokenizer) is None


def test_no_bound_for_wordpiece_or_a_bpe_that_drops_unknown_characters():
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert PromptBound.of(fast(wordpiece)) is None
    no_fallback = Tokenizer(models.BPE())  # unknown characters vanish
    no_fallback.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=100, show_progress=False))
    assert PromptBound.of(fast(no_fallback)) is None


@pytest.mark.parametrize("indent", [None, 4])
def test_every_request_that_fits_is_within_the_body_limit(indent):
    """The costliest bodies that still fit: texts at the bound in characters JSON escapes the most
    (control characters; a surrogate pair for the unit of a character-counting tokenizer), every
    short field at its longest, one token id or message per position, pretty-printed or not."""
    max_model_len = 128
    for bound in (PromptBound.of(load_tokenizer(SHIPPED)), PromptBound.of(sentencepiece_style())):
        units = bound.max_units(max_model_len)
        worst = "\x01" if bound.in_bytes else chr(0xF0000)
        limit = body_limit(bound, max_model_len, cap=1 << 40)
        short = {"model": worst * MAX_NAME_CHARS if not bound.in_bytes else "\x01" * MAX_NAME_CHARS,
                 "user": "\x01" * MAX_NAME_CHARS, "stop": [chr(0xF0000) * MAX_STOP_CHARS] * MAX_STOP_STRINGS,
                 "max_tokens": 1, "temperature": 0.123456789, "top_p": 0.987654321, "top_k": 2 ** 31 - 1,
                 "seed": -(2 ** 63), "n": 16, "stream": True, "min_p": 0.5,
                 "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        count = max_model_len - 1
        bodies = [{**short, "prompt": worst * units}, {**short, "prompt": [2 ** 31 - 1] * count},
                  {**short, "messages": [{"role": "assistant", "name": "",
                                          "content": worst * (units // count)} for _ in range(count)]}]
        for body in bodies:
            model = CompletionRequest if "prompt" in body else ChatCompletionRequest
            model.model_validate(body)  # a valid request
            assert len(json.dumps(body, indent=indent).encode()) <= limit


def test_the_costliest_text_passes_the_bound_and_makes_a_token_per_byte():
    tokenizer, max_model_len = load_tokenizer(SHIPPED), 256
    bound = PromptBound.of(tokenizer)
    text = longest_text(bound, max_model_len, max_body_bytes=1 << 22)
    bound.check(text, max_model_len, "prompt")
    assert bound.length(text) > bound.max_units(max_model_len) - 4  # as long as the bound lets through
    assert len(tokenizer.encode(text, add_special_tokens=False)) == len(text.encode())
    assert len(longest_text(None, max_model_len, max_body_bytes=400)) == 100  # no bound: what the body holds
