"""The one reader of the ledger document: what arrives as JSON is checked against its definition
(ledger_document.py) before anyone reads a field of it, so every reader (the exporter's worker and vLLM
adapters, the worker's own /metrics, selfcheck's scenarios on workers) reads typed fields and none checks
a field again.

Each field given is checked against its type and bound (ledger_bounds.py: no negative or absurd figure,
no pid the kernel never gives, no label with a newline); a field the definition does not name is
ignored (a newer producer's). What readers cannot do without must be there (NEEDED); any other field
may be left out, as a minimal producer's document does, and then reads as absent. Whatever is wrong
raises LedgerError, naming the field and its value, clipped; nothing else escapes. A value beyond its
bound raises BeyondBounds, a LedgerError that is also an OutOfBounds: the exporter tells a document
that is no ledger (a vLLM without the plugin's route, say) from an engine saying what cannot be.
"""
from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union, cast, get_args, get_origin

from typing_extensions import NotRequired, Required, get_type_hints, is_typeddict

from vramledger.ledger_bounds import BOUNDS, Bound, OutOfBounds, shown
from vramledger.ledger_document import (
    DeviceDoc,
    EntryDoc,
    LedgerDocument,
    ProcessIdentityDoc,
    ServerDocument,
    ServerProcessDoc,
)

# What a reader cannot do without, per part of the document.
NEEDED: dict[type, tuple[str, ...]] = {
    LedgerDocument: ("version", "worker", "device", "declared_bytes"),
    ProcessIdentityDoc: ("pid",),
    DeviceDoc: ("kind",),
    EntryDoc: ("component", "model", "bytes"),
    ServerDocument: ("version", "engine", "ranks"),
    ServerProcessDoc: ("role", "pid", "bytes"),
}
RANK_NEEDED = ("rank", "entries")  # a server's ranks are told apart by their number, declare by their entries

Check = Callable[[object], None]  # raises _Fault for a wrong value


class LedgerError(ValueError):
    """A document that is not a ledger of docs/ledger.md; the message says which field is wrong."""


class BeyondBounds(LedgerError, OutOfBounds):
    """A ledger saying what no engine could truthfully say: not a malformed document but a false one."""


class _Fault(Exception):
    """A wrong value: its error is made once it has passed up through the objects and lists around it, so
    that a place in the document is spelt only where a value is wrong, not for every value read."""

    def __init__(self, error: Callable[[str], LedgerError]):
        super().__init__()
        self.error = error  # the error, given the value's place
        self.path: list[str | int] = []  # the keys and indices leading to it, innermost first


def _check(hint: Any, document: object) -> None:
    """Raises the LedgerError of the first wrong value of the document."""
    try:
        _checker(hint)(document)
    except _Fault as fault:
        where = ""
        for step in reversed(fault.path):
            where = f"{where}[{step}]" if isinstance(step, int) else _at(where, step)
        raise fault.error(where) from None


def parse_ledger(document: object) -> LedgerDocument:
    """One process's ledger (a worker's GET /v1/memory, or one rank's), checked; raises LedgerError."""
    _check(LedgerDocument, document)
    return cast(LedgerDocument, document)


def parse_server_document(document: object) -> ServerDocument:
    """A vLLM server's GET /vramledger/memory, every rank's ledger in it checked; raises LedgerError."""
    _check(ServerDocument, document)
    doc = cast(ServerDocument, document)
    for i, rank in enumerate(doc["ranks"]):
        for key in RANK_NEEDED:
            if key not in rank:
                raise LedgerError(f"ranks[{i}].{key} is missing")
    return doc


@functools.cache
def _checker(hint: Any) -> Check:
    """The check of a value of the type, built once per type: a document is read on every scrape."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Annotated:
        return _bounded(_checker(args[0]), [b for b in hint.__metadata__ if isinstance(b, BOUNDS)])
    if origin in (Union, types.UnionType):
        [given] = [a for a in args if a is not type(None)]  # the definition's unions: a type, or null
        return _nullable(_checker(given)) if type(None) in args else _checker(given)
    if is_typeddict(hint):
        return _object(hint)
    if origin is list:
        return _list(_checker(args[0]), hint)
    return _scalar(hint)


def _bounded(check: Check, bounds: list[Bound]) -> Check:
    def bounded(value: object) -> None:
        for bound in bounds:  # first: a text no label could hold is false, whatever it should name
            if not bound.holds(value):
                raise _Fault(lambda where: BeyondBounds(f"{where} {shown(value)} is not {bound}"))
        check(value)
    return bounded


def _nullable(check: Check) -> Check:
    def nullable(value: object) -> None:
        if value is not None:
            check(value)  # the one type it may have: its own error says what is wrong inside it
    return nullable


def _object(typed_dict: type) -> Check:
    fields = [(key, _checker(field)) for key, field in _fields(typed_dict).items()]
    needed = NEEDED.get(typed_dict, ())

    def checked(value: object) -> None:
        if not isinstance(value, dict):
            raise _wrong(value, typed_dict)
        for key in needed:
            if key not in value:
                raise _Fault(lambda where: LedgerError(f"{_at(where, key)} is missing"))
        for key, check in fields:
            if key in value:
                try:
                    check(value[key])
                except _Fault as fault:
                    fault.path.append(key)
                    raise
    return checked


def _list(check: Check, hint: Any) -> Check:
    def items(value: object) -> None:
        if not isinstance(value, list):
            raise _wrong(value, hint)
        for i, item in enumerate(value):
            try:
                check(item)
            except _Fault as fault:
                fault.path.append(i)
                raise
    return items


def _scalar(hint: Any) -> Check:
    words = get_args(hint) if get_origin(hint) is Literal else None

    def scalar(value: object) -> None:
        if words is not None:
            holds = any(type(value) is type(word) and value == word for word in words)  # True is no 1
        elif hint is float:  # JSON writes 1.0 as 1; NaN and Infinity are Python's, no JSON number
            holds = type(value) in (int, float) and math.isfinite(value)  # type: ignore[arg-type]
        else:
            holds = type(value) is hint  # int, str, bool: a bool is no int
        if not holds:
            raise _wrong(value, hint)
    return scalar


@functools.cache
def _fields(typed_dict: type) -> dict[str, Any]:
    """A TypedDict's fields and their types, bounds kept, NotRequired taken off."""
    fields = get_type_hints(typed_dict, include_extras=True)
    return {key: get_args(f)[0] if get_origin(f) in (NotRequired, Required) else f for key, f in fields.items()}


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _wrong(value: object, hint: Any) -> _Fault:
    return _Fault(lambda where: LedgerError(f"{where or 'the document'} {shown(value)} is not {_named(hint)}"))


NAMES = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false", type(None): "null"}


def _named(hint: Any) -> str:
    """What a value of the type is, in a few words."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin is list:
        return "a list"
    return "an object" if is_typeddict(hint) else NAMES[hint]
