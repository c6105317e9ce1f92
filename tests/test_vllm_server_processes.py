"""The vLLM plugin's host memory, over real processes: the declaration of a server's processes besides
its ranks (server_processes.py; this test's process stands for vLLM's API server, its children for the
engine core, titled as vLLM titles it, a rank and a helper), and a CPU rank's own memory."""
from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from vramledger.procfs import read_pss
from vramledger.vllm_plugin.own_memory import OwnMemory
from vramledger.vllm_plugin.server_processes import at_ready, declarations

MiB = 1 << 20
# A child that holds 64 MiB more each time it reads a line, saying "ok"; it titles itself as its
# argv[0] says, as vLLM's engine core does (setproctitle: the command line and the kernel's name).
CHILD = r"""
import sys
with open("/proc/self/cmdline") as f, open("/proc/self/comm", "w") as comm:
    comm.write(f.read().split("\0")[0][:15])
held = []
print("ok", flush=True)
for line in sys.stdin:
    held.append(bytearray(64 << 20))
    held[-1][::4096] = b"x" * len(held[-1][::4096])
    print("ok", flush=True)
"""


@pytest.fixture
def children():
    procs = []

    def start(title: str) -> subprocess.Popen:
        proc = subprocess.Popen([title, "-c", CHILD], executable=sys.executable, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ok"
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_each_process_of_the_tree_declares_what_it_held_when_ready(children):
    core, rank, helper = children("VLLM::EngineCore"), children("python3"), children("python3")
    snapshot = {p.pid: p for p in at_ready()}
    assert {os.getpid(), core.pid, rank.pid, helper.pid} <= snapshot.keys()
    roles = {pid: snapshot[pid].role for pid in (os.getpid(), core.pid, rank.pid, helper.pid)}
    assert roles == {os.getpid(): "api_server", core.pid: "engine_core", rank.pid: "other", helper.pid: "other"}
    for pid in (os.getpid(), core.pid, helper.pid):  # as the exporter's host reader measures them
        p = snapshot[pid]
        assert p.measure == "pss" and 0 < p.bytes <= psutil.Process(pid).memory_info().rss

    core.stdin.write("grow\n")
    core.stdin.flush()
    assert core.stdout.readline().strip() == "ok"
    helper.kill()
    helper.wait()
    declared = {d["pid"]: d for d in declarations(snapshot.values(), frozenset([rank.pid]))}
    # The rank's own ledger declares it; the helper is gone: neither is declared here.
    assert rank.pid not in declared and helper.pid not in declared
    engine_core = declared[core.pid]
    # What it held at ready stands; what it grew by since is beside it, in no declaration.
    assert engine_core["bytes"] == snapshot[core.pid].bytes
    assert engine_core["live_bytes"] - engine_core["bytes"] >= 60 * MiB
    assert abs(engine_core["live_bytes"] - read_pss(core.pid)) < 8 * MiB
    assert (engine_core["role"], engine_core["scope"]) == ("engine_core", "process")
    assert engine_core["measured"] == "ready"


def test_a_pid_reused_by_another_process_is_not_declared(children):
    child = children("python3")
    [snapshot] = [p for p in at_ready() if p.pid == child.pid]
    reborn = snapshot.__class__(**{**snapshot.__dict__, "started": snapshot.started - 1})  # another start time
    assert declarations([reborn], frozenset()) == []
    assert [d["pid"] for d in declarations([snapshot], frozenset())] == [child.pid]


def test_a_rank_on_the_cpu_measures_its_own_memory_as_the_exporter_does():
    """The plugin's rank ledger reads its process's PSS (its runtime entry, its live memory), the host
    reader's measure: not its RSS, which counts shared pages whole, above what the exporter sees."""
    memory = OwnMemory("cpu")
    assert memory.source == "pss"
    held, pss, rss = memory.read(), read_pss(os.getpid()), psutil.Process().memory_info().rss
    assert abs(held - pss) < 4 * MiB and held < rss
