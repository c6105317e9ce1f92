"""GET /vramledger/memory on vLLM's API server: the ledger of every rank of its engine.

The ranks live in other processes (the engine core, its workers). The route asks them through
the engine client's collective_rpc, the path vLLM's plugin contract names for this pairing
(vllm/plugins/endpoint_plugins/interface.py): each rank answers from its own memory at that
moment, so live values are live and nothing is left behind when vLLM stops (no files to go
stale, no directory to agree on). The engine answers between two steps, so a busy engine delays
the answer by one step; a stuck one gets a 504 after RPC_TIMEOUT_S.

The server's other processes (this API server, the engine core, vLLM's helpers) keep no ledger: each
declares the host memory it held when the server became ready (server_processes.py), measured here
when vLLM sets up the endpoint's state, just before it takes requests.
"""
from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from fastapi.responses import JSONResponse

from vramledger.ledger_vocabulary import LEDGER_VERSION
from vramledger.vllm_plugin.gate import PLUGIN_NAME
from vramledger.vllm_plugin.hooks import RPC_METHOD
from vramledger.vllm_plugin.server_processes import at_ready, declarations

log = logging.getLogger("vllm.plugins.vramledger")

PATH = "/vramledger/memory"
RPC_TIMEOUT_S = 10.0


class MemoryEndpoint:
    """The endpoint plugin: one GET route that gathers the ranks' ledgers."""

    name = PLUGIN_NAME
    required_tasks = None  # every engine holds memory; the render-only server has none (503)

    def __init__(self, vllm_version: str):
        self.vllm_version = vllm_version

    def attach_router(self, app) -> None:
        app.add_api_route(PATH, self.memory, methods=["GET"], summary="The memory ledger of every rank")

    async def init_state(self, engine_client, state, args) -> None:
        state.vramledger_engine = engine_client
        state.vramledger_at_ready = None
        if engine_client is None:
            return
        try:  # the engine is up, its ranks hold their KV caches: the server's processes as it gets ready
            state.vramledger_at_ready = await asyncio.to_thread(at_ready)
        except Exception as e:  # the plugin must never break vLLM: the document says null instead
            log.warning("vramledger: measuring the server's processes failed (%s: %s); its document declares "
                        "none of them", type(e).__name__, e)

    async def memory(self, request: Request):
        engine = getattr(request.app.state, "vramledger_engine", None)
        if engine is None:
            return JSONResponse({"error": "this server runs no engine"}, status_code=503)
        try:
            ranks = await asyncio.wait_for(engine.collective_rpc(RPC_METHOD), RPC_TIMEOUT_S)
        except asyncio.TimeoutError:
            return JSONResponse({"error": f"the engine did not answer within {RPC_TIMEOUT_S:g} s"},
                                status_code=504)
        except Exception as e:  # a dead engine, or ranks started without the plugin
            return JSONResponse({"error": f"the engine's ranks gave no ledger: {type(e).__name__}: {e}"},
                                status_code=503)
        snapshot = getattr(request.app.state, "vramledger_at_ready", None)
        rank_pids = frozenset(r["worker"]["pid"] for r in ranks)
        processes = None if snapshot is None else await asyncio.to_thread(declarations, snapshot, rank_pids)
        return {"version": LEDGER_VERSION, "engine": "vllm", "engine_version": self.vllm_version,
                "ranks": sorted(ranks, key=lambda r: r["rank"]), "processes": processes}


class InactiveEndpoint:
    """What a vLLM version the plugin was not built for gets: no route, no state."""

    name = PLUGIN_NAME
    required_tasks = None

    def attach_router(self, app) -> None:
        pass

    async def init_state(self, engine_client, state, args) -> None:
        pass
