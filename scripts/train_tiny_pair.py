"""Build the shipped tiny "coder" pair: a BPE tokenizer, a target and a distilled draft.

Everything is trained from scratch on the running interpreter's standard library
(*.py), with fixed seeds, a deterministic hold-out and a seeded batch order.
CPU-only, about 24 min on 2 cores by default:

    .venv/bin/python scripts/train_tiny_pair.py                  # 22 min training budget
    .venv/bin/python scripts/train_tiny_pair.py --target-steps N --draft-steps M

The default fits a busy shared machine (the schedule follows elapsed time, so the
step count depends on the machine); fixed step counts make a rerun bit-identical
on the same machine and library versions.

Outputs worker/assets/tiny-coder-{target,draft}/ (HF checkpoint dirs with the same
tokenizer files) and prints held-out loss of both models and their greedy agreement.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pathlib
import shutil
import sys
import sysconfig
import tempfile
import time

# Sleeping (not spinning) OpenMP workers: on a shared 2-core box spinning threads
# fight other processes and made a training step 3x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

EOS = "<|endoftext|>"  # also bos and pad: id 0
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The draft keeps the target's width (so it can start from the target's embeddings
# and first block) but has 1 of its 8 layers: at batch 1 on CPU a forward costs
# roughly per layer, so proposing 4 tokens costs ~0.6 of one target forward.
TARGET_SHAPE = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=4, intermediate_size=512)
DRAFT_SHAPE = dict(hidden_size=256, num_hidden_layers=1, num_attention_heads=8,
                   num_key_value_heads=4, intermediate_size=512)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="worker/assets", help="parent dir of the two checkpoint dirs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads (shared machine)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=256)
    # small batches: in a 4-min A/B, 8x256 beat 16x256 on held-out loss (more updates per second)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--minutes", type=float, default=22.0,
                   help="wall-clock budget of the two training phases; the LR schedule follows "
                        "the fraction of the budget used, so it fits a busy machine")
    # the draft's agreement was still climbing at 5 min, so it gets ~7 of the 22
    p.add_argument("--target-share", type=float, default=0.68, help="share of --minutes for the target")
    p.add_argument("--target-steps", type=int, default=None,
                   help="with --draft-steps: fixed step counts instead of --minutes (bit-reproducible)")
    p.add_argument("--draft-steps", type=int, default=None)
    p.add_argument("--target-lr", type=float, default=3e-3)
    p.add_argument("--draft-lr", type=float, default=2e-3)
    # T=1 matches the argmax the draft must hit; T=1.5 agreed less often in a 3-min A/B
    p.add_argument("--temperature", type=float, default=1.0, help="distillation softening (>1 softens)")
    p.add_argument("--kl-weight", type=float, default=0.9, help="KL share of the draft loss; CE gets the rest")
    p.add_argument("--eval-windows", type=int, default=400, help="cap on held-out windows for the loss")
    p.add_argument("--prompts", type=int, default=20, help="held-out prompts for greedy agreement")
    p.add_argument("--no-bf16", action="store_true", help="train in plain fp32 (weights are fp32 either way)")
    return p.parse_args()


# ---- data -------------------------------------------------------------------

def stdlib_files() -> tuple[list[str], list[str], list[str]]:
    """(train texts, held-out texts, held-out names) from the stdlib, in sorted path order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    train, held, held_names = [], [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue  # third-party code, not the standard library
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test fixtures are deliberately not UTF-8
        if not text.strip():
            continue
        # ~2% held out, chosen by path hash so it never depends on file order or count
        if int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 50 == 0:
            held.append(text)
            held_names.append(rel)
        else:
            train.append(text)
    return train, held, held_names


# Qwen2's split pattern: a newline run never merges with the indentation after it,
# so a prompt ending in "\n" tokenizes like the same spot in the training text.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_tokenizer(texts: list[str], vocab: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE: every byte is in the alphabet, so any text round-trips."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS, unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:], model_max_length=2048,
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All files as one 1-D stream, each file followed by <|endoftext|>."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    # the raw backend: whole files exceed model_max_length, which is fine here
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def batches(stream: torch.Tensor, batch: int, seq_len: int, seed: int):
    """Endless random windows of seq_len+1 tokens; a seeded generator fixes the order."""
    gen = torch.Generator().manual_seed(seed)
    span = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
        yield stream[starts[:, None] + span]  # [B, T+1]


# ---- models -----------------------------------------------------------------

def make_config(tokenizer, shape: dict) -> LlamaConfig:
    eos = tokenizer.eos_token_id
    return LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, dtype="float32",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **shape)


def init_draft_from_target(draft: LlamaForCausalLM, target: LlamaForCausalLM) -> None:
    """Start the draft from the target's embeddings, first block and final norm."""
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.model.layers[0].load_state_dict(target.model.layers[0].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())


