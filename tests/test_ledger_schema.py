"""The ledger document's JSON Schema (vramledger/ledger.schema.json): generated from its one definition
(vramledger/ledger_document.py), and met by what both producers serve: the worker's live GET /v1/memory
and the vLLM plugin's documents (recorded from real vLLM servers in tests/data)."""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import get_args

import httpx
import jsonschema
import pytest

from vramledger import ledger_document, ledger_vocabulary
from vramledger.ledger_document import SCHEMA_FILE, schema_text
from vramledger.ledger_reading import LedgerError, parse_ledger, parse_server_document

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "vramledger" / SCHEMA_FILE
PLUGIN_DOCUMENTS = sorted((ROOT / "tests" / "data").glob("vllm_ledger*.json"))


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SHIPPED.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def worker_document(spec_server) -> dict:
    answer = httpx.get(spec_server.url + "/v1/memory", timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.fixture(scope="module")
def ledger_validator(validator) -> jsonschema.Draft202012Validator:
    """The schema's one-process document alone, so that an error names the field it is about."""
    return jsonschema.Draft202012Validator({"$defs": validator.schema["$defs"], "$ref": "#/$defs/LedgerDocument"})


def errors(validator, document) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def test_the_shipped_schema_is_the_one_generated_from_the_definition():
    assert SHIPPED.read_text() == schema_text(), \
        f"regenerate it: python -m vramledger.ledger_document > vramledger/{SCHEMA_FILE}"


@pytest.mark.parametrize("literal, words", [
    (ledger_document.Version, (ledger_vocabulary.LEDGER_VERSION,)),
    (ledger_document.Component, ledger_vocabulary.COMPONENTS),
    (ledger_document.Scope, (ledger_vocabulary.SCOPE_PROCESS, ledger_vocabulary.SCOPE_DEVICE)),
    (ledger_document.ServerRole, ledger_vocabulary.SERVER_ROLES),
])
def test_the_definitions_words_are_the_vocabularys(literal, words):
    assert get_args(literal) == words


def test_the_definition_imports_without_pydantic():
    """vLLM's processes load vramledger without pydantic being required: only the generator needs it."""
    code = ("import sys; sys.modules['pydantic'] = None; import vramledger.ledger_document as d; "
            "print(d.LedgerDocument.__required_keys__ >= {'entries', 'live'})")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


def test_the_workers_live_ledger_meets_the_schema_and_reads(validator, worker_document):
    assert errors(validator, worker_document) == []
    assert {e["model"] for e in worker_document["entries"]} >= {"target", "draft"}  # a speculating worker's
    assert parse_ledger(worker_document) is worker_document  # its one reader (vramledger/ledger_reading.py)


@pytest.mark.parametrize("path", PLUGIN_DOCUMENTS, ids=lambda p: p.stem)
def test_the_plugins_documents_meet_the_schema_and_read(validator, path):
    document = json.loads(path.read_text())
    assert errors(validator, document) == []
    assert parse_server_document(document) is document
    for rank in document["ranks"]:  # each rank's ledger is a document of its own
        assert errors(validator, rank) == []
        assert parse_ledger(rank) is rank


def test_the_recorded_documents_cover_the_plugins_optional_parts():
    """What the schema is checked against holds the plugin-only fields, with values, not only nulls."""
    ranks = [r for p in PLUGIN_DOCUMENTS for r in json.loads(p.read_text())["ranks"]]
    assert any(r["profile"] is not None for r in ranks)
    assert any(e["in_budget"] is not None and e["scope"] == "device" for r in ranks for e in r["entries"])
    assert any(json.loads(p.read_text()).get("processes") for p in PLUGIN_DOCUMENTS)


def _worker_like(worker_document: dict, change) -> dict:
    document = copy.deepcopy(worker_document)
    change(document)
    return document


@pytest.mark.parametrize("change, where", [
    (lambda d: d.update(declared_bytes=str(d["declared_bytes"])), "declared_bytes"),
    (lambda d: d["entries"][0].update(bytes=float(d["entries"][0]["bytes"]) + 0.5), "entries/0/bytes"),
    (lambda d: d["kv_cache"].update(blocks_total=None), "kv_cache/blocks_total"),
    (lambda d: d["device"].pop("kind"), "device"),
    (lambda d: d["live"].update(unaccounted=0), "live"),  # a field the definition does not have
    (lambda d: d["entries"][0].update(scope="host"), "entries/0/scope"),
    (lambda d: d["entries"][0].update(component="weight"), "entries/0/component"),
    (lambda d: d["device"].update(kind="gpu"), "device/kind"),
    (lambda d: d.update(version=2), "version"),
])
def test_a_wrong_document_is_refused_where_it_is_wrong(validator, ledger_validator, worker_document, change,
                                                      where):
    wrong = _worker_like(worker_document, change)
    assert errors(validator, wrong)
    assert errors(ledger_validator, worker_document) == []
    found = errors(ledger_validator, wrong)
    assert found and all(e.startswith(where + ":") for e in found), found
    if where == "live":  # a field the definition does not have: the schema refuses it, the reader ignores it
        assert parse_ledger(wrong) is wrong
    else:  # the reader refuses it too, naming the same field
        with pytest.raises(LedgerError, match="^" + re.escape(re.sub(r"/(\d+)", r"[\1]", where).replace("/", "."))):
            parse_ledger(wrong)


def test_a_rank_with_a_wrong_type_is_refused_in_a_server_document(validator):
    document = json.loads(PLUGIN_DOCUMENTS[0].read_text())
    document["ranks"][0]["rank"] = "0"
    assert errors(validator, document)
