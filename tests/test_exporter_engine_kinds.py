"""The registry of engine kinds: a kind declared by a module, or registered from outside, is in the
exporter's flags, the engines it opens, the Kubernetes watch, the wrong-kind hints and the docs' table
of engines, with nothing else to edit. The toy kind's server is a real one on a real socket; the
Kubernetes API is tests/kube_api.py's."""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from kube_api import Clock, pod
from test_exporter_discovery import NODE, UID, discovered
from test_exporter_hostile_engines import LEDGER, engine_server  # noqa: F401

from vramledger.exporter.cli import build_parser, given_engines, refuse_wrong_kinds
from vramledger.exporter.discovery import PodLocator
from vramledger.exporter.engines import (
    Engines,
    VllmEngine,
    VramledgerEngine,
    parse_engine_arg,
    vllm,
    vramledger,
)
from vramledger.exporter.engines.base import EngineInfo, EngineState, Wrong
from vramledger.exporter.engines.docs_table import DOCS, table, with_table
from vramledger.exporter.engines.fetch import HttpClient, fetch
from vramledger.exporter.engines.kinds import EngineKind
from vramledger.exporter.engines.registry import kind_named, kinds, register, unregister
from vramledger.exporter.engines.wrong_kind import other_kind
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.processes import Locator

TOY_METRICS = b"# TYPE toy_engine_ready gauge\ntoy_engine_ready 1\n"


@dataclass
class ToyEngine:
    """The smallest adapter: its /metrics must carry its own series, else it is wrong (naming the kind
    it is, where it is one)."""
    url: str
    client: HttpClient
    errors: ErrorLog
    locator: Locator | None
    kind = "toy"
    source = "toy"

    def read(self) -> EngineState:
        text = fetch(self.client, self.url + "/metrics").content
        if TOY.signature not in text:
            raise other_kind(self.url, text, TOY) or Wrong(f"{self.url}: no toy series")
        return EngineState(frozenset(), EngineInfo("toy"))

    def close(self) -> None:
        pass


TOY = EngineKind(name="toy", flag="--toy", title="a toy server", source="toy", adapter=ToyEngine,
                 signature=b"toy_engine_ready", declares="nothing: a toy", flags="nothing", port=9100)


@pytest.fixture
def toy():
    register(TOY)
    yield TOY
    unregister(TOY.name)


def test_the_modules_kinds_are_found_and_the_toy_only_while_registered(toy):
    assert {vramledger.KIND, vllm.KIND, toy} <= set(kinds())
    assert kind_named("toy") is toy and kind_named("vllm") is vllm.KIND
    unregister("toy")
    assert kind_named("toy") is None and toy not in kinds()
    register(toy)


def test_a_kind_with_a_taken_name_or_flag_is_refused(toy):
    with pytest.raises(ValueError, match="clashes with toy"):
        register(replace(TOY, flag="--toy2"))
    with pytest.raises(ValueError, match="clashes with vramledger"):
        register(replace(TOY, name="toy2", flag="--worker"))
    assert kind_named("toy2") is None


def test_the_toy_kind_has_its_flag_and_its_engines_are_opened(toy):
    args = build_parser().parse_args(["--toy", "http://a:9000/v1", "--toy", "http://b:9000=7",
                                      "--worker", "http://w:8000"])
    given = given_engines(args)
    assert given["toy"] == ["http://a:9000/v1", "http://b:9000=7"] and given["vramledger"] == ["http://w:8000"]
    # The toy takes no pid: "=7" is part of its URL, as for our worker.
    assert parse_engine_arg(toy, "http://b:9000=7") == ("http://b:9000=7", None)
    engines = Engines.open(given, 1.0, ErrorLog())
    try:
        by_url = {e.url: e for e in engines.engines}
        assert set(by_url) == {"http://a:9000", "http://b:9000=7", "http://w:8000"}
        assert isinstance(by_url["http://a:9000"], ToyEngine) and by_url["http://a:9000"].locator is None
        assert isinstance(by_url["http://w:8000"], VramledgerEngine)
        assert set(engines.sources) == {"toy", "worker"}
    finally:
        engines.close()
    unregister("toy")
    with pytest.raises(SystemExit):  # a kind no longer registered has no flag
        build_parser().parse_args(["--toy", "http://a:9000"])


