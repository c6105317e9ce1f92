"""The one state every route reads: settings, the engine loop, the prompt encoder, the metrics registry.

`ServerState.build` makes it once per app; the app keeps it on `app.state.server`, and a route
receives it by declaring a `StateDep` parameter.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request
from prometheus_client import CollectorRegistry

from vramledger.worker.config import EngineConfig
from vramledger.worker.engine.startup import StartupPhases, collector_paused, merged
from vramledger.worker.http.drain import Drain
from vramledger.worker.http.engine_loop import EngineLoop
from vramledger.worker.http.errors import APIError
from vramledger.worker.http.metrics import EngineCollector, RequestMetrics, ServingInfo
from vramledger.worker.http.prompt_bounds import body_limit
from vramledger.worker.http.prompt_encoder import PromptEncoder
from vramledger.worker.http.settings import ServerSettings

if TYPE_CHECKING:
    from vramledger.worker.engine.llm_engine import (
        LLMEngine,  # typing only: importing it loads torch and the models
    )

EngineFactory = Callable[[EngineConfig], "LLMEngine"]


@dataclass
class ServerState:
    """What the routes share: one per app."""

    config: EngineConfig
    settings: ServerSettings
    model_name: str  # the name the API answers to and reports
    version: str
    registry: CollectorRegistry
    encoder: PromptEncoder
    engine_loop: EngineLoop
    drain: Drain
    startup: StartupPhases  # the server's own phases; its engine keeps its own (LLMEngine.startup)
    started: int = field(default_factory=lambda: int(time.time()))  # /v1/models' `created`

    @classmethod
    def build(cls, config: EngineConfig, settings: ServerSettings,
              engine_factory: EngineFactory | None = None) -> ServerState:
        """A new app's state; its engine loads once the app starts the engine loop."""
        # The app's own registry, not the process-wide default (client_python's registries are
        # injected for this): /metrics shows this app's metrics only, and apps never collide.
        registry = CollectorRegistry()
        encoder = PromptEncoder()
        startup = StartupPhases()
        startup.begin("server")  # ends as the HTTP server starts the app (server.lifespan)
        load = functools.partial(load_engine, config, settings, encoder, engine_factory, startup)
        engine_loop = EngineLoop(load, RequestMetrics(registry) if settings.metrics else None)
        state = cls(config, settings, served_name(config, settings), package_version(), registry, encoder,
                    engine_loop, Drain(engine_loop, settings.drain_timeout), startup)
        if settings.metrics:
            registry.register(EngineCollector(state.serving_engine, engine_loop.num_pending, state.serving_info,
                                              state.startup_seconds))
        return state

    @property
    def ready(self) -> bool:
        """The engine and the server's tokenizer are loaded, and the engine has not failed."""
        return self.engine_loop.ready and self.encoder.tokenizer is not None

    def engine_or_503(self) -> LLMEngine:
        """The loaded engine, or a 503 saying it is loading (retry) or failed (the worker stops)."""
        if self.engine_loop.error is not None:
            raise APIError(503, "the engine failed; the worker is shutting down", type="server_error",
                           code="engine_failed")
        engine = self.engine_loop.engine
        if engine is None or self.encoder.tokenizer is None:
            raise APIError(503, "the model is still loading", type="server_error", code="model_loading",
                           headers={"Retry-After": "5"})
        return engine

    def check_model(self, name: str) -> None:
        """404 unless `name` is the served name or the model's path."""
        if name not in (self.model_name, self.config.model):
            raise APIError(404, f"the model {name!r} does not exist; this worker serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def body_limit(self) -> int:
        """The most bytes a request body may have: what a request that fits the model can need, once
        the engine and the tokenizer are loaded; the settings' cap before."""
        engine = self.engine_loop.engine
        if engine is None or self.encoder.tokenizer is None:
            return self.settings.max_body_bytes
        return body_limit(self.encoder.bound, engine.config.max_model_len, self.settings.max_body_bytes)

    def serving_engine(self) -> LLMEngine | None:
        """The engine the metrics read: None while it loads or after it failed."""
        return self.engine_loop.engine if self.engine_loop.ready else None

    def startup_seconds(self) -> dict[str, float]:
        """Seconds per start-up phase, the server's and its engine's."""
        engine_phases = getattr(self.engine_loop.engine, "startup", None)  # an engine factory's may have none
        return merged([self.startup, *([engine_phases] if engine_phases is not None else [])])

    def serving_info(self) -> ServingInfo | None:
        engine = self.engine_loop.engine
        return None if engine is None else ServingInfo.of(engine, self.model_name, self.version)


def load_engine(config: EngineConfig, settings: ServerSettings, encoder: PromptEncoder,
                engine_factory: EngineFactory | None, startup: StartupPhases) -> LLMEngine:
    """On the engine thread: the engine's libraries, the server's tokenizer, then the engine (an LLMEngine
    unless a factory is given) with the requests the server may hold in flight in its ledger."""
    # torch, transformers and the models: the HTTP side never needs them
    with startup.phase("imports"), collector_paused():
        from vramledger.worker.engine.llm_engine import LLMEngine
        from vramledger.worker.http.request_state import requests_in_flight
        from vramledger.worker.models.loader import import_model_libraries

        import_model_libraries(config.model)
    with startup.phase("tokenizer"):
        encoder.load(config.model)
    if engine_factory is not None:
        return engine_factory(config)
    return LLMEngine(config, functools.partial(requests_in_flight, settings, encoder))


def served_name(config: EngineConfig, settings: ServerSettings) -> str:
    return settings.served_model_name or Path(config.model.rstrip("/")).name


def package_version() -> str:
    try:
        return metadata.version("vramledger")
    except metadata.PackageNotFoundError:
        return "0+unknown"


async def server_state(request: Request) -> ServerState:
    # async: FastAPI runs a plain function dependency on a worker thread, a GIL round trip per request
    return request.app.state.server


StateDep = Annotated[ServerState, Depends(server_state)]
