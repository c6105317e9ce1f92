"""The guard in front of the app, a pure ASGI layer so it runs before any body is parsed: the API key
on /v1/* (and /metrics when asked), the request body size limit, and the bounded intake of bodies:
a slot per body held unparsed (body_slots.py) and a time limit to receive one."""
from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable

from vramledger.worker.http.body_slots import SCOPE_KEY, BodySlots
from vramledger.worker.http.errors import error_body, send_json
from vramledger.worker.http.intake import peer
from vramledger.worker.http.settings import ServerSettings

log = logging.getLogger(__name__)
CLOSE = {"connection": "close"}  # the body was not read to its end: the connection cannot carry another


class Guard:
    """Bearer check on /v1/* (constant time), a request body size limit (413): `body_limit()` bytes,
    what a request that fits the model can need (prompt_bounds.py), at most
    `max_receiving_bodies` bodies read and unparsed at once (503 after waiting the body timeout for
    one), and the body timeout to receive one (408)."""

    def __init__(self, app, settings: ServerSettings, body_limit: Callable[[], int]):
        self.app = app
        self.settings = settings
        self.body_limit = body_limit
        self.key = settings.api_key.encode() if settings.api_key else None
        self.slots = BodySlots(settings.max_receiving_bodies)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        protected = path.startswith("/v1/") or (self.settings.protect_metrics and path == "/metrics")
        if self.key is not None and protected and not self._authorized(scope):
            return await send_json(send, 401, error_body("invalid or missing API key (Authorization: Bearer "
                                                         "<key>)", "invalid_request_error", None,
                                                         "invalid_api_key"),
                                   {"www-authenticate": "Bearer"})
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        slot = await self.slots.take(self.settings.body_timeout)
        if slot is None:
            return await send_json(send, 503, error_body(
                f"the server is receiving {self.slots.size} other request bodies; retry later", "server_error",
                None, "server_busy"), {"retry-after": "1", **CLOSE})
        scope[SCOPE_KEY] = slot  # released by the route once it parsed the body, else when the app returns
        try:
            body = await self._read_body(scope, receive, send)
            if body is None:
                return None
            receive, body = replay(body, receive), None  # the app's to drop once parsed
            return await self.app(scope, receive, send)
        finally:
            slot.release()

    def _authorized(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def _read_body(self, scope, receive, send) -> bytes | None:
        """The whole body, or None after answering 413 or 408 (or when the client left)."""
        timeout = self.settings.body_timeout
        try:
            async with asyncio.timeout(timeout):
                return await self._receive_body(scope, receive, send)
        except TimeoutError:
            log.info("%s %s from %s: its body did not arrive within %g s (408)", scope["method"], scope["path"],
                     peer(scope.get("client")), timeout)
            await send_json(send, 408, error_body(f"the request body did not arrive within {timeout:g} s",
                                                  "invalid_request_error", None, "request_timeout"), CLOSE)
            return None

    async def _receive_body(self, scope, receive, send) -> bytes | None:
        limit = self.body_limit()
        too_large = error_body(f"the request body is larger than {limit} bytes, more than any request this "
                               "worker can serve needs", "invalid_request_error", None, "request_too_large")
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:  # refuse before reading it
            await send_json(send, 413, too_large)
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await send_json(send, 413, too_large)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def replay(body: bytes, receive):
    """A receive callable that hands out the buffered body once (keeping no reference to it: a
    running request holds only what was parsed from it), then the client's own messages."""
    buffered: list[bytes] = [body]

    async def replayed():
        if buffered:
            return {"type": "http.request", "body": buffered.pop(), "more_body": False}
        return await receive()

    return replayed
