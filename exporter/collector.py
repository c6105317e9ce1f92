"""The exporter's prometheus_client Collector: reads devices and ledgers on each scrape."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.attribution import Attribution, HostPidResolver, attribute
from exporter.errors import ErrorLog
from exporter.sources import DeviceMemory, Source
from exporter.workers import SOURCE as WORKER_SOURCE
from exporter.workers import LedgerFetcher, WorkerLedger

DEVICE = ("device", "uuid")
# name -> (help, labels); every gauge the exporter serves.
GAUGES = {
    "vramledger_device_memory_total_bytes": ("Total memory of the device.", DEVICE),
    "vramledger_device_memory_used_bytes": ("Used memory of the device (host: total - available).", DEVICE),
    "vramledger_device_memory_reserved_bytes": ("Memory the driver reserves (NVML v2 only).", DEVICE),
    "vramledger_device_process_memory_bytes": (
        "Memory of one process on the device; pid=\"other\" sums those beyond --max-processes.",
        DEVICE + ("pid", "process", "owner", "worker")),
    "vramledger_device_foreign_memory_bytes": ("Memory of the device's processes that are no watched worker.",
                                               DEVICE),
    "vramledger_device_unattributed_memory_bytes": (
        "Device used memory minus the memory of every process the reader can see.", DEVICE),
    "vramledger_worker_up": ("1 when the worker's ledger (GET /v1/memory) was read, else 0.", ("worker",)),
    "vramledger_worker_declared_memory_bytes": ("Memory the worker's ledger declares (declared_bytes).",
                                                ("worker",)),
    "vramledger_worker_observed_memory_bytes": ("Memory the device observes for the worker's process.",
                                                ("worker", "device")),
    "vramledger_worker_unaccounted_memory_bytes": ("max(0, observed - declared): memory the ledger misses.",
                                                   ("worker", "device")),
}
ERRORS = "vramledger_exporter_errors"
COLLECT_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1.0, 2.5, 5.0, 10.0)


class ExporterCollector(Collector):
    """Builds every exporter metric fresh on each scrape, so exited processes leave no series."""

    def __init__(self, source: Source, ledgers: LedgerFetcher, errors: ErrorLog, *,
                 resolver: HostPidResolver | None = None, max_processes: int = 32):
        self._source = source
        self._ledgers = ledgers
        self._errors = errors
        self._resolver = resolver or HostPidResolver()
        self._max_processes = max_processes
        self._lock = threading.Lock()  # concurrent scrapes would race on the sources' caches
        self._collect_seconds = Histogram("vramledger_exporter_collect_seconds",
                                          "Time to read the devices and ledgers for one scrape.",
                                          buckets=COLLECT_BUCKETS, registry=None)
        self._sources = (source.name, WORKER_SOURCE, "exporter")  # served at 0 before any error

    def describe(self) -> Iterator[Metric]:
        yield from (GaugeMetricFamily(name, doc, labels=labels) for name, (doc, labels) in GAUGES.items())
        yield CounterMetricFamily(ERRORS, "", labels=("source",))
        yield from self._collect_seconds.describe()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            start = time.perf_counter()
            families = self._build()
            self._collect_seconds.observe(time.perf_counter() - start)
            families.append(self._errors_family())
        yield from families
        yield from self._collect_seconds.collect()

    def _build(self) -> list[Metric]:
        gauges = {name: GaugeMetricFamily(name, doc, labels=labels) for name, (doc, labels) in GAUGES.items()}
        ledgers = self._guard(WORKER_SOURCE, self._ledgers.fetch, {})
        worker_pids = self._guard(WORKER_SOURCE, lambda: self._worker_pids(ledgers), {})
        devices = self._guard(self._source.name, lambda: self._source.read(frozenset(worker_pids)), [])
        declared = {url: ledger.declared_bytes for url, ledger in ledgers.items() if ledger is not None}
        joined = self._guard("exporter", lambda: attribute(devices, worker_pids, declared,
                                                           self._max_processes), Attribution())
        self._add_devices(gauges, devices)
        self._add_attribution(gauges, joined)
        for url in self._ledgers.urls:
            ledger = ledgers.get(url)
            gauges["vramledger_worker_up"].add_metric([url], 0 if ledger is None else 1)
            if ledger is not None:
                gauges["vramledger_worker_declared_memory_bytes"].add_metric([url], ledger.declared_bytes)
        return list(gauges.values())

    def _guard(self, source: str, read, fallback):
        # One failing source must not take the others' series down with it.
        try:
            return read()
        except Exception as e:  # noqa: BLE001 - counted and logged, never raised into the scrape
            self._errors.record(source, type(e).__name__, f"{type(e).__name__}: {e}")
            return fallback

    def _worker_pids(self, ledgers: dict[str, WorkerLedger | None]) -> dict[int, str]:
        pids = {}
        for url, ledger in ledgers.items():
            if ledger is None:
                continue
            pid = self._resolver.host_pid(ledger)
            if pid is None:
                self._errors.record(WORKER_SOURCE, f"pid_unresolved {url}",
                                    f"{url}: no host process is pid {ledger.pid} of container "
                                    f"{ledger.container_id} (is the exporter in the host pid namespace?)")
            else:
                pids[pid] = url
        return pids

    @staticmethod
    def _add_devices(gauges: dict[str, GaugeMetricFamily], devices: list[DeviceMemory]) -> None:
        for d in devices:
            labels = [d.device, d.uuid]
            gauges["vramledger_device_memory_total_bytes"].add_metric(labels, d.total)
            gauges["vramledger_device_memory_used_bytes"].add_metric(labels, d.used)
            if d.reserved is not None:
                gauges["vramledger_device_memory_reserved_bytes"].add_metric(labels, d.reserved)

    @staticmethod
    def _add_attribution(gauges: dict[str, GaugeMetricFamily], joined: Attribution) -> None:
        for p in joined.processes:
            gauges["vramledger_device_process_memory_bytes"].add_metric(
                [p.device, p.uuid, p.pid, p.process, p.owner, p.worker], p.bytes)
        for d in joined.devices:
            if d.foreign is not None:
                gauges["vramledger_device_foreign_memory_bytes"].add_metric([d.device, d.uuid], d.foreign)
            if d.unattributed is not None:
                gauges["vramledger_device_unattributed_memory_bytes"].add_metric([d.device, d.uuid],
                                                                                 d.unattributed)
        for w in joined.workers:
            gauges["vramledger_worker_observed_memory_bytes"].add_metric([w.worker, w.device], w.observed)
            gauges["vramledger_worker_unaccounted_memory_bytes"].add_metric([w.worker, w.device],
                                                                            w.unaccounted)

    def _errors_family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(ERRORS, "Errors while reading a source (nvml, host, worker), by source.",
                                     labels=("source",))
        counts = dict.fromkeys(self._sources, 0) | self._errors.counts()
        for source, count in sorted(counts.items()):
            family.add_metric([source], count)
        return family
