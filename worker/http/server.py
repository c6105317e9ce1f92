"""The worker's HTTP API: OpenAI-compatible completions, models, the ledger, health and metrics."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from starlette.exceptions import HTTPException as StarletteHTTPException

from worker.config import EngineConfig
from worker.http.api_models import (
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
    ResponseRenderer,
    SamplingRequest,
    error_body,
)
from worker.http.choices import Job, collect, events
from worker.http.drain import Drain, DrainGate, DrainingServer
from worker.http.engine_loop import EngineLoop
from worker.http.metrics import EngineCollector, RequestMetrics, WorkerInfo
from worker.http.openai_protocol import (
    chat_token_ids,
    choice_params,
    prompt_token_ids,
    sampling_params,
    validation_error,
)

log = logging.getLogger(__name__)
API_KEY_ENV = "VRAMLEDGER_API_KEY"
METRICS_ENV = "VRAMLEDGER_METRICS"  # "off": no request metrics and no /metrics (to measure their cost)
METRICS_AUTH_ENV = "VRAMLEDGER_METRICS_AUTH"  # "1": /metrics needs the API key too
ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)}


@dataclass
class ServerSettings:
    """HTTP settings beside the engine's: auth, admission and limits."""

    api_key: str | None = None
    max_waiting: int = 256
    metrics: bool = True
    protect_metrics: bool = False  # /health and /metrics are open unless this is set
    max_body_bytes: int = 4 << 20  # a long prompt is well under this; a 413 beats parsing a flood
    served_model_name: str | None = None
    drain_timeout: float = 30.0  # seconds running requests get after SIGTERM (worker/http/drain.py)

    def __post_init__(self):
        if self.max_waiting < 1:
            raise ValueError("--max-waiting must be >= 1")


def served_name(config: EngineConfig, settings: ServerSettings) -> str:
    return settings.served_model_name or Path(config.model.rstrip("/")).name


