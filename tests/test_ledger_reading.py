"""The ledger document's one reader (vramledger/ledger_reading.py): every field of the definition given a
value of another type, or one beyond its bound, is refused, naming that field; whatever a hostile
engine puts anywhere is refused with LedgerError, never another exception.

The documents read are the example of docs/ledger.md (a worker's) and the vLLM plugin's recorded
server documents (tests/data), which between them give every field of the definition; that the live
worker's and the plugin's documents read is shown beside the schema (tests/test_ledger_schema.py)."""
from __future__ import annotations

import copy
import json
import math
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pytest
from test_exporter_workers import documented_ledger
from typing_extensions import is_typeddict

from vramledger.ledger_bounds import MAX_LABEL, Most, OutOfBounds, Within
from vramledger.ledger_document import LedgerDocument, ServerDocument
from vramledger.ledger_reading import BeyondBounds, LedgerError, _fields, parse_ledger, parse_server_document

ROOT = Path(__file__).resolve().parents[1]
UNIONS = (Union, types.UnionType)  # Annotated[int, ...] | None is a typing.Union, str | None a UnionType


def plugin_document() -> dict:
    """A recorded plugin document with a profile and a sizing, and the CPU server's other processes."""
    cuda, cpu = (json.loads((ROOT / "tests" / "data" / f"{name}.json").read_text())
                 for name in ("vllm_ledger_cuda_neighbour", "vllm_ledger"))
    return cuda | {"processes": cpu["processes"]}


DOCUMENTS = {LedgerDocument: documented_ledger(), ServerDocument: plugin_document()}


def fields(value: Any, hint: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any, Any]]:
    """(path, type, the part it is a field of) of every field given in the document, list items too."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Annotated:
        yield from fields(value, args[0], path)
    elif origin in UNIONS:
        given = [a for a in args if a is not type(None)]
        if value is not None and len(given) == 1:
            yield from fields(value, given[0], path)
    elif is_typeddict(hint):
        for key, field in _fields(hint).items():
            if key in value:
                yield (*path, key), field, hint
                yield from fields(value[key], field, (*path, key))
    elif origin is list:
        for i, item in enumerate(value):
            yield (*path, i), args[0], list
            yield from fields(item, args[0], (*path, i))


def named(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def changed(document: dict, path: tuple, value: Any) -> dict:
    wrong = copy.deepcopy(document)
    place = wrong
    for key in path[:-1]:
        place = place[key]
    place[path[-1]] = value
    return wrong


def base(hint: Any) -> Any:
    """The type under a field's bound and null."""
    if get_origin(hint) is Annotated:
        return base(get_args(hint)[0])
    if get_origin(hint) in UNIONS:
        return base(next(a for a in get_args(hint) if a is not type(None)))
    return hint


def another_type(hint: Any) -> Any:
    """A JSON value no field of this type holds."""
    kind = base(hint)
    if get_origin(kind) is Literal:
        return "none of its words" if isinstance(get_args(kind)[0], int) else 7
    if is_typeddict(kind) or get_origin(kind) is list:
        return "an object or a list, as a string"
    return {int: 1.5, float: "1.5", str: 7, bool: "true"}[kind]


def bounds(hint: Any) -> list[Any]:
    """The bounds on a field (of its type, null or not)."""
    if get_origin(hint) is Annotated:
        return [*hint.__metadata__, *bounds(get_args(hint)[0])]
    if get_origin(hint) in UNIONS:
        return [b for a in get_args(hint) for b in bounds(a)]
    return []


def beyond(bound: Any) -> list[Any]:
    if isinstance(bound, Within):
        return [bound.low - 1, bound.high + 1] if isinstance(bound.low, int) else [-0.5, bound.high * 2]
    if isinstance(bound, Most):  # its length is checked before its items
        return [[None] * (bound.items + 1)]
    return ["two\nlines", "x" * (MAX_LABEL + 1)]


def parse(kind: Any, document: object) -> object:
    return parse_ledger(document) if kind is LedgerDocument else parse_server_document(document)


def cases(make) -> list:
    return [pytest.param(kind, path, value, id=f"{kind.__name__}:{named(path)}={value!r:.20}")
            for kind, document in DOCUMENTS.items() for path, hint, _ in fields(document, kind)
            for value in make(hint)]


