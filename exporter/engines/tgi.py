"""A Hugging Face TGI server (text-generation-inference's router): GET /metrics each scrape, GET /info
once per server run.

TGI gives no bytes: it declares nothing, so it has no declared or unaccounted series; its processes are
attributed: text-generation-launcher starts the router (behind the port) and one shard per GPU (which
hold the memory) as siblings, so where the router's parent is the launcher, the launcher's whole tree
is the server's. It gives its
token budget: max_batch_total_tokens, the tokens its KV cache holds, and the tokens the running batch
reserves of it, tgi_batch_current_max_tokens: their ratio is its KV cache usage.

The shapes, from huggingface/text-generation-inference: GET /info answers the router's Info
(router/src/lib.rs: model_id, model_sha, max_input_tokens, max_total_tokens, version, sha, ...; the
backend's BackendInfo flattened into it, backends/v3/src/lib.rs: max_batch_total_tokens,
max_waiting_tokens, max_batch_size, ...); GET /metrics serves tgi_* series (docs/source/reference/
metrics.md), among them the gauge tgi_batch_current_max_tokens, set by the batching loop to the running
batch's max_tokens and to 0 when it empties (backends/v3/src/backend.rs).
"""
from __future__ import annotations

from dataclasses import dataclass

import psutil

from vramledger.exporter.engines.base import EngineInfo, EngineState, Wrong
from vramledger.exporter.engines.fetch import HttpClient
from vramledger.exporter.engines.kinds import EngineKind
from vramledger.exporter.engines.served import PortEngine, field
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.processes import Locator, PortLocator

NAME = "tgi"
BATCH_TOKENS = "tgi_batch_current_max_tokens"
LAUNCHER = "text-generation-launcher"  # its executable (TGI's container entrypoint)


class LauncherLocator(PortLocator):
    """The process tree of the launcher whose router listens on the URL's port (the router's own where
    it has no launcher parent)."""

    # (the router, its start, the root of its tree): asked each scrape, the parent looked up once a router
    _top: tuple[int, float | None, int] | None = None

    def _root(self) -> int:
        router = super()._root()
        if self._top is None or self._top[:2] != (router, self._created):
            self._top = router, self._created, _launcher_of(router)
        return self._top[2]

    def forget(self) -> None:
        super().forget()
        self._top = None


def _launcher_of(router: int) -> int:
    """The router's parent where that is the launcher, else the router itself."""
    try:
        parent = psutil.Process(router).parent()
        return parent.pid if parent is not None and parent.name() == LAUNCHER else router
    except psutil.Error:  # gone or hidden: the router's tree, as for any other engine
        return router


@dataclass(frozen=True)
class TgiInfo:
    version: str
    model: str
    max_batch_total_tokens: int | None  # None where its backend sizes no batch by tokens


def parse_info(doc: object) -> TgiInfo:
    """A GET /info; raises ValueError where it is not TGI's."""
    model = field(doc, "model_id", str, "/info")
    version = field(doc, "version", str, "/info")
    field(doc, "max_total_tokens", int, "/info")
    budget = field(doc, "max_batch_total_tokens", int, "/info", optional=True)
    if budget is not None and budget <= 0:
        raise ValueError(f"max_batch_total_tokens {budget} holds no token")
    return TgiInfo(version, model, budget)


class TgiEngine(PortEngine):
    """Reads one TGI router each scrape; its /info once per server run."""
    kind = source = NAME

    def __init__(self, url: str, client: HttpClient, errors: ErrorLog, locator: Locator | None = None):
        super().__init__(url, client, errors, locator or LauncherLocator(url.rstrip("/")))

    def serving(self) -> EngineState:
        metrics = self.get("/metrics")
        pids = self.pids()
        try:
            info = self.fact("info", lambda: parse_info(self.json("/info")))
        except ValueError as e:
            raise Wrong(f"{self.url}/info: {e}") from None
        reserved = [s.value for s in self.samples(metrics, (BATCH_TOKENS,))]
        usage = None
        if reserved and info.max_batch_total_tokens is not None:
            usage = max(reserved) / info.max_batch_total_tokens
        return EngineState(pids, EngineInfo(NAME, info.version, info.model), usage,
                           token_capacity=info.max_batch_total_tokens)


KIND = EngineKind(
    name=NAME, flag="--tgi", title="a Hugging Face TGI server", source=NAME, adapter=TgiEngine,
    signature=b"tgi_",
    port=80,  # its Docker image sets PORT=80 (the launcher alone defaults to 3000)
    takes_pid=True,
    declares=("no bytes; token capacity `max_batch_total_tokens` (`/info`), KV usage "
              "`tgi_batch_current_max_tokens` / that; attributed by process"))
