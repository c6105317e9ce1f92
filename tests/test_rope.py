"""rotate_ rotates in place what the rotate-half formula computes out of place."""
from __future__ import annotations

import torch

from vramledger.worker.models.rope import rotate_


def test_rotating_in_place_matches_the_rotate_half_formula_and_writes_through_views():
    torch.manual_seed(0)
    heads = torch.randn(2, 5, 6, 8)  # [B, Q, heads, D]: rotate the first four heads, leave the rest
    angles = torch.randn(2, 5, 1, 4)
    cos, sin = angles.cos(), angles.sin()
    x = heads[:, :, :4].clone()
    full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    expected = x * full_cos + torch.cat((-x[..., 4:], x[..., :4]), -1) * full_sin
    untouched = heads[:, :, 4:].clone()
    rotate_(heads[:, :, :4], cos, sin)
    torch.testing.assert_close(heads[:, :, :4], expected)
    assert torch.equal(heads[:, :, 4:], untouched)
