"""A vLLM server: its /metrics (vllm:* series), the process tree behind its port, its budget.

vLLM's API server starts an engine-core process (and, with tensor parallelism, one worker per rank);
those children hold the device memory, so the whole tree is the worker. Its budget is vLLM V1's own
rule: gpu_memory_utilization x the total memory of each device it uses. With an explicit
kv_cache_memory_bytes that budget is unknown and nothing is declared; vLLM's CPU backend reports
its VLLM_CPU_KVCACHE_SPACE that way, and a share of the host is no budget anyway.
"""
from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from exporter.engines.base import EngineInfo, EngineState
from exporter.errors import ErrorLog
from exporter.processes import Locator, NotFound, PortLocator

KIND = "vllm"
SOURCE = "vllm"


@dataclass(frozen=True)
class VllmMetrics:
    """What the exporter reads from one vLLM /metrics text."""
    model: str = ""
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None  # set by the user: then utilization is not the budget
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    kv_usage: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    spec_decode_drafts: float | None = None
    spec_decode_draft_tokens: float | None = None
    spec_decode_accepted_tokens: float | None = None

    @property
    def declared_share(self) -> float | None:
        """The share of each device vLLM holds itself to, when that is its budget."""
        if self.kv_cache_memory_bytes is not None:
            return None
        return self.gpu_memory_utilization


def parse_metrics(text: str) -> VllmMetrics:
    """Parses a vLLM /metrics text (with prometheus_client's parser); series vLLM lacks stay None.

    A data-parallel server serves one series per engine: counts are summed, and its KV usage is
    the fullest engine's (the one that queues first).
    """
    sums: dict[str, float] = {}
    kv: list[float] = []
    config: dict[str, str] = {}
    model = ""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            model = model or sample.labels.get("model_name", "")
            if sample.name == "vllm:cache_config_info":
                config = sample.labels
            elif sample.name == "vllm:kv_cache_usage_perc":
                kv.append(sample.value)
            elif sample.name in _SUMMED:
                sums[_SUMMED[sample.name]] = sums.get(_SUMMED[sample.name], 0.0) + sample.value
    if not config:
        raise ValueError("no vllm:cache_config_info series: not a vLLM server's /metrics")
    return VllmMetrics(
        model=model,
        gpu_memory_utilization=_number(config.get("gpu_memory_utilization"), float),
        kv_cache_memory_bytes=_number(config.get("kv_cache_memory_bytes"), int),
        num_gpu_blocks=_number(config.get("num_gpu_blocks"), int),
        block_size=_number(config.get("block_size"), int),
        kv_usage=max(kv, default=None),
        **sums)


# vLLM series -> VllmMetrics field (counters appear with their _total sample name).
_SUMMED = {
    "vllm:num_requests_running": "requests_running",
    "vllm:num_requests_waiting": "requests_waiting",
    "vllm:spec_decode_num_drafts_total": "spec_decode_drafts",
    "vllm:spec_decode_num_draft_tokens_total": "spec_decode_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "spec_decode_accepted_tokens",
}


def _number(text: str | None, kind):
    if text in (None, "", "None"):
        return None
    try:
        return kind(float(text)) if kind is int else kind(text)
    except ValueError:
        return None


class VllmEngine:
    """Reads one vLLM server each scrape: GET /metrics, and its processes by port (or a given pid).

    A server that does not answer is vramledger_worker_up 0 (logged once, not counted); garbage, or
    processes that cannot be found, count in vramledger_exporter_errors_total{source="vllm"}.
    """
    kind, source = KIND, SOURCE

    def __init__(self, url: str, client: httpx.Client, errors: ErrorLog, locator: Locator | None = None):
        self.url = url.rstrip("/")
        self._client = client
        self._errors = errors
        self._locator = locator or PortLocator(self.url)
        self._version: str | None = None

    def read(self) -> EngineState | None:
        metrics = self.read_metrics()
        if metrics is None:
            self._locator.forget()
            self._version = None  # a restarted server may be another version
            return None
        try:
            pids = self._locator.pids()
        except (NotFound, ValueError) as e:
            self._errors.record(SOURCE, f"no_process {self.url}", f"{self.url}: {e}")
            pids = frozenset()
        return EngineState(pids, EngineInfo(KIND, self._read_version(), metrics.model), metrics.kv_usage,
                           declared_share=metrics.declared_share)

    def read_metrics(self) -> VllmMetrics | None:
        try:
            response = self._client.get(self.url + "/metrics")
            response.raise_for_status()
            return parse_metrics(response.text)
        except httpx.HTTPStatusError as e:
            self._fail(f"http_{e.response.status_code}", e, count=True)
        except (httpx.TimeoutException, httpx.TransportError) as e:  # down: vramledger_worker_up 0 says it
            self._fail("timeout" if isinstance(e, httpx.TimeoutException) else "unreachable", e, count=False)
        except (httpx.HTTPError, ValueError) as e:  # not a Prometheus text
            self._fail("invalid_metrics", e, count=True)
        return None

    def close(self) -> None:
        pass

    def _read_version(self) -> str:
        if self._version is None:  # GET /version: {"version": "0.32.0"}, read once per server run
            try:
                response = self._client.get(self.url + "/version")
                response.raise_for_status()
                self._version = str(response.json().get("version", ""))
            except (httpx.HTTPError, ValueError, AttributeError) as e:  # only the label is lost
                self._errors.note(SOURCE, f"no_version {self.url}", f"{self.url}/version: {e}")
                self._version = ""
        return self._version

    def _fail(self, kind: str, error: Exception, count: bool) -> None:
        report = self._errors.record if count else self._errors.note
        report(SOURCE, f"{kind} {self.url}", f"{self.url}/metrics: {type(error).__name__}: {error}")
