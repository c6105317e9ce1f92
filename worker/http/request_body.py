"""A generation request's JSON body: read whole (the guard bounds its size), then parsed by pydantic
straight from its bytes, once a check that no object of it repeats a key has passed (a repeated key
would otherwise take its last value silently: a proxy that read the first would be bypassed).

Not FastAPI's body parameter: that one keeps the raw bytes and a dict of the whole body alive for
as long as the request runs; here only the validated model stays, and the route decides when to
parse (prompt_encoder.py parses and tokenizes a few requests at a time). pydantic's JSON parser also
refuses what no tokenizer can encode (a lone surrogate escape, in any field) as invalid JSON.
"""
from __future__ import annotations

import json
from email.message import Message
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from vramledger.worker.http.error_handlers import validation_error
from vramledger.worker.http.errors import APIError

Body = TypeVar("Body", bound=BaseModel)


async def read_json(request: Request) -> bytes:
    """The body's bytes; 415 when its Content-Type says it is not JSON (none at all is taken as JSON)
    or when it is encoded (the server decodes no Content-Encoding: it would parse the wrong bytes)."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not is_json(content_type):
        raise APIError(415, f"the request body must be JSON sent with Content-Type: application/json "
                       f"(this one is {content_type.split(';')[0].strip() or 'empty'!r})",
                       code="unsupported_media_type")
    encodings = [e.strip() for value in request.headers.getlist("content-encoding") for e in value.split(",")]
    if any(e.lower() not in ("", "identity") for e in encodings):
        raise APIError(415, f"the request body must not be encoded (Content-Encoding: {', '.join(encodings)}); "
                       "send plain JSON", code="unsupported_content_encoding")
    return b"".join([chunk async for chunk in request.stream()])


def parse(raw: bytes, model: type[Body]) -> Body:
    """The body as `model`, or the 400 that says what is wrong with it."""
    check_unique_keys(raw)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None


def check_unique_keys(raw: bytes) -> None:
    """400 when any object of the body, at any depth, has a key twice. json's C scanner reads the body
    and keeps no object (each becomes None once checked), so the check costs a small part of the
    parse; a body it cannot read is left to pydantic, whose error says why."""
    try:
        json.loads(raw, object_pairs_hook=unique_keys)
    except RepeatedKey as exc:
        raise APIError(400, f"the request body repeats the key {exc.key!r} in one object; each key may "
                       "appear once", param=exc.key, code="duplicate_key") from None
    except (ValueError, RecursionError):
        pass  # not JSON that json reads: pydantic refuses it next, saying why


class RepeatedKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def unique_keys(pairs: list[tuple[str, object]]) -> None:
    if len(pairs) > 1 and len({key for key, _ in pairs}) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise RepeatedKey(key)
            seen.add(key)


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
