"""bench/serve.py without a server: its verdict on the serving goals from figures given here, and the
commands and loads its options build."""
import argparse
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


def loads(serve, *names):
    args = argparse.Namespace(prompt_tokens=32, output_tokens=128, concurrency=CS)
    return serve.build_loads(args, list(names))


def result(*tok_s, shared=None, long=None):
    """Short-load tok/s at CS; shared: (tok/s, TTFT ms) at 8 streams; long: tok/s at 4 streams."""
    figures = {"short": {c: {"tok_s": t} for c, t in zip(CS, tok_s)}}
    if shared is not None:
        figures["shared-prefix"] = {8: {"tok_s": shared[0], "ttft_ms": shared[1]}}
    if long is not None:
        figures["long-prompt"] = {4: {"tok_s": long, "ttft_ms": 1000.0}}
    return {"loads": figures, "acceptance": None}


def test_every_goal_holds_at_its_threshold(serve):
    verdict = serve.goals({"vllm": result(100, 400, 1000, 1200, shared=(200, 1000), long=30),
                           "ours": result(100, 400, 1000, 1200, shared=(300, 500), long=30),
                           "ours-draft-adaptive": result(160, 400, 1200, 1200, shared=(300, 500))},
                          loads(serve, "short", "shared-prefix", "long-prompt"))
    assert len(verdict) == 4 + 2 * 2 + 1 and all(held is True for held in verdict.values())


def test_each_goal_fails_on_its_own_figure(serve):
    vllm, plain, draft = result(100, 400, 1000, 1200), result(100, 399, 1000, 1200), result(159, 500, 1199, 1199)
    verdict = serve.goals({"vllm": vllm, "ours": plain, "ours-draft-adaptive": draft}, loads(serve, "short"))
    assert list(verdict.values()) == [False, False, False, False]
    verdict = serve.goals({"vllm": result(shared=(200, 1000), long=30),
                           "ours": result(shared=(299, 400), long=29.9),
                           "ours-draft-adaptive": result(shared=(400, 501))},
                          loads(serve, "shared-prefix", "long-prompt"))
    assert list(verdict.values()) == [False, True, True, False, False]


def test_a_failed_server_leaves_its_goals_unjudged(serve):
    verdict = serve.goals({"vllm": "failed: exited with 1", "ours": result(100, 400, 1000, 1200),
                           "ours-draft-adaptive": result(160, 480, 1200, 1300)}, loads(serve, "short"))
    assert verdict[next(iter(verdict))] is None
    assert list(verdict.values())[1:] == [None, None, True]
    verdict = serve.goals({"vllm": result(shared=(200, 1000)), "ours": result()},
                          loads(serve, "shared-prefix"))
    assert list(verdict.values()) == [None, None]  # ours has no shared-prefix figures


def test_the_options_defaults_build_every_server_and_load(serve):
    # bench/served_steps.py parses its fixed options this way: an option added to serve.py has its default.
    args = serve.options().parse_args(["--concurrency", "8", "--ours-cpu-threads", "1"])
    command = serve.our_server("ours", args, 8123, draft=True, speculation="adaptive").command
    assert command[command.index("--max-num-seqs") + 1] == "8" and command[command.index("--cpu-threads") + 1] == "1"
    assert command[command.index("--speculation") + 1] == "adaptive"
    assert set(serve.build_loads(args, list(serve.LOADS))) == set(serve.LOADS)


def test_the_draft_against_plain_per_load_over_rounds(serve):
    """Ratios taken round by round; median >= 1.0x and min >= 0.93x at each load, 1.25x at 1 stream."""
    rounds = [{"ours": result(100, 400, 1000, 1200, shared=(300, 500), long=30),
               "ours-draft-adaptive": result(130, 400, 930, 1300, shared=(300, 500), long=30)},
              {"ours": result(100, 400, 1000, 1200, shared=(300, 500), long=30),
               "ours-draft-adaptive": result(125, 396, 1100, 1100, shared=(290, 500), long=31)},
              {"ours-draft-adaptive": result(200, 800, 2000, 2400), "ours": "failed: exited with 1"}]
    ratios = serve.draft_vs_plain(rounds, loads(serve, "short", "shared-prefix", "long-prompt"))
    assert ratios[("short", 1)] == [1.3, 1.25] and ratios[("short", 16)] == [0.93, 1.1]
    verdict = list(serve.draft_goals(ratios).values())
    # short at 1 (median; 1.25x each round), 4 (median 0.995), 16 (min 0.93), 32 (min 0.917); shared prefix
    # (median 0.983); long prompts (1.0 and 1.03)
    assert verdict == [True, True, False, True, False, False, True]
    assert serve.draft_goals(serve.draft_vs_plain([rounds[2]], loads(serve, "long-prompt"))) == {
        next(iter(serve.draft_goals({("long-prompt", 4): [1.0]}))): None}
