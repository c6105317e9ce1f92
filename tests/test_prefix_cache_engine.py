"""Prefix caching and chunked prefill through the engine: exact outputs, honest block counts."""
import pytest
import torch
from test_engine import Scripted

from vramledger.worker.config import EngineConfig
from vramledger.worker.engine.llm_engine import LLMEngine
from vramledger.worker.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def tokens(n, seed):
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX = tokens(50, 1)  # 3 full blocks of 16 and 2 tokens
PROMPTS = [PREFIX + tokens(5 + 3 * i, 10 + i) for i in range(4)]


def engine(target, draft=None, **kw):
    kw = {"max_model_len": 128, "speculation": "fixed", **kw}
    return LLMEngine(EngineConfig(model=target, draft_model=draft, **kw))


def outputs(e, prompts, params=GREEDY):
    return [r[0] for r in e.generate(prompts, params)]


@pytest.mark.parametrize("with_draft", [False, True])
def test_greedy_with_a_cache_hit_equals_greedy_without(checkpoints, with_draft):
    draft = checkpoints["llama-draft"] if with_draft else None
    uncached = engine(checkpoints["llama"], draft, prefix_caching=False)
    reference = outputs(uncached, PROMPTS)
    assert uncached.blocks.hit_tokens == 0 and uncached.blocks.num_cached == 0
    cached = engine(checkpoints["llama"], draft)
    assert outputs(cached, PROMPTS[:1]) == reference[:1]  # fills the cache
    computed = cached.stats.prompt_tokens
    assert outputs(cached, PROMPTS[1:]) == reference[1:]  # three requests in one batch, each hits 48 tokens
    assert cached.blocks.hit_tokens == 3 * 48
    assert cached.stats.prompt_tokens - computed == sum(map(len, PROMPTS[1:])) - 3 * 48
    assert cached.blocks.num_used == 0 and cached.blocks.num_cached > 0


def test_seeded_sampling_with_a_cache_hit_equals_sampling_without(checkpoints):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    draft = checkpoints["llama-draft"]
    reference = outputs(engine(checkpoints["llama"], draft, prefix_caching=False), PROMPTS[1:2], params)
    cached = engine(checkpoints["llama"], draft)
    outputs(cached, PROMPTS[:1], params)
    assert outputs(cached, PROMPTS[1:2], params) == reference
    assert cached.blocks.hit_tokens == 48


def test_a_prefix_cached_while_the_draft_slept_is_read_by_the_draft_before_it_proposes(checkpoints):
    """The first request runs plain (a dormant draft reads nothing); the second takes its cached
    blocks for the target, and the draft, which never wrote them, catches up before its proposals:
    the target as its own draft accepts them all."""
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    reference = outputs(engine(checkpoints["llama"]), PROMPTS[:2], params)
    spec = engine(checkpoints["llama"], checkpoints["llama"])
    spec.speculation = Scripted([0])
    spec.speculation.current = 0  # asleep from the start: the prefill leaves the draft out
    assert outputs(spec, PROMPTS[:1], params) == reference[:1]
    assert spec.stats.drafts == 0
    spec.speculation = Scripted([2])  # awake; still, a prefill leaves the draft out
    second = spec.add_request(PROMPTS[1], params)
    spec.step()  # the prefill: the target starts after the cached 48 tokens, the draft at 0
    seq = spec._seqs[second]
    assert seq.num_cached == len(PROMPTS[1]) and seq.num_draft_cached == 0
    while spec.has_unfinished_requests():
        spec.step()
    assert seq.output_token_ids == reference[1]
    assert spec.stats.drafts > 0 and spec.stats.acceptance_rate == 1.0
    # Its catch-up marked the blocks: a third request starts its draft after the prefix, too, and its
    # prefill leaves the draft there until a step proposes.
    third = spec.add_request(PREFIX + [7, 8, 9], params)
    spec.step()
    assert spec._seqs[third].num_draft_cached == 48 < spec._seqs[third].num_cached  # its 3 full blocks


