"""The app's exception handlers and its crash barrier: every refusal, invalid body, unknown path and
crash as an OpenAI error body with a code."""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vramledger.worker.http.errors import APIError, error_body, send_json

log = logging.getLogger(__name__)
UNION_TAGS = ("str", "int", "float", "bool", "TextPart")  # pydantic's union branches in an error's path


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The first of pydantic's errors about a request body as a 400 naming the top-level parameter."""
    first = errors[0]
    kind, loc = first.get("type", ""), [p for p in first.get("loc", ()) if p != "body"]
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                        code="invalid_json")
    if not loc:
        return APIError(400, f"the request body must be a JSON object: {first['msg']}", code="invalid_body")
    path = ".".join(str(p) for p in loc if isinstance(p, int) or ("[" not in p and p not in UNION_TAGS))
    param = str(loc[0])
    if kind == "extra_forbidden":
        return APIError(400, f"unsupported parameter: {path}", param=param, code="unsupported_parameter")
    if kind == "missing":
        return APIError(400, f"missing required parameter: {path}", param=param, code="missing_parameter")
    return APIError(400, f"invalid value for {path}: {first['msg']}", param=param, code="invalid_value")


def api_error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def http_error_code(status: int) -> str:
    """404 -> "not_found", 405 -> "method_not_allowed": the status's own name."""
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return f"http_{status}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return api_error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind, None, http_error_code(exc.status_code)),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))


class CrashBarrier:
    """ASGI layer: an exception nothing handled becomes a 500 `internal_error`, logged once, and the
    connection stays open for the client's next request (an exception let through to the server
    would close it, and log it twice)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("unexpected error on %s %s", scope["method"], scope["path"])
            if not started:  # else the response is cut short: the server closes that connection only
                await send_json(send, 500, error_body("internal server error", "server_error", None,
                                                      "internal_error"))
