"""What a step's code works on: the engine's, or the profile run's scratch copies of them."""
from __future__ import annotations

from dataclasses import dataclass

from vramledger.worker.engine.block_manager import BlockManager
from vramledger.worker.engine.model_runner import ModelRunner
from vramledger.worker.engine.outputs import EngineStats
from vramledger.worker.engine.row_sampling import RowSampling


@dataclass(frozen=True)
class StepContext:
    """The models, the block pool (its prefix cache learns what a step wrote), the counters a step
    adds to, and the rows' sampling: plain_forward and SpeculativeStep read and change these only."""

    runner: ModelRunner
    blocks: BlockManager
    stats: EngineStats
    sampling: RowSampling