def test_the_documents_read_give_every_field_of_the_definition():
    """Else a field could be wrongly read and no case below would show it."""
    given = {(part, path[-1]) for kind, doc in DOCUMENTS.items() for path, _, part in fields(doc, kind)}
    defined: set = set()

    def walk(hint: Any) -> None:
        hint = base(hint)
        if get_origin(hint) is list:
            walk(get_args(hint)[0])
        elif is_typeddict(hint) and not any(part is hint for part, _ in defined):
            defined.update((hint, key) for key in _fields(hint))
            for field in _fields(hint).values():
                walk(field)
    walk(LedgerDocument)
    walk(ServerDocument)
    assert {(part.__name__, key) for part, key in defined - given} == set()


@pytest.mark.parametrize("kind, path, value", cases(lambda hint: [another_type(hint)]))
def test_a_field_of_another_type_is_refused_by_name(kind, path, value):
    document = DOCUMENTS[kind]
    with pytest.raises(LedgerError) as e:
        parse(kind, changed(document, path, value))
    assert str(e.value).startswith(named(path) + " "), e.value
    assert not isinstance(e.value, OutOfBounds)  # malformed, not false: its type is wrong, not its value


@pytest.mark.parametrize("kind, path, value", cases(lambda hint: [v for b in bounds(hint) for v in beyond(b)]))
def test_a_field_beyond_its_bound_is_refused_by_name(kind, path, value):
    document = DOCUMENTS[kind]
    with pytest.raises(BeyondBounds) as e:
        parse(kind, changed(document, path, value))
    assert str(e.value).startswith(named(path) + " "), e.value
    assert len(str(e.value)) < 200 and "\n" not in str(e.value)  # the value named, clipped


HOSTILE = [None, True, -1, 0, 10 ** 400, math.nan, math.inf, "", "x" * 100_000, [], {}, [[[]]], {"version": 1}]


@pytest.mark.parametrize("kind, path", [pytest.param(kind, path, id=f"{kind.__name__}:{named(path)}")
                                        for kind, doc in DOCUMENTS.items() for path, _, _ in fields(doc, kind)])
def test_whatever_a_field_holds_a_reader_gets_a_document_or_ledger_error(kind, path):
    for value in HOSTILE:
        try:
            parse(kind, changed(DOCUMENTS[kind], path, value))
        except LedgerError as e:
            assert len(str(e)) < 300
        # Nothing else escapes: any other exception fails this test.


@pytest.mark.parametrize("value", HOSTILE + [[documented_ledger()], "ledger", 1])
@pytest.mark.parametrize("kind", [LedgerDocument, ServerDocument])
def test_a_document_that_is_no_ledger_is_refused(kind, value):
    with pytest.raises(LedgerError):
        parse(kind, value)


@pytest.mark.parametrize("path", [("version",), ("worker",), ("device",), ("declared_bytes",), ("worker", "pid"),
                                  ("device", "kind")], ids=named)
def test_what_a_reader_needs_must_be_there(path):
    document = documented_ledger()
    place = document
    for key in path[:-1]:
        place = place[key]
    del place[path[-1]]
    with pytest.raises(LedgerError, match=f"^{named(path)} is missing"):
        parse_ledger(document)


@pytest.mark.parametrize("key", ["rank", "entries"])
def test_a_servers_rank_needs_its_number_and_its_entries(key):
    document = plugin_document()
    del document["ranks"][0][key]
    parse_ledger(document["ranks"][0])  # alone, a ledger still
    with pytest.raises(LedgerError, match=rf"^ranks\[0\]\.{key} is missing"):
        parse_server_document(document)


def test_a_minimal_document_reads_and_its_absent_parts_read_as_absent():
    # What a producer must give: the exporter's joins need no more (tests/test_exporter_nvml.py's ledgers).
    minimal = {"version": 1, "worker": {"pid": 4242}, "device": {"kind": "cpu"}, "declared_bytes": 0}
    doc = parse_ledger(minimal | {"a field a newer producer adds": [1, 2]})
    assert doc["declared_bytes"] == 0 and doc.get("kv_cache") is None and doc["worker"].get("host_pid") is None
