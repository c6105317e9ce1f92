"""The windowed incremental decoding gives, after every token, the text a whole decode gives."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from vramledger.worker.config import DEFAULT_MODEL
from vramledger.worker.engine.detokenizer import IncrementalText, text_decoder

CORPUS = ["déjà vu: naïve café ☕ — 東京 and 😀 emoji", "def f(x):\n    return x ** 2  # square",
          "Hello, world! It's a test. Don't stop."] * 20


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Llama 2, Mistral): words carry a leading '▁'."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>", *bytes_]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def streams(tokenizer, seed: int):
    rng = random.Random(seed)
    ids = [i for text in CORPUS[:3] for i in tokenizer.encode(text, add_special_tokens=False)]
    yield ids  # real text, multi-byte characters split across tokens included
    yield [rng.randrange(len(tokenizer)) for _ in range(300)]  # anything, special tokens too


@pytest.mark.parametrize("kind", ["shipped byte-level", "sentencepiece-style"])
def test_each_step_matches_a_whole_decode(kind):
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL) if kind.startswith("shipped") else metaspace_tokenizer()
    for ids in streams(tokenizer, seed=0):
        text = IncrementalText(text_decoder(tokenizer), [])
        for n in range(1, len(ids) + 1):
            text.update(ids[:n])
            assert text.text == tokenizer.decode(ids[:n], skip_special_tokens=True), n
        text.update(ids[:-1])  # a stop token taken back
        assert text.text == tokenizer.decode(ids[:-1], skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["shipped byte-level", "sentencepiece-style"])
@pytest.mark.parametrize("clean_up", [False, True])
def test_the_decoder_gives_what_the_tokenizer_decodes(kind, clean_up):
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL) if kind.startswith("shipped") else metaspace_tokenizer()
    tokenizer.clean_up_tokenization_spaces = clean_up  # on: the wrapper's clean-up, so the wrapper decodes
    decode = text_decoder(tokenizer)
    assert (decode.func == tokenizer.decode) is clean_up
    for ids in [*streams(tokenizer, seed=1), tokenizer.encode("a , b . c !", add_special_tokens=False)]:
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_decoding_windows_stay_short():
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    ids = tokenizer.encode("word " * 400, add_special_tokens=False)
    lengths = []
    decode = text_decoder(tokenizer)
    text = IncrementalText(lambda part: lengths.append(len(part)) or decode(part), ["never"])
    for n in range(1, len(ids) + 1):
        text.update(ids[:n])
        text.delta(final=False)
    assert text.text == tokenizer.decode(ids) and len(ids) >= 400
    assert max(lengths) <= 4


def test_a_stop_string_split_across_tokens_is_found_and_cut():
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    ids = tokenizer.encode("alpha beta STOP gamma", add_special_tokens=False)
    text = IncrementalText(text_decoder(tokenizer), ["STOP"])
    out = ""
    for n in range(1, len(ids) + 1):
        if text.update(ids[:n]):
            out += text.delta(final=True)
            break
        out += text.delta(final=False)
    assert out == "alpha beta "
