"""The vectorised batch layout against a plain loop over rows and tokens, on random block tables."""
import random

import pytest
import torch

from vramledger.worker.models.attention import BlockTables, GatherWorkspace, build_paged_batch

CPU = torch.device("cpu")


def loop_layout(token_rows, starts, tables, block_size, num_logits):
    """Row by row, token by token: what every field must hold."""
    B, Q = len(token_rows), max(len(r) for r in token_rows)
    context = max(s + len(r) for s, r in zip(starts, token_rows))
    ids, positions = torch.zeros(B, Q, dtype=torch.long), torch.zeros(B, Q, dtype=torch.long)
    writes = []
    gather = torch.zeros(B, context, dtype=torch.long)
    for b, (row, start, table) in enumerate(zip(token_rows, starts, tables)):
        for q, token in enumerate(row):
            p = start + q
            ids[b, q], positions[b, q] = token, p
            writes.append((b * Q + q, table[p // block_size] * block_size + p % block_size))
        for c in range(min(context, len(table) * block_size)):
            gather[b, c] = table[c // block_size] * block_size + c % block_size
    logits_index = torch.tensor([[max(0, len(r) - num_logits + i) for i in range(num_logits)] for r in token_rows],
                                dtype=torch.long)
    context_lens = torch.tensor([s + len(r) for s, r in zip(starts, token_rows)])
    return ids, positions, writes, gather, context_lens, logits_index


def random_rows(rng: random.Random, block_size: int, uniform: bool):
    B = rng.randint(1 if uniform else 2, 6)
    q_len = rng.randint(1, 5)
    free = list(range(400))
    rng.shuffle(free)
    rows, starts, tables = [], [], []
    for _ in range(B):
        n = q_len if uniform else rng.randint(1, 9)
        start = rng.randint(0, 40)
        need = -(-(start + n) // block_size) + rng.randint(0, 2)  # some rows hold spare blocks
        tables.append([free.pop() for _ in range(need)])
        rows.append([rng.randint(1, 500) for _ in range(n)])
        starts.append(start)
    return rows, starts, tables


@pytest.mark.parametrize("uniform", [True, False], ids=["same-length rows", "padded rows"])
@pytest.mark.parametrize("seed", range(20))
def test_layout_equals_the_loop(seed, uniform):
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    rows, starts, tables = random_rows(rng, block_size, uniform)
    num_logits = rng.randint(0, 3)
    batch = build_paged_batch(rows, starts, tables, block_size, num_logits, CPU)
    ids, positions, writes, gather, context_lens, logits_index = loop_layout(
        rows, starts, tables, block_size, num_logits)
    assert torch.equal(batch.input_ids, ids)
    assert torch.equal(batch.positions, positions)
    written = range(ids.numel()) if batch.write_rows is None else batch.write_rows.tolist()
    assert list(zip(written, batch.write_slots.tolist())) == writes
    assert (batch.write_rows is None) == (len({len(r) for r in rows}) == 1)  # padding only where rows differ
    # Columns past a row's table are never read (masked): compare only the covered ones.
    for b, table in enumerate(tables):
        covered = min(gather.shape[1], len(table) * block_size)
        assert torch.equal(batch.gather_slots[b, :covered], gather[b, :covered])
    assert batch.gather_slots.shape == gather.shape
    assert torch.equal(batch.context_lens, context_lens)
    assert torch.equal(batch.logits_index, logits_index)


@pytest.mark.parametrize("seed", range(5))
def test_mask_lets_each_query_see_its_own_past_only(seed):
    rng = random.Random(seed)
    rows, starts, tables = random_rows(rng, 4, uniform=False)
    batch = build_paged_batch(rows, starts, tables, 4, 1, CPU)
    window = rng.choice([None, 3])
    mask = batch.mask(window, torch.float32)[:, 0]
    for b, (row, start) in enumerate(zip(rows, starts)):
        for q in range(mask.shape[1]):
            p = start + q if q < len(row) else 0  # a padded query sees slot 0 only
            seen = [c for c in range(mask.shape[2]) if mask[b, q, c] == 0]
            lowest = 0 if window is None else max(0, p - window + 1)
            assert seen == list(range(lowest, p + 1))
        assert torch.isinf(mask[b]).sum() + (mask[b] == 0).sum() == mask[b].numel()


def test_shared_tables_equal_tables_built_per_forward():
    rng = random.Random(7)
    rows, starts, tables = random_rows(rng, 4, uniform=True)
    shared = BlockTables.build(tables, 4, CPU)
    for step in range(3):  # the draft's steps: one token further each time
        later = [s + step for s in starts]
        a = build_paged_batch(rows, later, shared, 4, 1, CPU)
        b = build_paged_batch(rows, later, tables, 4, 1, CPU)
        assert torch.equal(a.write_slots, b.write_slots) and torch.equal(a.gather_slots, b.gather_slots)


def test_rows_past_their_tables_are_refused():
    with pytest.raises(ValueError, match="cover 8 positions"):
        build_paged_batch([[1, 2, 3]], [6], [[0, 1]], 4, 1, CPU)


def test_workspace_keeps_its_buffers_and_grows_to_the_largest_step():
    workspace = GatherWorkspace()
    target, draft = torch.zeros(100, 4, 8), torch.zeros(100, 2, 8)
    keys, values = workspace.pair(30, target)
    assert keys.shape == values.shape == (30, 4, 8) and keys.data_ptr() != values.data_ptr()
    smaller = workspace.pair(10, target)
    assert smaller[0].shape == (10, 4, 8) and smaller[0].data_ptr() == keys.data_ptr()  # reused
    larger = workspace.pair(50, target)
    assert larger[0].shape == (50, 4, 8)
    assert workspace.pair(30, target)[1].data_ptr() == larger[1].data_ptr()  # kept at its largest
    assert workspace.pair(30, draft)[0].shape == (30, 2, 8)  # another cache shape: a pair of its own
    assert workspace.pair(30, target.double())[0].dtype == torch.float64
    workspace.clear()
    assert workspace.pair(5, target)[0].data_ptr() != larger[0].data_ptr()
