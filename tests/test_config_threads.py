"""--cpu-threads: passed through to the engine's settings, validated there."""
from __future__ import annotations

import pytest

from worker.cli import build_parser, engine_config
from worker.config import EngineConfig


def test_cpu_threads_flag_reaches_the_config_and_defaults_to_torchs_choice():
    parser = build_parser()
    assert engine_config(parser.parse_args(["profile", "--cpu-threads", "3"])).cpu_threads == 3
    assert engine_config(parser.parse_args(["profile"])).cpu_threads is None


def test_cpu_threads_below_one_is_refused():
    with pytest.raises(ValueError, match="cpu_threads must be >= 1"):
        EngineConfig(cpu_threads=0)
