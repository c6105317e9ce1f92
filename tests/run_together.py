"""Child processes that a module's tests each wait on, started together: most of a child's time is its
own imports and setup on one core, so on a machine of two cores two run in the time of one."""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

from vramledger.worker.config import usable_cores

T = TypeVar("T")


def selected_params(request) -> list[dict]:
    """The parameters of each test of the requesting module that this session runs (`-k` and the
    like leave the others out, so their children are never started)."""
    return [item.callspec.params for item in request.session.items
            if item.module is request.module and hasattr(item, "callspec")]


@contextmanager
def together(jobs: dict[Hashable, Callable[[], T]]) -> Iterator[dict[Hashable, Future[T]]]:
    """Every job started at once, as many running as there are cores; each test takes its own result
    (a job's exception is raised there); the block ends once every job has."""
    with ThreadPoolExecutor(usable_cores()) as pool:
        yield {key: pool.submit(job) for key, job in jobs.items()}
