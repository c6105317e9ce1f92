"""Rotary position embedding with the config's scaling."""
from __future__ import annotations

import torch


def rope_parameters(config) -> dict:
    """transformers >= 5 keeps theta and scaling in rope_parameters; older in rope_theta/rope_scaling."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(torch.nn.Module):
    inv_freq: torch.Tensor  # a buffer
    """cos/sin tables computed from positions on the fly (no length limit baked in)."""

    def __init__(self, config, head_dim: int):
        super().__init__()
        params = rope_parameters(config)
        with torch.device("cpu"):  # a table to compute, even while the model is built on meta
            inv_freq, self.scaling = self._inv_freq(config, params, head_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    @staticmethod
    def _inv_freq(config, params: dict, head_dim: int):
        rope_type = params["rope_type"]
        if rope_type == "default":
            return 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)), 1.0
        if rope_type == "dynamic":
            raise ValueError("rope_type 'dynamic' changes with sequence length and is not supported")
        # The static scalings (linear, llama3, yarn, longrope...) are published formulas;
        # transformers implements them from the same config fields.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        return inv_freq, float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin [B, Q, 1, D/2]: the rotate-half layout repeats the same angles in both halves."""
        freqs = positions[..., None].float() * self.inv_freq  # [B, Q, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        # Each op skipped is a dispatch saved: this runs once a forward, 5 forwards a speculative step.
        if self.scaling != 1.0:
            cos, sin = cos.mul_(self.scaling), sin.mul_(self.scaling)
        if dtype != cos.dtype:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos[:, :, None], sin[:, :, None]


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [..., D] in place, halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).

    One half-size temporary: the out-of-place form holds four tensors of x's size at once
    (12 MiB for q and k of a 2048-token prompt in the shipped target).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    x1_sin = x1 * sin
    x1.mul_(cos).addcmul_(x2, sin, value=-1)
    x2.mul_(cos).add_(x1_sin)
