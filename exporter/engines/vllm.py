"""A vLLM server: its /metrics (vllm:* series), its /health, the process tree behind its port, what it
declares.

vLLM's API server starts an engine-core process (and, with tensor parallelism or on vLLM's CPU build,
one worker per rank); those children hold the device memory, so the whole tree is the engine's. With the
vLLM plugin enabled it declares its ledger, rank by rank, and its other processes' host memory
(vllm_ledger.py). Without it, its budget is vLLM V1's own rule: gpu_memory_utilization x the total
memory of each device it uses. With an explicit
kv_cache_memory_bytes that budget is unknown and nothing is declared; vLLM's CPU backend reports
its VLLM_CPU_KVCACHE_SPACE that way, and a share of the host is no budget anyway.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from vramledger.exporter.engines.base import EngineInfo, EngineState, Loading, Unreachable, Wrong
from vramledger.exporter.engines.bounds import OutOfBounds, shown
from vramledger.exporter.engines.fetch import HttpClient
from vramledger.exporter.engines.kinds import EngineKind
from vramledger.exporter.engines.promtext import line_samples, sample_lines
from vramledger.exporter.engines.served import PortEngine
from vramledger.exporter.engines.vllm_ledger import LedgerReader
from vramledger.exporter.engines.wrong_kind import other_kind
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.processes import Locator

NAME = "vllm"
SOURCE = "vllm"
# The only series read; a vLLM /metrics is ~60 KB, mostly histograms, so the other lines are skipped
# unparsed (promtext.py).
CONFIG, KV_USAGE = "vllm:cache_config_info", "vllm:kv_cache_usage_perc"


@dataclass(frozen=True)
class VllmMetrics:
    """What the exporter reads from one vLLM /metrics text."""
    model: str = ""
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None  # set by the user: then utilization is not the budget
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    kv_usage: float | None = None

    @property
    def declared_share(self) -> float | None:
        """The share of each device vLLM holds itself to, when that is its budget."""
        if self.kv_cache_memory_bytes is not None:
            return None
        return self.gpu_memory_utilization


def parse_metrics(text: bytes | str) -> VllmMetrics:
    """The series the exporter uses from a vLLM /metrics text; raises ValueError when it has none.

    A data-parallel server serves one series per engine: its KV usage is the fullest engine's (the
    one that queues first).
    """
    lines = sample_lines(text.encode() if isinstance(text, str) else text, (CONFIG, KV_USAGE))
    kv: list[float] = []
    config: dict[str, str] = {}
    model = ""
    for line in lines:
        for sample in line_samples(line):  # the config line never changes while a server runs
            model = model or sample.labels.get("model_name", "")
            if sample.name == CONFIG:
                config = sample.labels
            elif sample.name == KV_USAGE:
                kv.append(sample.value)
    if not config:
        raise ValueError(f"no {CONFIG} series: not a vLLM server's /metrics")
    return VllmMetrics(
        model=model,
        gpu_memory_utilization=_number(config.get("gpu_memory_utilization"), float),
        kv_cache_memory_bytes=_number(config.get("kv_cache_memory_bytes"), int),
        num_gpu_blocks=_number(config.get("num_gpu_blocks"), int),
        block_size=_number(config.get("block_size"), int),
        kv_usage=max(kv, default=None))


def _number(text: str | None, kind):
    if text in (None, "", "None"):
        return None
    try:
        number = float(text)
    except ValueError:
        return None
    if not math.isfinite(number):  # a value, but none a server could hold (and no int)
        raise OutOfBounds(f"{shown(text)} is no finite number")
    return kind(number)


class VllmEngine(PortEngine):
    """Reads one vLLM server each scrape: GET /metrics and /health, and its processes by port (or a given
    pid); its version and its ledger (GET /vramledger/memory) once per process tree.

    A server that is not serving says why through NotServing (a vLLM that is still loading does not
    accept connections yet: unreachable). Processes that cannot be found are counted in
    vramledger_exporter_errors_total{source="vllm"}: the server serves, the exporter cannot see it.
    """
    kind, source = NAME, SOURCE

    def __init__(self, url: str, client: HttpClient, errors: ErrorLog, locator: Locator | None = None):
        super().__init__(url, client, errors, locator)
        self._ledger = LedgerReader(self.url, client, errors)

    def serving(self) -> EngineState:
        metrics = self.read_metrics()
        self.check_health()
        pids = self.pids()
        ledger = self._ledger.read(pids)
        # GET /version: {"version": "0.32.0"}
        version = self.noted_version(lambda: str(self.get("/version").json().get("version", "")))
        return EngineState(pids, EngineInfo(NAME, version, metrics.model), metrics.kv_usage,
                           declared_share=metrics.declared_share, ranks=ledger.ranks, processes=ledger.processes)

    def forget(self) -> None:
        super().forget()
        self._ledger.forget()

    def read_metrics(self) -> VllmMetrics:
        """GET /metrics, parsed; raises NotServing."""
        text = self.get("/metrics").content
        try:
            return parse_metrics(text)
        except ValueError as e:
            raise other_kind(self.url, text, KIND) or Wrong(f"{self.url}/metrics: {e}") from None

    def check_health(self) -> None:
        """GET /health; raises NotServing where vLLM says its engine is not healthy.

        vLLM's API server answers /metrics whatever its engine core does, but /health asks the engine
        client: 503 once the engine core has died (vllm/entrypoints/serve/instrumentator/health.py:
        EngineDeadError), until the API server exits (its watchdog, within 5 s; never with
        VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1). Such a server serves nothing: it is down, not loading (a vLLM
        that is loading accepts no connection yet).
        """
        try:
            self.get("/health")
        except Loading as e:
            raise Unreachable(f"{self.url}/health answered 503: its engine core is dead ({e})") from None


KIND = EngineKind(
    name=NAME, flag="--vllm", title="a vLLM server", source=SOURCE, adapter=VllmEngine,
    signature=CONFIG.encode(), takes_pid=True,
    declares=("with the vLLM plugin, each rank's ledger on its device (weights of each model, KV cache, CUDA "
              "graphs, activations, the rest) and its other processes' host memory; without it, "
              "`gpu_memory_utilization` x each GPU it uses (its budget); its KV cache usage"),
    flags=("unaccounted memory on each device where it declares; with the vLLM plugin, weights outside its "
           "budget (a draft loaded after its memory profile) and other processes' memory its profile run "
           "charged to it"))
