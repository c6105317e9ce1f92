"""The answers of the engines that cannot run here (they need a GPU), in their own shapes, each built from
that engine's source or docs (named beside each); tests/fake_engines.py serves them over HTTP.

Values are a plausible server's; tests change them through the arguments.
"""
from __future__ import annotations

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


# --- SGLang (sgl-project/sglang) ----------------------------------------------------------------

def sglang_memory(weight: float = 14.99, kvcache: float = 52.3, graph: float | None = 0.45,
                  token_capacity: int = 428_000, graph_key: str = "graph") -> dict:
    """One internal state's memory_usage: python/sglang/srt/managers/scheduler.py, get_internal_state
    (GB = 2^30 bytes, rounded to 2 decimals; older versions name graph cuda_graph)."""
    usage: dict = {"weight": weight, "kvcache": kvcache, "token_capacity": token_capacity}
    if graph is not None:
        usage[graph_key] = graph
    return usage


def sglang_server_info(*usages: dict, tp_size: int = 1, dp_size: int = 1, mem_fraction_static=0.88,
                       version: str = "0.5.3", **args) -> dict:
    """GET /get_server_info: python/sglang/srt/entrypoints/http_server.py get_server_info, the server's
    arguments (dataclasses.asdict(server_args), a few of its ~200 fields here) merged with the scheduler's
    info, "internal_states" (one per data-parallel rank, each the scheduler's dict(server args) plus its
    last_gen_throughput and memory_usage) and "version"."""
    server_args = {"model_path": MODEL, "tokenizer_path": MODEL, "served_model_name": MODEL,
                   "host": "0.0.0.0", "port": 30000, "mem_fraction_static": mem_fraction_static,
                   "max_total_tokens": None, "max_running_requests": None, "tp_size": tp_size,
                   "pp_size": 1, "dp_size": dp_size, "enable_dp_attention": False, "enable_metrics": True,
                   "kv_cache_dtype": "auto", "disable_cuda_graph": False, "cuda_graph_max_bs": 160} | args
    states = [server_args | {"last_gen_throughput": 0.0, "memory_usage": usage} for usage in usages]
    return server_args | {"max_total_num_tokens": usages[0]["token_capacity"] if usages else 428_000,
                          "max_req_input_len": 131066, "internal_states": states, "version": version}


def sglang_metrics(*usages: float) -> str:
    """GET /metrics with --enable-metrics: python/sglang/srt/metrics/collector.py, one sglang:token_usage
    gauge per scheduler (labelled model_name, engine_type, tp_rank, pp_rank), beside its other series."""
    lines = ["# HELP sglang:num_running_reqs The number of running requests.",
             "# TYPE sglang:num_running_reqs gauge"]
    labels = [f'engine_type="unified",model_name="{MODEL}",pp_rank="0",tp_rank="{i}"' for i in range(len(usages))]
    lines += [f"sglang:num_running_reqs{{{label}}} 2.0" for label in labels]
    lines += ["# HELP sglang:token_usage The token usage.", "# TYPE sglang:token_usage gauge"]
    lines += [f"sglang:token_usage{{{label}}} {usage}" for label, usage in zip(labels, usages)]
    return "\n".join(lines) + "\n"


# --- Ollama (ollama/ollama) -----------------------------------------------------------------------

def ollama_model(name: str = "llama3.2:3b", size: int = 3_600_000_000, size_vram: int | None = None,
                 context_length: int = 4096) -> dict:
    """One entry of GET /api/ps: api/types.go ProcessModelResponse (size and size_vram in bytes; a model
    Ollama could not fit on its GPUs has size_vram < size, the rest in host memory)."""
    return {"name": name, "model": name, "size": size,
            "digest": "a80c4f17acd55265feec403c7aef86be0c25983ab279d83f3bcd3abbcb5b8b72",
            "details": {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
                        "parameter_size": "3.2B", "quantization_level": "Q4_K_M"},
            "expires_at": "2026-12-07T14:38:31.83753Z", "size_vram": size if size_vram is None else size_vram,
            "context_length": context_length}


def ollama_ps(*models: dict) -> dict:
    """GET /api/ps: api.ProcessResponse (server/routes.go PsHandler), [] when nothing is loaded."""
    return {"models": list(models)}


def ollama_version(version: str = "0.12.3") -> dict:
    """GET /api/version: {"version": ...} (server/routes.go)."""
    return {"version": version}