def lr_at(step: int, progress: float, peak: float, warmup: int = 50) -> float:
    """Linear warm-up over steps, cosine decay to 10% of peak over progress in [0, 1]."""
    return peak * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def optimizer(model, lr: float) -> torch.optim.AdamW:
    # no weight decay on norms (1-D tensors)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def ce_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def distill_loss(s_logits, t_logits, labels, temp: float, kl_weight: float) -> torch.Tensor:
    """KL(target_T || draft_T) * T^2 (keeps gradient scale) plus CE on the data."""
    s, t = s_logits.float().flatten(0, 1), t_logits.float().flatten(0, 1)
    kl = F.kl_div(F.log_softmax(s / temp, -1), F.log_softmax(t / temp, -1),
                  log_target=True, reduction="batchmean") * temp ** 2
    return kl_weight * kl + (1 - kl_weight) * F.cross_entropy(s, labels.flatten())


def train_loop(name, model, step_fn, data, lr, bf16, steps=None, seconds=None) -> int:
    """AdamW with grad clipping for `steps` steps, or until `seconds` have passed.

    step_fn(model, batch) returns the loss. Returns the number of steps taken.
    """
    opt = optimizer(model, lr)
    model.train()
    bar = tqdm(total=steps or round(seconds), unit="step" if steps else "s",
               desc=f"train {name}", file=sys.stdout, mininterval=10)
    t0, step, ema = time.perf_counter(), 0, None
    while True:
        elapsed = time.perf_counter() - t0
        progress = step / steps if steps else elapsed / seconds
        if progress >= 1:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, progress, lr)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = step_fn(model, next(data))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        step += 1
        bar.update(1 if steps else round(time.perf_counter() - t0) - bar.n)
        bar.set_postfix(step=step, loss=f"{ema:.3f}", lr=f"{opt.param_groups[0]['lr']:.1e}", refresh=False)
    bar.close()
    model.eval()
    print(f"{name}: {step} steps in {time.perf_counter() - t0:.0f}s, train loss (ema) {ema:.3f}")
    return step


# ---- evaluation -------------------------------------------------------------

