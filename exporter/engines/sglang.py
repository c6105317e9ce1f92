"""An SGLang server: GET /get_server_info each scrape (its arguments, and the memory of each data-parallel
rank), and its /metrics where it serves one (--enable-metrics), for its KV cache usage.

What SGLang holds is the declaration: the weights, KV cache and CUDA graphs each rank says it holds, as
its ledger per rank. SGLang's budget, mem_fraction_static x each GPU, covers only its weights and KV
cache (SGLang leaves the rest of the GPU to its activations and CUDA graphs), so a server within its
budget still holds more than it; where a server gives no figures for its weights (SGLang before they
were added to its internal state) that budget is what it declares, the one figure it gives. What a rank
holds beyond its three figures (its CUDA context, its activations, NCCL's buffers) is then its
unaccounted memory.

The shapes, from sgl-project/sglang:
- /get_server_info (python/sglang/srt/entrypoints/http_server.py, get_server_info): the server's
  arguments (dataclasses.asdict(server_args): mem_fraction_static, tp_size, pp_size, dp_size,
  enable_dp_attention, model_path, served_model_name), the scheduler's info (max_total_num_tokens),
  "internal_states" (one per data-parallel rank, from tokenizer_manager.get_internal_state) and "version".
- internal_states[i].memory_usage (python/sglang/srt/managers/scheduler.py, get_internal_state):
  weight (model_runner.weight_load_mem_usage), kvcache (the KV pool's mem_usage), graph (cuda_graph in
  older versions; model_runner.graph_mem_usage) and token_capacity (max_total_num_tokens). Older versions
  give only kvcache and token_capacity.
- Their unit: "GB" meaning 2^30 bytes, rounded to 2 decimals (so each figure is within 5.4 MB). weight
  and graph are differences of get_available_gpu_memory, which returns free memory / (1 << 30)
  (python/sglang/srt/utils/common.py); kvcache is (K + V bytes) / GB with GB = 1024 * 1024 * 1024
  (python/sglang/srt/mem_cache/memory_pool.py).
- /metrics (python/sglang/srt/metrics/collector.py): sglang:token_usage, a gauge per scheduler (labels
  model_name, tp_rank, ...): the share of its KV cache's tokens in use.

Each internal state is the scheduler of tensor-parallel rank 0 of one data-parallel rank; its tensor-
(and pipeline-) parallel peers hold equal shares of the weights and KV heads, so each GPU of the group
is declared with those figures, a rank each, on an unnamed GPU (SGLang names none: base.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from vramledger.exporter.engines.base import EngineInfo, EngineState, Wrong
from vramledger.exporter.engines.bounds import MAX_BYTES, MAX_RANKS, OutOfBounds, shown
from vramledger.exporter.engines.kinds import EngineKind
from vramledger.exporter.engines.ranks import Entry, RankLedger
from vramledger.exporter.engines.served import PortEngine, field

NAME = "sglang"
GIB = 1 << 30  # SGLang's "GB"
TOKEN_USAGE = "sglang:token_usage"
# memory_usage key -> ledger component (vramledger.ledger_vocabulary.COMPONENTS)
COMPONENTS = {"weight": "weights", "kvcache": "kv_cache", "graph": "cuda_graph", "cuda_graph": "cuda_graph"}


@dataclass(frozen=True)
class ServerInfo:
    """What the exporter reads from one /get_server_info."""
    version: str
    model: str
    mem_fraction_static: float | None
    ranks: tuple[RankLedger, ...]  # () where the internal states give no weights
    token_capacity: int | None  # tokens of its KV caches, summed over its data-parallel ranks


def gib(value: object, where: str) -> int:
    """SGLang's GB figure in bytes; raises ValueError (OutOfBounds for a number no memory holds)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} {shown(value)} is no number")
    if not math.isfinite(value) or value < 0:
        raise OutOfBounds(f"{where} {shown(value)} GB is no amount of memory")
    if value > MAX_BYTES / GIB:  # checked before it is multiplied: 1e300 GB would overflow a float
        raise OutOfBounds(f"{where} {shown(value)} GB is beyond {MAX_BYTES // GIB} GB (1 PiB)")
    return round(value * GIB)


def gpus_per_state(doc: dict) -> int:
    """The GPUs one internal state speaks for: its tensor- and pipeline-parallel group (with data-parallel
    attention, the data-parallel ranks split one tensor-parallel group)."""
    tp, pp, dp = (field(doc, k, int, "server info", optional=True) for k in ("tp_size", "pp_size", "dp_size"))
    tp, pp, dp = (1 if size is None else size for size in (tp, pp, dp))
    if min(tp, pp, dp) < 1:
        raise ValueError(f"tp_size {tp}, pp_size {pp}, dp_size {dp}: not a parallel layout")
    shared = dp if doc.get("enable_dp_attention") is True else 1
    return max(1, tp * pp // shared)


def parse_server_info(doc: object) -> ServerInfo:
    """raises ValueError where doc is not SGLang's /get_server_info (OutOfBounds beyond bounds)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("version"), str) or "mem_fraction_static" not in doc:
        raise ValueError("not SGLang's server info (no version and mem_fraction_static)")
    share = field(doc, "mem_fraction_static", (int, float), "server info", optional=True)
    model = field(doc, "served_model_name", str, "server info", optional=True) \
        or field(doc, "model_path", str, "server info", optional=True) or ""
    states = field(doc, "internal_states", list, "server info", optional=True) or []
    usages = [field(state, "memory_usage", dict, f"internal state {i}") for i, state in enumerate(states)]
    capacities = [field(u, "token_capacity", int, f"internal state {i}", optional=True) for i, u in enumerate(usages)]
    capacity = sum(c for c in capacities if c is not None) if any(c is not None for c in capacities) \
        else field(doc, "max_total_num_tokens", int, "server info", optional=True)
    ranks: tuple[RankLedger, ...] = ()
    if usages and all("weight" in u for u in usages):
        per = gpus_per_state(doc)
        if len(usages) * per > MAX_RANKS:
            raise OutOfBounds(f"{len(usages)} data-parallel ranks of {per} GPUs, beyond {MAX_RANKS} ranks")
        ranks = tuple(_rank(i * per + j, usage, i) for i, usage in enumerate(usages) for j in range(per))
    return ServerInfo(doc["version"], model, None if share is None else float(share), ranks, capacity)


def _rank(rank: int, usage: dict, state: int) -> RankLedger:
    entries = tuple(Entry(component, "", gib(usage[key], f"internal state {state}: {key}"), None)
                    for key, component in COMPONENTS.items() if key in usage)
    return RankLedger(rank, "cuda", None, sum(e.bytes for e in entries), entries)


class SglangEngine(PortEngine):
    """Reads one SGLang server each scrape; its processes (its tokenizer manager, schedulers and detokenizer
    are children of the server listening on its port) by port."""
    kind = source = NAME

    def serving(self) -> EngineState:
        try:
            info = parse_server_info(self.json("/get_server_info"))
        except (ValueError, AttributeError) as e:
            if isinstance(e, OutOfBounds):
                raise
            raise Wrong(f"{self.url}/get_server_info: {e}") from None
        pids = self.pids()
        return EngineState(pids, EngineInfo(NAME, info.version, info.model), self.fullest(TOKEN_USAGE),
                           declared_share=None if info.ranks else info.mem_fraction_static, ranks=info.ranks,
                           token_capacity=info.token_capacity)


KIND = EngineKind(
    name=NAME, flag="--sglang", title="an SGLang server", source=NAME, adapter=SglangEngine,
    signature=b"sglang:",
    port=30000,  # its --port default (python/sglang/srt/server_args.py)
    takes_pid=True,
    declares=("weights, KV cache and CUDA graphs per rank (`/get_server_info`), or where it gives no "
              "weights its budget `mem_fraction_static` x each GPU; KV usage from `sglang:token_usage` "
              "(`--enable-metrics`); token capacity"),
    flags=("unaccounted memory on each GPU where it declares: what a rank holds beyond its weights, KV cache "
           "and CUDA graphs (its CUDA context, activations, communication buffers), or beyond its budget "
           "where it gives no weights"))
