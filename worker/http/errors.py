"""How the worker refuses a request: the OpenAI error body, the exception routes raise, and the raw
ASGI answer of the layers in front of the app (the guard, the drain gate).

Plain pydantic and json: the ledger's request state (request_state.py) imports this without FastAPI.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorDetail


# The error responses the OpenAPI schema documents for a route.
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 415, 503)}


class APIError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI-style error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


async def send_json(send, status: int, body: dict, headers: dict | None = None) -> None:
    """A whole JSON response on a raw ASGI `send`, for the layers in front of the app."""
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
