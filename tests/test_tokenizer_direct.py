"""The tokenizer loaded without transformers gives transformers' results for everything the worker asks of
a tokenizer, on every kind of checkpoint it takes; the checkpoints it does not take go to transformers."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from random_models import make_tokenizer
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer

from vramledger.worker.config import DEFAULT_MODEL
from vramledger.worker.models.loader import load_tokenizer
from vramledger.worker.models.tokenizer import CheckpointTokenizer, direct_tokenizer

TEXTS = ["def f(x):\n    return x + 1\n", "hello world, the quick brown fox", "  leading and trailing  ",
         "<|endoftext|>inside<|im_start|>user\nhi<|im_end|>", "unicode: é 漢字 🙂 \u0301a", "a , b . c ! don 't", ""]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi <|im_end|> there", "name": "ada"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "é 🙂"}],
]
TEMPLATES = {
    "names": "{% for m in messages %}{{ m['role'] }}{% if m['name'] %}({{ m['name'] }}){% endif %}: "
             "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}",
    "tojson, namespace, loop controls, special tokens":
        "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 3 %}{% break %}"
        "{% endif %}{% set ns.n = ns.n + 1 %}{{ m | tojson }}{{ eos_token }}\n{% endfor %}{{ ns.n }}"
        "{{ dict(a=1) | tojson }}{% if add_generation_prompt %}<|im_start|>{% endif %}",
    "generation block": "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
                        "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}",
    "whitespace control": "{% for m in messages %}\n    {{ m['content'] }}\n{% endfor %}",
    "an attribute the sandbox hides": "{{ messages.__class__ }}|{{ messages | length }}",
}


def metaspace(directory: Path, clean_up: bool, model: str = "BPE") -> Path:
    """A SentencePiece-style checkpoint tokenizer (Llama 2, Mistral), saved as files only."""
    tok = Tokenizer(models.BPE(unk_token="<unk>") if model == "BPE" else models.WordPiece(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = (trainers.BpeTrainer if model == "BPE" else trainers.WordPieceTrainer)(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(TEXTS * 20, trainer)
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    shutil.copy(Path(DEFAULT_MODEL) / "config.json", directory)  # load_tokenizer takes checkpoint directories
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "clean_up_tokenization_spaces": clean_up, "chat_template": TEMPLATES["names"]}))
    return directory


def shipped(directory: Path) -> Path:
    shutil.copytree(DEFAULT_MODEL, directory)
    return directory


def byte_level(directory: Path) -> Path:
    make_tokenizer(directory)
    shutil.copy(Path(DEFAULT_MODEL) / "config.json", directory)
    return directory


KINDS = {"shipped": shipped, "byte-level (tests' checkpoints)": byte_level,
         "metaspace": lambda d: metaspace(d, clean_up=False), "metaspace, clean-up": lambda d: metaspace(d, True)}


@pytest.mark.parametrize("kind", KINDS)
def test_the_direct_tokenizer_gives_what_transformers_gives(kind, tmp_path):
    directory = KINDS[kind](tmp_path / "tok")
    ours, theirs = direct_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    assert isinstance(ours, CheckpointTokenizer) and isinstance(load_tokenizer(str(directory)), CheckpointTokenizer)
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    assert (ours.eos_token_id, ours.vocab_size, len(ours)) == (theirs.eos_token_id, theirs.vocab_size, len(theirs))
    assert ours.get_vocab() == theirs.get_vocab() and ours.chat_template == theirs.chat_template
    assert ours.clean_up_tokenization_spaces == theirs.clean_up_tokenization_spaces
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)
    rng = random.Random(0)
    id_lists = [[rng.randrange(len(ours)) for _ in range(rng.randrange(1, 30))] for _ in range(200)]
    id_lists += [list(range(len(ours))), ours.encode(TEXTS[3]), [0, 1, 2]]
    for ids in id_lists:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), ids
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
        assert ours.decode(ids[:1]) == theirs.decode(ids[:1])


@pytest.mark.parametrize("template", [None, *TEMPLATES])
def test_chat_templates_render_as_transformers_renders_them(template, tmp_path):
    directory = shipped(tmp_path / "tok")
    if template is not None:
        (directory / "chat_template.jinja").write_text(TEMPLATES[template])
    ours, theirs = direct_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    assert ours is not None
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
                    == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt))


@pytest.mark.parametrize("template, error", [
    ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}{% endif %}ok",
     "a system message first"),
    ("{% set ns = namespace(_x=1) %}", "_x"),  # the sandbox keeps a template away from Python's internals
])
def test_a_template_that_raises_raises_in_both(template, error, tmp_path):
    directory = shipped(tmp_path / "tok")
    (directory / "chat_template.jinja").write_text(template)
    for tok in (direct_tokenizer(directory), AutoTokenizer.from_pretrained(directory)):
        with pytest.raises(Exception, match=error):
            tok.apply_chat_template(CONVERSATIONS[0], tokenize=False, add_generation_prompt=True)


CHANGES = {
    "a class that builds its own pipeline": lambda c: c.update(tokenizer_class="LlamaTokenizer"),
    "no class named": lambda c: c.pop("tokenizer_class"),
    "add_bos_token": lambda c: c.update(add_bos_token=True),
    "a special token given with options": lambda c: c.update(
        eos_token={"__type": "AddedToken", "content": "</s>", "lstrip": True, "rstrip": False, "normalized": False,
                   "single_word": False, "special": True}),
    "a special token the vocabulary lacks": lambda c: c.update(pad_token="<pad>"),
}


@pytest.mark.parametrize("change", CHANGES)
def test_other_checkpoints_go_to_transformers(change, tmp_path):
    directory = metaspace(tmp_path / "tok", clean_up=False)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    CHANGES[change](config)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert direct_tokenizer(directory) is None
    assert not isinstance(load_tokenizer(str(directory)), CheckpointTokenizer)


def test_a_wordpiece_tokenizer_that_cleans_up_spaces_goes_to_transformers(tmp_path):
    """transformers rewrites decoded text (" ." -> ".") for it; the tokenizers library does not."""
    assert direct_tokenizer(metaspace(tmp_path / "tok", clean_up=True, model="WordPiece")) is None
