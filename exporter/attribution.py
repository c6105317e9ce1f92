"""Joins what the device observes with what each worker declares.

The join is by host pid: NVML reports host pids, so a worker in a container is found through
/proc/<pid>/status (NSpid: host pid ... pid inside the container) and /proc/<pid>/cgroup.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from exporter.sources import DeviceMemory, ProcessMemory
from exporter.workers import WorkerLedger

WORKER, FOREIGN = "worker", "foreign"


@dataclass(frozen=True)
class ProcessRow:
    """One vramledger_device_process_memory_bytes series."""
    device: str
    uuid: str
    pid: str  # a pid, or "other" for the processes beyond --max-processes
    process: str
    owner: str
    worker: str
    bytes: int


@dataclass(frozen=True)
class DeviceRow:
    """Foreign and unattributed memory of one device; None where a process's usage is unknown."""
    device: str
    uuid: str
    foreign: int | None
    unattributed: int | None


@dataclass(frozen=True)
class WorkerRow:
    """What the device observes of one worker, and how much of it the worker did not declare."""
    worker: str
    device: str
    observed: int
    unaccounted: int


@dataclass
class Attribution:
    """Every joined row of one scrape."""
    processes: list[ProcessRow] = field(default_factory=list)
    devices: list[DeviceRow] = field(default_factory=list)
    workers: list[WorkerRow] = field(default_factory=list)


def unaccounted(observed: int, declared: int) -> int:
    """Memory the device sees that the ledger does not declare; a ledger above usage is not a leak."""
    return max(0, observed - declared)


def attribute(devices: Iterable[DeviceMemory], worker_pids: Mapping[int, str],
              declared: Mapping[str, int], max_processes: int) -> Attribution:
    """Classifies every device process as worker (pid in worker_pids) or foreign.

    Workers are always shown; foreign processes beyond max_processes are summed as pid="other".
    No value is derived from a process whose usage is unknown: such a row, and the foreign or
    unattributed sum it would enter, are left out rather than guessed.
    """
    out = Attribution()
    for dev in devices:
        if dev.processes is None:
            continue
        workers = [p for p in dev.processes if p.pid in worker_pids]
        foreign = [p for p in dev.processes if p.pid not in worker_pids]
        shown = 0
        for p in workers:
            if p.bytes is None:
                continue
            url = worker_pids[p.pid]
            out.processes.append(ProcessRow(dev.device, dev.uuid, str(p.pid), p.name, WORKER, url, p.bytes))
            out.workers.append(WorkerRow(url, dev.device, p.bytes, unaccounted(p.bytes, declared[url])))
            shown += 1
        out.processes.extend(_foreign_rows(dev, foreign, max(0, max_processes - shown)))
        out.devices.append(DeviceRow(dev.device, dev.uuid, _sum(foreign),
                                     _minus(dev.used, _sum(dev.processes))))
    return out


def _foreign_rows(dev: DeviceMemory, foreign: list[ProcessMemory], room: int) -> list[ProcessRow]:
    known = sorted((p for p in foreign if p.bytes is not None), key=lambda p: (-p.bytes, p.pid))
    rows = [ProcessRow(dev.device, dev.uuid, str(p.pid), p.name, FOREIGN, "", p.bytes) for p in known[:room]]
    if len(known) > room:  # bounded cardinality: the smallest are summed in one series
        rest = sum(p.bytes for p in known[room:])
        rows.append(ProcessRow(dev.device, dev.uuid, "other", "other", FOREIGN, "", rest))
    return rows


def _sum(processes: Iterable[ProcessMemory]) -> int | None:
    sizes = [p.bytes for p in processes]
    return None if None in sizes else sum(sizes)


def _minus(used: int, seen: int | None) -> int | None:
    # Clamped: shared pages (host) or reserved memory (NVML v2) can make the processes exceed "used".
    return None if seen is None else max(0, used - seen)


# --- pid mapping -------------------------------------------------------------------------------

def parse_nspid(status: str) -> tuple[int, ...]:
    """The NSpid line of /proc/<pid>/status: the pid in each namespace, outermost first."""
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            return tuple(int(x) for x in line.split()[1:])
    return ()


def in_container(cgroup: str, container_id: str) -> bool:
    """True when /proc/<pid>/cgroup names the container (full or short id, docker or containerd)."""
    return bool(container_id) and container_id in cgroup


class HostPidResolver:
    """Finds the host pid (the pid NVML reports) of each worker, through NSpid for containers."""

    def __init__(self, proc_root: str | Path = "/proc"):
        self._proc = Path(proc_root)
        self._cache: dict[tuple[str, int], int] = {}

    def host_pid(self, ledger: WorkerLedger) -> int | None:
        if ledger.host_pid is not None:
            return ledger.host_pid
        if ledger.container_id is None:  # same pid namespace as the exporter
            return ledger.pid
        key = (ledger.container_id, ledger.pid)
        cached = self._cache.get(key)
        if cached is not None and self._is_worker(cached, *key):  # pids are reused: check again
            return cached
        # The deepest namespace wins: a process that only shares the container's cgroup and happens to
        # carry the same pid in the exporter's own namespace is not the worker.
        depths = {pid: self._depth(pid, *key) for pid in self._pids()}
        found = max((pid for pid, depth in depths.items() if depth), key=depths.get, default=None)
        if found is None:
            self._cache.pop(key, None)
        else:
            self._cache[key] = found
        return found

    def _pids(self) -> list[int]:
        return [int(name) for name in _listdir(self._proc) if name.isdigit()]

    def _is_worker(self, host_pid: int, container_id: str, ns_pid: int) -> bool:
        return self._depth(host_pid, container_id, ns_pid) > 0

    def _depth(self, host_pid: int, container_id: str, ns_pid: int) -> int:
        """How many pid namespaces deep host_pid is, if it is ns_pid in the container; else 0."""
        try:
            nspid = parse_nspid((self._proc / str(host_pid) / "status").read_text())
            if not nspid or nspid[-1] != ns_pid:
                return 0
            cgroup = (self._proc / str(host_pid) / "cgroup").read_text()
        except OSError:  # the process exited meanwhile, or /proc hides it
            return 0
        return len(nspid) if in_container(cgroup, container_id) else 0


def _listdir(path: Path) -> list[str]:
    try:
        return [p.name for p in path.iterdir()]
    except OSError:
        return []
