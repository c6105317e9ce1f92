"""The app factory in-process: loading and failed states, auth on /metrics, a model without a chat template."""
import logging
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from vramledger.worker.config import EngineConfig
from vramledger.worker.engine.llm_engine import LLMEngine
from vramledger.worker.http.server import ServerSettings, create_app
from vramledger.worker.models.loader import ModelLoadError

KEY = {"Authorization": "Bearer k"}


def small_config(model: str) -> EngineConfig:
    # A short context keeps the startup profile run quick.
    return EngineConfig(model=model, draft_model=None, max_model_len=64, max_num_seqs=2,
                        max_num_batched_tokens=64)


def wait_healthy(client: TestClient, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the engine did not load"
        time.sleep(0.05)


def test_loading_then_ready_with_metrics_behind_the_key(checkpoints):
    release = threading.Event()

    def gated_engine(config):
        release.wait(60)
        return LLMEngine(config)

    settings = ServerSettings(api_key="k", protect_metrics=True)
    app = create_app(small_config(checkpoints["llama"]), settings, engine_factory=gated_engine)
    with TestClient(app) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        models = client.get("/v1/models", headers=KEY)
        assert models.status_code == 503 and models.headers["retry-after"] == "5"
        assert models.json()["error"]["code"] == "model_loading"
        loading_metrics = client.get("/metrics", headers=KEY).text
        assert "vramledger_requests_running" not in loading_metrics  # nothing read from a loading engine
        release.set()
        wait_healthy(client)

        assert client.get("/metrics").status_code == 401
        assert "vramledger_requests_running 0.0" in client.get("/metrics", headers=KEY).text
        chat = client.post("/v1/chat/completions", headers=KEY, json={
            "model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "no_chat_template"
        done = client.post("/v1/completions", headers=KEY, json={"model": "llama", "prompt": "hi", "max_tokens": 3})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] <= 3


def test_a_model_that_fails_to_load_fails_health_and_stops_the_server(checkpoints):
    def broken_engine(config):
        raise ModelLoadError("config.json is missing")

    fatal = []
    app = create_app(small_config(checkpoints["llama"]), ServerSettings(metrics=False),
                     engine_factory=broken_engine)
    app.state.server.engine_loop.on_fatal = fatal.append
    with TestClient(app) as client:
        deadline = time.monotonic() + 10
        while not fatal:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert isinstance(fatal[0], ModelLoadError)
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        refused = client.post("/v1/completions", json={"model": "llama", "prompt": "hi"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_failed"
        assert client.get("/metrics").status_code == 404  # metrics disabled on this app


@pytest.mark.parametrize("accept", ["", "text/plain", "application/openmetrics-text; version=1.0.0"])
def test_metrics_of_several_apps_live_in_their_own_registries(checkpoints, accept):
    never = threading.Event()
    apps = [create_app(small_config(checkpoints["llama"]), engine_factory=lambda c: never.wait(60))
            for _ in range(2)]  # a shared registry would refuse the second app's metrics
    for app in apps:
        with TestClient(app) as client:
            text = client.get("/metrics", headers={"Accept": accept}).text
            assert text.count("# TYPE vramledger_time_to_first_token_seconds histogram") == 1
    never.set()
    for app in apps:  # their engine threads end here, not while a later test captures logs
        app.state.server.engine_loop._thread.join(10)


@pytest.mark.parametrize("load_ends", ["fails", "returns"])
def test_a_server_stopped_while_loading_reports_no_failure(checkpoints, caplog, load_ends):
    release, fatal = threading.Event(), []

    def engine_still_loading(config):
        release.wait(60)
        if load_ends == "fails":  # what a load cut short by the shutdown meets (its helper threads are gone)
            raise RuntimeError("cannot schedule new futures after shutdown")
        return LLMEngine(config)

    app = create_app(small_config(checkpoints["llama"]), ServerSettings(metrics=False),
                     engine_factory=engine_still_loading)
    engine_loop = app.state.server.engine_loop
    engine_loop.on_fatal = fatal.append
    with caplog.at_level(logging.INFO, logger="vramledger.worker.http.engine_loop"):
        with TestClient(app):
            pass
        release.set()
        engine_loop._thread.join(60)
    assert not engine_loop._thread.is_alive()
    assert fatal == [] and engine_loop.error is None and engine_loop.engine is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "the server stopped while the engine loaded" in caplog.text


def test_an_unexpected_error_is_a_500_logged_once_and_its_connection_serves_on(checkpoints, caplog):
    never = threading.Event()
    app = create_app(small_config(checkpoints["llama"]), ServerSettings(metrics=False),
                     engine_factory=lambda c: never.wait(60))

    async def broken():
        raise RuntimeError("a bug")

    app.add_api_route("/test/broken", broken, include_in_schema=False)  # what no route of ours should do
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        serving_since = time.time()
        port = server.servers[0].sockets[0].getsockname()[1]
        one_connection = httpx.Limits(max_connections=1)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", limits=one_connection) as client:
            with caplog.at_level(logging.ERROR):
                crashed = client.get("/test/broken")
            assert crashed.status_code == 500 and crashed.headers.get("connection") != "close"
            assert crashed.json()["error"] == {"message": "internal server error", "type": "server_error",
                                               "param": None, "code": "internal_error"}
            assert client.get("/health").status_code == 503  # the same connection answers (loading)
        # This server's thread's records: another test's thread may log here, and its id may be reused
        # by this server's thread once it ended (so before the server started).
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.thread == thread.ident
                  and r.created >= serving_since]
        assert len(errors) == 1 and errors[0].exc_info is not None
        assert "/test/broken" in errors[0].getMessage()
    finally:
        server.should_exit = True
        thread.join(10)  # the app stops its engine loop first: the fake's return is then never stepped
        never.set()
        if app.state.server.engine_loop._thread is not None:
            app.state.server.engine_loop._thread.join(10)
