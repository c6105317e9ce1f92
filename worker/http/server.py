"""The worker's HTTP app and `python -m vramledger.worker serve`: the state, the routers, the error handlers and
the ASGI layers put together, then served by uvicorn."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from typing import Any

import uvicorn
from fastapi import FastAPI

from vramledger.worker.config import EngineConfig
from vramledger.worker.http.access_log import quiet_probes
from vramledger.worker.http.drain import DrainGate, DrainingServer
from vramledger.worker.http.error_handlers import CrashBarrier, install_error_handlers
from vramledger.worker.http.guard import Guard
from vramledger.worker.http.intake import intake_protocol
from vramledger.worker.http.request_body import body_schemas
from vramledger.worker.http.request_models import ChatCompletionRequest, CompletionRequest
from vramledger.worker.http.routers import chat, completions, health, memory, metrics, models
from vramledger.worker.http.settings import ENGINE_STOP_GRACE, HTTP_SHUTDOWN_GRACE, ServerSettings
from vramledger.worker.http.state import EngineFactory, ServerState

log = logging.getLogger(__name__)
# In the OpenAPI schema's order.
ROUTERS = (completions.router, chat.router, models.router, memory.router, health.router, metrics.router)


def create_app(config: EngineConfig, settings: ServerSettings | None = None,
               engine_factory: EngineFactory | None = None) -> FastAPI:
    """The worker's FastAPI app; the engine (LLMEngine by default) loads on a background thread."""
    state = ServerState.build(config, settings or ServerSettings(), engine_factory)
    app = FastAPI(title="vramledger worker", version=state.version, lifespan=lifespan,
                  description="OpenAI-compatible completions with speculative decoding and a memory ledger.")
    app.state.server = state
    install_error_handlers(app)
    document_the_bodies(app, state.model_name)
    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(Guard, settings=state.settings, body_limit=state.body_limit)  # before any parsing
    app.add_middleware(DrainGate, drain=state.drain)  # counts every generation request
    app.add_middleware(CrashBarrier)  # outermost: whatever fails below still answers in the OpenAI shape
    return app


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    state: ServerState = app.state.server
    state.startup.end("server")  # uvicorn listens once the app has started
    state.engine_loop.start(asyncio.get_running_loop())
    yield
    state.engine_loop.stop(ENGINE_STOP_GRACE)
    state.encoder.shutdown()


def document_the_bodies(app: FastAPI, model_name: str) -> None:
    """The OpenAPI schema documents the request bodies the generation routes parse themselves
    (request_body.py), naming the one model served, so generated clients (and fuzzers) reach generation."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            bodies = body_schemas(CompletionRequest, ChatCompletionRequest)
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                bodies[name]["properties"]["model"]["enum"] = [model_name]
            schema.setdefault("components", {}).setdefault("schemas", {}).update(bodies)
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema


def run_server(config: EngineConfig, args: argparse.Namespace) -> int:
    """Serve until interrupted; 1 when the engine failed to load or crashed."""
    app = create_app(config, ServerSettings.from_args(args))
    state: ServerState = app.state.server
    uvicorn_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                    timeout_graceful_shutdown=HTTP_SHUTDOWN_GRACE,
                                    http=intake_protocol(state.settings.keep_alive_timeout,
                                                         state.settings.header_timeout))
    server = DrainingServer(uvicorn_config, state.drain)  # SIGTERM drains first
    state.engine_loop.on_fatal = lambda exc: setattr(server, "should_exit", True)
    log.info("serving %s on http://%s:%d (draft: %s)", state.model_name, args.host, args.port,
             config.draft_model or "none")
    if not args.log_probes:
        quiet_probes()
    server.run()
    return 1 if state.engine_loop.error is not None else 0
