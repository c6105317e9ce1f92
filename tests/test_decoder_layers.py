"""A step's forward in one C call (decoder_layers.c) computes what the model in torch computes, and keeps
the bit-for-bit promises of the kernels it runs: a row alone and in a batch, a token decoded alone and
verified among a draft's, a prompt prefilled whole and in chunks, one thread and two."""
from __future__ import annotations

import pytest
import torch

from vramledger.worker.kernels import decoder_layers
from vramledger.worker.models import decoder_forward
from vramledger.worker.models.attention import build_paged_batch
from vramledger.worker.models.decoder_forward import DecoderForward
from vramledger.worker.models.loader import load_model
from vramledger.worker.models.packed_linear import plain

needs_kernel = pytest.mark.skipif(not decoder_layers.available(), reason="no AVX-512 or AVX2, or no C compiler here")
CPU = torch.device("cpu")
BLOCK = 16
TABLES = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def forward(model, batch, cache, fused: bool) -> torch.Tensor:
    kept = model.fused_forward
    model.fused_forward = kept if fused else None
    try:
        return model(batch, cache)
    finally:
        model.fused_forward = kept


def prefilled(model, lengths=(5, 40, 17)):
    """A cache holding three prompts, and the prompts."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    cache = torch.zeros(model.kv_cache_shape(12 * BLOCK))
    forward(model, build_paged_batch(prompts, [0] * 3, TABLES, BLOCK, 1, CPU), cache, fused=True)
    return cache, prompts


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])  # mistral: a sliding window of 12
def test_decode_and_verify_steps_match_the_layers_in_torch(checkpoints, family):
    model = load_model(checkpoints[family], torch.float32, CPU)
    assert model.fused_forward is not None
    cache, prompts = prefilled(model)
    lengths = [len(p) for p in prompts]
    steps = [build_paged_batch([[7], [8], [9]], lengths, TABLES, BLOCK, 1, CPU),
             build_paged_batch([[1, 2, 3, 4]] * 3, [n + 1 for n in lengths], TABLES, BLOCK, 4, CPU)]
    ours_cache, torch_cache = cache.clone(), cache.clone()
    for step in steps:
        assert model.fused_forward.runs_on(cache, step)
        ours, theirs = forward(model, step, ours_cache, True), forward(model, step, torch_cache, False)
        # Every stage computes its kernel's bits save SiLU (its own e^x) and RoPE's cos and sin (the C
        # library's): last-bit differences only.
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ours_cache, torch_cache, atol=2e-5, rtol=2e-5)
    assert ours_cache[:, :, 16 * 4:].abs().sum() > 0  # the steps wrote keys and values


@needs_kernel
def test_a_row_alone_and_in_a_batch_give_the_same_bits(checkpoints):
    model = load_model(checkpoints["llama"], torch.float32, CPU)
    cache, prompts = prefilled(model)
    lengths = [len(p) for p in prompts]
    batched = forward(model, build_paged_batch([[7], [8], [9]], lengths, TABLES, BLOCK, 1, CPU), cache.clone(), True)
    alone = forward(model, build_paged_batch([[8]], lengths[1:2], TABLES[1:2], BLOCK, 1, CPU), cache.clone(), True)
    assert torch.equal(alone[0], batched[1])


@needs_kernel
def test_a_token_decoded_alone_and_verified_among_a_drafts_give_the_same_bits(checkpoints):
    model = load_model(checkpoints["qwen2"], torch.float32, CPU)
    cache, prompts = prefilled(model)
    start, draft = len(prompts[2]), [11, 12, 13]
    verified = forward(model, build_paged_batch([draft], [start], TABLES[2:], BLOCK, 3, CPU), cache.clone(), True)
    one_by_one, decoding = [], cache.clone()
    for i, token in enumerate(draft):
        one_by_one.append(forward(model, build_paged_batch([[token]], [start + i], TABLES[2:], BLOCK, 1, CPU),
                                  decoding, True)[0, 0])
    assert torch.equal(verified[0], torch.stack(one_by_one))


@needs_kernel
def test_one_thread_and_two_give_the_same_bits(checkpoints, monkeypatch):
    monkeypatch.setattr(decoder_forward, "ONE_THREAD_WORK", 0)  # this small step too runs on torch's threads
    model = load_model(checkpoints["mistral"], torch.float32, CPU)
    cache, prompts = prefilled(model)
    step = build_paged_batch([[7], [8], [9]], [len(p) for p in prompts], TABLES, BLOCK, 1, CPU)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = forward(model, step, cache.clone(), True)
        torch.set_num_threads(2)
        two = forward(model, step, cache.clone(), True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_a_prompts_prefill_matches_the_layers_in_torch(checkpoints, family):
    """Prompts from position 0 and chunks after cached tokens (the prefill attention kernel)."""
    model = load_model(checkpoints[family], torch.float32, CPU)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (30, 45, 9)]
    steps = [build_paged_batch([p[:20] for p in prompts], [0] * 3, TABLES, BLOCK, 1, CPU),
             build_paged_batch([p[20:] for p in prompts], [20] * 3, TABLES, BLOCK, 1, CPU, prefill=True)]
    ours_cache, torch_cache = torch.zeros(2, *model.kv_cache_shape(12 * BLOCK)).unbind()
    for step in steps:
        assert step.prefill and model.fused_forward.runs_on(ours_cache, step)
        ours, theirs = forward(model, step, ours_cache, True), forward(model, step, torch_cache, False)
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ours_cache, torch_cache, atol=2e-5, rtol=2e-5)


@needs_kernel
def test_a_prompt_prefilled_whole_in_chunks_or_after_a_cached_prefix_gives_the_same_bits(checkpoints):
    """Each token's keys, values and logits depend on its own context only: rows and chunks around it
    change no bit."""
    model = load_model(checkpoints["mistral"], torch.float32, CPU)  # a sliding window too
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, model.config.vocab_size, (50,), generator=gen).tolist()
    other = torch.randint(0, model.config.vocab_size, (37,), generator=gen).tolist()
    whole = torch.zeros(model.kv_cache_shape(12 * BLOCK))
    logits = forward(model, build_paged_batch([prompt, other], [0, 0], TABLES[:2], BLOCK, 1, CPU), whole, True)
    chunked = torch.zeros_like(whole)
    for start, end in ((0, 16), (16, 19), (19, 50)):
        last = forward(model, build_paged_batch([prompt[start:end]], [start], TABLES[:1], BLOCK, 1, CPU,
                                                prefill=True), chunked, True)
    assert torch.equal(last[0], logits[0])
    assert torch.equal(chunked[:, :, :4 * BLOCK], whole[:, :, :4 * BLOCK])


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_prompts_chunk_and_the_rows_decoding_beside_it_in_one_forward_give_their_own_bits(checkpoints, family):
    """A mixed step: row 0's next 12 prompt tokens (prefill kernel) and rows 1 and 2's next tokens (decode
    kernel) share every other stage of one call; each part's logits and keys are those of its own forward."""
    model = load_model(checkpoints[family], torch.float32, CPU)
    cache, prompts = prefilled(model)
    lengths = [len(p) for p in prompts]
    chunk = build_paged_batch([list(range(3, 15))], lengths[:1], TABLES[:1], BLOCK, 1, CPU, prefill=True)
    decode = build_paged_batch([[8], [9]], lengths[1:], TABLES[1:], BLOCK, 1, CPU)
    apart = cache.clone()
    alone = [forward(model, chunk, apart, True), forward(model, decode, apart, True)]
    together = cache.clone()
    mixed = model.forward_parts([chunk, decode], together)
    assert [m.shape for m in mixed] == [a.shape for a in alone] == [(1, 1, model.config.vocab_size), (2, 1, model.config.vocab_size)]
    assert all(torch.equal(m, a) for m, a in zip(mixed, alone))
    assert torch.equal(together, apart) and not torch.equal(together, cache)


