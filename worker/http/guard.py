"""The guard in front of the app, a pure ASGI layer so it runs before any body is parsed: the API key
on /v1/* (and /metrics when asked) and the request body size limit."""
from __future__ import annotations

import hmac
from collections.abc import Callable

from worker.http.errors import error_body, send_json
from worker.http.settings import ServerSettings


class Guard:
    """Bearer check on /v1/* (constant time) and a request body size limit (413): `body_limit()`
    bytes, what a request that fits the model can need (prompt_bounds.py)."""

    def __init__(self, app, settings: ServerSettings, body_limit: Callable[[], int]):
        self.app = app
        self.settings = settings
        self.body_limit = body_limit
        self.key = settings.api_key.encode() if settings.api_key else None

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
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(scope, receive, send)
            if body is None:
                return None
            receive, body = replay(body, receive), None  # the app's to drop once parsed
        return await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def _read_body(self, scope, receive, send) -> bytes | None:
        """The whole body, or None after answering 413 (or when the client left)."""
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
