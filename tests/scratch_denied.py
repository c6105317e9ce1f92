"""A child process that calls one C kernel with its address space capped (RLIMIT_AS) just above what it
already holds, on inputs whose shapes make the kernel's scratch far larger than that: the scratch
cannot be allocated. Prints what the call raised, then calls the kernel again uncapped on small inputs
and says whether it gives what it gave before (the process goes on, the kernel still works).

Run as a script: python scratch_denied.py KERNEL THREADS MARGIN_MB [CHECKPOINT]
"""
from __future__ import annotations

import contextlib
import resource
import sys
from collections.abc import Callable, Iterator

import torch

from vramledger.worker.kernels import (
    decoder_layers,
    draw_tokens,
    paged_attention,
    prefill_attention,
    verify_tokens,
)


def held() -> int:
    """Bytes of address space this process holds now."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))


@contextlib.contextmanager
def capped(margin: int) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (held() + margin, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def attention_inputs(context: int, heads: int, window: int):
    """One row, one query token at the context's end, every position in cache slot 0."""
    q = torch.randn(1, 1, heads, 16, generator=torch.Generator().manual_seed(context))
    keys = values = torch.randn(1, 1, 16)
    slots = torch.zeros(1, context, dtype=torch.int64)
    return q, keys, values, slots, torch.tensor([[context - 1]]), torch.tensor([context]), window


def attention_case(attend: Callable[..., torch.Tensor], heads: int, context: int) -> tuple[Callable, Callable]:
    """attend over a short context (the check), and over `context` positions (the call denied)."""
    small, large = attention_inputs(40, heads, 0), attention_inputs(context, heads, 16)
    return (lambda: attend(*small)), (lambda: attend(*large))


def sampling_case(vocab: int, verify: bool) -> tuple[Callable, Callable]:
    def draw(v: int):
        logits = torch.randn(1, v, generator=torch.Generator().manual_seed(v))
        one, u = torch.ones(1), torch.full((1,), 0.5)
        if not verify:
            return lambda: draw_tokens.draw_tokens(logits, one, u)
        probs = torch.softmax(torch.randn(1, 1, v), -1)
        rows = torch.randn(1, 2, v, generator=torch.Generator().manual_seed(v))
        draft = torch.zeros(1, 1, dtype=torch.int64)
        return lambda: torch.cat([t.flatten() for t in verify_tokens.verify_tokens(draft, probs, rows, one, u[:, None], u)])
    return draw(100), draw(vocab)


def decoder_case(checkpoint: str, context: int, threads: int) -> tuple[Callable, Callable]:
    """A random model's forward of one decode token; the long context's block table names block 0 over and
    over, so the cache stays one block while the attention's scratch follows the context."""
    from vramledger.worker.models.attention import build_paged_batch
    from vramledger.worker.models.loader import load_model
    model = load_model(checkpoint, torch.float32, torch.device("cpu"))
    fused, cache = model.fused_forward, torch.zeros(model.kv_cache_shape(16))

    def forward(length: int):
        batch = build_paged_batch([[7]], [length - 1], [[0] * (length // 16 + 1)], 16, 1, torch.device("cpu"))
        rows = decoder_layers.Rows(batch.input_ids, batch.positions, batch.gather_slots, batch.context_lens,
                                   batch.logits_index, batch.prefill)
        return lambda: decoder_layers.decoder_forward(fused.layers, fused.ends, fused.dims, [rows], batch.write_slots,
                                                      batch.write_rows, cache[0], cache[1], threads)[1][0]
    return forward(10), forward(context)


def main() -> None:
    kernel, threads, margin = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) << 20
    torch.set_num_threads(threads)
    cases = {
        "paged_attention": lambda: attention_case(paged_attention.attend, 64, 1 << 21),
        "prefill_attention": lambda: attention_case(prefill_attention.attend, 1, 1 << 21),
        "draw_tokens": lambda: sampling_case(1 << 24, verify=False),
        "verify_tokens": lambda: sampling_case(1 << 23, verify=True),
        "decoder_forward": lambda: decoder_case(sys.argv[4], 1 << 23, threads),
    }
    check, denied = cases[kernel]()
    before = check()  # the thread pool and its threads' heaps exist before the cap
    with capped(margin):
        try:
            denied()
            print("raised: nothing")
        except MemoryError as e:
            print(f"raised: MemoryError: {e}")
    print("same after" if torch.equal(check(), before) else "different after")


if __name__ == "__main__":
    main()
