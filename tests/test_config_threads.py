"""--cpu-threads: passed through to the engine's settings, validated there; serve's defaults (those of a
step of one prompt alone among them)."""
from __future__ import annotations

import os

import pytest

from vramledger.worker.cli import (
    SPIN_BEFORE_SLEEP,
    build_parser,
    default_cpu_threads,
    default_prompt_threads,
    engine_config,
    main,
)
from vramledger.worker.config import EngineConfig


def test_cpu_threads_flag_reaches_the_config(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert engine_config(build_parser().parse_args(["profile", "--cpu-threads", "3"])).cpu_threads == 3


def test_cpu_threads_below_one_are_refused():
    with pytest.raises(ValueError, match="cpu_threads must be >= 1"):
        EngineConfig(cpu_threads=0)
    with pytest.raises(ValueError, match="cpu_prompt_threads must be >= 1"):
        EngineConfig(cpu_prompt_threads=0)


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (3, 2), (64, 63)])
def test_a_step_leaves_one_core_to_the_servers_own_threads(monkeypatch, cores, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_cpu_threads(cores) == threads
    assert default_prompt_threads(cores) == cores  # nothing streams beside a step of one prompt alone


def test_serve_and_profile_take_every_core_but_one_unless_told(monkeypatch):
    parser = build_parser()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    for command in ("serve", "profile"):
        config = engine_config(parser.parse_args([command]))
        assert (config.cpu_threads, config.cpu_prompt_threads) == (max(1, cores - 1), cores)
        config = engine_config(parser.parse_args([command, "--cpu-threads", "3"]))
        assert (config.cpu_threads, config.cpu_prompt_threads) == (3, None)  # every step's, prompts' too
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the operator's: torch reads it
        config = engine_config(parser.parse_args([command]))
        assert (config.cpu_threads, config.cpu_prompt_threads) == (None, None)
        monkeypatch.delenv("OMP_NUM_THREADS")


@pytest.mark.parametrize("preset", [None, "ACTIVE", "PASSIVE"])
def test_waiting_threads_spin_briefly_then_sleep_unless_the_operator_says_otherwise(monkeypatch, preset):
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):  # set, then removed: undone after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    if preset is not None:
        monkeypatch.setenv("OMP_WAIT_POLICY", preset)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert os.environ.get("OMP_WAIT_POLICY") == preset
    assert os.environ.get("GOMP_SPINCOUNT") == (None if preset else str(SPIN_BEFORE_SLEEP))


def test_an_operators_spin_count_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "")
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "INFINITE")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert os.environ["GOMP_SPINCOUNT"] == "INFINITE"
