"""vec16.h's two implementations: the kernels name only the project's vector names, and built on AVX2
(vectors as pairs of 256-bit registers) they give the AVX-512 build's bits."""
from __future__ import annotations

import re

import pytest
import torch

from vramledger.worker.kernels import (
    blocked_linear,
    decoder_layers,
    draw_tokens,
    native,
    paged_attention,
    prefill_attention,
    rms_norm,
    rotate_store,
    verify_tokens,
)
from vramledger.worker.models.attention import build_paged_batch
from vramledger.worker.models.loader import load_model

IMPLEMENTATIONS = {"vec16_avx512.h", "vec16_avx2.h"}
BINDINGS = (blocked_linear, decoder_layers, draw_tokens, paged_attention, prefill_attention, rms_norm,
            rotate_store, verify_tokens)
CPU = torch.device("cpu")
BLOCK = 16


def test_only_the_two_implementations_name_intels_intrinsics():
    intel = re.compile(r"\b(_mm\w*|__m\d+\w*|__mmask\w*|_MM_\w+|_CMP_\w+)\b|immintrin")
    sources = [p for p in native.HERE.glob("*.[ch]") if p.name not in IMPLEMENTATIONS]
    assert len(sources) > 10
    found = {p.name: sorted({m.group(0) for m in intel.finditer(p.read_text())}) for p in sources}
    assert {name: names for name, names in found.items() if names} == {}
    # and only vec16.h asks which instruction set the build has, to pick the implementation
    assert [p.name for p in sources if "__AVX" in p.read_text()] == ["vec16.h"]


def library(binding) -> str:
    """The file the binding's kernel was loaded from (a binding is named after its C source)."""
    return native.load(binding.__name__.rsplit(".", 1)[1])._name


def reload_kernels():
    native.load.cache_clear()
    for binding in BINDINGS:
        binding._kernel.cache_clear()


