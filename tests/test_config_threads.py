"""--cpu-threads: passed through to the engine's settings, validated there; serve's defaults."""
from __future__ import annotations

import os

import pytest

from worker.cli import SPIN_BEFORE_SLEEP, build_parser, engine_config, main
from worker.config import EngineConfig


def test_cpu_threads_flag_reaches_the_config_and_defaults_to_torchs_choice():
    parser = build_parser()
    assert engine_config(parser.parse_args(["profile", "--cpu-threads", "3"])).cpu_threads == 3
    assert engine_config(parser.parse_args(["profile"])).cpu_threads is None


def test_cpu_threads_below_one_is_refused():
    with pytest.raises(ValueError, match="cpu_threads must be >= 1"):
        EngineConfig(cpu_threads=0)


def test_serve_and_profile_take_every_core_unless_told(monkeypatch):
    parser = build_parser()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for command in ("serve", "profile"):
        assert engine_config(parser.parse_args([command])).cpu_threads is None  # torch's: every core
        assert engine_config(parser.parse_args([command, "--cpu-threads", "3"])).cpu_threads == 3


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
