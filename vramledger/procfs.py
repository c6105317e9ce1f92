"""A host process's memory as /proc gives it: its RSS, its proportional set size (PSS) and its start
time. The exporter's host reader and the vLLM plugin both measure host memory here, so that what a
ledger declares on the CPU and what the exporter observes are the same measure (PSS).

RSS counts a page that n processes share (a library, a fork's copy-on-write pages, shared memory) n
times; PSS counts 1/n of it in each, so the PSS of a host's processes adds up to what they hold.
"""
from __future__ import annotations

import os
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def _read_small(path: str) -> bytes:
    """A /proc file of one short line, in one read(2): the kernel gives such a file whole to a read
    with room for it. Without a Python file object, which costs several times the read itself (the
    exporter's host reader reads these of every process on every scrape)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 4096)  # room for /proc/<pid>/stat with its 52 numbers at their widest
    finally:
        os.close(fd)


def read_rss(pid: int, proc_root: str | Path = "/proc") -> int | None:
    """Resident bytes (as psutil's memory_info().rss); None when the process is gone or hidden."""
    try:
        return int(_read_small(f"{proc_root}/{pid}/statm").split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return None


def _stat_fields(pid: int, proc_root: str | Path) -> list[bytes]:
    """/proc/<pid>/stat's fields from the third on (after "pid (comm)", whose name may hold blanks)."""
    text = _read_small(f"{proc_root}/{pid}/stat")
    return text[text.rindex(b")") + 2:].split()


def read_start(pid: int, proc_root: str | Path = "/proc") -> int | None:
    """When the process started, in clock ticks since boot: with its pid, who it is (pids are reused)."""
    try:
        return int(_stat_fields(pid, proc_root)[19])  # field 22
    except (OSError, IndexError, ValueError):
        return None


def read_start_rss(pid: int, proc_root: str | Path = "/proc") -> tuple[int, int] | None:
    """(read_start(), read_rss()) in one read of stat (fields 22 and 24: its RSS is statm's, the same
    counters summed); None when the process is gone or hidden."""
    try:
        fields = _stat_fields(pid, proc_root)
        return int(fields[19]), int(fields[21]) * PAGE
    except (OSError, IndexError, ValueError):
        return None


def read_pss(pid: int, proc_root: str | Path = "/proc") -> int | None:
    """PSS in bytes; None when the process is gone, hidden (another user's, without privilege) or the
    kernel has no smaps_rollup (before 4.14)."""
    try:
        with open(Path(proc_root) / str(pid) / "smaps_rollup", "rb") as f:
            text = f.read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(b"Pss:"):
            return int(line.split()[1]) * 1024  # kB
    return None


def host_memory(pid: int) -> tuple[int, str] | None:
    """(bytes, measure) of a process: its PSS ("pss"), else its RSS ("rss") where PSS cannot be read,
    as the exporter's host reader measures it; None when the process is gone."""
    pss = read_pss(pid)
    if pss is not None:
        return pss, "pss"
    rss = read_rss(pid)
    return None if rss is None else (rss, "rss")
