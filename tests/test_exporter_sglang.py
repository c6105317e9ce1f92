"""An SGLang server (it needs a GPU: a fake serving SGLang's own shapes, tests/engine_shapes.py) watched by
the adapter over a real socket: its ledger per rank in 2^30-byte GB, its KV usage, its processes found
behind its port, its lifecycle and values beyond bounds."""
from __future__ import annotations

import math

import pytest
from engine_shapes import MODEL, sglang_memory, sglang_metrics, sglang_server_info
from fake_engines import FakeEngine, of_engine, owned
from fake_pynvml import FakeGpu, GiB, proc
from test_exporter_host import spawn  # noqa: F401
from test_exporter_nvml import exporter, scrape

from vramledger.exporter.engines import read_one
from vramledger.exporter.engines.base import EngineInfo, EngineState, Status
from vramledger.exporter.engines.fetch import HttpClient
from vramledger.exporter.engines.sglang import GIB, KIND, parse_server_info
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.sources import HOST, DeviceMemory

GPU = DeviceMemory("0", "GPU-0", "gpu", 80 * GiB, 0, 80 * GiB, None, ())
HOST_MEMORY = DeviceMemory(HOST, "", "host", 64 * GiB, 0, 64 * GiB, None, ())


def sglang(spawn, tmp_path, routes, children=2) -> FakeEngine:  # noqa: F811
    return FakeEngine(spawn, tmp_path, routes, children=children)


def adapter(url: str, errors: ErrorLog | None = None):
    return KIND.adapter(url, HttpClient(5), errors or ErrorLog(), None)


def test_a_rank_declares_its_weights_kv_cache_and_graphs_in_2_30_byte_gb():
    info = parse_server_info(sglang_server_info(sglang_memory(weight=14.99, kvcache=52.3, graph=0.45)))
    [rank] = info.ranks
    # SGLang's GB is 2^30 bytes (free memory / (1 << 30); GB = 1024 * 1024 * 1024): not 10^9.
    assert GIB == 1 << 30
    assert {e.component: e.bytes for e in rank.entries} == {
        "weights": round(14.99 * GIB), "kv_cache": round(52.3 * GIB), "cuda_graph": round(0.45 * GIB)}
    assert rank.declared_bytes == round(14.99 * GIB) + round(52.3 * GIB) + round(0.45 * GIB)
    assert (rank.device_kind, rank.device_uuid) == ("cuda", None)  # SGLang names no GPU
    assert (info.version, info.model, info.token_capacity) == ("0.5.3", MODEL, 428_000)


def test_older_shapes_cuda_graph_and_no_weights():
    older = parse_server_info(sglang_server_info(sglang_memory(graph=0.5, graph_key="cuda_graph")))
    assert {e.component for e in older.ranks[0].entries} == {"weights", "kv_cache", "cuda_graph"}
    # Before weights were in the internal state: its budget is all it gives, and that is declared.
    oldest = {"kvcache": 52.3, "token_capacity": 428_000}
    info = parse_server_info(sglang_server_info(oldest, mem_fraction_static=0.88))
    assert info.ranks == () and info.mem_fraction_static == 0.88


def test_tensor_parallel_ranks_each_declare_on_one_gpu():
    info = parse_server_info(sglang_server_info(sglang_memory(), sglang_memory(), tp_size=2, dp_size=2))
    assert [r.rank for r in info.ranks] == [0, 1, 2, 3]  # two data-parallel ranks of two GPUs each
    assert info.token_capacity == 2 * 428_000  # each data-parallel rank has its own KV cache
    one = info.ranks[0].declared_bytes
    state = EngineState(frozenset([1]), EngineInfo("sglang"), ranks=info.ranks)
    assert state.declared_on(GPU) == one  # one rank per GPU: never the sum of all
    assert state.declared_total([GPU]) == 4 * one
    assert state.declared_on(HOST_MEMORY) is None


def test_the_server_over_a_socket_its_processes_and_kv_usage(spawn, tmp_path):  # noqa: F811
    fake = sglang(spawn, tmp_path, {"/get_server_info": sglang_server_info(sglang_memory()),
                                    "/metrics": sglang_metrics(0.25, 0.625)})
    errors = ErrorLog()
    reading = read_one(adapter(fake.url, errors))
    assert reading.status is Status.SERVING, reading.reason
    state = reading.state
    assert state.pids == fake.tree  # the process behind its port and its children (its schedulers)
    assert state.kv_usage == 0.625  # the fullest scheduler
    assert (state.info.kind, state.info.version, state.info.model) == ("sglang", "0.5.3", MODEL)
    assert state.token_capacity == 428_000 and errors.counts() == {}


def test_without_metrics_no_kv_usage_and_nothing_counted(spawn, tmp_path):  # noqa: F811
    fake = sglang(spawn, tmp_path, {"/get_server_info": sglang_server_info(sglang_memory())}, children=0)
    errors = ErrorLog()
    engine = adapter(fake.url, errors)
    states = [read_one(engine).state, read_one(engine).state]
    assert [s.kv_usage for s in states] == [None, None] and errors.counts() == {}
    assert states[0].ranks[0].declared_bytes > 0


