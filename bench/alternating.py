"""Timing several ways of doing one thing in one process, calls alternating so all see the same load."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def alternate(methods: dict[str, Callable[[], object]], repeats: int, calls: int) -> dict[str, list[float]]:
    """Microseconds per call of each method, one figure per block of `calls` calls, blocks interleaved."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, run in methods.items():
            start = time.perf_counter()
            for _ in range(calls):
                run()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return times


def spread(values: list[float]) -> str:
    """min median max."""
    return f"{min(values):6.0f} {statistics.median(values):6.0f} {max(values):6.0f}"


def ratio(slow: list[float], fast: list[float]) -> float:
    return statistics.median(slow) / statistics.median(fast)
