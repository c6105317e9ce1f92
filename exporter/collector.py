"""The exporter's prometheus_client Collector: reads devices and engines on each scrape."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vramledger.exporter.attribution import Attribution, attribute
from vramledger.exporter.engines import EngineSet, EngineState, Reading, Status
from vramledger.exporter.engines.ranks import RankLedger
from vramledger.exporter.engines.vramledger import SOURCE as WORKER_SOURCE
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.kubernetes import NO_POD, PodDirectory
from vramledger.exporter.kubernetes import SOURCE as KUBERNETES_SOURCE
from vramledger.exporter.sources import DeviceMemory, Source

DEVICE = ("device", "uuid")
ENGINE = ("engine",)  # the engine's URL, as given or found
RANK = ENGINE + ("rank",)  # a vLLM rank's ledger (the vLLM plugin); our worker serves its own, without these
# name -> (help, labels); every gauge the exporter serves.
GAUGES = {
    "vramledger_device_memory_total_bytes": ("Total memory of the device.", DEVICE),
    "vramledger_device_memory_used_bytes": ("Used memory of the device (host: total - available).", DEVICE),
    "vramledger_device_memory_reserved_bytes": ("Memory the driver reserves (NVML v2 only).", DEVICE),
    "vramledger_device_process_memory_bytes": (
        ("Memory of one process on the device, owned by a watched engine (engine: its URL) or foreign; "
         "pid=\"other\" sums those beyond --max-processes. measure: nvml (NVML's used GPU memory), pss (host: "
         "proportional set size, shared pages split among their sharers) or rss (host, where PSS cannot be "
         "read)."),
        DEVICE + ("pid", "process", "owner", "engine", "measure")),
    "vramledger_device_foreign_memory_bytes": ("Memory of the device's processes that are no watched engine's.",
                                               DEVICE),
    "vramledger_device_unattributed_memory_bytes": (
        "Device used memory minus the memory of every process the reader can see.", DEVICE),
    "vramledger_engine_up": (
        ("1 when the engine serves (read as its kind: our worker's ledger; vLLM's /metrics, and its /health "
         "200), else 0."), ENGINE),
    "vramledger_engine_state": (
        ("1 for the engine's state, 0 for the others: serving; loading (it answered 503, as while it "
         "loads its model); unreachable (no whole answer within --engine-timeout, or a vLLM whose /health "
         "answers 503, its engine core dead; an answer begun but not finished is counted in "
         "vramledger_exporter_errors_total); wrong (an answer that is not this kind "
         "of engine's, a value beyond the exporter's bounds or a pid not behind its port, counted in "
         "vramledger_exporter_errors_total)."), ENGINE + ("state",)),
    "vramledger_engine_info": ("The engine behind each URL: its kind, version and model.",
                               ENGINE + ("kind", "version", "model")),
    "vramledger_engine_kv_cache_usage_ratio": ("Fraction of the engine's KV cache in use.", ENGINE),
    "vramledger_engine_declared_memory_bytes": (
        ("Memory the engine declares: our worker's ledger's declared_bytes; vLLM's ranks' ledgers (the vLLM "
         "plugin), else gpu_memory_utilization x the total of each device it uses, summed."), ENGINE),
    "vramledger_engine_observed_memory_bytes": ("Memory the device observes for the engine's processes.",
                                                ENGINE + ("device",)),
    "vramledger_engine_unaccounted_memory_bytes": (
        "max(0, observed - declared) on a device: memory the engine holds but does not declare.",
        ENGINE + ("device",)),
    "vramledger_engine_memory_bytes": (
        ("Memory a vLLM rank's ledger declares, per component and model, from the vLLM plugin's "
         "/vramledger/memory (a vramledger worker serves its own ledger on its /metrics)."),
        RANK + ("component", "model")),
    "vramledger_engine_process_declared_bytes": (
        ("Host memory a vLLM server's processes besides its ranks declare (the vLLM plugin's /vramledger/memory): "
         "what each held when the server became ready, summed per role (api_server, engine_core, other)."),
        ENGINE + ("role",)),
    "vramledger_engine_memory_budget_bytes": (
        "The budget a vLLM rank sized its KV cache against (none when it was given a KV cache size).", RANK),
    "vramledger_engine_weights_outside_budget_bytes": (
        ("Memory a model's weights hold outside the budget its vLLM rank sized against (0 when inside): a "
         "draft model loaded after the memory profile, so the KV cache took its share."), RANK + ("model",)),
    "vramledger_engine_foreign_charged_bytes": (
        ("Other processes' memory a vLLM rank charged to itself at start-up: what its sizing charged its budget "
         "before the KV cache above its own process's memory (0 with own-process sizing)."),
        RANK),
    "vramledger_engine_sizing_info": (
        ("How a vLLM rank sized its KV cache: sizing is vllm (vLLM's arithmetic, from the device's free memory) "
         "or own-process (its own process's memory); fallback says why own-process was asked and vllm ran."),
        RANK + ("sizing", "fallback")),
    "vramledger_engine_sizing_charge_bytes": (
        ("What each arithmetic charges a vLLM rank's budget before the KV cache: vllm, and own-process (absent "
         "where NVML cannot see the rank's process); vramledger_engine_sizing_info says which ran."),
        RANK + ("arithmetic",)),
    "vramledger_engine_sizing_given_back_bytes": (
        ("KV cache bytes a vLLM rank's sizing gave back against vLLM's arithmetic (vllm charge - charged; "
         "0 with vLLM's sizing)."), RANK),
    "vramledger_engine_token_capacity": (
        ("Tokens the engine's KV cache holds, where the engine says: SGLang's token capacity summed over its "
         "data-parallel ranks, TGI's max_batch_total_tokens, TensorRT-LLM's KV cache blocks x tokens per block."),
        ("engine",)),
    "vramledger_engine_model_declared_bytes": (
        ("Memory an engine declares per loaded model (Ollama's /api/ps): memory=gpu its size_vram, on the GPUs "
         "it uses; memory=host the rest of its size, in host memory."), ("engine", "model", "memory")),
    "vramledger_engine_runtime_memory_bytes": (
        ("Memory TensorRT-LLM says its runtime holds (Triton's nv_trt_llm_runtime_memory_metrics), per "
         "memory_type (gpu, cpu, pinned), summed over its models: published, not declared."),
        ("engine", "memory_type")),
}
PROCESS = "vramledger_device_process_memory_bytes"
POD_LABELS = ("namespace", "pod", "container")  # --kubernetes only; empty for a process in no pod
ERRORS = "vramledger_exporter_errors"
COLLECT_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1.0, 2.5, 5.0, 10.0)


class ExporterCollector(Collector):
    """Builds every exporter metric fresh on each scrape, so exited processes leave no series."""

    def __init__(self, source: Source, engines: EngineSet, errors: ErrorLog, *, max_processes: int = 32,
                 pods: PodDirectory | None = None):
        self._source = source
        self._engines = engines
        self._errors = errors
        self._max_processes = max_processes
        self._lock = threading.Lock()  # concurrent scrapes would race on the sources' caches
        self._collect_seconds = Histogram("vramledger_exporter_collect_seconds",
                                          "Time to read the devices and engines for one scrape.",
                                          buckets=COLLECT_BUCKETS, registry=None)
        # Served at 0 before any error.
        self._sources = tuple(dict.fromkeys((source.name, WORKER_SOURCE, *engines.sources, "exporter")))
        self._pods = pods  # --kubernetes: each process series names its pod

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
        if self._pods is not None:
            doc, labels = GAUGES[PROCESS]
            gauges[PROCESS] = GaugeMetricFamily(PROCESS, doc, labels=labels + POD_LABELS)
        read: dict[str, Reading] = self._guard(WORKER_SOURCE, self._engines.read, {})
        states: dict[str, EngineState] = {url: r.state for url, r in read.items() if r.state is not None}
        pids = frozenset(pid for state in states.values() for pid in state.pids)
        devices = self._guard(self._source.name, lambda: self._source.read(pids), [])
        joined = self._guard("exporter", lambda: attribute(devices, states, self._max_processes),
                             Attribution())
        self._add_devices(gauges, devices)
        self._add_attribution(gauges, joined, self._pod_labels)
        for url, reading in read.items():
            gauges["vramledger_engine_up"].add_metric([url], int(reading.status is Status.SERVING))
            for status in Status:
                gauges["vramledger_engine_state"].add_metric([url, status.value],
                                                             int(reading.status is status))
            state = reading.state
            if state is None:
                continue
            info = state.info
            gauges["vramledger_engine_info"].add_metric([url, info.kind, info.version, info.model], 1)
            if state.kv_usage is not None:
                gauges["vramledger_engine_kv_cache_usage_ratio"].add_metric([url], state.kv_usage)
            if url in joined.declared:
                gauges["vramledger_engine_declared_memory_bytes"].add_metric([url], joined.declared[url])
            for rank in state.ranks:
                self._add_rank(gauges, url, rank)
            self._add_engine_figures(gauges, url, state)
            by_role: dict[str, int] = {}
            for process in state.processes:
                by_role[process.role] = by_role.get(process.role, 0) + process.bytes
            for role, size in by_role.items():
                gauges["vramledger_engine_process_declared_bytes"].add_metric([url, role], size)
        return list(gauges.values())

    @staticmethod
    def _add_rank(gauges: dict[str, GaugeMetricFamily], url: str, rank: RankLedger) -> None:
        labels = [url, str(rank.rank)]
        for (component, model), size in rank.components().items():
            gauges["vramledger_engine_memory_bytes"].add_metric(labels + [component, model], size)
        if rank.budget_bytes is not None:
            gauges["vramledger_engine_memory_budget_bytes"].add_metric(labels, rank.budget_bytes)
        for model, size in rank.weights_outside_budget().items():
            gauges["vramledger_engine_weights_outside_budget_bytes"].add_metric(labels + [model], size)
        if rank.foreign_charged_bytes is not None:
            gauges["vramledger_engine_foreign_charged_bytes"].add_metric(labels, rank.foreign_charged_bytes)
        sizing = rank.sizing
        if sizing is not None:
            gauges["vramledger_engine_sizing_info"].add_metric(labels + [sizing.ran, sizing.fallback], 1)
            charges: dict[str, int | None] = {"vllm": sizing.vllm_charged_bytes, "own-process": sizing.own_process_bytes}
            for arithmetic, charge in charges.items():
                if charge is not None:
                    gauges["vramledger_engine_sizing_charge_bytes"].add_metric(labels + [arithmetic], charge)
            gauges["vramledger_engine_sizing_given_back_bytes"].add_metric(
                labels, sizing.vllm_charged_bytes - sizing.charged_bytes)

    @staticmethod
    def _add_engine_figures(gauges: dict[str, GaugeMetricFamily], url: str, state: EngineState) -> None:
        """What engines of other kinds give beside a declaration: token capacity, models, runtime memory."""
        if state.token_capacity is not None:
            gauges["vramledger_engine_token_capacity"].add_metric([url], state.token_capacity)
        for m in state.models:
            gauges["vramledger_engine_model_declared_bytes"].add_metric([url, m.model, "gpu"], m.device_bytes)
            gauges["vramledger_engine_model_declared_bytes"].add_metric([url, m.model, "host"], m.host_bytes)
        for memory_type, size in state.runtime_memory:
            gauges["vramledger_engine_runtime_memory_bytes"].add_metric([url, memory_type], size)

    def _guard(self, source: str, read, fallback):
        # One failing source must not take the others' series down with it.
        try:
            return read()
        except Exception as e:  # noqa: BLE001 - counted and logged, never raised into the scrape
            self._errors.record(source, type(e).__name__, f"{type(e).__name__}: {e}")
            return fallback

    @staticmethod
    def _add_devices(gauges: dict[str, GaugeMetricFamily], devices: list[DeviceMemory]) -> None:
        for d in devices:
            labels = [d.device, d.uuid]
            gauges["vramledger_device_memory_total_bytes"].add_metric(labels, d.total)
            gauges["vramledger_device_memory_used_bytes"].add_metric(labels, d.used)
            if d.reserved is not None:
                gauges["vramledger_device_memory_reserved_bytes"].add_metric(labels, d.reserved)

    def _pod_labels(self, pid: str) -> list[str]:
        if self._pods is None:
            return []
        pod = self._guard(KUBERNETES_SOURCE, lambda: self._pods.labels_of_pid(pid), NO_POD)
        return [pod.namespace, pod.pod, pod.container]

    @staticmethod
    def _add_attribution(gauges: dict[str, GaugeMetricFamily], joined: Attribution, pod_labels) -> None:
        for p in joined.processes:
            labels = [p.device, p.uuid, p.pid, p.process, p.owner, p.engine, p.measure, *pod_labels(p.pid)]
            gauges[PROCESS].add_metric(labels, p.bytes)
        for d in joined.devices:
            if d.foreign is not None:
                gauges["vramledger_device_foreign_memory_bytes"].add_metric([d.device, d.uuid], d.foreign)
            if d.unattributed is not None:
                gauges["vramledger_device_unattributed_memory_bytes"].add_metric([d.device, d.uuid],
                                                                                 d.unattributed)
        for e in joined.engines:
            gauges["vramledger_engine_observed_memory_bytes"].add_metric([e.engine, e.device], e.observed)
            if e.unaccounted is not None:
                gauges["vramledger_engine_unaccounted_memory_bytes"].add_metric([e.engine, e.device],
                                                                                e.unaccounted)

    def _errors_family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(ERRORS, "Errors while reading a source: the device (nvml, host), an "
                                     "engine that answers wrong or too slowly (its kind's source: worker, vllm, ...), kubernetes, "
                                     "the exporter itself.",
                                     labels=("source",))
        counts = dict.fromkeys(self._sources, 0) | self._errors.counts()
        for source, count in sorted(counts.items()):
            family.add_metric([source], count)
        return family
