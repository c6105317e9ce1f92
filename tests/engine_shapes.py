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


# --- llama.cpp (ggml-org/llama.cpp, tools/server/README.md) ---------------------------------------

LLAMACPP_LOADING = (503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
LLAMACPP_OK = {"status": "ok"}  # GET /health once the model is loaded


def llamacpp_props(total_slots: int = 4, n_ctx: int = 8192, build_info: str = "b6712-4f8d3b2e",
                   model_path: str = "/models/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf") -> dict:
    """GET /props: default_generation_settings (one slot's settings, n_ctx among them), total_slots,
    model_path, chat_template, modalities, build_info (a few of its settings here)."""
    return {"default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": n_ctx, "speculative": False,
                                            "is_processing": False,
                                            "params": {"n_predict": -1, "temperature": 0.8, "top_k": 40}},
            "total_slots": total_slots, "model_path": model_path, "chat_template": "...",
            "modalities": {"vision": False}, "build_info": build_info}


def llamacpp_metrics(kv_cache_usage_ratio: float | None = None) -> str:
    """GET /metrics with --metrics: llamacpp:* series (the README's table); builds before the KV cache was
    unified also served llamacpp:kv_cache_usage_ratio and llamacpp:kv_cache_tokens."""
    lines = ["# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.",
             "# TYPE llamacpp:prompt_tokens_total counter", "llamacpp:prompt_tokens_total 6886",
             "# HELP llamacpp:requests_processing Number of requests processing.",
             "# TYPE llamacpp:requests_processing gauge", "llamacpp:requests_processing 1",
             "# HELP llamacpp:n_tokens_max High watermark of the context size observed.",
             "# TYPE llamacpp:n_tokens_max counter", "llamacpp:n_tokens_max 1911"]
    if kv_cache_usage_ratio is not None:
        lines += ["# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.",
                  "# TYPE llamacpp:kv_cache_usage_ratio gauge", f"llamacpp:kv_cache_usage_ratio {kv_cache_usage_ratio}",
                  "# HELP llamacpp:kv_cache_tokens KV-cache tokens.", "# TYPE llamacpp:kv_cache_tokens gauge",
                  "llamacpp:kv_cache_tokens 2131"]
    return "\n".join(lines) + "\n"


# --- TGI (huggingface/text-generation-inference) --------------------------------------------------

def tgi_info(max_batch_total_tokens: int | None = 163_840, version: str = "3.3.4") -> dict:
    """GET /info: router/src/lib.rs Info, with the v3 backend's BackendInfo (backends/v3/src/lib.rs)
    flattened into it."""
    return {"model_id": MODEL, "model_sha": "0e9e39f249a16976918f6564b8830bc894c89659",
            "model_pipeline_tag": "text-generation", "max_concurrent_requests": 128, "max_best_of": 2,
            "max_stop_sequences": 4, "max_input_tokens": 8191, "max_total_tokens": 8192,
            "validation_workers": 2, "max_client_batch_size": 4, "router": "text-generation-router",
            "version": version, "sha": "b4d17f18ff6b1f4a5a0bbfd1a5a0e43ea5d8ee1f", "docker_label": None,
            "model_device_type": "cuda", "model_dtype": "torch.float16", "speculate": 0,
            "waiting_served_ratio": 0.3, "max_batch_total_tokens": max_batch_total_tokens,
            "max_waiting_tokens": 20, "max_batch_size": None, "support_chunking": True,
            "prefix_caching": True, "attention_impl": "flashinfer", "block_size": 1}


def tgi_metrics(batch_tokens: int | None = None) -> str:
    """GET /metrics: tgi_* series (docs/source/reference/metrics.md); tgi_batch_current_max_tokens once a
    batch has run (backends/v3/src/backend.rs sets it per batch, 0 when the batch empties)."""
    lines = ["# TYPE tgi_request_count counter", "tgi_request_count 253",
             "# TYPE tgi_queue_size gauge", "tgi_queue_size 0"]
    if batch_tokens is not None:
        lines += ["# TYPE tgi_batch_current_size gauge", "tgi_batch_current_size 8",
                  "# TYPE tgi_batch_current_max_tokens gauge", f"tgi_batch_current_max_tokens {batch_tokens}"]
    return "\n".join(lines) + "\n"


# --- TensorRT-LLM behind Triton (triton-inference-server/tensorrtllm_backend, README.md) ----------

def triton_metrics(used: int = 1, free: int = 6239, tokens_per: int = 64, gpu_bytes: int = 1_610_236,
                   trt_llm: bool = True) -> str:
    """GET :8002/metrics: Triton's own nv_* series and, once its TensorRT-LLM model serves, the
    nv_trt_llm_* gauges of the README's "Triton Metrics" example (labels model, version)."""
    lines = ["# HELP nv_inference_request_success Number of successful inference requests",
             "# TYPE nv_inference_request_success counter",
             'nv_inference_request_success{model="ensemble",version="1"} 12',
             "# HELP nv_gpu_memory_used_bytes GPU used memory, in bytes",
             "# TYPE nv_gpu_memory_used_bytes gauge",
             'nv_gpu_memory_used_bytes{gpu_uuid="GPU-8c9e2f0a-1b2c-3d4e-5f60-718293a4b5c6"} 75161927680']
    if trt_llm:
        labels = 'model="tensorrt_llm",version="1"'
        lines += ["# HELP nv_trt_llm_runtime_memory_metrics TRT LLM runtime memory metrics",
                  "# TYPE nv_trt_llm_runtime_memory_metrics gauge",
                  f'nv_trt_llm_runtime_memory_metrics{{memory_type="pinned",{labels}}} 0',
                  f'nv_trt_llm_runtime_memory_metrics{{memory_type="gpu",{labels}}} {gpu_bytes}',
                  f'nv_trt_llm_runtime_memory_metrics{{memory_type="cpu",{labels}}} 0',
                  "# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics",
                  "# TYPE nv_trt_llm_kv_cache_block_metrics gauge",
                  f'nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="tokens_per",{labels}}} {tokens_per}',
                  f'nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="used",{labels}}} {used}',
                  f'nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="free",{labels}}} {free}',
                  f'nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="max",{labels}}} {used + free}']
    return "\n".join(lines) + "\n"
