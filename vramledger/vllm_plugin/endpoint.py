"""GET /vramledger/memory on vLLM's API server: the ledger of every rank of its engine.

The ranks live in other processes (the engine core, its workers). The route asks them through
the engine client's collective_rpc, the path vLLM's plugin contract names for this pairing
(vllm/plugins/endpoint_plugins/interface.py): each rank answers from its own memory at that
moment, so live values are live and nothing is left behind when vLLM stops (no files to go
stale, no directory to agree on). The engine answers between two steps, so a busy engine delays
the answer by one step; a stuck one gets a 504 after RPC_TIMEOUT_S.
"""
from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from vramledger.ledger_vocabulary import LEDGER_VERSION
from vramledger.vllm_plugin.gate import PLUGIN_NAME
from vramledger.vllm_plugin.hooks import RPC_METHOD

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
        return {"version": LEDGER_VERSION, "engine": "vllm", "engine_version": self.vllm_version,
                "ranks": sorted(ranks, key=lambda r: r["rank"])}


class InactiveEndpoint:
    """What a vLLM version the plugin was not built for gets: no route, no state."""

    name = PLUGIN_NAME
    required_tasks = None

    def attach_router(self, app) -> None:
        pass

    async def init_state(self, engine_client, state, args) -> None:
        pass
