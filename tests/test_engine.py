"""Speculative decoding through the engine: exactness, acceptance, preemption, stopping."""
import itertools

import pytest
import torch

from vramledger.worker.config import EngineConfig
from vramledger.worker.engine.llm_engine import LLMEngine
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.engine.speculation import Speculation
from vramledger.worker.models.loader import ModelLoadError

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def prompts(n):
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 300, (2 + 5 * i,), generator=gen).tolist() for i in range(n)]


def engine(target, draft=None, speculation="fixed", **kw):
    """Fixed by default: every decode step proposes K, the strictest run of propose, verify and
    roll back (the default, adaptive, is tested here by name)."""
    return LLMEngine(EngineConfig(model=target, draft_model=draft, max_model_len=128,
                                  speculation=speculation, **kw))


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_speculative_equals_greedy_plain(checkpoints, family, batch):
    plain = engine(checkpoints[family]).generate(prompts(batch), GREEDY)
    spec = engine(checkpoints[family], checkpoints[family + "-draft"]).generate(prompts(batch), GREEDY)
    assert [r[0] for r in spec] == [r[0] for r in plain]
    assert all(len(r[0]) == 24 and r[2] == "length" for r in spec)


class Scripted(Speculation):
    """A policy that proposes the given ks in turn, whatever they cost."""

    def __init__(self, ks):
        super().__init__(max(ks))
        self.ks = itertools.cycle(ks)

    def choose(self, batch_size):
        self.current = next(self.ks)
        return self.current


