"""non_torch is a residual: the process's growth since start that neither torch nor an entry measured
as growth explains. Every entry recorded before the profile run must be declared as growth
(ledger_vocabulary.GROWTH_BEFORE_PROFILE), or the residual would count it a second time."""
from __future__ import annotations

import pytest

from vramledger.ledger_vocabulary import GROWTH_BEFORE_PROFILE, MEASURED_FROM_PROFILE, WORKER_COMPONENTS
from vramledger.worker.engine import memory_setup
from vramledger.worker.engine.memory_setup import unexplained_growth
from vramledger.worker.memory.device import CpuDevice
from vramledger.worker.memory.ledger import Ledger
from vramledger.worker.memory.profiler import MemorySnapshot

MiB = 1 << 20


def loaded_ledger() -> Ledger:
    """A ledger as loading leaves it: the runtime and every entry measured as the process's growth."""
    ledger = Ledger(device=CpuDevice(), total_bytes=4096 * MiB, free_at_start_bytes=4000 * MiB,
                    target_model="/models/target")
    ledger.record("runtime", 300 * MiB)
    ledger.record("weights", 100 * MiB, "target")
    ledger.record("weights", 20 * MiB, "draft")
    ledger.record("kernels", 7 * MiB)
    ledger.record("compiled", 5 * MiB)
    return ledger


def snapshot(process: int, torch_reserved: int) -> MemorySnapshot:
    return MemorySnapshot(timestamp=0.0, total=4096 * MiB, free=3000 * MiB, process=process,
                          process_peak=process, torch_allocated=torch_reserved, torch_reserved=torch_reserved,
                          torch_peak=torch_reserved)


@pytest.mark.parametrize("torch_reserved, explained_by_torch", [(0, 120 * MiB), (150 * MiB, 150 * MiB)],
                         ids=["weights-explain", "torch-reserved-explains"])
def test_the_residual_subtracts_every_declared_growth(torch_reserved, explained_by_torch):
    # 300 runtime + 500 of growth, of which the weights (or torch's reservation), kernels and compiled
    # code explain their share: the rest is non_torch.
    now = snapshot(800 * MiB, torch_reserved)
    assert unexplained_growth(loaded_ledger(), now) == 500 * MiB - explained_by_torch - 7 * MiB - 5 * MiB


def test_an_entry_not_declared_as_growth_is_refused(monkeypatch):
    # A component measured before the profile run but named in neither list (here: kernels, taken
    # out of the growth): the residual would count its bytes again, so sizing stops, naming it.
    monkeypatch.setattr(memory_setup, "GROWTH_BEFORE_PROFILE", ("weights", "compiled"))
    with pytest.raises(RuntimeError, match="'kernels'.*GROWTH_BEFORE_PROFILE"):
        unexplained_growth(loaded_ledger(), snapshot(800 * MiB, 0))


def test_an_earlier_plans_entries_are_replaced_not_refused():
    ledger = loaded_ledger()
    for component in MEASURED_FROM_PROFILE:
        ledger.record(component, 64 * MiB)
    assert unexplained_growth(ledger, snapshot(800 * MiB, 0)) == 500 * MiB - 120 * MiB - 7 * MiB - 5 * MiB


def test_every_worker_component_is_classified():
    # A new component is added to the vocabulary with its place in the residual, or this fails.
    classified = ("runtime", *GROWTH_BEFORE_PROFILE, *MEASURED_FROM_PROFILE)
    assert sorted(classified) == sorted(WORKER_COMPONENTS)

