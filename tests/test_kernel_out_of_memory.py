"""A C kernel whose scratch cannot be allocated raises MemoryError naming it, in Python, instead of
writing through a null pointer: each case runs the shipped build in a child process (scratch_denied.py)
whose address space is capped just above what it holds, on inputs that make the scratch large. With
two threads whose scratch only one of them gets, the one that got it is not left waiting."""
from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Hashable
from concurrent.futures import Future
from pathlib import Path

import pytest
from run_together import selected_params, together

from vramledger.worker.kernels import native

pytestmark = pytest.mark.slow  # it starts processes (`make test-fast` leaves it out)

CHILD = Path(__file__).with_name("scratch_denied.py")
FORWARD = "decoder_forward"
needs_kernels = pytest.mark.skipif(native.isa() is None, reason="no AVX-512 or AVX2 here")


def denied(kernel: str, threads: int, margin_mb: int, *extra: str) -> str:
    proc = subprocess.run([sys.executable, str(CHILD), kernel, str(threads), str(margin_mb), *extra],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"the child ended with {proc.returncode}: {proc.stderr[-2000:]}"
    return proc.stdout


def case(params: dict) -> tuple[str, int, int]:
    """A test's child: kernel, threads, margin (the forward's test is parametrized by its threads alone)."""
    return params.get("kernel", FORWARD), params["threads"], params.get("margin_mb", 64)


@pytest.fixture(scope="module")
def children(request):
    """The child of every test here that this session runs, all started with the module's first
    (run_together.py): each caps only its own address space."""
    cases = sorted({case(params) for params in selected_params(request)})
    forward = [request.getfixturevalue("checkpoints")["llama"]] if any(c[0] == FORWARD for c in cases) else []
    with together({c: functools.partial(denied, *c, *(forward if c[0] == FORWARD else [])) for c in cases}) as runs:
        yield runs


def output(children: dict[Hashable, Future[str]], kernel: str, threads: int, margin_mb: int) -> str:
    return children[kernel, threads, margin_mb].result()


@needs_kernels
@pytest.mark.parametrize(("kernel", "threads", "margin_mb"), [
    ("paged_attention", 1, 64),  # scratch: ~545 MB a thread
    ("paged_attention", 2, 800),  # room for one thread's scratch, not both
    ("prefill_attention", 2, 64),  # ~290 MB a thread
    ("draw_tokens", 1, 16),  # ~68 MB
    ("verify_tokens", 1, 16),  # ~68 MB
])
def test_a_kernel_without_scratch_raises_memory_error_and_the_process_goes_on(children, kernel, threads, margin_mb):
    out = output(children, kernel, threads, margin_mb)
    assert f"raised: MemoryError: the {kernel} kernel ran out of memory" in out
    assert "same after" in out


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_the_forward_stops_and_raises_when_its_attention_has_no_scratch(children, threads):
    out = output(children, FORWARD, threads, 64)  # the checkpoint's scratch: ~260 MB a thread
    assert "raised: MemoryError: the decoder_forward kernel ran out of memory" in out
    assert "same after" in out
