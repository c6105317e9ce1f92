"""A generation request's JSON body: read whole (the guard bounds its size), then parsed by pydantic
straight from its bytes.

Not FastAPI's body parameter: that one keeps the raw bytes and a dict of the whole body alive for
as long as the request runs; here only the validated model stays, and the route decides when to
parse (prompt_encoder.py parses and tokenizes a few requests at a time). pydantic's JSON parser also
refuses what no tokenizer can encode (a lone surrogate escape, in any field) as invalid JSON.
"""
from __future__ import annotations

from email.message import Message
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from worker.http.error_handlers import validation_error
from worker.http.errors import APIError

Body = TypeVar("Body", bound=BaseModel)


async def read_json(request: Request) -> bytes:
    """The body's bytes; 415 when its Content-Type says it is not JSON (none at all is taken as JSON)."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not is_json(content_type):
        raise APIError(415, f"the request body must be JSON sent with Content-Type: application/json "
                       f"(this one is {content_type.split(';')[0].strip() or 'empty'!r})",
                       code="unsupported_media_type")
    return b"".join([chunk async for chunk in request.stream()])


def parse(raw: bytes, model: type[Body]) -> Body:
    """The body as `model`, or the 400 that says what is wrong with it."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None


def is_json(content_type: str) -> bool:
    message = Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or
                                                                 subtype.endswith("+json"))


def documented(model: type[BaseModel]) -> dict:
    """The route's `openapi_extra`: the body it parses, as FastAPI documents a body parameter."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def body_schemas(*models: type[BaseModel]) -> dict:
    """The OpenAPI components `documented` refers to, with the models they nest."""
    schemas = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas
