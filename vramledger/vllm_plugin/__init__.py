"""vLLM's memory ledger from inside vLLM: a general plugin records every worker, an endpoint serves it.

Both entry points are named "vramledger"; `VLLM_PLUGINS=vramledger` enables the pair. This module
imports nothing heavy: vLLM imports it in every process, and the worker hooks load only when enabled.
"""
from __future__ import annotations

import logging

from vramledger.vllm_plugin.gate import enabled, unsupported_reason, vllm_version

log = logging.getLogger("vllm.plugins.vramledger")


def register() -> None:
    """vllm.general_plugins: runs in every vLLM process; installs the worker hooks where enabled."""
    # Not enabled: vLLM itself says why (endpoint plugins need VLLM_PLUGINS). Unsupported: the
    # endpoint says it, once, in the API server; the engine processes stay quiet.
    if not enabled() or unsupported_reason(vllm_version()) is not None:
        return
    from vramledger.vllm_plugin.hooks import install

    install()


def make_endpoint():
    """vllm.endpoint_plugins: the API server's GET /vramledger/memory."""
    from vramledger.vllm_plugin.endpoint import InactiveEndpoint, MemoryEndpoint

    version = vllm_version()
    reason = unsupported_reason(version)
    if reason is not None:
        log.warning(reason)
        return InactiveEndpoint()
    return MemoryEndpoint(version)