def test_a_vllm_pid_is_taken_by_its_flag():
    engines = Engines.open({"vllm": ["http://127.0.0.1:8001=4242"]}, 1.0, ErrorLog())
    try:
        [engine] = engines.engines
        assert isinstance(engine, VllmEngine) and engine.url == "http://127.0.0.1:8001"
        assert engine._locator.listeners() == {4242}
    finally:
        engines.close()


def test_a_pod_labelled_with_the_toy_kind_gets_its_adapter(api, toy):
    errors = ErrorLog()
    # No vramledger.io/port annotation: the toy's own default port.
    api.pods[:] = [pod("toy-0", "inference", NODE, uid=UID, ip="10.244.1.40", labels={"vramledger.io/engine": "toy"}),
                   pod("other-0", "inference", NODE, ip="10.244.1.41", labels={"vramledger.io/engine": "nope"})]
    engines = discovered(api, Clock(), errors)
    try:
        engines._update(engines._pods.engines())
        [adapter] = engines._engines.engines
        assert isinstance(adapter, ToyEngine) and adapter.url == "http://10.244.1.40:9100"
        assert isinstance(adapter.locator, PodLocator) and adapter.locator.pod_uid == UID
        assert "toy" in engines.sources
    finally:
        engines.close()


def test_a_toy_server_watched_as_a_worker_is_refused_naming_the_toy_flag(engine_server, toy):  # noqa: F811
    url = engine_server({"/metrics": TOY_METRICS})
    errors = ErrorLog()
    client = HttpClient(5)
    engines = Engines([VramledgerEngine(url, client, errors)], errors, client, timeout=5)
    try:
        with pytest.raises(ValueError) as refused:
            refuse_wrong_kinds(engines)
        assert str(refused.value) == (f"{url} is a toy server, not a vramledger worker: watch it with --toy {url} "
                                      "(in a cluster: pod label vramledger.io/engine: toy)")
    finally:
        engines.close()


def test_a_worker_watched_as_a_toy_names_the_worker_flag(engine_server, toy):  # noqa: F811
    # This process serves the ledger and the worker's identity series, as a worker does.
    url = engine_server({"/v1/memory": LEDGER, "/metrics": b'vramledger_serving_info{version="1"} 1\n'})
    errors = ErrorLog()
    client = HttpClient(5)
    engines = Engines([ToyEngine(url, client, errors, None)], errors, client, timeout=5)
    try:
        reading = engines.read()[url]
        assert (reading.status.value, reading.wrong_kind) == ("wrong", True)
        assert f"watch it with --worker {url} (in a cluster: pod label vramledger.io/engine: vramledger)" in (
            reading.reason)
        assert errors.counts() == {"toy": 1}
    finally:
        engines.close()


def test_a_text_with_no_known_signature_gets_no_hint(toy):
    assert other_kind("http://x", b"something_else 1\n", vramledger.KIND) is None
    # Its own signature is no hint either: the adapter itself found its text wrong.
    assert other_kind("http://x", TOY_METRICS, toy) is None


def test_the_docs_table_is_generated_from_the_kinds(toy):
    docs = DOCS.read_text()
    generated = table()
    assert "| a toy server | `--toy URL` | `vramledger.io/engine: toy` (9100) | nothing: a toy | nothing |" in generated
    assert "| a vLLM server | `--vllm URL[=PID]` | `vramledger.io/engine: vllm` (8000) |" in generated
    # docs/exporter.md holds the table of the kinds this package declares: python -m
    # vramledger.exporter.engines.docs_table writes it.
    unregister("toy")
    assert with_table(docs, table()) == docs, "stale: run python -m vramledger.exporter.engines.docs_table"
