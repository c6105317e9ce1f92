"""The prefix cache's bookkeeping, without torch: chained block hashes, shared blocks, eviction."""
from vramledger.worker.engine.block_manager import BlockManager, chain_hashes
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.engine.scheduler import Scheduler
from vramledger.worker.engine.sequence import Sequence

BS = 4


def seq(name, tokens):
    return Sequence(name, list(tokens), SamplingParams())


def prefill(blocks, s, cached=None):
    """Admit s and compute its whole prompt, as the engine's prefill leaves it."""
    blocks.admit(s, blocks.cached_prefix(s) if cached is None else cached)
    s.num_cached = s.num_draft_cached = len(s)
    blocks.commit(s)


def test_same_prefix_same_blocks_a_differing_token_in_block_i_reuses_blocks_before_i_only():
    blocks = BlockManager(num_blocks=32, block_size=BS)
    first = seq("first", range(14))  # 3 full blocks and a partial one
    prefill(blocks, first)
    assert blocks.cached_prefix(seq("same", range(14))) == first.block_table[:3]
    for i in range(3):
        differing = list(range(14))
        differing[BS * i + 1] = 99
        assert blocks.cached_prefix(seq("differs", differing)) == first.block_table[:i]
    # Equal tokens after another prefix are another block: the hash is chained over what precedes it.
    moved = seq("moved", [99, 98, 97, 96] + list(range(4, 14)))
    assert blocks.cached_prefix(moved) == []
    assert chain_hashes(moved, BS, 2)[1] != chain_hashes(first, BS, 2)[1]


def test_the_last_partial_block_and_the_block_of_the_last_token_are_never_shared():
    blocks = BlockManager(num_blocks=32, block_size=BS)
    first = seq("first", range(14))
    prefill(blocks, first)
    # first's tokens 12-13 fill a partial block: never registered, so a longer prompt stops before it.
    assert blocks.cached_prefix(seq("longer", range(20))) == first.block_table[:3]
    # A prompt of exactly 3 blocks computes its last token itself: it takes 2 blocks, not 3.
    assert blocks.cached_prefix(seq("exact", range(12))) == first.block_table[:2]
    assert blocks.cached_prefix(seq("one more", range(13))) == first.block_table[:3]


def test_only_blocks_of_committed_tokens_are_registered():
    blocks = BlockManager(num_blocks=32, block_size=BS)
    s = seq("s", range(6))
    blocks.admit(s, [])
    s.num_cached = 6
    blocks.commit(s)
    s.output_token_ids += [50, 51, 52]  # 9 tokens; a verify step wrote slots up to 12 (k=4)
    blocks.allocate(s, 13)
    s.num_cached = 7  # one proposal accepted: slots 7-12 hold rejected proposals
    blocks.commit(s)
    assert blocks.cached_prefix(seq("reader", list(range(6)) + [50, 51, 52, 53, 54])) == s.block_table[:1]
    s.num_cached = 8  # block 1 (slots 4-7) is all committed now
    blocks.commit(s)
    assert blocks.cached_prefix(seq("reader", list(range(6)) + [50, 51, 52, 53, 54])) == s.block_table[:2]


def test_shared_blocks_are_counted_once_and_never_freed_while_a_request_holds_them():
    blocks = BlockManager(num_blocks=8, block_size=BS)
    a = seq("a", range(10))
    prefill(blocks, a)
    assert blocks.num_used == 3 and blocks.num_cached == 0
    b = seq("b", list(range(8)) + [70, 71, 72])
    cached = blocks.cached_prefix(b)
    assert cached == a.block_table[:2] and blocks.can_admit(b, cached)
    prefill(blocks, b, cached)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached == 11
    assert blocks.num_used == 4  # a's 3 and b's own third block
    blocks.free(a)  # a finishes: the blocks b reads stay held, a's third block is cached
    assert blocks.num_used == 3 and blocks.num_cached == 0  # a's third block held only a partial block
    assert set(b.block_table) <= {x for x in range(8) if blocks._refs[x] > 0}
    blocks.free(b)
    assert blocks.num_used == 0 and blocks.num_cached == 2  # the two full blocks stay for later prompts
    assert blocks.queried_tokens == 10 + 11 and blocks.hit_tokens == 8


def test_free_cached_blocks_are_evicted_least_recently_used_first():
    blocks = BlockManager(num_blocks=6, block_size=BS)
    old, new = seq("old", [1] * 9), seq("new", [2] * 9)
    for s in (old, new):
        prefill(blocks, s)
    old_table, new_table = list(old.block_table), list(new.block_table)
    blocks.free(old)
    blocks.free(new)
    assert blocks.num_used == 0 and blocks.num_cached == 4
    other = seq("other", [3] * 5)
    blocks.admit(other, [])
    # The least recently freed go first: old's partial block (a request's tail goes first), then
    # old's second full block; old's first block and all of new's stay cached.
    assert other.block_table == [old_table[2], old_table[1]]
    assert blocks.cached_prefix(seq("x", [1] * 9)) == old_table[:1]
    assert blocks.cached_prefix(seq("x", [2] * 9)) == new_table[:2]
    assert blocks.num_cached == 3 and blocks.num_used == 2


