"""bench/serve.py's verdict on issue 14's goals, from figures given here (no server runs)."""
import importlib.util
import sys
from pathlib import Path

import pytest

CS = [1, 4, 16, 32]


@pytest.fixture(scope="module")
def serve():
    path = Path(__file__).resolve().parent.parent / "bench" / "serve.py"
    spec = importlib.util.spec_from_file_location("bench_serve", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def result(*tok_s):
    return {"rows": {c: {"tok_s": t} for c, t in zip(CS, tok_s)}, "acceptance": None}


def test_every_goal_holds_at_its_threshold(serve):
    verdict = serve.goals({"vllm": result(100, 400, 1000, 1200), "ours": result(100, 400, 1000, 1200),
                           "ours-draft-adaptive": result(160, 400, 1200, 1200)}, CS)
    assert list(verdict.values()) == [True, True, True, True]


def test_each_goal_fails_on_its_own_figure(serve):
    vllm, plain, draft = result(100, 400, 1000, 1200), result(100, 399, 1000, 1200), result(159, 500, 1199, 1199)
    verdict = serve.goals({"vllm": vllm, "ours": plain, "ours-draft-adaptive": draft}, CS)
    assert list(verdict.values()) == [False, False, False, False]


def test_a_failed_server_leaves_its_goals_unjudged(serve):
    verdict = serve.goals({"vllm": "failed: exited with 1", "ours": result(100, 400, 1000, 1200),
                           "ours-draft-adaptive": result(160, 480, 1200, 1300)}, CS)
    assert verdict[next(iter(verdict))] is None
    assert list(verdict.values())[1:] == [None, None, True]
