"""Scenario 6, two vLLM servers start at once: vLLM (with the vramledger plugin and the pair, as in
scenario 5) at gpu_memory_utilization 0.7 and 0.2 of one GPU. First each alone, for the KV cache it
gets with nothing else moving; then both started at the same moment with own-process sizing
(VRAMLEDGER_VLLM_SIZING=own-process, docs/vllm.md): both start, each KV cache within one block of
what it got alone; then both at once with vLLM's own arithmetic, shown beside (whether each started,
the blocks it lost). Skipped, saying why, without a CUDA device, vLLM and the plugin, or the room."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from typing import Protocol

from vramledger.ledger_document import ServerDocument, SizingDoc
from vramledger.units import format_bytes
from vramledger.vllm_plugin.sizing import OWN_PROCESS, SETTING, VLLM
from vramledger.worker.selfcheck import scenario_vllm
from vramledger.worker.selfcheck.context import Context
from vramledger.worker.selfcheck.processes import ProcessExited, WaitTimedOut, free_port, wait_http
from vramledger.worker.selfcheck.report import CannotRun, Check, ScenarioResult
from vramledger.worker.selfcheck.scale import PAIR_SHARES

TITLE = "two vLLM servers start at once (own-process sizing)"
BLOCK_TOLERANCE = 1  # blocks: "each KV cache within one block of what it gets alone"
CONTEXT_SHARE = 0.05  # of the GPU, free beyond the two budgets: the servers' CUDA contexts


@dataclass(frozen=True)
class Outcome:
    """One server of a run: its KV cache and the sizing its ledger says ran, or why it did not serve."""

    share: float
    failed: str | None = None
    blocks: int | None = None  # as allocated: those vLLM hands out and its null block
    bytes_per_block: int | None = None
    sizing: SizingDoc | None = None  # the rank's ledger's `sizing` (docs/ledger.md)

    @classmethod
    def from_ledger(cls, share: float, doc: ServerDocument) -> Outcome:
        ranks = doc.get("ranks") or []
        errors = [e for r in ranks for e in r.get("errors", [])]
        if len(ranks) != 1 or errors:
            return cls(share, failed=f"its ledger has {len(ranks)} rank(s), hook errors: {'; '.join(errors) or 'none'}")
        kv = ranks[0]["kv_cache"]
        return cls(share, blocks=kv["blocks_total"] + kv.get("blocks_reserved", 0),
                   bytes_per_block=kv["bytes_per_block"], sizing=ranks[0].get("sizing"))

    def describe(self) -> str:
        if self.failed is not None:
            return f"{self.share:g}: {self.failed}"
        return f"{self.share:g}: {self.blocks} blocks ({format_bytes((self.blocks or 0) * (self.bytes_per_block or 0))})"


class Servers(Protocol):
    def together(self, shares: tuple[float, ...], sizing: str) -> dict[float, Outcome]:
        """Start a server at each share at once, with the sizing asked for; {share: Outcome}."""


def preconditions(view, device: str) -> None:
    """CannotRun unless the device is a GPU with room for both budgets at once (view: kind, total, free)."""
    if view.kind != "cuda":
        raise CannotRun("needs a CUDA device, and there is none here: two vLLM servers share one GPU's memory "
                        f"at gpu_memory_utilization {' + '.join(map(str, PAIR_SHARES))}, and vLLM's CPU build "
                        "runs no memory profile to size them")
    total, free = view.total_bytes(), view.free_bytes()
    need = math.ceil((sum(PAIR_SHARES) + CONTEXT_SHARE) * total)
    if free < need:
        raise CannotRun(f"needs {format_bytes(need)} free on {device} (the budgets "
                        f"{' + '.join(map(str, PAIR_SHARES))} of it and the servers' CUDA contexts); "
                        f"{format_bytes(free)} is free")


class VllmServers:
    """Real vLLM servers with the plugin on the GPU selfcheck checks (scenario 5's command and checks
    of the environment), started back to back, each read once it serves, all stopped after."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.python = scenario_vllm.vllm_python(ctx.vllm_python)
        scenario_vllm.check_environment(self.python, scenario_vllm.probe(self.python), version("vramledger"))

    def together(self, shares: tuple[float, ...], sizing: str) -> dict[float, Outcome]:
        s, procs = self.ctx.scale, self.ctx.procs
        started = {}
        for share in shares:
            port = free_port()
            started[share] = (port, procs.start(f"s6-vllm-{share:g}-{sizing}",
                                                scenario_vllm.server_command(self.python, s, port, share),
                                                env=scenario_vllm.server_env(s, **{SETTING: sizing})))
        out = {}
        try:
            for share, (port, server) in started.items():
                url = f"http://127.0.0.1:{port}"
                try:
                    wait_http(url + "/health", scenario_vllm.ready_timeout(s), server)
                    out[share] = Outcome.from_ledger(share, scenario_vllm.read_server(url)[0])
                except ProcessExited as e:
                    out[share] = Outcome(share, failed=f"exited: {e.last_error()}")
                except WaitTimedOut as e:
                    out[share] = Outcome(share, failed=e.headline)
        finally:
            for _, server in started.values():
                procs.stop(server)
        return out


