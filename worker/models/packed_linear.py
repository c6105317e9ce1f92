"""Linear weights packed for the CPU's matmuls: this project's kernel where it runs, else oneDNN.

float32 weights on an AVX-512 or AVX2 CPU go to kernels/blocked_linear.py (its own kernel: fastest at
every row count measured, no kernels to build per shape). Elsewhere, and for weights whose outputs do
not fill whole blocks, oneDNN packs them, as follows.

On this project's AMD CPUs MKL's sgemm takes a generic path: oneDNN over packed weights was 1.2-2x
faster per pass over the target's projections at 1-80 rows with one thread (bench/packed_linear.py)
and 2-3.5x with two in a one-off run. vLLM's CPU build packs its weights too. But oneDNN builds and
keeps a kernel (~0.55 MiB of code and buffers) for every row count and weight shape it meets, and a
server meets a new row count with almost every prompt: rows are padded up to one of ROW_BUCKETS, and
longer inputs go through in chunks of the largest. Every kernel a forward can ask for is then built
at startup (warm), where the ledger measures it, and none is built while serving.
"""
from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

from vramledger.worker.kernels import blocked_linear

PACK_BATCH_HINT = 32  # rows the packing is tuned for; any row count is computed correctly
# Up to 16 rows a pass costs about the same at any count (it reads the weights); above, a padded
# row costs as much as a real one, so the steps narrow to at most a third of the count.
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128)


def packs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether weights of this device and dtype are packed (only float32 on the CPU)."""
    return device_type == "cpu" and dtype == torch.float32 and (
        blocked_linear.available() or torch.backends.mkldnn.is_available())


def packable(weight: torch.Tensor) -> bool:
    return packs(weight.device.type, weight.dtype)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] in the layout its matmuls are fastest in; the plain one may be freed."""
    if blocked_linear.available() and blocked_linear.fits(weight):
        return blocked_linear.pack(weight)
    return pack_onednn(weight) if torch.backends.mkldnn.is_available() else weight


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """An opaque oneDNN tensor holding weight [out, in]."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def is_packed(weight: torch.Tensor) -> bool:
    return weight.is_mkldnn or blocked_linear.is_blocked(weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for plain and packed weights alike."""
    if blocked_linear.is_blocked(weight):
        return blocked_linear.linear(x, weight, bias)
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= ROW_BUCKETS[-1]:
        out = _bucketed(rows, weight, bias)
    else:
        out = in_slices(rows, lambda part: _bucketed(part, weight, bias), weight.shape[0])
    return out.view(*x.shape[:-1], weight.shape[0])


def in_slices(rows: torch.Tensor, fn, width: int) -> torch.Tensor:
    """fn over rows [N, in] in slices of the largest bucket, into one [N, width] output: each
    slice's result is copied in and freed, so the results are never all held twice (torch.cat)."""
    out = rows.new_empty(rows.shape[0], width)
    largest = ROW_BUCKETS[-1]
    for start in range(0, rows.shape[0], largest):
        out[start:start + largest] = fn(rows[start:start + largest])
    return out


def _bucketed(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    n = rows.shape[0]
    bucket = ROW_BUCKETS[bisect.bisect_left(ROW_BUCKETS, n)]
    if bucket != n or not rows.is_contiguous():  # a kernel is built per layout too: always dense rows
        rows = F.pad(rows, (0, 0, 0, bucket - n))
    out = kernel(rows, weight, bias)
    return out if bucket == n else out[:n]


def kernel(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")


def warm(weights: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """Build every kernel linear() can ask for: each packed weight's shape, with or without a bias,
    at every bucket. Kernels are kept per shape, not per tensor: layers alike share them."""
    kinds = {(w.shape, w.dtype, b is None): (w, b) for w, b in weights if w.is_mkldnn}
    with torch.inference_mode():
        for weight, bias in kinds.values():
            for n in ROW_BUCKETS:
                linear(torch.zeros(n, weight.shape[1], dtype=weight.dtype), weight, bias)


def plain(weight: torch.Tensor) -> torch.Tensor:
    """The [out, in] values of a packed or plain weight."""
    if blocked_linear.is_blocked(weight):
        return blocked_linear.unpack(weight)
    return weight.to_dense() if weight.is_mkldnn else weight
