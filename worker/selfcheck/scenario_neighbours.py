"""Scenario 3, a neighbour's memory is foreign and two workers start at once: a neighbour holds
memory before the workers start; then two workers (0.7 and 0.2 of the device, scaled on the CPU)
start at the same moment. Both start, each reports the neighbour as foreign at start, and neither
ledger holds the neighbour's or the other worker's memory."""
from __future__ import annotations

from dataclasses import dataclass, field

from vramledger.units import format_bytes
from vramledger.worker.selfcheck.context import Context
from vramledger.worker.selfcheck.neighbour import start_neighbour
from vramledger.worker.selfcheck.processes import ProcessExited, Started, WaitTimedOut
from vramledger.worker.selfcheck.report import CannotRun, Check, ScenarioResult
from vramledger.worker.selfcheck.scale import PAIR_SHARES
from vramledger.worker.selfcheck.scenario_ledger import idle_check
from vramledger.worker.selfcheck.view import settle
from vramledger.worker.selfcheck.workers import WorkerProcess, needed

TITLE = "a neighbour's memory is foreign, two workers start at once"
FOREIGN_TOLERANCE = 0.05


@dataclass
class Neighbourhood:
    """The neighbour and the two workers that started beside it (scenarios 3 and 4 share them)."""

    neighbour: Started
    neighbour_bytes: int | None
    workers: list[WorkerProcess] = field(default_factory=list)  # those that started
    failed: dict[str, str] = field(default_factory=dict)  # worker name -> why it did not start
    flags: dict[str, list[str]] = field(default_factory=dict)


def set_up(ctx: Context) -> Neighbourhood:
    """Start the neighbour, then both workers back to back, then wait for both."""
    s, view = ctx.scale, ctx.view
    total = view.total_bytes()
    need, free = s.pair_needs_free_bytes(total), view.free_bytes()
    if free < need:
        raise CannotRun(f"needs {format_bytes(need)} free on {s.device} for the neighbour and the "
                        f"{' + '.join(map(str, PAIR_SHARES))} workers; {format_bytes(free)} is free")
    ctx.say(f"scenario 3: a neighbour holding {format_bytes(s.neighbour_bytes)}, then two workers at once")
    neighbour = start_neighbour(ctx.procs, "s3-neighbour", s.device, s.neighbour_bytes)
    hood = Neighbourhood(neighbour, settle(view, neighbour.pid))
    started = []
    for share, flags in zip(PAIR_SHARES, s.pair_flags(total), strict=True):
        name = f"worker-{share:g}"
        hood.flags[name] = flags
        started.append(ctx.start_worker(name, s.engine_flags(draft=True) + flags))
    for worker in started:
        try:
            hood.workers.append(ctx.wait_ready(worker))
        except ProcessExited as e:
            hood.failed[worker.name] = f"exited: {e.last_error()}"
        except WaitTimedOut as e:
            hood.failed[worker.name] = e.headline  # a line of the table: its log stays in its file
    return hood


def run(ctx: Context, hood: Neighbourhood, result: ScenarioResult) -> None:
    names = list(hood.flags)
    ready = {w.name: w for w in hood.workers}
    measured = "; ".join(f"{n} ready in {ready[n].ready_seconds:.1f} s" if n in ready
                         else f"{n} {hood.failed[n]}" for n in names)
    result.add(Check.compare("both start", not hood.failed, measured,
                             "both start (" + ", ".join(" ".join(hood.flags[n]) for n in names) + ")"))
    for worker in hood.workers:
        ledger = worker.ledger()
        foreign = needed(ledger.get("foreign_at_start"), "foreign_at_start")
        listed = {p["pid"]: p["bytes"] for p in foreign["processes"]}
        seen = listed.get(hood.neighbour.pid)
        expected = hood.neighbour_bytes
        ok = (seen is not None and expected is not None
              and abs(seen - expected) <= FOREIGN_TOLERANCE * expected)
        result.add(Check.compare(
            f"neighbour foreign at start ({worker.name})", ok,
            "not listed" if seen is None else f"pid {hood.neighbour.pid}: {format_bytes(seen)}",
            f"pid {hood.neighbour.pid}: {format_bytes(expected)} ±{FOREIGN_TOLERANCE:.0%}",
            measured_bytes=seen, expected_bytes=expected,
            foreign_at_start_bytes=foreign["bytes"]))
        # A ledger charged with the neighbour or the other worker would sit far above the process.
        result.add(idle_check(ctx, worker, ledger, f" ({worker.name}: its own memory only)"))
