"""Shared fixtures: small random checkpoints built once per test session."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
pytest.register_assert_rewrite("server_fixtures", "vllm_scenarios")  # before their import: asserts report well

from random_models import make_checkpoint  # noqa: E402

pytest_plugins = ["server_fixtures",  # the servers the HTTP tests share (spec_server, plain_server, ...)
                  "vllm_scenarios"]  # vLLM's worker code on the faked device (cuda_path)

# `make test-fast` runs what is not marked slow. A test is slow when it starts a worker, an engine
# process or vLLM: through one of these fixtures, or by its module's `pytestmark = pytest.mark.slow`.
PROCESS_FIXTURES = frozenset({"spec_server", "plain_server", "gated_worker", "spawn", "plugin_site",
                              "cuda_path"})


def pytest_collection_modifyitems(items):
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Random target/draft checkpoints per family, sharing one tokenizer."""
    root = tmp_path_factory.mktemp("checkpoints")
    built = {}
    for family in ("llama", "qwen2", "mistral"):
        built[family] = make_checkpoint(root / family, family, layers=2, seed=0)
        built[family + "-draft"] = make_checkpoint(root / (family + "-draft"), family, layers=1, seed=1)
    return {k: str(v) for k, v in built.items()}


@pytest.fixture
def api():
    """A local server answering the Kubernetes API's pod list and get (tests/kube_api.py)."""
    from kube_api import KubeAPI

    server = KubeAPI()
    yield server
    try:
        server.stop()
    except OSError:  # a test that stopped it already
        pass