# --- HTTP guards: a pure ASGI layer, so they run before any body is parsed ----------------------
class Guard:
    """Bearer check on /v1/* (constant time) and a request body size limit (413)."""

    def __init__(self, app, settings: ServerSettings):
        self.app = app
        self.settings = settings
        self.key = settings.api_key.encode() if settings.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        protected = path.startswith("/v1/") or (self.settings.protect_metrics and path == "/metrics")
        if self.key is not None and protected and not self._authorized(scope):
            return await send_json(send, 401, error_body("invalid or missing API key (Authorization: Bearer "
                                                         "<key>)", "invalid_request_error", None,
                                                         "invalid_api_key"),
                                   {"www-authenticate": "Bearer"})
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(scope, receive, send)
            if body is None:
                return None
            receive = replay(body, receive)
        return await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def _read_body(self, scope, receive, send) -> bytes | None:
        """The whole body, or None after answering 413 (or when the client left)."""
        limit = self.settings.max_body_bytes
        too_large = error_body(f"the request body is larger than {limit} bytes", "invalid_request_error",
                               None, "request_too_large")
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:  # refuse before reading it
            await send_json(send, 413, too_large)
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await send_json(send, 413, too_large)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def replay(body: bytes, receive):
    """A receive callable that hands out the buffered body once, then the client's own messages."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def send_json(send, status: int, body: dict, headers: dict | None = None) -> None:
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


# --- errors ------------------------------------------------------------------------------------
def api_error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return api_error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)


# --- streaming -------------------------------------------------------------------------------
class EventStream(StreamingResponse):
    """Server-sent events that notice a client that left even while no token is due."""

    async def __call__(self, scope, receive, send):
        async with anyio.create_task_group() as group:
            async def watch():
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                await self.stream_response(send)
            except OSError:
                pass  # the client closed the connection while we wrote
            finally:
                await self.body_iterator.aclose()  # runs the stream's finally: the abort
                group.cancel_scope.cancel()


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# --- the app -----------------------------------------------------------------------------------
def create_app(config: EngineConfig, settings: ServerSettings | None = None,
               engine_factory: Callable[[EngineConfig], object] | None = None) -> FastAPI:
    """The worker's FastAPI app; the engine (LLMEngine by default) loads on a background thread."""
    settings = settings or ServerSettings()
    model_name = served_name(config, settings)
    registry = CollectorRegistry()  # one per app: tests build several apps in one process
    state = {"tokenizer": None, "started": int(time.time())}
    # Encoding runs on one helper thread: a long prompt never stalls the other streams, and the
    # server's tokenizer is never used from two threads at once.
    encoder_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

    async def encode(function, *args) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(encoder_thread, function, *args)

    def build():
        from worker.models.loader import load_config, load_tokenizer

        # The server's own tokenizer: encoding never races the engine thread's decoding.
        tokenizer = load_tokenizer(config.model)
        # Token-id prompts must index the embedding and decode: both limits hold.
        vocab_size = min(len(tokenizer), load_config(config.model).vocab_size)
        # What the first request would start once (the encoder thread, its arena, the tokenizer's
        # pool) starts now, before the ledger takes the runtime: later growth is per request.
        encoder_thread.submit(prompt_token_ids, "warm up", tokenizer, vocab_size).result()
        if engine_factory is None:
            from worker.engine.llm_engine import LLMEngine
            from worker.http.request_state import requests_in_flight
            engine = LLMEngine(config, functools.partial(requests_in_flight, config, settings.max_waiting))
        else:
            engine = engine_factory(config)
        state["vocab_size"], state["tokenizer"] = vocab_size, tokenizer
        return engine

    engine_loop = EngineLoop(build, RequestMetrics(registry) if settings.metrics else None)
    if settings.metrics:
        registry.register(EngineCollector(lambda: engine_loop.engine if engine_loop.ready else None,
                                          engine_loop.num_pending,
                                          lambda: worker_info(engine_loop.engine, model_name)))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start(asyncio.get_running_loop())
        yield
        engine_loop.stop()
        encoder_thread.shutdown(wait=False)

    app = FastAPI(title="vramledger worker", version=package_version(), lifespan=lifespan,
                  description="OpenAI-compatible completions with speculative decoding and a memory ledger.")
    app.state.engine_loop, app.state.registry, app.state.settings = engine_loop, registry, settings
    install_error_handlers(app)

    def openapi() -> dict:
        # The schema names the one model served, so generated clients (and fuzzers) can reach generation.
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                schema["components"]["schemas"][name]["properties"]["model"]["enum"] = [model_name]
        return app.openapi_schema

    app.openapi = openapi

    def engine_or_503():
        if engine_loop.error is not None:
            raise APIError(503, "the engine failed; the worker is shutting down", type="server_error",
                           code="engine_failed")
        if engine_loop.engine is None or state["tokenizer"] is None:
            raise APIError(503, "the model is still loading", type="server_error", code="model_loading",
                           headers={"Retry-After": "5"})
        return engine_loop.engine

    def check_model(name: str) -> None:
        if name not in (model_name, config.model):
            raise APIError(404, f"the model {name!r} does not exist; this worker serves {model_name!r}",
                           param="model", code="model_not_found")

    def admit(body: SamplingRequest, token_ids: list[int], chat: bool, param: str) -> Job:
        engine = engine_or_503()
        params = sampling_params(body, len(token_ids), engine.config.max_model_len, chat, param,
                                 state["vocab_size"])
        if body.n > settings.max_waiting:  # could never be admitted: the client's to change
            raise APIError(400, f"n={body.n} is more than this worker queues ({settings.max_waiting})",
                           param="n", code="invalid_value")
        if engine_loop.num_waiting() + body.n > settings.max_waiting:
            raise APIError(503, f"the worker is overloaded ({settings.max_waiting} requests waiting); "
                           "retry later", type="server_error", code="queue_full", headers={"Retry-After": "1"})
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        choice_ids = [request_id] if body.n == 1 else [f"{request_id}-{i}" for i in range(body.n)]
        arrival = time.monotonic()
        streams = [engine_loop.submit(choice_id, token_ids, p, arrival)  # n sequences, one prompt
                   for choice_id, p in zip(choice_ids, choice_params(params, body.n))]
        render = ResponseRenderer(request_id, chat, model_name, body.return_token_ids, body.num_logprobs)
        return Job(request_id, choice_ids, streams, render, len(token_ids))

    def abort(job: Job) -> None:
        for choice_id in job.choice_ids:
            engine_loop.abort(choice_id)

    async def respond(request: Request, body: SamplingRequest, job: Job):
        if body.stream:
            return EventStream(events(job, body.include_usage, body.continuous_usage, engine_loop.abort),
                               media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        collecting = asyncio.ensure_future(collect(job))
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            await asyncio.wait((collecting, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collecting.done():  # the client left (or we are cancelled): free its blocks
                collecting.cancel()
                abort(job)
        if not collecting.done() or collecting.cancelled():
            return Response(status_code=499)
        if collecting.exception() is not None:
            abort(job)  # one choice failed: the others stop too
        return JSONResponse(job.render.response(collecting.result(), job.prompt_tokens))

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request):
        """Complete a prompt (text or token ids); `"stream": true` answers with server-sent events."""
        engine_or_503()
        check_model(body.model)
        token_ids = await encode(prompt_token_ids, body.prompt, state["tokenizer"], state["vocab_size"])
        return await respond(request, body, admit(body, token_ids, chat=False, param="prompt"))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """Answer a conversation through the model's chat template; streams like /v1/completions."""
        engine_or_503()
        check_model(body.model)
        token_ids = await encode(chat_token_ids, body, state["tokenizer"])
        return await respond(request, body, admit(body, token_ids, chat=True, param="messages"))

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models():
        """The one model this worker serves."""
        engine = engine_or_503()
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": state["started"],
                                            "owned_by": "vramledger",
                                            "max_model_len": engine.config.max_model_len}]}

    @app.get("/v1/memory", responses=ERRORS)
    async def memory():
        """The memory ledger (docs/ledger.md), with live values measured now."""
        return engine_or_503().memory_report()

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        """200 once the engine is loaded; 503 while loading or after it failed."""
        if engine_loop.ready and state["tokenizer"] is not None:
            return {"status": "ok"}
        status = "failed" if engine_loop.error is not None else "loading"
        return JSONResponse({"status": status, **error_body(f"the worker is {status}", "server_error",
                                                             None, f"model_{status}")}, status_code=503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request):
        if not settings.metrics:
            raise APIError(404, "metrics are disabled on this worker", code="metrics_disabled")
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(registry), headers={"Content-Type": content_type})

    app.add_middleware(Guard, settings=settings)  # before routing and body parsing
    app.state.drain = Drain(engine_loop, settings.drain_timeout)
    app.add_middleware(DrainGate, drain=app.state.drain)  # outermost: counts every generation request
    return app