def test_the_exporter_declares_per_rank_and_flags_what_sglang_does_not_name(monkeypatch, spawn,  # noqa: F811
                                                                            tmp_path):
    fake = sglang(spawn, tmp_path, {"/get_server_info": sglang_server_info(sglang_memory(), sglang_memory(),
                                                                           tp_size=1, dp_size=2),
                                    "/metrics": sglang_metrics(0.5, 0.25)})
    [s0, s1] = fake.children
    declared = round(14.99 * GIB) + round(52.3 * GIB) + round(0.45 * GIB)
    # Each scheduler holds its three figures and a CUDA context SGLang does not name; a trainer shares GPU 1.
    gpus = [FakeGpu("GPU-0", allocated=70 * GiB, processes=[proc(s0, "sglang::scheduler_DP0", 69)]),
            FakeGpu("GPU-1", allocated=75 * GiB, processes=[proc(s1, "sglang::scheduler_DP1", 68.5),
                                                            proc(999, "trainer", 6)])]
    client = HttpClient(5)
    registry, _ = exporter(monkeypatch, gpus, {}, engines=[lambda errors: KIND.adapter(fake.url, client, errors,
                                                                                      None)])
    values, errors = scrape(registry)
    series = of_engine(values, fake.url)
    assert series[("declared_memory_bytes", ())] == 2 * declared
    assert series[("unaccounted_memory_bytes", (("device", "0"),))] == 69 * GiB - declared
    assert series[("unaccounted_memory_bytes", (("device", "1"),))] == int(68.5 * GiB) - declared
    assert series[("kv_cache_usage_ratio", ())] == 0.5
    assert series[("token_capacity", ())] == 2 * 428_000
    assert series[("memory_bytes", (("component", "kv_cache"), ("model", ""), ("rank", "1")))] == round(52.3 * GIB)
    assert owned(values, fake.url) == {s0: 69 * GiB, s1: int(68.5 * GiB)}  # the trainer is not SGLang's
    assert errors["sglang"] == 0
    client.close()


def test_loading_down_and_back_as_another_version(spawn, tmp_path):  # noqa: F811
    fake = sglang(spawn, tmp_path, {"/get_server_info": (503, {"error": "starting"})}, children=0)
    engine = adapter(fake.url)
    assert read_one(engine).status is Status.LOADING
    fake.serve({"/get_server_info": sglang_server_info(sglang_memory(), version="0.5.3")})
    assert read_one(engine).state.info.version == "0.5.3"
    fake.serve({"/get_server_info": (503, {"error": "restarting"})})
    reading = read_one(engine)
    assert reading.status is Status.LOADING and not reading.counted  # a restart is no error
    fake.serve({"/get_server_info": sglang_server_info(sglang_memory(), version="0.5.4")})
    assert read_one(engine).state.info.version == "0.5.4"  # read anew: not the cached one
    fake.proc.kill()
    fake.proc.wait(timeout=10)
    reading = read_one(engine)
    assert reading.status is Status.UNREACHABLE and not reading.counted


@pytest.mark.parametrize("doc", [
    {"status": "ok"},  # another server's JSON
    sglang_server_info(sglang_memory(weight="15 GB")),
    sglang_server_info(sglang_memory(), tp_size="2"),
])
def test_another_shape_is_wrong_and_counted(spawn, tmp_path, doc):  # noqa: F811
    fake = sglang(spawn, tmp_path, {"/get_server_info": doc}, children=0)
    reading = read_one(adapter(fake.url))
    assert reading.status is Status.WRONG and reading.counted
    assert reading.state is None


@pytest.mark.parametrize("doc, why", [
    (sglang_server_info(sglang_memory(weight=1e300)), "beyond"),
    (sglang_server_info(sglang_memory(weight=-1.0)), "no amount of memory"),
    (sglang_server_info(sglang_memory(kvcache=math.inf)), "no amount of memory"),
    (sglang_server_info(sglang_memory(), tp_size=1 << 20), "beyond"),
    (sglang_server_info(sglang_memory(token_capacity=1 << 60)), "token capacity"),
    (sglang_server_info(sglang_memory(), version="x" * 300), "no label value"),
])
def test_values_beyond_bounds_are_wrong_not_a_crash(spawn, tmp_path, doc, why):  # noqa: F811
    fake = sglang(spawn, tmp_path, {"/get_server_info": doc}, children=0)
    reading = read_one(adapter(fake.url))
    assert reading.status is Status.WRONG and reading.counted and why in reading.reason
    assert "exporter fault" not in reading.reason


def test_a_metrics_text_beyond_bounds_is_wrong(spawn, tmp_path):  # noqa: F811
    fake = sglang(spawn, tmp_path, {"/get_server_info": sglang_server_info(sglang_memory()),
                                    "/metrics": sglang_metrics(1.5)}, children=0)
    reading = read_one(adapter(fake.url))
    assert reading.status is Status.WRONG and "KV cache usage" in reading.reason


def test_no_parallel_layout_is_wrong():
    with pytest.raises(ValueError, match="not a parallel layout"):
        parse_server_info(sglang_server_info(sglang_memory(), tp_size=0))
