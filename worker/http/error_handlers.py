"""The app's exception handlers: every refusal, invalid body, unknown path and crash as an OpenAI error body."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from worker.http.errors import APIError, error_body

log = logging.getLogger(__name__)
UNION_TAGS = ("str", "int", "float", "bool", "TextPart")  # pydantic's union branches in an error's path


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem of a request body as a 400 with the offending top-level parameter."""
    first = exc.errors()[0]
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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return api_error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)
