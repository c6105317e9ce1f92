"""TensorRT-LLM behind a Triton Inference Server: its metrics endpoint's /metrics (port 8002 by default:
watch that URL), each scrape.

TensorRT-LLM gives no total it holds: it declares nothing, so it has no declared or unaccounted series;
Triton's processes are attributed (the server behind its metrics port, which also serves its HTTP and
gRPC ports, and its children: the model instances TensorRT-LLM spawns in orchestrator mode). It gives
its KV cache in blocks (its usage: used / max blocks; its capacity: max blocks x tokens per block) and
its runtime's memory, published per type (vramledger_engine_runtime_memory_bytes): a part of what it
holds, not all of it (the engine's weights and activations are outside it), so not a declaration.
Triton's nv_gpu_memory_used_bytes is the whole GPU's, every process's: NVML reads that already.

The shapes, from triton-inference-server/tensorrtllm_backend README.md ("Triton Metrics"): the gauges
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"|"free"|"used"|"tokens_per"|"fraction", model,
version} and nv_trt_llm_runtime_memory_metrics{memory_type="gpu"|"cpu"|"pinned", model, version} (bytes),
beside Triton's own nv_* series (nv_inference_*, nv_gpu_*). Triton serves its nv_* series before its
TensorRT-LLM model is loaded; the nv_trt_llm_* series appear once it serves.
"""
from __future__ import annotations

from vramledger.exporter.engines.base import EngineInfo, EngineState, Loading, Wrong
from vramledger.exporter.engines.bounds import OutOfBounds
from vramledger.exporter.engines.kinds import EngineKind
from vramledger.exporter.engines.served import PortEngine

NAME = "triton"
BLOCKS, RUNTIME = "nv_trt_llm_kv_cache_block_metrics", "nv_trt_llm_runtime_memory_metrics"
TRITON = b"\nnv_"  # any of Triton's own series


class TritonEngine(PortEngine):
    """Reads one Triton server's metrics endpoint each scrape."""
    kind = source = NAME

    def serving(self) -> EngineState:
        metrics = self.get("/metrics")
        blocks: dict[str, dict[str, float]] = {}  # model -> block type -> value
        runtime: dict[str, int] = {}
        for sample in self.samples(metrics, (BLOCKS, RUNTIME)):
            model = sample.labels.get("model", "")
            if sample.name == BLOCKS:
                blocks.setdefault(model, {})[sample.labels.get("kv_cache_block_type", "")] = sample.value
            elif sample.value != int(sample.value) or sample.value < 0:
                raise OutOfBounds(f"{RUNTIME} {sample.value!r} is no number of bytes")
            else:
                kind = sample.labels.get("memory_type", "")
                runtime[kind] = runtime.get(kind, 0) + int(sample.value)
        if not blocks and not runtime:
            if TRITON in b"\n" + metrics.content:
                raise Loading(f"{self.url}/metrics: Triton serves no TensorRT-LLM model yet")
            raise Wrong(f"{self.url}/metrics: no nv_ series: not a Triton server's metrics endpoint")
        pids = self.pids()
        usage, capacity = _kv_cache(blocks)
        models = sorted(blocks)
        return EngineState(pids, EngineInfo(NAME, "", models[0] if len(models) == 1 else ""), usage,
                           token_capacity=capacity, runtime_memory=tuple(sorted(runtime.items())))


def _kv_cache(blocks: dict[str, dict[str, float]]) -> tuple[float | None, int | None]:
    """(usage of the fullest model's KV cache, tokens all of them hold); None where a model lacks a figure."""
    usages, tokens = [], []
    for model, kinds in blocks.items():
        most, used, per = kinds.get("max"), kinds.get("used"), kinds.get("tokens_per")
        if most is None or used is None or per is None:
            return None, None
        if most <= 0 or not 0 <= used <= most or per <= 0 or most != int(most) or per != int(per):
            raise OutOfBounds(f"{model}: KV cache blocks used {used!r} of {most!r}, {per!r} tokens each")
        usages.append(used / most)
        tokens.append(int(most) * int(per))
    return max(usages, default=None), sum(tokens) if tokens else None


KIND = EngineKind(
    name=NAME, flag="--triton", title="a Triton server with TensorRT-LLM", source=NAME, adapter=TritonEngine,
    signature=b"nv_trt_llm_",
    port=8002,  # Triton's --metrics-port default: the URL watched is its metrics endpoint
    takes_pid=True,
    declares=("no bytes; KV usage and token capacity from `nv_trt_llm_kv_cache_block_metrics`, its "
              "runtime memory (`nv_trt_llm_runtime_memory_metrics`) published; attributed by process"))
