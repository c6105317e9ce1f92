"""Block manager and scheduler bookkeeping, without torch."""
import sys

from vramledger.worker.engine.block_manager import BlockManager
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.engine.scheduler import Scheduler
from vramledger.worker.engine.sequence import Sequence, Status


def seq(name, n):
    return Sequence(name, list(range(n)), SamplingParams())


def test_allocate_grow_trim_free():
    blocks = BlockManager(num_blocks=6, block_size=4)
    a = seq("a", 5)
    assert blocks.can_allocate(a, 5)
    blocks.allocate(a, 5)
    assert len(a.block_table) == 2 and blocks.num_free == 4
    blocks.allocate(a, 13)  # grow for lookahead slots
    assert len(a.block_table) == 4 and blocks.num_free == 2
    assert blocks.slot(a, 9) == a.block_table[2] * 4 + 1
    blocks.trim(a, 6)  # rejected draft slots give their blocks back
    assert len(a.block_table) == 2 and blocks.num_free == 4
    assert not blocks.can_allocate(seq("b", 30), 30)
    blocks.free(a)
    assert a.block_table == [] and blocks.num_free == 6


def test_scheduler_preempts_newest_and_leaks_nothing():
    blocks = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64, lookahead=2)
    old, new = seq("old", 6), seq("new", 6)
    sched.add(old)
    sched.add(new)
    batch = sched.schedule()
    assert batch.prefill == [old, new] and not batch.decode
    for s in batch.prefill:  # as the engine's prefill leaves them
        s.num_cached, s.prefilled = len(s), True
        s.output_token_ids.append(1)
    # Each now needs 7 + 2 slots = 3 blocks: only one fits, the newest is preempted, and it is not
    # readmitted in the step that preempted it.
    batch = sched.schedule()
    assert batch.decode == [old] and not batch.prefill
    assert new.status is Status.WAITING and new.block_table == [] and new.num_cached == 0
    assert sched.num_preemptions == 1 and list(sched.waiting) == [new]
    sched.finish(old, "stop")
    batch = sched.schedule()  # the preempted request comes back with its output kept
    assert batch.prefill == [new] and not batch.decode and new.token_ids[-1] == 1
    sched.finish(new, "length")
    assert blocks.num_free == 4 and not sched.has_unfinished()


def test_admission_respects_limits():
    blocks = BlockManager(num_blocks=100, block_size=4)
    sched = Scheduler(blocks, max_num_seqs=2, max_num_batched_tokens=10, lookahead=0)
    for name, n in [("a", 4), ("b", 4), ("c", 4)]:
        sched.add(seq(name, n))
    assert [s.request_id for s in sched.schedule().prefill] == ["a", "b"]  # max_num_seqs
    sched2 = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=10, lookahead=0)
    for name, n in [("a", 4), ("b", 4), ("c", 4)]:
        sched2.add(seq(name, n))
    assert [s.request_id for s in sched2.schedule().prefill] == ["a", "b"]  # token budget


def test_bookkeeping_imports_no_torch():
    for name in ("vramledger.worker.engine.block_manager", "vramledger.worker.engine.scheduler", "vramledger.worker.engine.sequence"):
        module = sys.modules[name]
        assert "torch" not in vars(module), name
    import subprocess
    code = "import sys, worker.engine.scheduler, worker.engine.block_manager; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
