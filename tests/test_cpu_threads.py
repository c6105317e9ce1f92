"""The engine's torch threads on the CPU: the user's choice, else every core but one."""
from __future__ import annotations

from worker.engine.cpu_threads import compute_threads


def test_cpu_threads_leave_a_core_to_the_server_unless_told():
    assert compute_threads(None, {}, cores=2) == 1
    assert compute_threads(None, {}, cores=16) == 15
    assert compute_threads(None, {}, cores=1) == 1
    assert compute_threads(None, {"OMP_NUM_THREADS": "4"}, cores=16) is None  # the user's choice stands
    assert compute_threads(3, {"OMP_NUM_THREADS": "4"}, cores=16) == 3  # the flag wins over both
