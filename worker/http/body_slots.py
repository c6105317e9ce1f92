"""A bound on the request bodies the process holds unparsed: each one read takes a slot, from its first
byte until its request is parsed (or answered), so stalled uploads hold at most `size` bodies at the
body limit, which the ledger's `server` entry declares (request_state.py). A request beyond them
waits for a slot without reading its body (intake.py), for at most the body timeout."""
from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

SCOPE_KEY = "vramledger.body_slot"  # where the guard leaves a request's slot for the route that parses it


class BodySlot:
    """One held slot; releasing it twice releases it once."""

    def __init__(self, free: asyncio.Semaphore):
        self._free: asyncio.Semaphore | None = free

    def release(self) -> None:
        if self._free is not None:
            self._free.release()
            self._free = None


class BodySlots:
    def __init__(self, size: int):
        self.size = size
        self._free = asyncio.Semaphore(size)

    async def take(self, timeout: float) -> BodySlot | None:
        """A slot, or None when none came free within `timeout` seconds."""
        try:
            async with asyncio.timeout(timeout):
                await self._free.acquire()
        except TimeoutError:
            return None
        return BodySlot(self._free)


def release_body_slot(scope: MutableMapping[str, Any]) -> None:
    """The route has parsed its body: the slot goes to the next request's body."""
    slot = scope.get(SCOPE_KEY)
    if slot is not None:
        slot.release()
