"""The ledger's words (docs/ledger.md): its version, its components in order, how an entry was measured."""

from typing import Final

LEDGER_VERSION: Final = 1  # Final: its value is its type (ledger_document.Version)
# Entry order in the document and the table: from the process's start to the KV cache.
COMPONENTS = ("runtime", "weights", "kernels", "compiled", "activation_peak", "non_torch", "allocator",
              "sequence_state", "server", "cuda_graph", "kv_cache")
# The worker captures no CUDA graphs and so records no cuda_graph entry; vLLM's ledger (vllm_plugin) does.
# The memory-ledger dashboard stacks exactly these (tests/test_dashboards.py).
WORKER_COMPONENTS = tuple(c for c in COMPONENTS if c != "cuda_graph")
# What the worker measures as growth of its process before the profile run, and so what its non_torch
# residual (the process's growth since start that nothing else explains) subtracts. A component
# recorded before the profile run and not named here would be counted twice: the worker refuses to
# size its KV cache then (worker/engine/memory_setup.py).
GROWTH_BEFORE_PROFILE = ("weights", "kernels", "compiled")
# What the worker's memory plan measures from the profile run on, replacing an earlier plan's. With
# runtime and the growth above, these are every worker component (tests/test_non_torch_residual.py).
MEASURED_FROM_PROFILE = ("activation_peak", "non_torch", "allocator", "sequence_state", "server", "kv_cache")
# An entry's scope: measured for its process alone, or read from the device's free memory, which
# also moves when other processes allocate (how a neighbour gets charged to an engine).
SCOPE_PROCESS: Final = "process"
SCOPE_DEVICE: Final = "device"
# A vLLM server's processes besides its ranks, by role (the vLLM plugin's "processes": the API server, the
# engine core, vLLM's helpers); each declares the host memory it held once the server was ready.
SERVER_ROLES = ("api_server", "engine_core", "other")