@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq_len: int, max_windows: int) -> float:
    """Mean per-token CE over non-overlapping held-out windows."""
    n = min(max_windows, (len(stream) - 1) // seq_len)
    total = 0.0
    for i in range(0, n, 16):
        rows = torch.stack([stream[j * seq_len: j * seq_len + seq_len + 1]
                            for j in range(i, min(n, i + 16))])
        logits = model(input_ids=rows[:, :-1]).logits
        total += ce_loss(logits, rows[:, 1:]).item() * len(rows)
    return total / n


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation of exactly new_tokens tokens ([T] -> [new_tokens])."""
    out = model.generate(prompt[None], do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens)
    return out[0, len(prompt):]


@torch.no_grad()
def greedy_agreement(target, draft, tokenizer, texts, n_prompts, k: int = 4) -> dict:
    """Teacher-forced draft argmax vs the target's greedy tokens, on held-out prompts.

    Under greedy verification a draft token is accepted exactly when it equals the
    target's argmax, so walking the matches also gives tokens per target forward at k.
    """
    prompts = []
    for text in texts:
        ids = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) >= 64:
            prompts.append(torch.tensor(ids[:64]))
    step = max(1, len(prompts) // n_prompts)
    prompts = prompts[::step][:n_prompts]  # spread over the held-out files
    matches, per_forward = [], []
    for prompt in tqdm(prompts, desc="greedy agreement", file=sys.stdout, mininterval=5):
        cont = greedy(target, prompt, 64)
        seq = torch.cat([prompt, cont])
        pred = draft(input_ids=seq[None, :-1]).logits[0, len(prompt) - 1:].argmax(-1)
        hit = (pred == cont).tolist()
        matches += hit
        i = forwards = 0
        while i < len(hit):  # one verify step: accept the run of hits (<= k) plus one target token
            run = 0
            while run < k and i + run < len(hit) and hit[i + run]:
                run += 1
            i += run + 1
            forwards += 1
        per_forward.append(len(hit) / forwards)
    return {"prompts": len(prompts), "greedy_agreement": sum(matches) / len(matches),
            f"tokens_per_target_forward_k{k}": sum(per_forward) / len(per_forward)}


# ---- saving -----------------------------------------------------------------

def legacy_tokenizer_config(path: pathlib.Path) -> None:
    """Spell the config the way transformers 4.x reads it too (5.x accepts both)."""
    cfg = json.loads(path.read_text())
    cfg.pop("backend", None)
    cfg.pop("extra_special_tokens", None)  # 4.x expects a dict here, 5.x writes a list
    cfg["additional_special_tokens"] = SPECIAL_TOKENS[1:]
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def save_pair(out: pathlib.Path, tokenizer, target, draft, metrics: dict) -> dict:
    """Write both HF dirs; the tokenizer is saved once and copied so files are identical."""
    eos = tokenizer.eos_token_id
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        legacy_tokenizer_config(pathlib.Path(tmp) / "tokenizer_config.json")
        sizes = {}
        for name, model in (("target", target), ("draft", draft)):
            d = out / f"tiny-coder-{name}"
            if d.exists():
                shutil.rmtree(d)
            model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
            model.save_pretrained(d)
            for f in pathlib.Path(tmp).iterdir():
                shutil.copy(f, d / f.name)
            for f in d.iterdir():
                f.chmod(0o644)  # save_pretrained leaves the weights 0600; assets are read by others
            (d / "metrics.json").write_text(json.dumps(metrics[name], indent=2) + "\n")
            sizes[name] = (d / "model.safetensors").stat().st_size
    return sizes


def check_saved(out: pathlib.Path) -> None:
    """Reload offline and check the contracts the worker relies on."""
    for name in ("target", "draft"):
        d = out / f"tiny-coder-{name}"
        tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True)
        text = "def f(x):\n\tif x:\n        return 'héllo  wörld'  # ✓\n"
        assert tok.decode(tok(text)["input_ids"]) == text, "round-trip failed"
        chat = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                       add_generation_prompt=True, tokenize=False)
        assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", chat
        assert model.config.eos_token_id == tok.eos_token_id == 0
        assert model.dtype == torch.float32
        assert tok.convert_tokens_to_ids("<|im_end|>") == 2 and "<|im_end|>" in tok.all_special_tokens


def main() -> None:
    args = parse_args()
    args.bf16 = not args.no_bf16
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()
    out = pathlib.Path(args.out)

    train_texts, held_texts, held_names = stdlib_files()
    print(f"stdlib {sysconfig.get_paths()['stdlib']}: {len(train_texts)} train files, "
          f"{len(held_texts)} held out")
    tokenizer = train_tokenizer(train_texts, args.vocab)
    train_stream = token_stream(tokenizer, train_texts)
    held_stream = token_stream(tokenizer, held_texts)
    print(f"tokenizer vocab {len(tokenizer)}; {len(train_stream):,} train tokens, "
          f"{len(held_stream):,} held-out tokens ({time.time() - t_start:.0f}s)")

    target = LlamaForCausalLM(make_config(tokenizer, TARGET_SHAPE))
    draft = LlamaForCausalLM(make_config(tokenizer, DRAFT_SHAPE))

    def target_step(model, rows):
        return ce_loss(model(input_ids=rows[:, :-1]).logits, rows[:, 1:])

    def draft_step(model, rows):
        with torch.no_grad():
            t_logits = target(input_ids=rows[:, :-1]).logits
        return distill_loss(model(input_ids=rows[:, :-1]).logits, t_logits, rows[:, 1:],
                            args.temperature, args.kl_weight)

    target_data = batches(train_stream, args.batch, args.seq_len, args.seed + 1)
    draft_data = batches(train_stream, args.batch, args.seq_len, args.seed + 2)
    fixed = args.target_steps is not None and args.draft_steps is not None
    budget = {"target": args.minutes * 60 * args.target_share,
              "draft": args.minutes * 60 * (1 - args.target_share)}
    print(f"target {sum(p.numel() for p in target.parameters()):,} params, "
          f"draft {sum(p.numel() for p in draft.parameters()):,} params; "
          + ("fixed steps" if fixed else f"time budget {args.minutes} min"))

    def run(name, model, step_fn, data, lr, steps):
        if fixed:
            return train_loop(name, model, step_fn, data, lr, args.bf16, steps=steps)
        return train_loop(name, model, step_fn, data, lr, args.bf16, seconds=budget[name])

    args.target_steps = run("target", target, target_step, target_data, args.target_lr, args.target_steps)
    target.requires_grad_(False)
    init_draft_from_target(draft, target)
    args.draft_steps = run("draft", draft, draft_step, draft_data, args.draft_lr, args.draft_steps)

    # evaluation runs in fp32, like the worker
    metrics = {name: {"heldout_loss": heldout_loss(m, held_stream, args.seq_len, args.eval_windows)}
               for name, m in (("target", target), ("draft", draft))}
    agree = greedy_agreement(target, draft, tokenizer, held_texts, args.prompts)
    metrics["draft"].update(agree)
    metrics["target"]["train_steps"], metrics["draft"]["train_steps"] = args.target_steps, args.draft_steps
    sample_ids = tokenizer("def fibonacci(n):\n", add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    sample = tokenizer.decode(greedy(target, sample_ids, 64))

    sizes = save_pair(out, tokenizer, target, draft, metrics)
    check_saved(out)
    wall = time.time() - t_start
    summary = {"wall_seconds": round(wall), "target_steps": args.target_steps,
               "draft_steps": args.draft_steps, "train_tokens": len(train_stream),
               "heldout_tokens": len(held_stream), "heldout_files": len(held_names),
               "safetensors_bytes": sizes, **{f"{k}_metrics": v for k, v in metrics.items()}}
    print(json.dumps(summary, indent=2))
    print("greedy sample (target):\n" + "def fibonacci(n):\n" + sample)


if __name__ == "__main__":
    main()