@pytest.mark.parametrize("ks", [[0, 3, 1, 4, 2], [4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_with_k_changing_every_step_equals_greedy_plain(checkpoints, batch, ks):
    """Plain steps leave the draft behind; its next proposal catches up first."""
    plain = engine(checkpoints["llama"]).generate(prompts(batch), GREEDY)
    spec = engine(checkpoints["llama"], checkpoints["llama"])  # the target as its own draft: all accepted
    spec.speculation = Scripted(ks)
    assert [r[0] for r in spec.generate(prompts(batch), GREEDY)] == [r[0] for r in plain]
    assert spec.stats.acceptance_rate == 1.0  # a draft out of step would propose other tokens
    assert spec.stats.draft_tokens < 4 * spec.stats.drafts  # steps did propose fewer than K


def record_draft_reads(spec):
    """Every draft forward from now on: (the policy's k, each row's tokens, starts, prefill)."""
    reads, forward = [], spec.runner.forward

    def forward_and_record(name, rows, starts, *args, prefill=False, **kw):
        if name == "draft":
            reads.append((spec.speculation.current, [len(r) for r in rows], list(starts), prefill))
        return forward(name, rows, starts, *args, prefill=prefill, **kw)

    spec.runner.forward = forward_and_record
    return reads


def test_a_dormant_draft_reads_nothing_until_a_step_proposes(checkpoints):
    """Neither prefill nor plain steps run a dormant draft, however far behind it falls; the next
    step that proposes first feeds it what it missed (every row is more than CATCH_UP_AFTER tokens
    behind), as one prompt chunk a row up to its last token, and its proposals are still the
    target's own tokens (all accepted) and exact."""
    plain_steps = 40
    params = SamplingParams(max_tokens=plain_steps + 8, temperature=0, ignore_eos=True)
    plain = engine(checkpoints["llama"]).generate(prompts(4), params)
    spec = engine(checkpoints["llama"], checkpoints["llama"])
    spec.speculation = Scripted([0] * plain_steps + [2])
    spec.speculation.current = 0  # asleep from the start: the prompts' prefill leaves the draft out
    draft_reads = record_draft_reads(spec)
    assert [r[0] for r in spec.generate(prompts(4), params)] == [r[0] for r in plain]
    assert spec.stats.acceptance_rate == 1.0 and spec.stats.drafts == 4
    assert all(k == 2 for k, *_ in draft_reads)  # only in the step that proposes
    # The catch-up reads every row from 0 up to its last token in one prefill forward (4 rows well
    # within the token budget); then 2 proposals read one token a row each, the first from there.
    (_, caught_up, zeros, prefill), (_, first, last, _), (_, second, _, _) = draft_reads
    assert prefill and zeros == [0] * 4 and caught_up == last and min(last) > plain_steps
    assert first == second == [1] * 4


def test_steps_that_do_not_propose_run_no_draft_forward(checkpoints):
    """An awake draft reads no prompt at its prefill and nothing in plain steps: a run whose steps
    all choose k=0 runs the draft model not once."""
    plain = engine(checkpoints["llama"]).generate(prompts(4), GREEDY)
    spec = engine(checkpoints["llama"], checkpoints["llama-draft"])
    spec.speculation = Scripted([0])
    spec.speculation.current = 4  # awake at the prefill
    draft_reads = record_draft_reads(spec)
    assert [r[0] for r in spec.generate(prompts(4), GREEDY)] == [r[0] for r in plain]
    assert draft_reads == [] and spec.stats.drafts == 0


def test_prompts_beside_decoding_rows_decode_plain_and_the_draft_reads_them_only_to_propose(checkpoints):
    """Adaptive: a step that prefills a prompt beside a decoding row runs plain (the row rides the
    chunk's forward) and no draft forward; the draft reads that prompt when a step first proposes for
    it, and the output is plain greedy's."""
    rows = prompts(2)
    reference = engine(checkpoints["llama"]).generate(rows, GREEDY)
    spec = engine(checkpoints["llama"], checkpoints["llama"], speculation="adaptive")
    draft_reads = record_draft_reads(spec)
    tokens: dict[str, list[int]] = {}

    def step():
        for out in spec.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    first = spec.add_request(rows[0], GREEDY)
    step()  # its prefill alone
    assert draft_reads == [] and spec._seqs[first].num_draft_cached == 0
    step()  # a decode step: awake, a batch size not measured yet, K
    assert draft_reads and spec.stats.drafts == 1
    second = spec.add_request(rows[1], GREEDY)
    reads_before = len(draft_reads)
    step()  # the second's prefill beside the first's decoding
    assert len(draft_reads) == reads_before and spec.stats.drafts == 1
    assert spec._seqs[second].num_draft_cached == 0 < spec._seqs[second].num_cached
    while spec.has_unfinished_requests():
        step()
    assert [tokens[first], tokens[second]] == [r[0] for r in reference]
    assert spec.stats.drafts > 1 and spec.stats.acceptance_rate == 1.0  # the draft read the second's prompt


def test_rows_sharing_a_prefix_catch_up_on_it_once(checkpoints):
    """A dormant draft behind 4 requests that share a 64-token cached prefix: the catch-up writes the
    prefix's blocks for one row, the others skip them and read only their own tokens, and the
    proposals are the target's own tokens (all accepted)."""
    prefix = list(range(10, 74))  # 4 full blocks
    rows = [prefix + [100 + i, 200 + i, 300 + i] for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reference = engine(checkpoints["llama"]).generate(rows, params)
    spec = engine(checkpoints["llama"], checkpoints["llama"])
    spec.speculation = Scripted([0] * 4 + [2])
    spec.speculation.current = 0
    draft_reads = record_draft_reads(spec)
    assert [r[0] for r in spec.generate(rows, params)] == [r[0] for r in reference]
    assert spec.stats.acceptance_rate == 1.0
    first = next(i for i, (*_, prefill) in enumerate(draft_reads) if not prefill)  # the first proposals
    behind = draft_reads[first][2]  # where they read: every row caught up from 0 to there
    caught_up = sum(sum(lengths) for _, lengths, _, _ in draft_reads[:first])
    assert len(behind) == 4 and caught_up == sum(behind) - 3 * len(prefix)


@pytest.mark.parametrize("speculation", ["fixed", "adaptive"])
def test_both_speculation_modes_keep_greedy_exact(checkpoints, speculation):
    plain = engine(checkpoints["llama"]).generate(prompts(8), GREEDY)
    spec = engine(checkpoints["llama"], checkpoints["llama-draft"], speculation=speculation)
    assert [r[0] for r in spec.generate(prompts(8), GREEDY)] == [r[0] for r in plain]
    if speculation == "fixed":
        assert spec.stats.draft_tokens == 4 * spec.stats.drafts


def test_identical_draft_accepts_everything(checkpoints):
    e = engine(checkpoints["llama"], checkpoints["llama"], num_speculative_tokens=3)
    e.generate(prompts(4), GREEDY)
    assert e.stats.acceptance_rate == 1.0
    assert e.stats.mean_acceptance_length == 4.0
    assert e.stats.accepted_per_position == [e.stats.drafts] * 3


def test_preemption_under_block_pressure_keeps_outputs(checkpoints):
    roomy = engine(checkpoints["llama"], checkpoints["llama-draft"])
    reference = roomy.generate(prompts(8), GREEDY)
    twelve_blocks = 12 * roomy.runner.bytes_per_block()
    tight = engine(checkpoints["llama"], checkpoints["llama-draft"], kv_cache_memory=twelve_blocks)
    assert tight.num_blocks == 12
    assert [r[0] for r in tight.generate(prompts(8), GREEDY)] == [r[0] for r in reference]
    assert tight.scheduler.num_preemptions > 0
    assert tight.blocks.num_used == 0


def test_seeded_sampling_is_reproducible_and_batch_independent(checkpoints):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = engine(checkpoints["llama"], checkpoints["llama-draft"]).generate(prompts(1), params)
    crowd_params = [params] + [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)] * 5
    crowd = engine(checkpoints["llama"], checkpoints["llama-draft"]).generate(prompts(6), crowd_params)
    assert crowd[0][0] == alone[0][0]


def test_stop_string_and_eos_finish_requests(checkpoints):
    e = engine(checkpoints["llama"], checkpoints["llama-draft"])
    (tokens, text, reason), = e.generate([prompts(1)[0]], SamplingParams(max_tokens=40, temperature=0,
                                                                          ignore_eos=True))
    stop = text[5:8]
    (_, stopped_text, stop_reason), = e.generate([prompts(1)[0]], SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]))
    assert stop_reason == "stop" and stop not in stopped_text and text.startswith(stopped_text)
    eos = e.tokenizer.eos_token_id
    e.sampling.eos_token_ids = {tokens[3]}  # pretend a greedy token is the end of text
    (eos_tokens, _, eos_reason), = e.generate([prompts(1)[0]], SamplingParams(max_tokens=40, temperature=0))
    assert eos_reason == "stop" and eos_tokens == tokens[:tokens.index(tokens[3]) + 1]
    assert eos is not None


def test_abort_frees_blocks(checkpoints):
    e = engine(checkpoints["llama"], checkpoints["llama-draft"])
    rid = e.add_request(prompts(1)[0], SamplingParams(max_tokens=50))
    e.step()
    e.step()
    assert e.blocks.num_used > 0
    e.abort_request(rid)
    assert e.blocks.num_used == 0 and not e.has_unfinished_requests()


def test_bad_inputs_are_clear(checkpoints, tmp_path):
    e = engine(checkpoints["llama"])
    with pytest.raises(ValueError, match="empty"):
        e.add_request([], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        e.add_request(list(range(128)), GREEDY)
    for bad in ([1, e.vocab_size], [-1, 2]):
        with pytest.raises(ValueError, match=rf"token ids must be in \[0, {e.vocab_size}\)"):
            e.add_request(bad, GREEDY)
    assert not e.has_unfinished_requests()
    with pytest.raises(ModelLoadError, match="not a directory"):
        engine(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelLoadError, match="not supported.*LlamaForCausalLM"):
        engine(str(tmp_path))


def test_draft_with_another_tokenizer_is_refused(checkpoints, tmp_path):
    import shutil
    other = tmp_path / "other"
    shutil.copytree(checkpoints["llama-draft"], other)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    with pytest.raises(ModelLoadError, match="tokenizer"):
        engine(checkpoints["llama"], str(other))


def test_shipped_pair_speculative_equals_plain_at_batch_1_and_8():
    texts = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def push(self, item):\n",
             "for i in range(10):\n", "    return ", "def main():\n    parser = argparse.",
             "x = [", "if __name__ == '__main__':\n"]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    small = dict(max_model_len=256, max_num_seqs=8)
    plain = LLMEngine(EngineConfig(draft_model=None, **small))
    spec = LLMEngine(EngineConfig(**small))
    for batch in (texts[:1], texts):
        assert [r[0] for r in spec.generate(batch, params)] == [r[0] for r in plain.generate(batch, params)]
    assert spec.stats.acceptance_rate > 0.2  # the pair was distilled to agree


def test_generate_cli_runs_the_shipped_pair_with_no_flags():
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-m", "vramledger.worker", "generate", "--max-tokens", "16"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("import os\nimport sys\n\n\ndef main(argv):\n")  # the default prompt
    assert "acceptance rate" in result.stderr and "mean acceptance length" in result.stderr


def test_penalties_min_tokens_and_logprobs_agree_between_speculative_and_plain(checkpoints):
    """Greedy with penalties and min_tokens: the draft changes neither the tokens nor their logprobs."""
    params = SamplingParams(max_tokens=20, temperature=0, presence_penalty=1.5, frequency_penalty=1.0,
                            repetition_penalty=1.5, logprobs=3)
    unpenalised = engine(checkpoints["llama"]).generate(prompts(4), GREEDY)
    plain_engine = engine(checkpoints["llama"])
    plain = plain_engine.generate(prompts(4), params)
    spec = engine(checkpoints["llama"], checkpoints["llama-draft"]).generate(prompts(4), params)
    assert [r[0] for r in spec] == [r[0] for r in plain]
    assert [r[0] for r in plain] != [r[0][:20] for r in unpenalised]  # the penalties change the text
    # A strong repetition penalty keeps greedy decoding from repeating a token in a row.
    assert all(a != b for r in plain for a, b in zip(r[0], r[0][1:]))

    rid = plain_engine.add_request(prompts(1)[0], params)
    outs = []
    while plain_engine.has_unfinished_requests():
        outs += [o for o in plain_engine.step() if o.request_id == rid]
    logprobs = [lp for o in outs for lp in o.logprobs]
    assert [lp.token_id for lp in logprobs] == plain[0][0]
    for lp in logprobs:
        assert len(lp.top) == 3 and lp.logprob <= 0 and lp.text == plain_engine.tokenizer.decode([lp.token_id])
        assert [v for _, _, v in lp.top] == sorted((v for _, _, v in lp.top), reverse=True)
        assert lp.top[0][2] >= lp.logprob  # the model's own distribution: the choice was penalised


def test_min_tokens_holds_back_end_of_text_and_stop_token_ids_end_the_request(checkpoints):
    e = engine(checkpoints["llama"], checkpoints["llama-draft"])
    (tokens, _, _), = e.generate([prompts(1)[0]], SamplingParams(max_tokens=30, temperature=0,
                                                                     ignore_eos=True))
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    (stopped, stopped_text, reason), = e.generate([prompts(1)[0]], SamplingParams(
        max_tokens=30, temperature=0, stop_token_ids=[stop_id]))
    assert reason == "stop" and stopped == tokens[:first + 1]
    assert stopped_text == e.tokenizer.decode(tokens[:first], skip_special_tokens=True)  # without the stop token
    # min_tokens: that token may not end the request (nor be chosen) before 10 tokens are out.
    e.sampling.eos_token_ids = {stop_id}
    (held, _, reason), = e.generate([prompts(1)[0]], SamplingParams(max_tokens=30, temperature=0, min_tokens=10))
    assert stop_id not in held[:10] and len(held) > 10
    assert reason == "length" or held[-1] == stop_id


def test_a_batch_reuses_its_sampling_settings_only_while_its_rows_are_the_same(checkpoints):
    eng = engine(checkpoints["llama"])
    sampled = SamplingParams(max_tokens=4, temperature=0.8)
    ids = [eng.add_request(p, sampled) for p in prompts(2)]
    ids.append(eng.add_request(prompts(3)[2], SamplingParams(max_tokens=4, temperature=0.8, seed=7)))
    a, b, seeded = (eng._seqs[i] for i in ids)
    rows = eng.sampling.rows([a, b])
    assert eng.sampling.rows([a, b]) is rows
    reordered = eng.sampling.rows([seeded, a])
    assert reordered is not rows and reordered.generators == [eng.sampling.generators[ids[2]], None]
    penalized = eng._seqs[eng.add_request(prompts(1)[0], SamplingParams(max_tokens=4, repetition_penalty=1.2))]
    assert eng.sampling.rows([a, penalized]) is not eng.sampling.rows([a, penalized])  # a history changes every step
