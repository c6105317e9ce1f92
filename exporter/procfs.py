"""Host processes' memory from /proc: each one's RSS and start time, read directly (psutil's
objects cost several times more per process, and a host reader reads every process each scrape),
and its proportional set size (PSS), from /proc/<pid>/smaps_rollup (vramledger/procfs.py reads each,
the readers the vLLM plugin measures its processes with too).

RSS counts a page that n processes share (a library, a fork's copy-on-write pages, shared memory) n
times, so the RSS of a host's processes adds up to more than the host uses; PSS counts 1/n of it in
each. The kernel walks a process's page tables to answer (about 20 ms per GiB resident on a small
host), so a process is read when first seen, then again once its reading is `max_age` seconds old,
stalest first and for at most `budget` seconds of each scrape; in between its PSS follows its RSS
(pages it maps alone, such as new allocations, count fully in both).
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vramledger.procfs import read_pss, read_rss, read_start, read_start_rss

__all__ = ["ProportionalSizes", "children_files", "descendants", "pids", "read_pss", "read_rss", "read_start",
           "read_start_rss"]


def pids(proc_root: str | Path = "/proc") -> Iterator[int]:
    """Every process this pid namespace shows."""
    with os.scandir(proc_root) as entries:
        yield from (int(e.name) for e in entries if e.name.isdigit())


def children_files(proc_root: str | Path = "/proc") -> bool:
    """Whether the kernel lists each thread's children (/proc/<pid>/task/<tid>/children, CONFIG_PROC_CHILDREN)."""
    return os.path.exists(f"{proc_root}/{os.getpid()}/task/{os.getpid()}/children")


def _children(pid: int, proc_root: str | Path) -> list[int]:
    """The processes whose parent is pid: each of its threads lists those it started. Raises
    PermissionError where /proc hides them."""
    try:
        tasks = os.listdir(f"{proc_root}/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
        return []
    found: list[int] = []
    for tid in tasks:
        try:
            fd = os.open(f"{proc_root}/{pid}/task/{tid}/children", os.O_RDONLY)
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        try:
            text = b"".join(iter(lambda: os.read(fd, 65536), b""))
        except ProcessLookupError:
            continue
        finally:
            os.close(fd)
        found.extend(int(child) for child in text.split())
    return found


def descendants(pid: int, proc_root: str | Path = "/proc") -> frozenset[int]:
    """pid and every process below it, read from the children files (children_files()): the tree's
    own processes, where scanning every process's parent costs a read of each process on the host.

    As psutil's children(recursive=True): a process that started before pid is a reused pid, not a
    descendant, and neither is anything below it. frozenset() where pid is gone; raises PermissionError
    where /proc hides its children.
    """
    root_start = read_start(pid, proc_root)
    if root_start is None:
        return frozenset()
    tree, stack = {pid}, [pid]
    while stack:
        for child in _children(stack.pop(), proc_root):
            if child in tree:
                continue
            start = read_start(child, proc_root)
            if start is not None and start >= root_start:
                tree.add(child)
                stack.append(child)
    return frozenset(tree)


@dataclass(frozen=True)
class _Reading:
    started: int  # read_start(): a reused pid is another process
    pss: int | None
    rss: int  # RSS when PSS was read
    at: float


class ProportionalSizes:
    """Each process's PSS now, re-reading smaps_rollup only as often as the scrape can afford."""

    def __init__(self, proc_root: str | Path = "/proc", max_age: float = 30.0, budget: float = 0.005,
                 clock=time.monotonic):
        self._proc_root = proc_root
        self._max_age, self._budget = max_age, budget
        self._clock = clock
        self._known: dict[int, _Reading] = {}

    def sizes(self, processes: dict[int, tuple[int, int]]) -> dict[int, int | None]:
        """PSS of each process given as pid -> (read_start(), RSS now); None where it cannot be read."""
        start = self._clock()
        self._known = {pid: r for pid, r in self._known.items()
                       if pid in processes and r.started == processes[pid][0]}
        for pid in processes.keys() - self._known.keys():
            self._read(pid, *processes[pid])
        stale = sorted((r.at, pid) for pid, r in self._known.items() if start - r.at >= self._max_age)
        for i, (_, pid) in enumerate(stale):
            if i and self._clock() - start >= self._budget:  # one at least, so every reading renews
                break
            self._read(pid, *processes[pid])
        return {pid: self._estimate(self._known[pid], processes[pid][1]) for pid in processes}

    def _read(self, pid: int, started: int, rss: int) -> None:
        self._known[pid] = _Reading(started, read_pss(pid, self._proc_root), rss, self._clock())

    @staticmethod
    def _estimate(reading: _Reading, rss: int) -> int | None:
        if reading.pss is None:
            return None
        return min(rss, max(0, reading.pss + rss - reading.rss))
