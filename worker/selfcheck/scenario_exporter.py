"""Scenario 4, the exporter sees it: beside scenario 3's workers and neighbour, the exporter (NVML on
CUDA, the host on the CPU) labels each worker's pid owner="engine", the neighbour's owner="foreign",
and reports each worker's unaccounted memory as the device's view minus its ledger."""
from __future__ import annotations

import sys

import httpx
from prometheus_client.parser import text_string_to_metric_families

from vramledger.units import format_bytes
from vramledger.worker.selfcheck.context import Context
from vramledger.worker.selfcheck.processes import ProcessExited, free_port, wait_http
from vramledger.worker.selfcheck.report import CannotRun, Check, ScenarioResult
from vramledger.worker.selfcheck.scenario_neighbours import Neighbourhood

TITLE = "the exporter sees it"
TOLERANCE = 0.05


def scrape(url: str) -> list:
    response = httpx.get(url, timeout=30, trust_env=False)
    response.raise_for_status()
    return [s for family in text_string_to_metric_families(response.text) for s in family.samples]


def find(samples: list, name: str, **labels) -> list:
    return [s for s in samples if s.name == name and labels.items() <= s.labels.items()]


def run(ctx: Context, hood: Neighbourhood, result: ScenarioResult) -> None:
    if not hood.workers:
        raise CannotRun("no worker of scenario 3 started")
    backend = "host" if ctx.view.kind == "cpu" else "nvml"
    port = free_port()
    cmd = [sys.executable, "-m", "vramledger.exporter", "--backend", backend, "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "WARNING"]
    for worker in hood.workers:
        cmd += ["--worker", worker.url]
    ctx.say(f"scenario 4: the exporter ({backend}) beside {len(hood.workers)} workers and the neighbour")
    exporter = ctx.procs.start("s4-exporter", cmd)
    try:
        wait_http(f"http://127.0.0.1:{port}/metrics", 120, exporter)
    except ProcessExited as e:
        if "NVML unavailable" in exporter.log_tail():
            raise CannotRun(f"the exporter cannot read NVML here: {e.last_error()}") from e
        raise
    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    views = ctx.view.processes()  # read right after the scrape: idle processes do not move
    rows = "vramledger_device_process_memory_bytes"
    for worker in hood.workers:
        found = find(samples, rows, pid=str(worker.pid))
        owners = sorted({s.labels.get("owner", "?") for s in found})
        result.add(Check.compare(f"pid {worker.pid} ({worker.name})", owners == ["engine"],
                                 f"owner={','.join(owners) or 'not listed'}", 'owner="engine"'))
    found = find(samples, rows, pid=str(hood.neighbour.pid))
    owners = sorted({s.labels.get("owner", "?") for s in found})
    result.add(Check.compare(f"pid {hood.neighbour.pid} (neighbour)", owners == ["foreign"],
                             f"owner={','.join(owners) or 'not listed'}", 'owner="foreign"'))
    for worker in hood.workers:
        declared = worker.ledger()["declared_bytes"]
        seen = views.get(worker.pid)
        got = find(samples, "vramledger_engine_unaccounted_memory_bytes", engine=worker.url)
        if seen is None or seen.bytes is None or not got:
            unseen = seen is None or seen.bytes is None
            result.add(Check.compare(f"unaccounted ({worker.name})", False,
                                     format_bytes(got[0].value) if got else "not exported",
                                     "the device does not list the worker" if unseen else "a value"))
            continue
        expected = max(0, seen.bytes - declared)
        value = got[0].value
        result.add(Check.compare(
            f"unaccounted ({worker.name})", abs(value - expected) <= TOLERANCE * seen.bytes,
            format_bytes(value),
            f"device view {format_bytes(seen.bytes)} - ledger {format_bytes(declared)} = "
            f"{format_bytes(expected)} "
            f"±{TOLERANCE:.0%} of the view", measured_bytes=value, expected_bytes=expected))
