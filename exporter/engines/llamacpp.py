"""A llama.cpp server (llama-server): GET /health each scrape, GET /props once per server run, and its
/metrics where it serves one (--metrics), for its KV cache usage.

llama.cpp gives no bytes: it declares nothing, so it has no declared or unaccounted series; its
processes are attributed (the one behind its port), so what they hold is its observed memory and no
other engine's or a foreign process's.

The shapes, from ggml-org/llama.cpp tools/server/README.md: GET /health answers 503
{"error": {"code": 503, "message": "Loading model", ...}} while the model loads, 200 {"status": "ok"}
once ready; GET /props gives total_slots, model_path (and, in newer builds, model_alias), build_info
and default_generation_settings.n_ctx (the context of one slot: whether slots share one KV cache it does
not say, so no token capacity is derived from it); GET /metrics, only with --metrics (an error status
without it), serves llamacpp:* series, among them, in builds before the KV cache was unified,
llamacpp:kv_cache_usage_ratio (1 means full); newer builds serve no KV cache usage.
"""
from __future__ import annotations

import posixpath

from vramledger.exporter.engines.base import EngineInfo, EngineState, Wrong
from vramledger.exporter.engines.kinds import EngineKind
from vramledger.exporter.engines.served import PortEngine, field

NAME = "llamacpp"
KV_USAGE = "llamacpp:kv_cache_usage_ratio"


def parse_props(doc: object) -> tuple[str, str]:
    """(version, model) of a GET /props; raises ValueError where it is not llama.cpp's."""
    field(doc, "total_slots", int, "/props")
    field(field(doc, "default_generation_settings", dict, "/props"), "n_ctx", int, "default_generation_settings")
    assert isinstance(doc, dict)  # field has checked it
    version = field(doc, "build_info", str, "/props", optional=True) or ""
    alias = field(doc, "model_alias", str, "/props", optional=True)
    model = alias or posixpath.basename(field(doc, "model_path", str, "/props"))
    return version, model


class LlamacppEngine(PortEngine):
    """Reads one llama.cpp server each scrape; its identity once per server run."""
    kind = source = NAME

    def serving(self) -> EngineState:
        self.get("/health")  # 503 while its model loads: loading
        pids = self.pids()
        try:
            version, model = self.fact("props", lambda: parse_props(self.json("/props")))
        except ValueError as e:
            raise Wrong(f"{self.url}/props: {e}") from None
        return EngineState(pids, EngineInfo(NAME, version, model), self.fullest(KV_USAGE))


KIND = EngineKind(
    name=NAME, flag="--llamacpp", title="a llama.cpp server", source=NAME, adapter=LlamacppEngine,
    signature=b"llamacpp:",
    port=8080,  # llama-server's --port default
    takes_pid=True,
    declares=("no bytes; KV usage from `llamacpp:kv_cache_usage_ratio` where its build serves it "
              "(`--metrics`); attributed by process"))
