"""No request holds every running slot: a request's extra choices never take the last free one, so a
request behind one with as many choices as --max-num-seqs starts within a step. The scheduler alone,
then a real worker whose engine steps only as the test allows (tests/serve_with_step_gate.py)."""
from __future__ import annotations

import json
import threading
from collections import Counter

import httpx
from server_fixtures import metric_value

from vramledger.worker.engine.block_manager import BlockManager
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.engine.scheduler import Scheduler
from vramledger.worker.engine.sequence import Sequence
from vramledger.worker.selfcheck.processes import wait_until

PATIENCE = 60.0  # seconds to wait for what a few released steps do


def scheduler(max_num_seqs: int) -> Scheduler:
    return Scheduler(BlockManager(num_blocks=400, block_size=4), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=64, lookahead=0)


def choices(group: str, n: int) -> list[Sequence]:
    return [Sequence(f"{group}-{i}", [1, 2, 3], SamplingParams(), group=group) for i in range(n)]


def admitted(sched: Scheduler) -> list[str]:
    batch = sched.schedule()
    assert batch is not None
    for seq in batch.prefill:  # as the engine does: prefilled, one token out
        seq.num_cached, seq.prefilled = len(seq), True
        seq.output_token_ids.append(1)
    return [seq.request_id for seq in batch.prefill]


def test_extra_choices_leave_the_last_slot_to_the_next_request():
    sched = scheduler(4)
    for seq in choices("big", 4):
        sched.add(seq)
    assert admitted(sched) == ["big-0", "big-1", "big-2"]
    sched.add(Sequence("small", [1, 2], SamplingParams()))  # a request of its own
    for seq in choices("other", 2):
        sched.add(seq)
    assert admitted(sched) == ["small"]  # big-3 waits, small goes past it into the free slot
    assert [s.request_id for s in sched.waiting] == ["big-3", "other-0", "other-1"]


def test_one_slot_runs_every_choice_in_turn():
    sched = scheduler(1)  # nothing to leave: the choices take the one slot one after another
    for seq in choices("big", 2):
        sched.add(seq)
    assert admitted(sched) == ["big-0"]
    sched.finish(sched.running[0], "length")
    assert admitted(sched) == ["big-1"]


class StreamReader(threading.Thread):
    """Reads a streamed completion: the chunks each choice received, and whether it ended."""

    def __init__(self, response: httpx.Response):
        super().__init__(daemon=True)
        self.response, self.chunks, self.done = response, Counter(), False

    def run(self):
        for line in self.response.iter_lines():
            if line == "data: [DONE]":
                self.done = True
            elif line.startswith("data: "):
                for choice in json.loads(line[6:])["choices"]:
                    self.chunks[choice["index"]] += 1


def test_a_one_token_request_behind_one_with_16_choices_answers_within_a_few_steps(gated_worker):
    _, url, model = gated_worker()  # --max-num-seqs 16, the default
    big = {"model": model, "prompt": "def f(x):", "n": 16, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=PATIENCE) as client:
        def queues() -> tuple[float | None, float | None]:
            text = client.get("/metrics").text
            return metric_value(text, "vramledger_requests_running"), metric_value(text, "vramledger_requests_waiting")

        with client.stream("POST", "/v1/completions", json=big) as stream:
            reader = StreamReader(stream)
            reader.start()
            wait_until(lambda: sum(queues()) == 16, PATIENCE, "the 16 choices to queue")
            client.post("/test/steps", params={"n": 3})  # its choices start, as many as may
            wait_until(lambda: max(reader.chunks.values(), default=0) >= 3, PATIENCE, "three steps")
            running, _ = queues()
            small: dict = {}
            asking = threading.Thread(target=lambda: small.update(client.post("/v1/completions", json={
                "model": model, "prompt": "hi", "max_tokens": 1}).json()))
            asking.start()
            wait_until(lambda: sum(queues()) == 17, PATIENCE, "the small request to queue")
            client.post("/test/steps", params={"n": 3})
            asking.join(PATIENCE)
            assert small.get("usage", {}).get("completion_tokens") == 1, small or "no answer within 3 steps"
            assert not reader.done and max(reader.chunks.values()) <= 6  # the big one is still running
            assert running == 15  # one slot was left free
            client.post("/test/steps", params={"n": -1})
            reader.join(PATIENCE)
    assert reader.done and len(reader.chunks) == 16  # every choice ran in the end
