"""Where a served step's time goes: the shared-prefix load through our HTTP server, and its shape in the
engine alone, step by step.

    python bench/served_steps.py [--runs 3] [--draft] [--requests-per-stream 3]

Each run starts our worker (plain, or with the draft and adaptive k) with its engine steps traced: this
script runs itself as the server (`--serve TRACE -- worker args`), timing each step and its forward on
the engine thread. guidellm drives bench/serve.py's shared-prefix load once (8 streams, 24 requests by
default, the prefix not yet cached), while the cores' use is sampled every 10 ms. Then the same shape
runs in the engine alone, in this process, on the server's threads: 8 closed-loop streams, 24 requests
of one 1024-token prefix + 32 tokens, 32 output tokens each.

Per kind of step (a long prompt's chunk alone, a mixed step: a chunk beside decoding streams, a decode
step), prints the medians over every run of the wall time of the step, of its forward and of the
forward's C kernel (decoder_layers), each with the engine thread's CPU time and the time it was runnable
but waited for a core. The rest it slept: outside the kernel on the GIL (the event loop holds it),
inside it, which holds no GIL, on the kernel's other threads at the barriers between its stages. Also
prints, while the server was busy, the cores it used and those everything else used, and where a served
request's time to its first token went (the worker's own histograms, means over the drive): from its
arrival to its first scheduling into a step, and from there to its first token.
Timings only: nothing here is a test.
"""
from __future__ import annotations

import argparse
import inspect
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

BIG_CHUNK = 100  # prompt tokens above which a step counts as a long prompt's chunk


def thread_clock():
    """A clock of the calling thread: each call gives (wall, CPU, queued) seconds, queued being the time
    the thread was runnable but waited for a core (the scheduler's run delay), so wall - CPU - queued is
    time asleep. The CPU time is the thread clock's: schedstat's own moves only at the scheduler's ticks.
    The file stays open: a step reads it several times."""
    schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)  # this thread's, resolved now

    def now() -> tuple[float, float, float]:
        return time.monotonic(), time.thread_time(), int(os.pread(schedstat, 128, 0).split()[1]) / 1e9
    return now


def step_kind(batch) -> str:
    if sum(batch.chunks) > BIG_CHUNK:
        return "long chunk"
    return "mixed" if batch.prefill else "decode"


def trace_steps(engine, record) -> None:
    """record(kind, *step, *forward, *kernel) for every step the engine runs from now on: each the
    (wall, CPU, queued) seconds of the engine thread's clock. Call it on that thread."""
    from vramledger.worker.kernels import decoder_layers

    forward, kernel, depth, scheduled = [0.0] * 3, [0.0] * 3, [0], []
    runner, schedule, step = engine.runner, engine.scheduler.schedule, engine.step
    clock = thread_clock()  # called on the engine thread, which runs every step

    def timed(call, into):
        """call, its clock times added to `into`."""
        def timed_call(*args, **kwargs):
            start = clock()
            try:
                return call(*args, **kwargs)
            finally:
                for i, (end, begin) in enumerate(zip(clock(), start)):
                    into[i] += end - begin
        return timed_call

    def outermost(call):
        """call, timed into `forward` where no other forward called it (forward_parts may call forward)."""
        inner = timed(call, forward)

        def once(*args, **kwargs):
            if depth[0]:
                return call(*args, **kwargs)
            depth[0] += 1
            try:
                return inner(*args, **kwargs)
            finally:
                depth[0] -= 1
        return once

    if decoder_layers.available():  # the C forward holds no GIL: what waits there waits for threads or cores
        c_forward = timed(decoder_layers._kernel(), kernel)
        decoder_layers._kernel = lambda: c_forward

    def kept_schedule():
        batch = schedule()
        scheduled.append(batch)
        return batch

    def timed_step(*args, **kwargs):
        forward[:] = kernel[:] = [0.0] * 3
        scheduled.clear()
        start = clock()
        outputs = step(*args, **kwargs)
        if scheduled and scheduled[0] is not None:
            record(step_kind(scheduled[0]), *(end - begin for end, begin in zip(clock(), start)),
                   *forward, *kernel)
        return outputs

    runner.forward, runner.forward_parts = outermost(runner.forward), outermost(runner.forward_parts)
    engine.scheduler.schedule, engine.step = kept_schedule, timed_step


