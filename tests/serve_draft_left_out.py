"""`python -m vramledger.worker serve` wrapped for the tests with seed 000's bug: the memory plan leaves the draft
out. Its weights are not subtracted from the budget and the KV blocks are sized for the target's
layers alone, while the engine still loads the draft and allocates its layers in every block.

    python tests/serve_draft_left_out.py [serve flags...]
"""
from __future__ import annotations

import sys

from vramledger.worker import cli
from vramledger.worker.engine import engine_parts
from vramledger.worker.engine.memory_setup import plan_memory


def plan_memory_without_the_draft(runner, config, device, ledger, tokenizer=None, server_state=None) -> int:
    draft_weights = ledger.bytes_of("weights", "draft")
    ledger.entries = [e for e in ledger.entries if (e.component, e.model) != ("weights", "draft")]
    bytes_per_block = runner.bytes_per_block
    runner.bytes_per_block = lambda name=None: bytes_per_block(name or "target")
    try:
        return plan_memory(runner, config, device, ledger, tokenizer, server_state)
    finally:
        runner.bytes_per_block = bytes_per_block
        if draft_weights:  # the ledger still lists the draft's weights: only the plan forgot them
            ledger.record("weights", draft_weights, model="draft")


if __name__ == "__main__":
    engine_parts.plan_memory = plan_memory_without_the_draft  # where the engine calls it
    sys.exit(cli.main(["serve", *sys.argv[1:]]))
