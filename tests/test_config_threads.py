"""--cpu-threads: passed through to the engine's settings, validated there; serve's default."""
from __future__ import annotations

import pytest

from worker.cli import build_parser, engine_config, serving_config
from worker.config import EngineConfig


def test_cpu_threads_flag_reaches_the_config_and_defaults_to_torchs_choice():
    parser = build_parser()
    assert engine_config(parser.parse_args(["profile", "--cpu-threads", "3"])).cpu_threads == 3
    assert engine_config(parser.parse_args(["profile"])).cpu_threads is None


def test_cpu_threads_below_one_is_refused():
    with pytest.raises(ValueError, match="cpu_threads must be >= 1"):
        EngineConfig(cpu_threads=0)


def test_serve_leaves_a_core_to_the_server_unless_told(monkeypatch):
    import torch
    parser = build_parser()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for command in ("serve", "profile"):
        assert serving_config(parser.parse_args([command])).cpu_threads == max(1, torch.get_num_threads() - 1)
        assert serving_config(parser.parse_args([command, "--cpu-threads", "3"])).cpu_threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the operator's choice, which torch already follows
    assert serving_config(parser.parse_args(["serve"])).cpu_threads is None