def serve(trace: Path, argv: list[str]) -> int:
    """The worker, its steps traced into `trace` (one line a step) once the engine has loaded."""
    from vramledger.worker.cli import main
    from vramledger.worker.http import engine_loop

    out = open(trace, "w", buffering=1)
    run = engine_loop.EngineLoop._run

    def traced_run(self):
        build = self._build

        def build_traced():
            engine = build()
            trace_steps(engine, lambda *fields: out.write(" ".join(map(str, fields)) + "\n"))
            return engine
        self._build = build_traced
        run(self)
    engine_loop.EngineLoop._run = traced_run
    return main(argv)


def read_trace(trace: Path) -> list[tuple]:
    rows = []
    for line in trace.read_text().splitlines():
        kind, *numbers = line.rsplit(" ", 9)
        rows.append((kind, *map(float, numbers)))
    return rows


class CoreUse:
    """Cores used by one process and by everything else, sampled every 10 ms from /proc."""

    def __init__(self, pid: int):
        self.pid, self.samples, self._stop = pid, [], threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _sample(self):
        tick = os.sysconf("SC_CLK_TCK")
        while not self._stop.is_set():
            with open("/proc/stat") as f:
                fields = f.readline().split()[1:9]
            busy = sum(int(x) for i, x in enumerate(fields) if i not in (3, 4))  # all but idle and iowait
            with open(f"/proc/{self.pid}/stat") as f:
                own = f.read().rsplit(")", 1)[1].split()
            self.samples.append((time.monotonic(), busy / tick, (int(own[11]) + int(own[12])) / tick))
            time.sleep(0.01)

    def while_busy(self) -> tuple[float, float, float]:
        """(seconds, server cores, other cores) over the 100 ms bins from the first to the last in
        which the server used more than 0.3 of a core: the drive, without guidellm's start-up."""
        bins: dict[int, list[float]] = {}
        for (t0, busy0, own0), (t1, busy1, own1) in zip(self.samples, self.samples[1:]):
            b = bins.setdefault(int(t0 * 10), [0.0, 0.0, 0.0])
            b[0] += t1 - t0
            b[1] += own1 - own0
            b[2] += (busy1 - busy0) - (own1 - own0)
        busy = [k for k, (span, own, _) in bins.items() if span and own / span > 0.3]
        if not busy:
            return 0.0, 0.0, 0.0
        total = [sum(bins[k][i] for k in range(min(busy), max(busy) + 1) if k in bins) for i in range(3)]
        return total[0], total[1] / total[0], total[2] / total[0]


FIRST_TOKEN = ("vramledger_time_to_first_token_seconds", "vramledger_request_queue_seconds")
FIRST_TOKEN_SERIES = [f"{name}_{part}" for name in FIRST_TOKEN for part in ("sum", "count")]


def first_token_split(before: dict[str, float], after: dict[str, float]) -> str:
    """Mean ms from arrival to the first token, to the first scheduling, and between, over the drive."""
    ttft, queue = ((after[f"{n}_sum"] - before[f"{n}_sum"]) / max(1.0, after[f"{n}_count"] - before[f"{n}_count"])
                   for n in FIRST_TOKEN)
    return (f"server TTFT mean {ttft * 1e3:.0f} ms: {queue * 1e3:.0f} from arrival to the first scheduling, "
            f"{(ttft - queue) * 1e3:.0f} from there to the first token")


