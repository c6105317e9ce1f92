"""Joins what the devices observe with what each engine declares.

The join is by host pid: NVML reports host pids, and each engine adapter answers the host pids of
its processes (exporter/processes.py finds them).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from vramledger.exporter.engines.base import EngineState
from vramledger.exporter.sources import DeviceMemory
from vramledger.processes import ProcessMemory

ENGINE, FOREIGN = "engine", "foreign"  # vramledger_device_process_memory_bytes{owner}


@dataclass(frozen=True)
class ProcessRow:
    """One vramledger_device_process_memory_bytes series."""
    device: str
    uuid: str
    pid: str  # a pid, or "other" for the processes beyond --max-processes
    process: str
    owner: str
    engine: str  # the URL of the engine it belongs to; "" for a foreign process
    measure: str  # ProcessMemory.measure; for pid="other", each measure it sums, comma-separated
    bytes: int


@dataclass(frozen=True)
class DeviceRow:
    """Foreign and unattributed memory of one device; None where a process's usage is unknown."""
    device: str
    uuid: str
    foreign: int | None
    unattributed: int | None


@dataclass(frozen=True)
class EngineRow:
    """What a device observes of one engine's processes, and how much of it the engine did not declare."""
    engine: str
    device: str
    observed: int
    unaccounted: int | None  # None where the engine declares nothing on this device


@dataclass
class Attribution:
    """Every joined row of one scrape, and each engine's declared total over the devices it uses."""
    processes: list[ProcessRow] = field(default_factory=list)
    devices: list[DeviceRow] = field(default_factory=list)
    engines: list[EngineRow] = field(default_factory=list)
    declared: dict[str, int] = field(default_factory=dict)


def unaccounted(observed: int, declared: int) -> int:
    """Memory the device sees that the ledger does not declare; a ledger above usage is not a leak."""
    return max(0, observed - declared)


def attribute(devices: Iterable[DeviceMemory], states: Mapping[str, EngineState],
              max_processes: int) -> Attribution:
    """Classifies every device process as an engine's (its pid in the engine's pids) or foreign.

    Engines' processes are always shown; foreign processes beyond max_processes are summed as pid="other".
    An engine's processes on one device are observed together (vLLM's engine core and its ranks).
    No value is derived from a process whose usage is unknown: such a row, and the sum it would
    enter, are left out rather than guessed.
    """
    owner = {pid: url for url, state in states.items() for pid in state.pids}
    out = Attribution()
    used_on: dict[str, list[DeviceMemory]] = {}
    for dev in devices:
        if dev.processes is None:
            continue
        by_engine: dict[str, list[ProcessMemory]] = {}  # in the order their first process comes
        foreign = []
        for p in dev.processes:
            url = owner.get(p.pid)
            if url is None:
                foreign.append(p)
            else:
                by_engine.setdefault(url, []).append(p)
        for url, mine in by_engine.items():
            used_on.setdefault(url, []).append(dev)
            out.processes.extend(ProcessRow(dev.device, dev.uuid, str(p.pid), p.name, ENGINE, url, p.measure,
                                            p.bytes) for p in mine if p.bytes is not None)
            observed = _sum(mine)
            if observed is not None:
                declared = states[url].declared_on(dev)
                out.engines.append(EngineRow(url, dev.device, observed,
                                             None if declared is None else unaccounted(observed, declared)))
        shown = sum(1 for mine in by_engine.values() for p in mine if p.bytes is not None)
        out.processes.extend(_foreign_rows(dev, foreign, max(0, max_processes - shown)))
        out.devices.append(DeviceRow(dev.device, dev.uuid, _sum(foreign),
                                     _minus(dev.used, _sum(dev.processes))))
    for url, state in states.items():
        total = state.declared_total(used_on.get(url, []))
        if total is not None:
            out.declared[url] = total
    return out


def _foreign_rows(dev: DeviceMemory, foreign: list[ProcessMemory], room: int) -> list[ProcessRow]:
    known = sorted(((p, p.bytes) for p in foreign if p.bytes is not None), key=lambda ps: (-ps[1], ps[0].pid))
    rows = [ProcessRow(dev.device, dev.uuid, str(p.pid), p.name, FOREIGN, "", p.measure, size)
            for p, size in known[:room]]
    if len(known) > room:  # bounded cardinality: the smallest are summed in one series
        rest = known[room:]
        measures = ",".join(sorted({p.measure for p, _ in rest}))
        rows.append(ProcessRow(dev.device, dev.uuid, "other", "other", FOREIGN, "", measures,
                               sum(size for _, size in rest)))
    return rows


def _sum(processes: Iterable[ProcessMemory]) -> int | None:
    sizes = [p.bytes for p in processes]
    known = [size for size in sizes if size is not None]
    return sum(known) if len(known) == len(sizes) else None


def _minus(used: int, seen: int | None) -> int | None:
    # Clamped: reserved memory (NVML v2), or RSS where a host process's PSS cannot be read, can make
    # the processes exceed "used".
    return None if seen is None else max(0, used - seen)
