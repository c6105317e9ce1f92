"""What a step's prompt chunks cost and which prompts share a step (the scheduler alone, without torch)."""
from vramledger.worker.engine.block_manager import BlockManager
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.engine.scheduler import Scheduler
from vramledger.worker.engine.sequence import Sequence


def scheduler(join_tokens=None, attention_span=16.0, budget=64):
    return Scheduler(BlockManager(num_blocks=400, block_size=4), max_num_seqs=16, max_num_batched_tokens=budget,
                     lookahead=0, attention_span=attention_span, join_tokens=join_tokens)


def add(sched, names, tokens):
    for name in names:
        sched.add(Sequence(name, list(range(tokens)), SamplingParams()))


def run(sched, steps):
    """Schedule `steps` steps, doing to each request what the engine does; each step as
    (prefilled request ids, decoded request ids)."""
    done = []
    for _ in range(steps):
        batch = sched.schedule()
        if batch is None:
            break
        for s, chunk in zip(batch.prefill, batch.chunks):
            s.num_cached += chunk
            if s.num_cached == len(s):
                s.prefilled = True
                s.output_token_ids.append(1)
        for s in batch.decode:
            s.num_cached = len(s)
            s.output_token_ids.append(1)
        done.append(("".join(s.request_id for s in batch.prefill), "".join(s.request_id for s in batch.decode)))
    return done


def test_costly_prompts_go_one_a_step_each_beside_the_decoding_streams():
    sched = scheduler(join_tokens=16)
    add(sched, ["s"], 8)
    run(sched, 2)  # its prefill, then a decode step: it decodes from now on
    add(sched, "abc", 8)  # each costs 8 tokens + 8 * 4.5 / 16 of attention = 10.25 > join_tokens / 2
    assert run(sched, 4) == [("a", "s"), ("b", "sa"), ("c", "sab"), ("", "sabc")]


def test_prompts_arriving_together_start_decoding_a_step_apart_and_finish_apart():
    sched = scheduler(join_tokens=16)
    for name in "abcd":
        sched.add(Sequence(name, list(range(8)), SamplingParams(max_tokens=4)))
    finished = []
    for _ in range(20):
        batch = sched.schedule()
        if batch is None:
            break
        rows = [*zip(batch.prefill, batch.chunks), *((s, 1) for s in batch.decode)]
        for s, chunk in rows:
            s.num_cached = s.num_cached + chunk if s in batch.prefill else len(s)
            if s.num_cached == len(s):
                s.prefilled = True
                s.output_token_ids.append(1)
                if len(s.output_token_ids) == 4:
                    sched.finish(s, "length")
                    finished.append(s.request_id)
        finished.append("|")  # a step ends
    # each finishes in a step of its own: their successors would arrive apart, not as a burst
    steps = "".join(finished).split("|")
    assert [step for step in steps if step] == list("abcd")


def test_while_nothing_decodes_a_long_prompts_chunks_follow_each_other():
    sched = scheduler(join_tokens=16)
    add(sched, ["long"], 150)  # chunks of 64 tokens
    assert run(sched, 4) == [("long", "")] * 3 + [("", "long")]


def test_small_prompts_share_a_step():
    sched = scheduler(join_tokens=16)
    add(sched, "abcdefgh", 2)  # 2 tokens + 2 * 1.5 / 16 each: 7 rows cost 15.3, 8 cost 17.5
    assert run(sched, 2) == [("abcdefg", ""), ("h", "abcdefg")]


def test_attention_is_part_of_the_cost():
    tokens_only = scheduler(join_tokens=16, attention_span=float("inf"))
    add(tokens_only, "ab", 8)
    assert run(tokens_only, 1) == [("ab", "")]  # 16 tokens
    with_attention = scheduler(join_tokens=16)
    add(with_attention, "ab", 8)
    assert run(with_attention, 1) == [("a", "")]  # 20.5


def test_without_a_join_limit_prompts_share_steps_up_to_the_budget():
    sched = scheduler()
    add(sched, ["s"], 8)
    run(sched, 2)
    add(sched, "abcdef", 8)  # 6 rows: 61.5
    assert run(sched, 2) == [("abcdef", "s"), ("", "sabcdef")]


def test_a_long_prompts_chunks_ride_with_the_decoding_streams():
    sched = scheduler(join_tokens=16)
    add(sched, ["s"], 8)
    run(sched, 2)
    add(sched, ["long"], 150)  # chunks of 64 tokens, each costing more than the budget with attention
    assert run(sched, 4) == [("long", "s")] * 3 + [("", "slong")]


def test_a_prompt_is_not_cut_to_join_a_step_unless_it_goes_in_chunks_anyway():
    sched = scheduler(join_tokens=16, attention_span=float("inf"))
    add(sched, ["a"], 6)
    add(sched, ["b"], 12)  # 2 x 12 > 16: not cut to 6 tokens to join, it goes whole next step
    assert run(sched, 2) == [("a", ""), ("b", "a")]
    assert sched.running[1].num_cached == 12
    long = scheduler(join_tokens=16, attention_span=float("inf"), budget=20)
    add(long, ["a"], 6)
    add(long, ["b"], 30)  # longer than the budget: its first chunk is as wide as the step
    assert long.schedule().chunks == [6, 6]