def worker_info(engine, model_name: str) -> WorkerInfo | None:
    if engine is None:
        return None
    config, device = engine.config, engine.device
    return WorkerInfo(model=model_name,
                      draft_model=Path(config.draft_model.rstrip("/")).name if config.draft_model else "",
                      device="cpu" if device.kind == "cpu" else f"{device.kind}:{device.index}",
                      num_speculative_tokens=config.num_speculative_tokens, version=package_version())


@functools.cache  # a metadata lookup scans sys.path: once, not on every scrape
def package_version() -> str:
    try:
        return metadata.version("vramledger")
    except metadata.PackageNotFoundError:
        return "0+unknown"


# --- python -m worker serve --------------------------------------------------------------------
def run_server(config: EngineConfig, args) -> int:
    """Serve until interrupted; 1 when the engine failed to load or crashed."""
    import uvicorn

    settings = ServerSettings(api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                              max_waiting=args.max_waiting,
                              metrics=os.environ.get(METRICS_ENV, "on").lower() not in ("off", "0", "false"),
                              protect_metrics=os.environ.get(METRICS_AUTH_ENV, "") == "1",
                              served_model_name=getattr(args, "served_model_name", None),
                              drain_timeout=args.drain_timeout)
    app = create_app(config, settings)
    uvicorn_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                    timeout_graceful_shutdown=5)
    server = DrainingServer(uvicorn_config, app.state.drain)  # SIGTERM drains first
    app.state.engine_loop.on_fatal = lambda exc: setattr(server, "should_exit", True)
    log.info("serving %s on http://%s:%d (draft: %s)", served_name(config, settings), args.host, args.port,
             config.draft_model or "none")
    server.run()
    return 1 if app.state.engine_loop.error is not None else 0
