"""vLLM 0.33's names: 0.32's, unchanged (each checked against 0.33.0's sources).

Between 0.32 and 0.33 nothing the hooks reach moved: the same functions with the same parameters,
MemoryProfilingResult and MemorySnapshot with the same fields (`non_torch_memory` included), both
model runners' `capture_model` as in 0.32. What changed around them (the V2 runner's warm-up, cuBLAS
handles created before the start snapshot) is in what vLLM measures, not in where the plugin reads it.
"""
from __future__ import annotations

from dataclasses import replace

from vramledger.vllm_plugin.versions import v0_32

NAMES = replace(v0_32.NAMES, version="0.33")
