"""The order of a selfcheck run: the device, the sizes, the six scenarios, the report."""
from __future__ import annotations

import argparse
import functools
import logging
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from vramledger.units import format_bytes
from vramledger.worker.config import DEFAULT_MODEL
from vramledger.worker.memory.device import get_device
from vramledger.worker.selfcheck import (
    scenario_draft,
    scenario_exporter,
    scenario_ledger,
    scenario_neighbours,
    scenario_vllm,
    scenario_vllm_pair,
)
from vramledger.worker.selfcheck.checkpoints import LARGE_SHAPES, build_random_checkpoint
from vramledger.worker.selfcheck.context import Context
from vramledger.worker.selfcheck.processes import Processes, ProcessExited, WaitTimedOut, signals_raise
from vramledger.worker.selfcheck.report import (
    FAIL,
    CannotRun,
    ScenarioResult,
    exit_code,
    format_table,
    to_json,
)
from vramledger.worker.selfcheck.scale import make_scale
from vramledger.worker.selfcheck.view import DeviceView

log = logging.getLogger(__name__)
TITLES = {1: scenario_ledger.TITLE, 2: scenario_draft.TITLE, 3: scenario_neighbours.TITLE,
          4: scenario_exporter.TITLE, 5: scenario_vllm.TITLE, 6: scenario_vllm_pair.TITLE}


def attempt(ctx: Context, result: ScenarioResult, body: Callable[[], None]) -> None:
    """Run one scenario's body; a reason to skip, or an error, ends up in its result."""
    start = time.monotonic()
    try:
        body()
    except CannotRun as e:
        result.skipped = str(e)
    except ProcessExited as e:
        result.error = f"{e.headline}: {e.last_error()}"
    except WaitTimedOut as e:  # one line of the report: the process's log stays in its file
        result.error = e.headline
    except Exception as e:  # a scenario that could not finish has failed; the next ones still run
        log.debug("scenario %d:\n%s", result.number, traceback.format_exc())
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.seconds = time.monotonic() - start
        ctx.say(f"scenario {result.number}: {result.status} ({result.seconds:.0f} s)")


def run_scenarios(ctx: Context, keep_going: bool = False) -> list[ScenarioResult]:
    """Scenarios 1 to 6 in order; without keep_going, those after a failure are skipped."""
    results = [ScenarioResult(n, title) for n, title in TITLES.items()]
    r1, r2, r3, r4, r5, r6 = results

    def stopped(result: ScenarioResult) -> bool:
        failed = [r.number for r in results if r.status == FAIL]
        if failed and not keep_going:
            result.skipped = f"not run: scenario {failed[0]} failed (--keep-going runs the rest)"
        return bool(failed) and not keep_going

    for result, scenario in ((r1, scenario_ledger), (r2, scenario_draft)):
        if not stopped(result):
            attempt(ctx, result, functools.partial(scenario.run, ctx, result))
    if stopped(r3):
        stopped(r4)
    else:
        neighbours_and_exporter(ctx, r3, r4, stopped)
    for started in ctx.procs.started:  # vLLM gets a device that only it uses
        ctx.procs.stop(started)
    for result, vllm_scenario in ((r5, scenario_vllm), (r6, scenario_vllm_pair)):  # each stops its servers
        if not stopped(result):
            attempt(ctx, result, functools.partial(vllm_scenario.run, ctx, result))
    return results


def neighbours_and_exporter(ctx: Context, r3: ScenarioResult, r4: ScenarioResult, stopped) -> None:
    """Scenarios 3 and 4, which share scenario 3's processes."""
    hood: list[scenario_neighbours.Neighbourhood] = []

    def neighbours() -> None:
        hood.append(scenario_neighbours.set_up(ctx))
        scenario_neighbours.run(ctx, hood[0], r3)

    attempt(ctx, r3, neighbours)
    if r3.skipped is not None and not hood:
        r4.skipped = f"needs scenario 3's processes: {r3.skipped}"
    elif not hood:
        r4.skipped = "needs scenario 3's processes, which did not start"
    elif not stopped(r4):
        attempt(ctx, r4, lambda: scenario_exporter.run(ctx, hood[0], r4))


def large_models(cache_dir: str | None, device: str) -> tuple[Path, Path]:
    root = Path(cache_dir or "~/.cache/vramledger/selfcheck").expanduser()
    build_on = device if device.startswith("cuda") else "cpu"
    target, draft = (build_random_checkpoint(root / f"large-{role}", DEFAULT_MODEL, LARGE_SHAPES[role], seed,
                                             build_on) for seed, role in enumerate(("target", "draft")))
    return target, draft


def main(args: argparse.Namespace) -> int:
    device = get_device(args.device)  # ValueError: the CLI says what is wrong, exit 2
    spec = f"{device.kind}:{device.index}" if device.kind == "cuda" else "cpu"
    view = DeviceView(device)
    total = view.total_bytes()
    large = None
    if args.scale == "large" and not (args.model and args.draft_model):
        print(f"selfcheck: building the large random pair (once) on {spec}", file=sys.stderr, flush=True)
        large = large_models(args.cache_dir, spec)
    scale = make_scale(device.kind, spec, total, device.dtype.itemsize, scale=args.scale, model=args.model,
                       draft_model=args.draft_model, dtype=args.dtype,
                       num_speculative_tokens=args.num_speculative_tokens, block_size=args.block_size,
                       max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, large_models=large)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vramledger-selfcheck-"))
    header = (f"vramledger selfcheck on {device} ({format_bytes(total)}), scale {scale.name}: "
              f"max_model_len {scale.max_model_len}, max_num_seqs {scale.max_num_seqs}")
    print(f"selfcheck: {header}; logs in {workdir}", file=sys.stderr, flush=True)
    start = time.monotonic()
    try:
        with signals_raise(), Processes(workdir) as procs:
            context = Context(view, scale, procs, vllm_python=args.vllm_python)
            results = run_scenarios(context, keep_going=args.keep_going)
    except KeyboardInterrupt:  # every process is stopped by now
        print(f"selfcheck: interrupted; the processes' logs are in {workdir}", file=sys.stderr)
        return 130
    meta = {"device": {"kind": device.kind, "index": device.index, "name": device.name, "total_bytes": total},
            "scale": scale.name, "models": {"target": scale.model, "draft": scale.draft_model},
            "max_model_len": scale.max_model_len, "max_num_seqs": scale.max_num_seqs,
            "seconds": round(time.monotonic() - start, 1), "workdir": str(workdir), "notes": scale.notes,
            "processes": [{"name": p.name, "pid": p.pid, "returncode": p.popen.returncode}
                          for p in procs.started]}
    code = exit_code(results)
    if args.json:
        print(to_json(results, meta))
    else:
        print(format_table(results, header))
    if code == 0 and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"selfcheck: the processes' logs are in {workdir}", file=sys.stderr)
    return code
