"""How many threads torch computes with on the CPU."""
from __future__ import annotations

import os

import torch


def compute_threads(requested: int | None, environ: dict, cores: int) -> int | None:
    """The thread count to set, or None to keep torch's own (OMP_NUM_THREADS given by the user).

    By default every core but one: the HTTP server, the tokenizer and the clients run beside the
    engine, and OpenMP threads that share a core with them wait at every barrier (a forward
    measured 8x slower on 2 busy cores). vLLM's CPU worker reserves a core the same way.
    """
    if requested is not None:
        return requested
    if environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, cores - 1)


def set_cpu_threads(requested: int | None) -> int:
    """Apply compute_threads to this process; returns the count torch now uses."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = compute_threads(requested, os.environ, cores)
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