@needs_kernel
def test_plain_weights_keep_the_layers_in_torch(checkpoints):
    assert load_model(checkpoints["llama"], torch.float32, CPU, pack=False).fused_forward is None  # compile's


@needs_kernel
def test_a_step_without_logits_fills_the_cache_as_torch_does(checkpoints):
    """The draft's catch-up reads tokens and wants no logits: the head never runs."""
    model = load_model(checkpoints["qwen2"], torch.float32, CPU)
    cache, prompts = prefilled(model)
    step = build_paged_batch([[1, 2, 3]] * 3, [len(p) for p in prompts], TABLES, BLOCK, 0, CPU)
    ours_cache, torch_cache = cache.clone(), cache.clone()
    ours, theirs = forward(model, step, ours_cache, True), forward(model, step, torch_cache, False)
    assert ours.shape == theirs.shape == (3, 0, model.config.vocab_size)
    torch.testing.assert_close(ours_cache, torch_cache, atol=2e-5, rtol=2e-5)
    assert not torch.equal(ours_cache, cache)


@needs_kernel
def test_a_head_that_is_not_blocked_is_left_to_torch(checkpoints):
    """A vocabulary that is not whole blocks of 16 keeps its head plain: the C call stops at the
    last layer and torch applies the final norm and the head."""
    model = load_model(checkpoints["mistral"], torch.float32, CPU)
    cache, prompts = prefilled(model)
    step = build_paged_batch([[1, 2], [3, 4], [5, 6]], [len(p) for p in prompts], TABLES, BLOCK, 2, CPU)
    blocked = forward(model, step, cache.clone(), True)
    model.lm_head.weight = torch.nn.Parameter(plain(model.lm_head.weight).contiguous(), requires_grad=False)
    model.fused_forward = DecoderForward(model)
    assert not model.fused_forward.has_head
    torch.testing.assert_close(forward(model, step, cache.clone(), True), blocked, atol=2e-5, rtol=2e-5)


