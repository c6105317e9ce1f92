"""A checkpoint's fast tokenizer loaded with the `tokenizers` library alone, where transformers would build
the same one: importing transformers' tokenizer code took a quarter of the worker's start-up (it pulls in
torch.distributed and sympy). It offers what the worker asks of a tokenizer (encode, decode, the vocabulary,
the end-of-sequence id, the chat template) with transformers' results; tests/test_tokenizer_direct.py
compares the two on every kind of checkpoint it takes. Any other checkpoint goes to transformers."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, processors

from vramledger.worker.models.chat_template import ChatTemplate

# The tokenizer classes whose fast tokenizer is tokenizer.json as written (no class rebuilds its pipeline).
GENERIC_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}
NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
EXTRA_SPECIAL = ("additional_special_tokens", "extra_special_tokens")
# tokenizer_config.json keys this loader reads or that change nothing it offers; any other sends the
# checkpoint to transformers (add_bos_token, added_tokens_decoder, split_special_tokens, ...).
KNOWN_KEYS = {*NAMED_SPECIAL, *EXTRA_SPECIAL, "tokenizer_class", "clean_up_tokenization_spaces", "chat_template",
              "model_max_length", "padding_side", "truncation_side", "model_input_names", "backend"}
# Files transformers reads beside tokenizer_config.json that this loader does not.
OTHER_FILES = ("special_tokens_map.json", "added_tokens.json", "chat_template.json", "additional_chat_templates")
# transformers patches the pre-tokenizer of large vocabularies of these model types (a Mistral regex fix).
MISTRAL_TYPES = {"mistral", "mistral3", "voxtral", "ministral", "pixtral"}


class CheckpointTokenizer:
    """A checkpoint's tokenizer.json with its tokenizer_config.json's special tokens and chat template."""

    def __init__(self, backend: Tokenizer, config: dict, chat_template: str | None):
        self.backend_tokenizer = backend
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.model_max_length = config.get("model_max_length")
        self.special_tokens_map = {name: config[name] for name in NAMED_SPECIAL if config.get(name) is not None}
        eos = self.special_tokens_map.get("eos_token")
        self.eos_token_id = None if eos is None else backend.token_to_id(eos)
        self.chat_template = chat_template
        self._template = ChatTemplate(chat_template) if chat_template else None

    @property
    def _tokenizer(self) -> Tokenizer:  # transformers' name for it (prompt_encoder.without_word_cache)
        return self.backend_tokenizer

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (transformers' vocab_size)."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        """The conversation rendered as text (the worker tokenizes it itself)."""
        if tokenize or self._template is None:
            raise ValueError("only rendering to text through the checkpoint's chat template is offered")
        return self._template.render(messages, add_generation_prompt, self.special_tokens_map)


def generic_config(directory: Path) -> dict | None:
    """The checkpoint's tokenizer_config.json where its files alone allow loading it without transformers
    (tokenizer.json beside it, a generic class, nothing this loader does not read), else None."""
    tokenizer_file, config_file = directory / "tokenizer.json", directory / "tokenizer_config.json"
    if not (tokenizer_file.is_file() and config_file.is_file()):
        return None
    if any((directory / name).exists() for name in OTHER_FILES):
        return None
    config = json.loads(config_file.read_text())
    if config.get("tokenizer_class") not in GENERIC_CLASSES or not set(config) <= KNOWN_KEYS:
        return None
    if not all(isinstance(t, str) for t in special_tokens(config)):
        return None  # AddedToken dicts carry options (lstrip, normalized...) this loader does not apply
    if not isinstance(config.get("chat_template", ""), str):
        return None  # a list of named templates
    return config


def special_tokens(config: dict) -> list:
    """The named special tokens (bos, eos...), then the extra ones, as tokenizer_config.json lists them."""
    named = [config[n] for n in NAMED_SPECIAL if config.get(n) is not None]
    return named + [t for key in EXTRA_SPECIAL for t in config.get(key) or []]


def direct_tokenizer(directory: Path) -> CheckpointTokenizer | None:
    """The checkpoint's tokenizer without transformers, or None where transformers would build another."""
    config = generic_config(directory)
    if config is None:
        return None
    special = special_tokens(config)
    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    if backend.truncation is not None or backend.padding is not None:
        return None
    if any(backend.token_to_id(t) is None for t in special):
        return None  # transformers would add it, at an id this loader does not promise to match
    if backend.get_vocab_size() > 100_000 and model_type(directory) in MISTRAL_TYPES:
        return None
    if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        return None  # transformers cleans up spaces in decoded text, except for BPE models
    # What transformers does to every fast tokenizer it loads: its special tokens marked special (not
    # normalized), and a post-processor that adds nothing where the file has none.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if backend.post_processor is None:
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    backend.encode_special_tokens = False
    return CheckpointTokenizer(backend, config, chat_template(directory, config))


def chat_template(directory: Path, config: dict) -> str | None:
    """chat_template.jinja, else the config's template (as transformers reads them)."""
    file = directory / "chat_template.jinja"
    return file.read_text(encoding="utf-8") if file.is_file() else config.get("chat_template")


def model_type(directory: Path) -> str | None:
    try:
        return json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