def served(args) -> tuple[list[tuple], tuple[float, float, float], str]:
    import serve as bench

    ns = bench.options().parse_args(["--concurrency", "8", "--requests-per-stream", str(args.requests_per_stream)])
    load = bench.build_loads(ns, ["shared-prefix"])["shared-prefix"]
    logdir = Path(tempfile.mkdtemp())
    trace = logdir / "steps.txt"
    server = bench.our_server("ours", ns, bench.free_port(), draft=args.draft, speculation="adaptive")
    server.command[1:3] = [__file__, "--serve", str(trace), "--"]
    server.start(logdir)
    try:
        server.wait_ready()
        bench.warm_up(server)
        skip = len(read_trace(trace))  # the warm-up's steps
        before = bench.metric_sums(server.url, FIRST_TOKEN_SERIES)
        with CoreUse(server.process.pid) as cores:
            result = bench.run_guidellm(bench.guidellm_command(), server, ns, load, logdir / "report.json")[0]
        split = first_token_split(before, bench.metric_sums(server.url, FIRST_TOKEN_SERIES))
    finally:
        server.stop()
    summary = f"{result['tok_s']:.0f} tok/s, TTFT median {result['ttft_ms']:.0f} ms ({split})"
    return read_trace(trace)[skip:], cores.while_busy(), summary


def alone(args, runs: int) -> list[tuple]:
    from vramledger.worker.cli import thread_settings  # the served steps' threads
    from vramledger.worker.config import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL, EngineConfig
    from vramledger.worker.engine.llm_engine import LLMEngine
    from vramledger.worker.engine.sampling_params import SamplingParams

    draft = DEFAULT_DRAFT_MODEL if args.draft else None
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, draft_model=draft, max_num_seqs=8, max_model_len=2048,
                                    speculation="adaptive", **thread_settings(None)))
    rows: list[tuple] = []
    trace_steps(engine, lambda *fields: rows.append(fields))
    # Words, as guidellm's prompts are: the engine's own source.
    text = engine.tokenizer.encode(Path(inspect.getfile(LLMEngine)).read_text(), verbose=False)
    params = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True)
    for run in range(runs):
        rng = random.Random(run)
        start = rng.randrange(len(text) - 1024)
        prefix = text[start:start + 1024]
        left = 24
        while left:
            if len(engine.scheduler.waiting) + len(engine.scheduler.running) < 8:
                start = rng.randrange(len(text) - 32)
                engine.add_request(prefix + text[start:start + 32], params)
                left -= 1
                continue
            engine.step()
        while engine.has_unfinished_requests():
            engine.step()
    return rows


def medians(rows: list[tuple], kind: str) -> str:
    """Median wall ms (CPU, queued) of the step, its forward and the forward's C kernel."""
    picked = [r[1:] for r in rows if r[0] == kind]
    if not picked:
        return "-"
    m = [statistics.median(x) * 1e3 for x in zip(*picked)]
    return f"{len(picked):4d} steps: " + "; ".join(
        f"{part} {m[i]:6.2f} ({m[i + 1]:5.2f}, {m[i + 2]:4.2f})"
        for part, i in (("step", 0), ("forward", 3), ("C kernel", 6)))


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        return serve(Path(sys.argv[2]), sys.argv[4:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="served drives, each on a fresh server")
    parser.add_argument("--draft", action="store_true", help="with the draft, adaptive k (default: plain)")
    parser.add_argument("--requests-per-stream", type=int, default=3,
                        help="the served drive's requests per stream (the engine alone keeps 3)")
    args = parser.parse_args()
    if args.runs < 1 or args.requests_per_stream < 1:
        parser.error("--runs and --requests-per-stream must be at least 1")
    served_rows: list[tuple] = []
    for run in range(args.runs):
        rows, (seconds, own, others), summary = served(args)
        served_rows += rows
        print(f"served drive {run + 1}: {summary}; while the server was busy ({seconds:.2f} s): "
              f"server {own:.2f} cores, everything else {others:.2f}, idle "
              f"{max(0.0, (os.cpu_count() or 1) - own - others):.2f} of {os.cpu_count()}", flush=True)
    alone_rows = alone(args, args.runs)
    mode = "with the draft, adaptive" if args.draft else "plain"
    print(f"medians per step ({mode}), ms: wall (the engine thread's CPU, and its time waiting for a core) "
          "of the step, of its forward and of the forward's C kernel")
    for kind in ("long chunk", "mixed", "decode"):
        print(f"  {kind:10s} served {medians(served_rows, kind)}")
        print(f"  {'':10s} alone  {medians(alone_rows, kind)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
