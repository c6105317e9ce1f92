"""A process as a device reader sees it: its pid, its name and the memory it holds there."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessMemory:
    """Memory one process holds on a device; bytes is None when the device cannot say."""

    pid: int
    name: str
    bytes: int | None
    measure: str  # what bytes is: "nvml" (used GPU memory), "pss" or "rss" (host memory)