@needs_kernel
def test_a_small_step_runs_on_one_thread_and_a_large_one_on_torchs(checkpoints, monkeypatch):
    model = load_model(checkpoints["llama"], torch.float32, CPU)
    fused = model.fused_forward
    monkeypatch.setattr(torch, "get_num_threads", lambda: 6)
    decode = build_paged_batch([[7], [8], [9]], [5, 40, 17], TABLES, BLOCK, 1, CPU)
    assert fused.threads([decode]) == 1
    work = decode.input_ids.numel() * (fused.token_work + fused.position_work * decode.gather_slots.shape[1])
    monkeypatch.setattr(decoder_forward, "ONE_THREAD_WORK", work)  # this step's work: no longer below
    assert fused.threads([decode]) == 6
    monkeypatch.setattr(decoder_forward, "ONE_THREAD_WORK", work + 1)
    assert fused.threads([decode]) == 1


@needs_kernel
def test_a_large_step_of_one_prompt_alone_runs_on_its_threads(checkpoints, monkeypatch):
    model = load_model(checkpoints["llama"], torch.float32, CPU)
    fused = model.fused_forward
    monkeypatch.setattr(torch, "get_num_threads", lambda: 6)
    prompt = build_paged_batch([[7] * 20], [0], TABLES[:1], BLOCK, 1, CPU)
    work = prompt.input_ids.numel() * (fused.token_work + fused.position_work * prompt.gather_slots.shape[1])
    monkeypatch.setattr(decoder_forward, "ONE_THREAD_WORK", work)
    fused.alone_threads = 8  # as ModelRunner.prompt_alone sets it
    assert fused.threads([prompt]) == 8
    monkeypatch.setattr(decoder_forward, "ONE_THREAD_WORK", work + 1)
    assert fused.threads([prompt]) == 1  # a small step still runs on one
    fused.alone_threads = None
    monkeypatch.setattr(decoder_forward, "ONE_THREAD_WORK", work)
    assert fused.threads([prompt]) == 6