def test_admission_holds_its_cached_blocks_before_taking_fresh_ones():
    blocks = BlockManager(num_blocks=3, block_size=BS)
    x, y = seq("x", [2] * 8), seq("y", [3] * 4)
    prefill(blocks, x)
    prefill(blocks, y)
    blocks.free(x)
    blocks.free(y)  # least recently used first: x's blocks (second, first), then y's
    again = seq("again", [2] * 8 + [6])
    cached = blocks.cached_prefix(again)
    assert cached == [0, 1] and blocks.can_admit(again, cached)
    blocks.admit(again, cached)  # its 2 cached blocks and 1 fresh: y's, not one it is about to read
    assert again.block_table == [0, 1, 2] and again.num_cached == 8
    assert not blocks.can_admit(seq("more", [9]), [])


def test_a_reusing_request_starts_its_draft_where_the_draft_wrote():
    blocks = BlockManager(num_blocks=16, block_size=BS)
    dormant = seq("dormant", range(13))
    blocks.admit(dormant, [])
    dormant.num_cached, dormant.num_draft_cached = 13, 5  # the draft read 5 tokens (a catch-up chunk)
    blocks.commit(dormant)
    reader = seq("reader", range(14))
    blocks.admit(reader, blocks.cached_prefix(reader))
    assert reader.num_cached == 12 and reader.num_draft_cached == 4  # block 0 only holds the draft's too
    dormant.num_draft_cached = 12  # the draft catches up: its blocks are marked as it goes
    blocks.commit(dormant)
    late = seq("late", range(14))
    blocks.admit(late, blocks.cached_prefix(late))
    assert late.num_cached == late.num_draft_cached == 12


def test_the_drafts_backlog_counts_shared_blocks_once_and_skips_what_a_draft_wrote():
    """The tokens a catch-up would have a dormant draft read, as the policy weighs a probe."""
    blocks = BlockManager(num_blocks=32, block_size=BS)
    first = seq("first", range(14))  # 3 full blocks and 2 tokens
    blocks.admit(first, [])
    first.num_cached = 14  # prefilled; its draft read nothing
    blocks.commit(first)
    second = seq("second", list(range(12)) + [50, 51, 52])  # takes first's 3 full blocks
    blocks.admit(second, blocks.cached_prefix(second))
    second.num_cached = 15
    # Each reads up to its last token: first 13 tokens, second 12 shared ones (counted once) and 2 more.
    assert blocks.draft_backlog([first], 0) == 13
    assert blocks.draft_backlog([first, second], 0) == 13 + 2
    assert blocks.draft_backlog([first, second], 13) == 14  # first lags 13: its first proposal reads them
    first.num_draft_cached = 12  # first's draft caught up on the shared blocks, and they are marked
    blocks.commit(first)
    assert blocks.draft_backlog([first, second], 0) == 1 + 2


def test_without_caching_nothing_is_shared_or_counted():
    blocks = BlockManager(num_blocks=8, block_size=BS, caching=False)
    a = seq("a", range(10))
    prefill(blocks, a)
    assert blocks.cached_prefix(seq("b", range(10))) == []
    blocks.free(a)
    assert blocks.num_cached == 0 and blocks.queried_tokens == blocks.hit_tokens == 0


def test_scheduler_chunks_long_prompts_beside_decoding():
    blocks = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=8, lookahead=0)
    short, long = seq("short", range(3)), seq("long", range(20, 40))
    sched.add(short)
    sched.add(long)
    batch = sched.schedule()  # the short prompt whole, and the long one as wide as the batch allows
    assert batch.prefill == [short, long] and batch.chunks == [3, 3] and not batch.decode
    short.num_cached, short.prefilled = 3, True  # as the engine leaves them
    short.output_token_ids.append(7)
    long.num_cached = 3
    # The rest of the long prompt in chunks of 8 (each the whole budget), each in a step that decodes
    # the short one, which got its token from the first step.
    chunks = []
    while not long.prefilled:
        batch = sched.schedule()
        assert batch.prefill == [long] and batch.decode == [short]
        chunks += batch.chunks
        long.num_cached += batch.chunks[0]
        long.prefilled = long.num_cached == 20
        short.num_cached = len(short)
        short.output_token_ids.append(7)
    assert chunks == [8, 8, 1]