def test_a_kv_starved_engine_with_caching_serves_everything_and_its_blocks_add_up_at_every_step(checkpoints):
    draft = checkpoints["llama-draft"]
    prompts = [PREFIX[:20 + 8 * (i % 3)] + tokens(4 + i, 30 + i) for i in range(8)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    reference = outputs(engine(checkpoints["llama"], draft, prefix_caching=False), prompts, params)
    roomy = engine(checkpoints["llama"], draft)
    tight = engine(checkpoints["llama"], draft, kv_cache_memory=12 * roomy.runner.bytes_per_block())
    assert tight.num_blocks == 12
    ids = [tight.add_request(p, params) for p in prompts]
    got = {i: [] for i in ids}
    while tight.has_unfinished_requests():
        for out in tight.step():
            got[out.request_id] += out.new_token_ids
        kv = tight.memory_report()["kv_cache"]
        held = {b for s in tight.scheduler.running for b in s.block_table}
        assert kv["blocks_used"] == len(held) == tight.blocks.num_used
        assert kv["blocks_used"] + kv["blocks_cached"] + kv["blocks_free"] == kv["blocks_total"] == 12
        assert kv["blocks_free"] >= 0 and kv["blocks_cached"] >= 0
    assert [got[i] for i in ids] == reference
    assert tight.scheduler.num_preemptions > 0 and tight.blocks.hit_tokens > 0
    assert tight.blocks.num_used == 0  # nothing leaked


@pytest.mark.parametrize("with_draft", [False, True])
def test_a_long_prompt_is_prefilled_in_chunks_without_pausing_running_streams(checkpoints, with_draft):
    """Four streams decode; a 100-token prompt arrives. With 16-token prefill steps it takes 7
    chunks, and every stream gets its next tokens in every step meanwhile."""
    draft = checkpoints["llama-draft"] if with_draft else None
    long_prompt = tokens(100, 5)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    reference = outputs(engine(checkpoints["llama"], draft, max_model_len=256), PROMPTS + [long_prompt],
                        params)
    e = engine(checkpoints["llama"], draft, max_model_len=256, max_num_batched_tokens=16,
               prefix_caching=False)
    streams = [e.add_request(p, params) for p in PROMPTS]
    got = {i: [] for i in streams}
    while any(len(got[i]) < 3 for i in streams):  # the four are decoding
        for out in e.step():
            got[out.request_id] += out.new_token_ids
    late = e.add_request(long_prompt, params)
    got[late] = []
    waited = {i: 0 for i in streams}  # steps since each stream's last tokens
    longest_wait = 0
    while not got[late]:
        outs = e.step()
        for out in outs:
            got[out.request_id] += out.new_token_ids
        for i in streams:
            waited[i] = 0 if any(o.request_id == i for o in outs) else waited[i] + 1
            longest_wait = max(longest_wait, waited[i])
    assert longest_wait == 0  # each chunk rides in a step that decodes them
    assert e.stats.prompt_tokens >= len(long_prompt) + sum(map(len, PROMPTS))
    while e.has_unfinished_requests():
        for out in e.step():
            got[out.request_id] += out.new_token_ids
    assert [got[i] for i in streams + [late]] == reference  # chunks change no token


def test_a_speculative_steps_prompt_gets_its_first_token_before_the_proposals_run(checkpoints):
    e = engine(checkpoints["llama"], checkpoints["llama-draft"])  # fixed k: every decode step proposes
    stream = e.add_request(PROMPTS[0], GREEDY)
    e.step()  # its prefill: it decodes from now on
    late = e.add_request(PROMPTS[1], GREEDY)
    early, proposals = [], []
    decode = e.speculative_step
    e.speculative_step = lambda *a: proposals.append(list(early)) or decode(*a)
    rest = e.step(early=early.extend)
    assert [o.request_id for o in early] == [late] and len(early[0].new_token_ids) == 1
    assert proposals == [early]  # delivered before the proposals ran
    assert [o.request_id for o in rest] == [stream] and len(rest[0].new_token_ids) >= 1


def test_chunked_prefill_of_a_batch_of_long_prompts_equals_whole_prefill(checkpoints):
    prompts = [tokens(90 + 7 * i, 40 + i) for i in range(3)]
    whole = outputs(engine(checkpoints["llama"]), prompts)
    chunked = engine(checkpoints["llama"], max_num_batched_tokens=24)
    assert outputs(chunked, prompts) == whole


def test_the_scheduler_weighs_attention_by_the_targets_own_sizes(checkpoints):
    """attention_span: a layer's matmul multiply-adds per token over the attention's per position
    (scores and weighted values, per head and dim)."""
    e = engine(checkpoints["llama"])
    config = e.runner.models["target"].config
    hidden, inner, heads = config.hidden_size, config.intermediate_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    qkv = hidden * (heads + 2 * config.num_key_value_heads) * head_dim
    matmuls = qkv + heads * head_dim * hidden + 3 * hidden * inner
    assert e.scheduler.attention_span == e.runner.attention_span() == matmuls / (2 * heads * head_dim)