def every_kernel(model) -> dict[str, torch.Tensor]:
    """Each kernel's outputs on fixed inputs, through its binding: tails that end mid-vector throughout."""
    g = torch.Generator().manual_seed(0)
    out = {}
    packed = blocked_linear.pack(torch.randn(336, 200, generator=g))
    x, bias = torch.randn(13, 200, generator=g), torch.randn(336, generator=g)
    out["blocked_linear"] = blocked_linear.linear(x, packed, bias)
    out["rms_norm"] = rms_norm.rms_norm(torch.randn(7, 77, generator=g), torch.randn(77, generator=g), 1e-6)
    heads, cache = torch.randn(2, 3, 8, 32, generator=g), torch.zeros(2, 40, 2, 32)
    cos, sin = torch.randn(2, 3, 1, 16, generator=g), torch.randn(2, 3, 1, 16, generator=g)
    rotate_store.rotate_store(heads, 4, cos, sin, cache[0], cache[1], torch.tensor([5, 9, 30, 2]),
                              torch.tensor([0, 2, 3, 5]))
    out["rotate_store"] = torch.cat([heads.flatten(), cache.flatten()])
    tables = [[5, 9, 2, 7], [1, 3], [11, 12, 13, 14, 15]]
    batch = build_paged_batch([[1] * 5, [1] * 3, [1]], [40, 10, 70], tables, BLOCK, 1, CPU)
    for heads, kv_heads, dim in [(8, 4, 32), (4, 2, 48)]:
        kv = torch.randn(2, 64 * BLOCK, kv_heads, dim, generator=g)
        q = torch.randn(3, 5, heads, dim, generator=g)
        for window in (None, 7):
            out[f"paged_attention {dim} {window}"] = paged_attention.attend(
                q, kv[0], kv[1], batch.gather_slots, batch.positions, batch.context_lens, window)
    # nine rows decoding after one prefix: its blocks in vector lanes on AVX-512, in sum trees on AVX2
    shared = build_paged_batch([[1]] * 9, [33 + r for r in range(9)], [[5, 9, 20 + r] for r in range(9)], BLOCK, 1,
                               CPU)
    kv, q = torch.randn(2, 64 * BLOCK, 4, 32, generator=g), torch.randn(9, 1, 8, 32, generator=g)
    out["paged_attention shared"] = paged_attention.attend(q, kv[0], kv[1], shared.gather_slots, shared.positions,
                                                           shared.context_lens, None)
    chunks = build_paged_batch([[1] * 37, [1] * 9], [0, 21], tables[::2], BLOCK, 1, CPU, prefill=True)
    for heads, kv_heads, dim in [(8, 4, 32), (4, 2, 48), (16, 1, 16)]:
        kv = torch.randn(2, 64 * BLOCK, kv_heads, dim, generator=g)
        q = torch.randn(2, 37, heads, dim, generator=g)
        for window in (None, 7):
            out[f"prefill_attention {dim} {window}"] = prefill_attention.attend(
                q, kv[0], kv[1], chunks.gather_slots, chunks.positions, chunks.context_lens, window)
    logits, temperature = torch.randn(9, 1037, generator=g) * 3, torch.rand(9, generator=g) + 0.3
    probs = torch.empty_like(logits)
    out["draw_tokens"] = draw_tokens.draw_tokens(logits, temperature, torch.rand(9, generator=g), probs=probs)
    out["draw_tokens probs"] = probs
    draft, q = torch.randint(0, 1037, (9, 4), generator=g), torch.rand(9, 4, 1037, generator=g)
    accepted, tokens = verify_tokens.verify_tokens(
        draft, q / q.sum(-1, keepdim=True), torch.randn(9, 5, 1037, generator=g) * 3, temperature,
        torch.rand(9, 4, generator=g), torch.rand(9, generator=g))
    out["verify_tokens"] = torch.cat([accepted, tokens.flatten()])
    # decoder_layers.c: a prefill, the next chunk of one prompt, then decode and verify steps
    kv_cache = torch.zeros(model.kv_cache_shape(12 * BLOCK))
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 40, 17)]
    lengths = [len(p) for p in prompts]
    steps = [build_paged_batch(prompts, [0] * 3, tables, BLOCK, 1, CPU),
             build_paged_batch([[3] * 20], [lengths[0]], tables[:1], BLOCK, 1, CPU, prefill=True),
             build_paged_batch([[7], [8], [9]], [lengths[0] + 20, *lengths[1:]], tables, BLOCK, 1, CPU),
             build_paged_batch([[1, 2, 3, 4]] * 3, [lengths[0] + 21, *(n + 1 for n in lengths[1:])], tables, BLOCK,
                               4, CPU)]
    for i, step in enumerate(steps):
        out[f"forward {i}"] = model(step, kv_cache)
    out["kv cache"] = kv_cache
    return out


def test_the_avx2_build_gives_the_avx512_builds_bits(checkpoints, monkeypatch):
    """The tests run the build for this CPU; where that is AVX-512, the AVX2 build (which AVX-512 CPUs
    run too) runs here against it. Bit for bit: each vec16 function computes the same lanes in the same
    order on both."""
    if native.isa() != "AVX512":
        pytest.skip("no AVX-512 here: every other kernel test runs the AVX2 build (or none) already")
    model = load_model(checkpoints["mistral"], torch.float32, CPU)  # a sliding window too
    assert model.fused_forward is not None
    avx512 = every_kernel(model)
    libraries = {binding: library(binding) for binding in BINDINGS}
    try:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
        reload_kernels()
        for binding, avx512_library in libraries.items():
            assert binding.available()
            assert library(binding) != avx512_library
        avx2 = every_kernel(model)
    finally:
        monkeypatch.undo()
        reload_kernels()
    assert avx2.keys() == avx512.keys()
    assert [name for name in avx512 if not torch.equal(avx2[name], avx512[name])] == []
