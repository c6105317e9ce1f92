"""Llama-family decoder (Llama, Qwen2, Mistral) reading its KV cache through block tables."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vramledger.worker.kernels import paged_attention, prefill_attention, rms_norm, rotate_store
from vramledger.worker.models.attention import PagedBatch
from vramledger.worker.models.decoder_forward import DecoderForward
from vramledger.worker.models.packed_linear import ROW_BUCKETS, in_slices, linear, pack, packable
from vramledger.worker.models.rope import RotaryEmbedding, rotate_

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class Arch:
    """What differs between the supported architectures."""

    def __init__(self, config):
        name = config.architectures[0]
        self.qkv_bias = name == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False))
        self.o_bias = name == "LlamaForCausalLM" and bool(getattr(config, "attention_bias", False))
        self.mlp_bias = bool(getattr(config, "mlp_bias", False))
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        if layer_types:
            self.windows = [window if t == "sliding_attention" else None for t in layer_types]
        else:
            self.windows = [window if name == "MistralForCausalLM" else None] * config.num_hidden_layers


def fuse_linears(module: nn.Module, name: str, parts: tuple[str, ...]) -> dict[str, tuple[str, int, int]]:
    """Replace the Linear layers `parts` by `{name}_weight` (and `{name}_bias`), their rows stacked.

    Returns where each checkpoint tensor lands: {"q_proj.weight": ("qkv_weight", first row, end row)}.
    On the meta device (the loader's way) this only lays out shapes, and the checkpoint is read
    straight into the fused rows; on a real device the originals are freed one by one as their
    rows are copied, so they and the fused copy never all exist at once.
    """
    linears = [getattr(module, p) for p in parts]
    layout: dict[str, tuple[str, int, int]] = {}
    for kind in ("weight", "bias"):
        tensors = [getattr(lin, kind) for lin in linears]
        if tensors[0] is None:
            setattr(module, f"{name}_{kind}", None)
            continue
        rows = sum(t.shape[0] for t in tensors)
        first = tensors[0]
        fused = torch.empty((rows, *first.shape[1:]), dtype=first.dtype, device=first.device)
        start = 0
        for part, lin, t in zip(parts, linears, tensors):
            end = start + t.shape[0]
            if not fused.is_meta:
                fused[start:end].copy_(t.detach())
                setattr(lin, kind, None)  # drop the original now: its rows live in `fused`
            layout[f"{part}.{kind}"] = (f"{name}_{kind}", start, end)
            start = end
        setattr(module, f"{name}_{kind}", nn.Parameter(fused, requires_grad=False))
    for p in parts:
        delattr(module, p)
    return layout


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if rms_norm.runs_on(x, self.weight):
            return rms_norm.rms_norm(x, self.weight, self.eps)
        # Hugging Face's formula, in float32 whatever the dtype. Not F.rms_norm: inside a forward on
        # the CPU (its code and data out of the caches after a matmul) it took 20 us a call, these 14.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(self.eps))
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    qkv_weight: torch.Tensor  # q, k and v fused at load (fuse_linears)
    qkv_bias: torch.Tensor | None

    def __init__(self, config, arch: Arch, layer: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.window = arch.windows[layer]
        self.layer = layer
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=arch.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=arch.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=arch.o_bias)
        self.write_kv = write_kv  # compiled.py swaps in an opaque op

    def fuse(self) -> dict[str, tuple[str, int, int]]:
        """One matmul for q, k and v: small batches pay per call, not per FLOP."""
        return fuse_linears(self, "qkv", ("q_proj", "k_proj", "v_proj"))

    def forward(self, x, cos, sin, kv_cache, batch: PagedBatch):
        B, Q, _ = x.shape
        H, kvH = self.num_heads, self.num_kv_heads
        heads = linear(x, self.qkv_weight, self.qkv_bias).view(B, Q, H + 2 * kvH, self.head_dim)
        # Rotate q and k in place and write the new keys/values; then attend to the context (read
        # through the block table).
        if rotate_store.runs_on(heads, kv_cache):
            rotate_store.rotate_store(heads, H, cos, sin, kv_cache[0, self.layer], kv_cache[1, self.layer],
                                      batch.write_slots, batch.write_rows)
            q, k, v = heads.split([H, kvH, kvH], 2)
        else:
            rotate_(heads[:, :, :H + kvH], cos, sin)  # q and k in one rotation
            q, k, v = heads.split([H, kvH, kvH], 2)
            self.write_kv(kv_cache, self.layer, batch.write_slots,
                          real_tokens(k, batch.write_rows), real_tokens(v, batch.write_rows))
        gqa = H != kvH
        context = batch.gather_slots.shape[1]
        if batch.prefill and prefill_attention.runs_on(q, kv_cache, context):  # a prompt's chunk
            out = prefill_attention.attend(q, kv_cache[0, self.layer], kv_cache[1, self.layer], batch.gather_slots,
                                           batch.positions, batch.context_lens, self.window)
            return linear(out, self.o_proj.weight, self.o_proj.bias)
        if batch.from_start and self.window is None:
            # The context is these tokens: no read, and no [B, Q, C] mask (16 MiB at 2048 tokens).
            # Padded queries see padding keys; their outputs are never read.
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=gqa)
        elif paged_attention.runs_on(q, kv_cache, context):  # decode and verify
            out = paged_attention.attend(q, kv_cache[0, self.layer], kv_cache[1, self.layer], batch.gather_slots,
                                         batch.positions, batch.context_lens, self.window)
            return linear(out, self.o_proj.weight, self.o_proj.bias)
        else:
            key_buffer, value_buffer = batch.context_buffers(kv_cache[0, self.layer])
            keys = read_context(kv_cache[0, self.layer], batch.gather_slots, key_buffer)  # [B, kvH, C, D]
            values = read_context(kv_cache[1, self.layer], batch.gather_slots, value_buffer)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=batch.mask(self.window, q.dtype),
                enable_gqa=gqa)  # [B, H, Q, D]
        return linear(out.transpose(1, 2).reshape(B, Q, -1), self.o_proj.weight, self.o_proj.bias)


def write_kv(kv_cache: torch.Tensor, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store one layer's new keys and values [N, kvH, D] at their slots.

    One function that mutates the whole cache: a compiled model calls it as an opaque op (compiled.py).
    """
    kv_cache[0, layer].index_copy_(0, slots, k)
    kv_cache[1, layer].index_copy_(0, slots, v)


def real_tokens(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """[B, Q, kvH, D] -> [N, kvH, D]: the tokens that are not padding (all when rows is None)."""
    flat = x.reshape(-1, *x.shape[2:])
    return flat if rows is None else flat.index_select(0, rows)


def read_context(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """[slots, kvH, D] cache, [B, C] slots -> [B, kvH, C, D], a view of `out` ([B * C, kvH, D]).

    index_select, not cache[slots]: on the CPU it copies rows several times faster.
    """
    B, C = slots.shape
    flat = torch.index_select(cache, 0, slots.reshape(-1), out=out)
    return flat.view(B, C, *cache.shape[1:]).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, config, arch: Arch):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=arch.mlp_bias)
        self.up_proj = nn.Linear(hidden, inner, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(inner, hidden, bias=arch.mlp_bias)
        self.act = ACTIVATIONS[config.hidden_act]

    def fuse(self) -> dict[str, tuple[str, int, int]]:
        """One matmul for gate and up."""
        return fuse_linears(self, "gate_up", ("gate_proj", "up_proj"))

    def forward(self, x):
        if not self.gate_up_weight.is_mkldnn or x.numel() <= ROW_BUCKETS[-1] * x.shape[-1]:
            return self._rows(x)
        # Packed weights multiply in slices of the largest bucket anyway: slicing the whole MLP at
        # the same rows keeps its widest tensors (gate and up) one slice long, not prompt long.
        return in_slices(x.reshape(-1, x.shape[-1]), self._rows, x.shape[-1]).view_as(x)

    def _rows(self, x):
        gate, up = linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, -1)
        return linear(self.act(gate) * up, self.down_proj.weight, self.down_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, config, arch: Arch, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, arch, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, arch)

    def forward(self, x, cos, sin, kv_cache, batch):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, config, arch: Arch):
        super().__init__()
        # Given its (empty) weight, the embedding skips its random init: the checkpoint fills it, and on the
        # meta device the loader builds on, that init runs through torch's Python reference kernels, whose
        # first use imports torch._dynamo (0.3 s and more of every start-up).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, arch, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Parameter names follow the Hugging Face checkpoints, so state dicts load as they are."""

    fused_forward: DecoderForward | None  # a step in one C call (pack_linears sets it)

    def __init__(self, config):
        super().__init__()
        self.config = config
        arch = Arch(config)
        self.model = Decoder(config, arch)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        attn = self.model.layers[0].self_attn
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.rotary = RotaryEmbedding(config, self.head_dim)
        self.fused_forward = None

    def fuse_projections(self) -> dict[str, tuple[str, int, int]]:
        """Checkpoint-shaped q/k/v and gate/up become fused matmuls.

        Returns {checkpoint name: (parameter name, first row, end row)} for every fused tensor.
        """
        layout = {}
        for i, layer in enumerate(self.model.layers):
            for prefix, module in ((f"model.layers.{i}.self_attn.", layer.self_attn),
                                   (f"model.layers.{i}.mlp.", layer.mlp)):
                fused = module.fuse().items()
                layout.update({prefix + src: (prefix + dst, a, b) for src, (dst, a, b) in fused})
        return layout

    def projections(self) -> list[tuple[nn.Module, str, str | None]]:
        """Every weight a forward multiplies by: (module, weight attribute, bias attribute)."""
        found = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            found += [(attn, "qkv_weight", "qkv_bias"), (attn.o_proj, "weight", "bias"),
                      (mlp, "gate_up_weight", "gate_up_bias"), (mlp.down_proj, "weight", "bias")]
        return found + [(self.lm_head, "weight", None)]

    def token_work(self) -> tuple[int, int]:
        """A token's multiply-adds over every layer: in the matmuls (the head aside), and in attention
        per context position (scores and weighted values: 2 per head and dim)."""
        matmuls = sum(getattr(module, weight).numel() for module, weight, _ in self.projections()[:-1])
        attention = self.model.layers[0].self_attn
        return matmuls, 2 * attention.num_heads * attention.head_dim * len(self.model.layers)

    def pack_linears(self) -> None:
        """Projection weights packed for the CPU's matmuls (packed_linear.py), one at a time:
        each plain weight is freed as its packed copy is made. A no-op off the CPU.

        A tied head gets a packed copy and the embedding stays plain (it is indexed): the copy
        costs vocab x hidden more bytes (in the ledger's weights); decoding with the shipped
        pair got 1.10-1.16x faster (docs/benchmarks.md), least in plain batch-1 steps.
        """
        for module, name, _ in self.projections():
            weight = getattr(module, name)
            if packable(weight):
                setattr(module, name, nn.Parameter(pack(weight), requires_grad=False))
        self.fused_forward = DecoderForward(self) if DecoderForward.fits(self) else None

    def kv_cache_shape(self, num_slots: int) -> tuple[int, ...]:
        """[k/v, layers, slots, kv heads, head dim]: one tensor holds the whole cache."""
        return (2, self.num_layers, num_slots, self.num_kv_heads, self.head_dim)

    def forward_parts(self, batches: list[PagedBatch], kv_cache: torch.Tensor) -> list[torch.Tensor]:
        """forward() of each batch: in one call where the one-call forward takes every batch and its head."""
        fused = self.fused_forward
        if fused is not None and fused.has_head and all(fused.runs_on(kv_cache, b) for b in batches):
            _, logits = fused.forward_parts(batches, kv_cache)
            if logits is not None:
                return logits
        return [self.forward(batch, kv_cache) for batch in batches]

    def forward(self, batch: PagedBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Logits [B, n, V] at batch.logits_index (n may be 0: fill the cache only)."""
        if self.fused_forward is not None and self.fused_forward.runs_on(kv_cache, batch):
            x, logits = self.fused_forward(batch, kv_cache)
            if logits is not None:
                return logits
        else:
            x = self.model.embed_tokens(batch.input_ids)
            cos, sin = self.rotary(batch.positions, x.dtype)
            for layer in self.model.layers:
                x = layer(x, cos, sin, kv_cache, batch)
        if batch.logits_index.shape[1] == 0:
            return x.new_empty(x.shape[0], 0, self.config.vocab_size)
        picked = x.gather(1, batch.logits_index[:, :, None].expand(-1, -1, x.shape[-1]))
        return linear(self.model.norm(picked), self.lm_head.weight).float()
