"""Our paged model code against transformers' own forward on the same weights."""
import pytest
import torch
import transformers

from vramledger.worker.models.attention import GatherWorkspace, build_paged_batch
from vramledger.worker.models.loader import load_model

CPU = torch.device("cpu")
FAMILIES = ["llama", "qwen2", "mistral"]


def reference_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_decode_matches_transformers(checkpoints, family):
    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = reference_logits(checkpoints[family], ids)
    model = load_model(checkpoints[family], torch.float32, CPU)
    block_size, table = 4, [9, 2, 7, 0, 5, 11, 3]  # scattered blocks on purpose
    cache = torch.zeros(model.kv_cache_shape(12 * block_size))
    # Every forward gathers into one kept workspace, oversized and full of NaN from an earlier step.
    workspace = GatherWorkspace()
    for stale in workspace.pair(64, cache[0, 0]):
        stale.fill_(float("nan"))
    prefill = build_paged_batch([ids[:17]], [0], [table], block_size, 17, CPU)
    prefill.workspace = workspace
    ours = [model(prefill, cache)[0]]
    for pos in range(17, 24):
        step = build_paged_batch([[ids[pos]]], [pos], [table], block_size, 1, CPU)
        step.workspace = workspace
        ours.append(model(step, cache)[0])
    torch.testing.assert_close(torch.cat(ours), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_of_different_lengths_matches_transformers(checkpoints, family):
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (3, 19, 8)]
    model = load_model(checkpoints[family], torch.float32, CPU)
    block_size = 8
    tables = [[0], [1, 4, 5], [2]]
    cache = torch.zeros(model.kv_cache_shape(6 * block_size))
    batch = build_paged_batch(prompts, [0, 0, 0], tables, block_size, 3, CPU)
    logits = model(batch, cache)  # [3, 3, V]: the last three positions of each row
    for row, ids in enumerate(prompts):
        ref = reference_logits(checkpoints[family], ids)
        n = min(3, len(ids))
        torch.testing.assert_close(logits[row, 3 - n:], ref[-n:], atol=1e-4, rtol=1e-4)
