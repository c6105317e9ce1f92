"""Small random Hugging Face checkpoints with a byte-level tokenizer, built locally (no hub)."""
from __future__ import annotations

from pathlib import Path

import torch

CONFIGS = {
    "llama": dict(cls="LlamaConfig", model="LlamaForCausalLM", extra=dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    "qwen2": dict(cls="Qwen2Config", model="Qwen2ForCausalLM", extra=dict(tie_word_embeddings=True)),
    "mistral": dict(cls="MistralConfig", model="MistralForCausalLM", extra=dict(sliding_window=12)),
}
VOCAB = 320  # 256 byte symbols, a few merges, the special token


def make_tokenizer(directory: Path):
    """A byte-level BPE tokenizer with an end-of-text token; round-trips any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["def f(x):\n    return x + 1\n", "hello world, the quick brown fox"] * 50,
                            trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(directory)
    return fast


def make_checkpoint(directory: Path, family: str = "llama", *, layers: int = 2, hidden: int = 64,
                    heads: int = 4, kv_heads: int = 2, seed: int = 0, std: float = 0.3,
                    intermediate: int | None = None) -> Path:
    """Save a random model of `family` with the test tokenizer to `directory`."""
    import transformers

    directory = Path(directory)
    tokenizer = make_tokenizer(directory)
    spec = CONFIGS[family]
    config = getattr(transformers, spec["cls"])(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate or hidden * 2, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, **spec["extra"])
    torch.manual_seed(seed)
    model = getattr(transformers, spec["model"])(config).eval()
    with torch.no_grad():  # the default init is near zero; widen it so logits have clear winners
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    model.save_pretrained(directory)
    return directory
