"""The prompt encoder: off the event loop on two lanes, so a long prompt delays only itself; the text
the ledger tokenizes costs the most; a long prompt's heap goes back once it is tokenized, and nothing
grows with the prompts tokenized before."""
from __future__ import annotations

import asyncio
import functools
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from run_together import together

from vramledger.worker.http.errors import APIError
from vramledger.worker.http.prompt_bounds import ledger_texts, longest_text
from vramledger.worker.http.prompt_encoder import SHORT_CHARS, PromptEncoder
from vramledger.worker.memory.device import CpuDevice
from vramledger.worker.memory.profiler import measure_held

pytestmark = pytest.mark.slow  # it measures tokenizing in processes of their own (`make test-fast` leaves it out)

SHIPPED = "worker/assets/tiny-coder-target"
MiB = 1 << 20


@pytest.fixture(scope="module")
def encoder():
    encoder = PromptEncoder()
    encoder.load(SHIPPED)
    yield encoder
    encoder.shutdown()


def test_a_long_prompt_delays_only_itself(encoder):
    long = "def f(x):\n    return x + 1\n" * 40_000  # a million characters: a second or more to tokenize

    async def race() -> list[str]:
        finished = []

        async def encode(name: str, text: str):
            await encoder.prompt(text, max_model_len=10 ** 6)
            finished.append(name)

        first = asyncio.ensure_future(encode("long", long))
        await asyncio.sleep(0.01)  # the long one is on its thread
        await asyncio.gather(encode("short", "def g(y):"), encode("short", "x" * SHORT_CHARS), first)
        return finished

    assert asyncio.run(race()) == ["short", "short", "long"]


def long_words(rng: random.Random, count: int) -> str:
    """`count` words of 120-250 random letters: nearly every word a prompt has is new."""
    return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(120, 250)))
                    for _ in range(count))


def texts_as_long_as_the_bound_lets_through(bound, max_model_len: int) -> dict[str, str]:
    """The ledger's text ("ledger") and others a prompt may be, each as long as the bound lets through."""
    units = bound.max_units(max_model_len)
    rng = random.Random(0)

    def chars(first: int, last: int, count: int) -> str:
        return "".join(chr(rng.randrange(first, last + 1)) for _ in range(count))

    ledger = {f"ledger {i}": text for i, text in enumerate(ledger_texts(bound, max_model_len, 1 << 30))}
    return {**ledger, "spaces": " " * units, "code": ("def f(x):\n    return x + 1\n" * units)[:units],
            "letters": chars(ord("a"), ord("z"), units), "cjk": chars(0x4E00, 0x9FFF, units // 3),
            "cyrillic": chars(0x400, 0x4FF, units // 2), "latin-1 letters": chars(0xC0, 0xFF, units // 2),
            "letter, symbol, letter": "\u0436\u00b7" * (units // 4), "long words": long_words(rng, units // 120)[:units]}


def cost_of_tokenizing(name: str) -> int:
    """Peak memory of tokenizing one of those texts, run in a process of its own: in one that
    tokenized another text first (or ran other tests), the freed heap that left behind hid part of
    the peak, more of a later text's than of an earlier one's."""
    encoder = PromptEncoder()
    encoder.load(SHIPPED)
    max_model_len = 2048
    text = texts_as_long_as_the_bound_lets_through(encoder.bound, max_model_len)[name]
    encoder.bound.check(text, max_model_len, "prompt")  # it may be a prompt: it is tokenized
    cost = measure_held(CpuDevice(), lambda: encoder._encode(text, False), peak=True)
    encoder.shutdown()
    return cost


def cost_in_a_fresh_process(name: str) -> int:
    code = f"import test_prompt_encoder as t; print(t.cost_of_tokenizing({name!r}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                          cwd=Path(__file__).resolve().parent.parent,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.splitlines()[-1])


def test_the_ledger_tokenizes_the_costliest_text_a_prompt_may_have(encoder):
    """Of texts as long as the bound lets through, the costlier of the ledger's (which it tokenizes one
    after another) takes the most memory to tokenize."""
    names = texts_as_long_as_the_bound_lets_through(encoder.bound, 2048)
    # Each process measures its own peak, on one thread: they run together (run_together.py).
    with together({name: functools.partial(cost_in_a_fresh_process, name) for name in names}) as runs:
        costs = {name: run.result() for name, run in runs.items()}
    ledger = max(cost for name, cost in costs.items() if name.startswith("ledger"))
    for name, cost in costs.items():
        assert cost <= ledger + MiB, (name, costs)


def test_prompts_of_distinct_long_words_leave_nothing_behind(encoder):
    """A tokenizer's cache of split words would keep each prompt's words (tens of MiB of them here)."""
    device, rng = CpuDevice(), random.Random(1)
    encoder._encode(long_words(rng, 300), False)
    before = device.process_bytes()
    for _ in range(30):
        encoder._encode(long_words(rng, 300), False)
    assert device.process_bytes() - before < 2 * MiB


def test_a_prompt_refused_after_tokenizing_leaves_its_heap_behind_no_longer(encoder):
    device, max_model_len = CpuDevice(), 2048
    text = longest_text(encoder.bound, max_model_len, 1 << 30)  # passes the bound, too many tokens

    async def refused():
        with pytest.raises(APIError):
            token_ids = await encoder.prompt(text, max_model_len)
            assert len(token_ids) > max_model_len - 1
            raise APIError(400, "too many tokens")  # what admission answers

    before = device.process_bytes()
    for _ in range(5):
        asyncio.run(refused())
    assert device.process_bytes() - before < 2 * MiB