def run(ctx: Context, result: ScenarioResult, servers: Callable[[Context], Servers] = VllmServers) -> None:
    preconditions(ctx.view, ctx.scale.device)
    start = servers(ctx).together
    alone = {}
    for share in PAIR_SHARES:
        ctx.say(f"scenario 6: vLLM alone at {share:g} ({OWN_PROCESS} sizing)")
        alone.update(start((share,), OWN_PROCESS))
    ctx.say(f"scenario 6: two vLLM servers at {' + '.join(map(str, PAIR_SHARES))} at once, {OWN_PROCESS} sizing")
    own = start(PAIR_SHARES, OWN_PROCESS)
    ctx.say(f"scenario 6: the same with vLLM's own arithmetic ({SETTING}={VLLM})")
    arithmetic = start(PAIR_SHARES, VLLM)
    check_pair(result, alone, own, arithmetic)


def check_pair(result: ScenarioResult, alone: dict[float, Outcome], own: dict[float, Outcome],
               arithmetic: dict[float, Outcome]) -> None:
    """The checks of the three runs, each {share: Outcome}; vLLM's arithmetic is shown, not judged."""
    for share in PAIR_SHARES:
        result.add(Check.compare(f"alone at {share:g}", alone[share].failed is None, alone[share].describe(),
                                 f"it serves alone ({OWN_PROCESS} sizing): the KV cache to compare with"))
    result.add(Check.compare("both start (own-process)", all(own[s].failed is None for s in PAIR_SHARES),
                             "; ".join(own[s].describe() for s in PAIR_SHARES), "both serve, started at once"))
    for share in PAIR_SHARES:
        got, reference = own[share], alone[share]
        lost = None if got.blocks is None or reference.blocks is None else reference.blocks - got.blocks
        result.add(Check.compare(
            f"KV cache at {share:g} (own-process, together)", lost is not None and abs(lost) <= BLOCK_TOLERANCE,
            got.describe() if lost is None else f"{got.blocks} blocks ({-lost:+d} against alone)",
            f"{reference.blocks} blocks (alone) ±{BLOCK_TOLERANCE}", blocks=got.blocks, alone_blocks=reference.blocks))
        sizing: dict = dict(got.sizing or {})
        result.add(Check.compare(
            f"sizing at {share:g} (own-process, together)",
            sizing.get("ran") == OWN_PROCESS and sizing.get("fallback") is None,
            f"ran {sizing.get('ran')}" + (f", fell back: {sizing.get('fallback_reason')}"
                                          if sizing.get("fallback") else ""),
            f"ran {OWN_PROCESS}, no fallback (NVML sees each rank's process)"))
    for share in PAIR_SHARES:
        got, reference = arithmetic[share], alone[share]
        sizing = dict(got.sizing or {})
        charged, own_bytes = sizing.get("vllm_charged_bytes"), sizing.get("own_process_bytes")
        if got.failed is not None or got.blocks is None or reference.blocks is None:
            measured = got.describe()
        else:
            beyond = "" if charged is None or own_bytes is None else (
                f"; charged {format_bytes(charged - own_bytes)} beyond its own process")
            measured = f"{got.blocks} blocks ({got.blocks - reference.blocks:+d} against alone){beyond}"
        result.add(Check.shown(f"vLLM's arithmetic at {share:g} (together)", measured,
                               "shown: it charges what the other server takes while this one profiles",
                               blocks=got.blocks, alone_blocks=reference.blocks, failed=got.failed))
