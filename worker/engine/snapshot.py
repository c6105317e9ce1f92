"""The engine's state as the server reads it: counts only, published whole after each change.

The engine is not thread-safe: its scheduler, block pool and counters change on the engine thread
in the middle of a step. Other threads (the metrics, /v1/memory, the server's admission) read the
engine's `snapshot` instead: a frozen record the engine thread builds after each step, request added
and request aborted, and publishes by one reference assignment (atomic in CPython). A reader takes
the reference once and reads only that record, so every figure it reports comes from the same moment.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Concatenate, ParamSpec, Protocol, TypeVar

if TYPE_CHECKING:  # the server imports this module: it need not load the engine's parts
    from vramledger.worker.engine.block_manager import BlockManager
    from vramledger.worker.engine.outputs import EngineStats
    from vramledger.worker.engine.scheduler import Scheduler


@dataclass(frozen=True)
class EngineSnapshot:
    """Queue lengths, KV blocks and cumulative counters of the engine after its latest change."""

    requests_running: int
    requests_waiting: int
    blocks_total: int
    blocks_used: int  # held by requests
    blocks_cached: int  # held by none, kept for the prefixes they hold
    preemptions: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, found there
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: tuple[int, ...]  # one count per draft position: K numbers, not a copy of a queue
    current_speculative_tokens: int

    @property
    def blocks_free(self) -> int:
        """Blocks holding nothing."""
        return self.blocks_total - self.blocks_used - self.blocks_cached

    @classmethod
    def of(cls, scheduler: Scheduler, blocks: BlockManager, stats: EngineStats) -> EngineSnapshot:
        """The counts of the engine's parts now (on the engine thread, between changes)."""
        return cls(requests_running=len(scheduler.running),
                   requests_waiting=len(scheduler.waiting), blocks_total=blocks.num_blocks,
                   blocks_used=blocks.num_used, blocks_cached=blocks.num_cached,
                   preemptions=scheduler.num_preemptions, prompt_tokens=stats.prompt_tokens,
                   generation_tokens=stats.generation_tokens, prefix_cache_queries=blocks.queried_tokens,
                   prefix_cache_hits=blocks.hit_tokens, drafts=stats.drafts, draft_tokens=stats.draft_tokens,
                   accepted_tokens=stats.accepted_tokens,
                   accepted_per_position=tuple(stats.accepted_per_position),
                   current_speculative_tokens=stats.current_speculative_tokens)


class Publisher(Protocol):
    def publish_snapshot(self) -> None: ...


P = ParamSpec("P")
R = TypeVar("R")
E = TypeVar("E", bound=Publisher)


def publishes(method: Callable[Concatenate[E, P], R]) -> Callable[Concatenate[E, P], R]:
    """An engine method that changes requests, blocks or counters: the engine publishes a new snapshot
    when it returns (on every return path, so none is missed)."""
    @functools.wraps(method)
    def changed(self: E, *args: P.args, **kwargs: P.kwargs) -> R:
        result = method(self, *args, **kwargs)
        self.publish_snapshot()
        return result
    return changed
