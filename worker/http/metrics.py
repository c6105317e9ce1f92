"""Every Prometheus metric of the worker, in one place.

Two kinds: what the engine already knows (the ledger, KV blocks, queues, cumulative token and
speculative-decoding counters) is read when scraped by `EngineCollector`, from one snapshot the
engine published (worker/engine/snapshot.py), so a scrape's figures are of one moment and never
read the engine's parts while its thread changes them; what only shows as
requests progress (latencies, outcomes, per-request acceptance) is observed by `RequestMetrics`
on the engine thread. No prompt or completion text ever enters a metric.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vramledger.ledger_document import LedgerDocument
from vramledger.ledger_reading import parse_ledger
from vramledger.worker.engine.outputs import RequestOutput
from vramledger.worker.engine.snapshot import EngineSnapshot

if TYPE_CHECKING:
    from vramledger.worker.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort")
TTFT_BUCKETS = (.005, .01, .025, .05, .075, .1, .15, .2, .3, .4, .5, .75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
ITL_BUCKETS = (.001, .0025, .005, .01, .015, .02, .025, .03, .04, .05, .075, .1, .15, .2, .3, .4, .5,
               .75, 1, 2.5)
LATENCY_BUCKETS = (.05, .1, .25, .5, 1, 2.5, 5, 10, 15, 20, 30, 40, 60, 120, 300, 600)
QUEUE_BUCKETS = (.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300)
RATIO_BUCKETS = (0, .1, .2, .3, .4, .5, .6, .7, .8, .9, 1)


@dataclass(frozen=True)
class ServingInfo:
    """The labels of vramledger_serving_info."""

    model: str
    draft_model: str
    device: str
    num_speculative_tokens: int
    version: str

    @classmethod
    def of(cls, engine: LLMEngine, model: str, version: str) -> ServingInfo:
        """The labels of a loaded engine serving `model` (its served name)."""
        config, device = engine.config, engine.device
        draft_model = Path(config.draft_model.rstrip("/")).name if config.draft_model else ""
        return cls(model=model, draft_model=draft_model,
                   device="cpu" if device.kind == "cpu" else f"{device.kind}:{device.index}",
                   num_speculative_tokens=config.num_speculative_tokens, version=version)


class EngineCollector(Collector):
    """Builds the ledger and engine metrics fresh on each scrape; nothing while the engine loads."""

    def __init__(self, engine: Callable[[], LLMEngine | None], pending: Callable[[], int],
                 info: Callable[[], ServingInfo | None], startup: Callable[[], dict[str, float]]):
        self._engine = engine  # None while loading
        self._pending = pending  # requests handed to the engine thread but not yet in its queue
        self._info = info
        self._startup = startup  # seconds per start-up phase
        self._failed: set[str] = set()

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        if engine is None:
            return
        snapshot = engine.snapshot  # taken once: every figure of this scrape is of the same moment
        report = functools.partial(engine.memory_report, snapshot)
        sources: dict[str, Callable[[], Iterator[Metric]]] = {
            "ledger": lambda: self._ledger(parse_ledger(report())),  # read as any reader does: no figure unchecked
            "kv_cache": lambda: self._kv_cache(snapshot),
            "queues": lambda: self._queues(snapshot),
            "counters": lambda: self._counters(snapshot),
            "speculation": lambda: self._speculation(snapshot),
            "serving_info": self._serving_info,
            "startup_phases": self._startup_phases,
        }
        # Each source on its own: a failing ledger read must not hide the queue gauges.
        for name, source in sources.items():
            try:
                yield from list(source())
            except Exception:  # a scrape never fails as a whole
                if name not in self._failed:
                    self._failed.add(name)
                    log.exception("metrics source %s failed; its metrics are left out", name)

    def _ledger(self, report: LedgerDocument) -> Iterator[Metric]:
        memory = GaugeMetricFamily("vramledger_memory_bytes", "Memory the ledger declares, per component "
                                   "and model (weights per model; other components have model=\"\").",
                                   labels=("component", "model"))
        for entry in report["entries"]:
            memory.add_metric((entry["component"], entry["model"]), entry["bytes"])
        yield memory
        live = report["live"]
        yield from known_gauge("vramledger_memory_budget_bytes", "Memory the worker may use on its device.",
                               report["budget"]["bytes"])
        yield from known_gauge("vramledger_memory_device_total_bytes", "Total memory of the worker's device.",
                               report["device"]["total_bytes"])
        yield from known_gauge("vramledger_foreign_memory_at_start_bytes",
                               "Device memory other processes held when the worker started.",
                               report["foreign_at_start"]["bytes"])
        yield from known_gauge("vramledger_process_memory_bytes", "Memory the worker's process holds now "
                               "(NVML per process on CUDA, RSS on the CPU).", live["process_bytes"])
        yield from known_gauge("vramledger_unaccounted_memory_bytes",
                               "max(0, process memory - declared memory), measured now.",
                               live["unaccounted_bytes"])

    def _kv_cache(self, snapshot: EngineSnapshot) -> Iterator[Metric]:
        total, used, cached = snapshot.blocks_total, snapshot.blocks_used, snapshot.blocks_cached
        yield gauge("vramledger_kv_cache_blocks", "KV cache blocks allocated at start (constant).", total)
        yield gauge("vramledger_kv_cache_blocks_used", "KV cache blocks held by requests.", used)
        yield gauge("vramledger_kv_cache_blocks_cached", "KV cache blocks no request holds that keep a full "
                    "block of an earlier prompt for requests that start alike (evicted least recently used "
                    "first when fresh blocks run out).", cached)
        yield gauge("vramledger_kv_cache_blocks_free",
                    "KV cache blocks holding nothing (blocks - used - cached).", snapshot.blocks_free)
        yield gauge("vramledger_kv_cache_usage_ratio", "Share of the KV cache blocks in use.",
                    used / total if total else 0.0)

    def _queues(self, snapshot: EngineSnapshot) -> Iterator[Metric]:
        yield gauge("vramledger_requests_running", "Requests in the running batch.", snapshot.requests_running)
        yield gauge("vramledger_requests_waiting", "Requests waiting for admission (or readmission).",
                    snapshot.requests_waiting + self._pending())

    def _counters(self, snapshot: EngineSnapshot) -> Iterator[Metric]:
        yield counter("vramledger_preemptions", "Requests preempted to free KV blocks (recomputed later).",
                      snapshot.preemptions)
        yield counter("vramledger_prompt_tokens", "Prompt tokens prefilled (recomputation included; tokens "
                      "found in the prefix cache left out).",
                      snapshot.prompt_tokens)
        yield counter("vramledger_generation_tokens", "Tokens generated.", snapshot.generation_tokens)
        yield counter("vramledger_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                      "(each admission, readmissions after preemption included).",
                      snapshot.prefix_cache_queries)
        yield counter("vramledger_prefix_cache_hits", "Of the prompt tokens looked up, those found in the "
                      "prefix cache (not computed again).", snapshot.prefix_cache_hits)
        yield counter("vramledger_spec_decode_drafts", "Draft proposals verified (one per request per "
                      "speculative step).", snapshot.drafts)
        yield counter("vramledger_spec_decode_draft_tokens", "Draft tokens proposed.", snapshot.draft_tokens)
        yield counter("vramledger_spec_decode_accepted_tokens", "Draft tokens the target accepted.",
                      snapshot.accepted_tokens)
        per_position = CounterMetricFamily("vramledger_spec_decode_accepted_tokens_per_position",
                                           "Drafts whose token at this position (0-based) was accepted.",
                                           labels=("position",))
        for position, accepted in enumerate(snapshot.accepted_per_position):
            per_position.add_metric((str(position),), accepted)
        yield per_position

    def _speculation(self, snapshot: EngineSnapshot) -> Iterator[Metric]:
        yield gauge("vramledger_spec_decode_num_speculative_tokens", "Draft tokens proposed per request "
                    "per decode step, as the speculation policy last chose (probes aside); at most "
                    "--num-speculative-tokens, 0 for plain steps.", snapshot.current_speculative_tokens)

    def _serving_info(self) -> Iterator[Metric]:
        info = self._info()
        if info is None:
            return
        family = GaugeMetricFamily("vramledger_serving_info", "What the worker serves: its models, device, "
                                   "draft tokens per step and version (value 1).",
                                   labels=("model", "draft_model", "device", "num_speculative_tokens", "version"))
        family.add_metric((info.model, info.draft_model, info.device, str(info.num_speculative_tokens),
                           info.version), 1)
        yield family

    def _startup_phases(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("vramledger_startup_seconds", "Seconds each start-up phase took (imports, "
                                   "tokenizer, weights per model, kernels, memory profile, KV cache, server).",
                                   labels=("phase",))
        for phase, seconds in self._startup().items():
            family.add_metric((phase,), seconds)
        yield family


def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def known_gauge(name: str, documentation: str, value: float | None) -> Iterator[Metric]:
    """A gauge of a figure the ledger document lets be unknown (null, docs/ledger.md): none then."""
    if value is not None:
        yield gauge(name, documentation, value)


def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


@dataclass
class _Timing:
    arrival: float
    last_token: float | None = None


class RequestMetrics:
    """Latencies, outcomes and per-request acceptance, observed from each step's outputs."""

    def __init__(self, registry: CollectorRegistry):
        self.finished = Counter("vramledger_requests", "Requests finished, by finish_reason "
                                "(abort: the client went away).", ("finish_reason",), registry=registry)
        for reason in FINISH_REASONS:
            self.finished.labels(reason)  # every series exists from the start, at 0
        self.ttft = Histogram("vramledger_time_to_first_token_seconds",
                              "From arrival to the first generated token.", buckets=TTFT_BUCKETS,
                              registry=registry)
        self.inter_token = Histogram("vramledger_inter_token_latency_seconds",
                                     "Between consecutive tokens of a request; a step that emits n "
                                     "tokens counts n gaps of 1/n of its interval.", buckets=ITL_BUCKETS,
                                     registry=registry)
        self.latency = Histogram("vramledger_request_latency_seconds",
                                 "From arrival to the last token (aborted requests excluded).",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.queue = Histogram("vramledger_request_queue_seconds",
                               "From arrival to the first scheduling into a batch.",
                               buckets=QUEUE_BUCKETS, registry=registry)
        self.acceptance = Histogram("vramledger_spec_decode_request_acceptance_ratio",
                                    "Accepted / proposed draft tokens of each finished request.",
                                    buckets=RATIO_BUCKETS, registry=registry)
        self._timings: dict[str, _Timing] = {}  # engine thread only

    def added(self, request_id: str, arrival: float) -> None:
        self._timings[request_id] = _Timing(arrival)

    def aborted(self, request_id: str) -> None:
        if self._timings.pop(request_id, None) is not None:
            self.finished.labels("abort").inc()

    def step(self, outputs: list[RequestOutput], started: float, ended: float) -> None:
        """Observe one step's outputs: `started` when the step began, `ended` when its outputs went to
        the server's event loop (monotonic)."""
        for out in outputs:
            timing = self._timings.get(out.request_id)
            if timing is None:
                continue
            n = len(out.new_token_ids)
            last = timing.last_token
            if n and last is None:
                # A long prompt's prefill takes several steps: its first scheduling may be steps earlier.
                scheduled = started if out.first_scheduled_time is None else out.first_scheduled_time
                self.queue.observe(max(0.0, scheduled - timing.arrival))
                self.ttft.observe(ended - timing.arrival)
            elif n and last is not None:
                gap = (ended - last) / n
                for _ in range(n):
                    self.inter_token.observe(gap)
            if n:
                timing.last_token = ended
            if out.finished:
                del self._timings[out.request_id]
                self.latency.observe(ended - timing.arrival)
                self.finished.labels(out.finish_reason or "stop").inc()
                if out.num_draft_tokens:
                    self.acceptance.observe(out.num_accepted_tokens / out.num_draft_tokens)
