"""The vLLM names the plugin reaches, one module per vLLM version (major.minor) it supports.

Each module gives a VllmNames: the modules, functions and methods the hooks wrap, how a profile
result is read and rewritten, and every name of vLLM's sources those rely on (`source`), which
tests/test_vllm_versions.py checks against that version's own sources. Supporting a new version is
a module here (usually the previous one's names with what moved replaced) listed in MODULES.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # the gate reads this package in every vLLM process: nothing more is imported there
    from vramledger.vllm_plugin.record import ProfileFacts
    from vramledger.vllm_plugin.versions.source import SourceName

MODULES = {"0.32": "v0_32", "0.33": "v0_33"}  # major.minor: its module here
SUPPORTED_VERSIONS = tuple(MODULES)


@dataclass(frozen=True)
class VllmNames:
    """What the hooks reach in one vLLM version."""

    version: str  # major.minor
    worker_base: tuple[str, str]  # (module, class) whose __init__ every worker runs
    # The worker's start-up calls the plugin wraps per worker, in vLLM's order.
    init_device: str
    size_kv_cache: str  # returns the KV cache's bytes
    allocate_kv_cache: str  # takes the engine core's KV cache config
    capture: str  # the model runner's graph capture, returning the free memory it took
    # The module whose helpers are wrapped where it looks them up: the start snapshot's and the profile's.
    gpu_worker: str
    start_snapshot: str  # called right after vLLM's start snapshot, with it first
    profile: str  # the context manager yielding vLLM's profile result
    cpu_memory: str  # the module with the CPU worker's memory node functions
    profile_facts: Callable[[Any, int | None], ProfileFacts]  # (profile result, process growth)
    # Rewrites a profile result to charge (consumed, non-torch, charged before the KV cache) instead.
    charge: Callable[[Any, int, int, int], None]
    profile_only: Callable[[tuple, dict], bool]  # a capture's (args, kwargs): only measuring, kept nowhere
    source: tuple[SourceName, ...]


def minor_version(version: str) -> str:
    """"0.32" of "0.32.1+cpu"."""
    return ".".join(version.split("+")[0].split(".")[:2])


def names_for(version: str) -> VllmNames | None:
    """The names of this vLLM version, None where the plugin was not built for it."""
    module = MODULES.get(minor_version(version))
    if module is None:
        return None
    return importlib.import_module(f"{__name__}.{module}").NAMES
