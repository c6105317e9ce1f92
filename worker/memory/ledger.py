"""The memory ledger: every byte the worker holds, by owner, as served by GET /v1/memory."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from vramledger.identity import ProcessIdentity
from vramledger.ledger_document import Component, LedgerDocument
from vramledger.ledger_vocabulary import COMPONENTS, LEDGER_VERSION, WORKER_COMPONENTS
from vramledger.processes import ProcessMemory
from vramledger.units import GiB, MiB, format_bytes
from vramledger.worker.memory.device import Device
from vramledger.worker.memory.plan import blocks_per_sequence
from vramledger.worker.memory.profiler import MemorySnapshot, foreign_bytes, runtime_bytes


@dataclass
class LedgerEntry:
    """One owner of memory: a component, its model ("" for none) and its bytes."""

    component: Component
    model: str
    bytes: int


@dataclass
class Ledger:
    """Every byte the worker's process holds on its device, by owner (docs/ledger.md)."""

    device: Device
    total_bytes: int
    free_at_start_bytes: int
    target_model: str
    draft_model: str | None = None
    budget_bytes: int = 0
    utilization: float | None = None
    kv_cache_memory: int | None = None
    entries: list[LedgerEntry] = field(default_factory=list)
    foreign_at_start_bytes: int = 0
    foreign_at_start_processes: list[ProcessMemory] = field(default_factory=list)
    block_size: int = 0
    bytes_per_block: int = 0
    blocks_total: int = 0
    max_model_len: int = 0
    num_speculative_tokens: int = 0
    worker: ProcessIdentity = field(default_factory=ProcessIdentity.current)

    @classmethod
    def at_start(cls, device: Device, target_model: str, draft_model: str | None = None,
                 snapshot: MemorySnapshot | None = None) -> Ledger:
        """A ledger opened before any model is loaded, with the runtime entry and foreign memory."""
        snapshot = snapshot or MemorySnapshot.take(device)
        ledger = cls(device=device, total_bytes=snapshot.total, free_at_start_bytes=snapshot.free,
                     target_model=target_model, draft_model=draft_model,
                     foreign_at_start_bytes=foreign_bytes(snapshot),
                     foreign_at_start_processes=device.other_processes())
        ledger.record("runtime", runtime_bytes(snapshot))
        return ledger

    def record(self, component: Component, nbytes: int, model: str = "") -> None:
        """Set the bytes of (component, model), replacing an earlier measurement."""
        if component not in WORKER_COMPONENTS:
            raise ValueError(f"unknown ledger component {component!r}; expected one of {WORKER_COMPONENTS}")
        if nbytes < 0:
            raise ValueError(f"ledger entry {component}/{model} cannot be negative ({nbytes})")
        self.entries = [e for e in self.entries if (e.component, e.model) != (component, model)]
        self.entries.append(LedgerEntry(component, model, int(nbytes)))
        self.entries.sort(key=lambda e: COMPONENTS.index(e.component))  # stable: models keep order

    def set_kv_cache(self, block_size: int, bytes_per_block: int, blocks_total: int) -> None:
        """Record the allocated KV cache: blocks_total blocks of block_size tokens."""
        self.block_size, self.bytes_per_block, self.blocks_total = block_size, bytes_per_block, blocks_total
        self.record("kv_cache", blocks_total * bytes_per_block)

    def bytes_of(self, component: str, model: str | None = None) -> int:
        return sum(e.bytes for e in self.entries
                   if e.component == component and (model is None or e.model == model))

    @property
    def declared_bytes(self) -> int:
        return sum(e.bytes for e in self.entries)

    @property
    def non_kv_bytes(self) -> int:
        """Everything declared except the KV cache: what the budget must hold before it."""
        return self.declared_bytes - self.bytes_of("kv_cache")

    @property
    def capacity_tokens(self) -> int:
        return self.blocks_total * self.block_size

    def max_concurrency(self) -> float | None:
        """How many max_model_len sequences the KV cache holds at once (None if unknown)."""
        if not (self.max_model_len and self.block_size):
            return None
        per_seq = blocks_per_sequence(self.max_model_len, self.block_size, self.num_speculative_tokens)
        return self.blocks_total / per_seq

    def to_dict(self, process_bytes: int | None = None, blocks_used: int = 0,
                blocks_cached: int = 0) -> LedgerDocument:
        """The ledger document of docs/ledger.md with the blocks in use and cached as given (the
        engine's published counts), and the process's memory measured now unless given."""
        process = self.device.process_bytes() if process_bytes is None else int(process_bytes)
        used, cached = int(blocks_used), int(blocks_cached)
        declared = self.declared_bytes
        d = self.device
        return {
            "version": LEDGER_VERSION,
            "worker": self.worker.to_dict(),
            "models": {"target": self.target_model, "draft": self.draft_model},
            "device": {"kind": d.kind, "index": d.index, "uuid": d.uuid, "name": d.name,
                       "total_bytes": self.total_bytes, "free_at_start_bytes": self.free_at_start_bytes},
            "budget": {"bytes": self.budget_bytes, "utilization": self.utilization,
                       "kv_cache_memory": self.kv_cache_memory},
            "entries": [{"component": e.component, "model": e.model, "bytes": e.bytes}
                        for e in self.entries],
            "declared_bytes": declared,
            "foreign_at_start": {"bytes": self.foreign_at_start_bytes,
                                 "processes": [{"pid": p.pid, "name": p.name, "bytes": p.bytes}
                                               for p in self.foreign_at_start_processes]},
            "kv_cache": {"block_size": self.block_size, "bytes_per_block": self.bytes_per_block,
                         "blocks_total": self.blocks_total, "blocks_used": used, "blocks_cached": cached,
                         "blocks_free": self.blocks_total - used - cached,
                         "capacity_tokens": self.capacity_tokens},
            "live": {"process_bytes": process, "declared_bytes": declared,
                     "unaccounted_bytes": max(0, process - declared), "measured_at": time.time()},
        }


# --- reports ---
def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _entry_label(entry: LedgerEntry) -> str:
    return f"{entry.component}[{entry.model}]" if entry.model else entry.component


def format_table(ledger: Ledger) -> str:
    """The ledger as a text table: component, model, GiB, share of the budget."""
    budget = ledger.budget_bytes

    def row(component: str, model: str, nbytes: int) -> str:
        share = f"{100 * nbytes / budget:6.1f}%" if budget else "      -"
        return f"{component:<16} {model:<8} {_gib(nbytes):>9} {nbytes / MiB:>10.1f} {share:>8}"

    d = ledger.device
    lines = [f"device {d.kind}:{d.index} ({d.name}): {_gib(ledger.total_bytes)} GiB total, "
             f"{_gib(ledger.free_at_start_bytes)} GiB free at start, "
             f"{_gib(ledger.foreign_at_start_bytes)} GiB foreign at start",
             f"{'component':<16} {'model':<8} {'GiB':>9} {'MiB':>10} {'budget':>8}",
             "-" * 55]
    lines += [row(e.component, e.model, e.bytes) for e in ledger.entries]
    lines += ["-" * 55, row("declared", "", ledger.declared_bytes), row("budget", "", budget)]
    lines.append(f"KV capacity: {ledger.capacity_tokens} tokens "
                 f"({ledger.blocks_total} blocks x {ledger.block_size} tokens)")
    concurrency = ledger.max_concurrency()
    if concurrency is not None:
        lines.append(f"maximum concurrency at max_model_len {ledger.max_model_len}: {concurrency:.2f}x")
    return "\n".join(lines)


def summary_line(ledger: Ledger) -> str:
    """The ledger on one line, for the startup log."""
    parts = ", ".join(f"{_entry_label(e)} {_gib(e.bytes)}" for e in ledger.entries)
    utilization = "" if ledger.utilization is None else f", utilization {ledger.utilization:g}"
    return (f"memory ledger ({ledger.device.kind}:{ledger.device.index}, GiB): {parts}; "
            f"declared {_gib(ledger.declared_bytes)} of budget {_gib(ledger.budget_bytes)}{utilization} "
            f"(device {_gib(ledger.total_bytes)}, foreign at start {_gib(ledger.foreign_at_start_bytes)}); "
            f"KV {ledger.blocks_total} blocks = {ledger.capacity_tokens} tokens")


def plot(ledger: Ledger, path: str) -> None:
    """Draw the ledger beside the budget and the device total, and a zoom on the budget (PNG at path)."""
    # Figure + the Agg canvas directly: no pyplot, no global backend switch, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 6.5))
    FigureCanvasAgg(fig)
    device_ax, zoom_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.6]})
    _plot_device(ledger, device_ax)
    _plot_budget(ledger, zoom_ax)
    fig.suptitle(f"memory ledger: {ledger.device.kind}:{ledger.device.index} ({ledger.device.name})")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)


def _plot_device(ledger: Ledger, ax) -> None:
    """The device view: the ledger stacked beside the budget and the device total."""
    bottom = 0.0
    top = max(ledger.total_bytes, ledger.budget_bytes, ledger.declared_bytes) / GiB
    for i, entry in enumerate(ledger.entries):
        height = entry.bytes / GiB
        ax.bar(0, height, bottom=bottom, color=f"C{i % 10}", edgecolor="white", label=_entry_label(entry))
        if height > 0.06 * top:  # room for a two-line label inside the segment
            ax.text(0, bottom + height / 2, f"{_entry_label(entry)}\n{height:.2f}", ha="center",
                    va="center", fontsize=8, color="white")
        bottom += height
    ax.bar(1, ledger.budget_bytes / GiB, color="0.6", label="budget")
    ax.axhline(ledger.budget_bytes / GiB, color="0.4", linestyle="--", linewidth=0.8)
    foreign = ledger.foreign_at_start_bytes / GiB
    ax.bar(2, ledger.total_bytes / GiB, color="0.85", label="device total")
    ax.bar(2, foreign, color="firebrick", label="foreign at start")
    for x, value in ((0, bottom), (1, ledger.budget_bytes / GiB), (2, ledger.total_bytes / GiB)):
        ax.text(x, value, f"{value:.2f} GiB", ha="center", va="bottom", fontsize=9)
    ax.set_xticks([0, 1, 2], ["declared (ledger)", "budget", f"{ledger.device.kind} total"])
    ax.set_ylabel("GiB")
    ax.set_title("the device")
    ax.legend(fontsize=7, loc="upper left")


def _plot_budget(ledger: Ledger, ax) -> None:
    """The zoom: one row per entry on the budget's scale, each starting where the one before ended
    (so the rows add up to the budget), its size written beside it however thin it is."""
    budget = ledger.budget_bytes or ledger.declared_bytes or 1
    scale, unit = (GiB, "GiB") if budget >= 4 * GiB else (MiB, "MiB")
    rows = [(_entry_label(e), e.bytes) for e in ledger.entries]
    start = 0
    labels = []
    for i, (label, nbytes) in enumerate(rows):
        ax.barh(i, nbytes / scale, left=start / scale, color=f"C{i % 10}", edgecolor="none", height=0.7)
        share = f" ({100 * nbytes / budget:.1f}%)" if ledger.budget_bytes else ""
        end = (start + nbytes) / scale
        inside = nbytes > 0.35 * budget  # long bars carry their text; short ones have it beside them
        ax.text(end - 0.01 * budget / scale if inside else end + 0.01 * budget / scale, i,
                format_bytes(nbytes) + share, va="center", ha="right" if inside else "left", fontsize=9,
                color="white" if inside else "black")
        labels.append(label)
        start += nbytes
    n = len(rows)
    ax.barh(n, budget / scale, color="0.6", height=0.7)
    ax.text(budget / scale * 0.99, n, f"budget {format_bytes(ledger.budget_bytes)}", va="center", ha="right",
            fontsize=9, color="white")
    ax.barh(n + 1, ledger.declared_bytes / scale, color="0.35", height=0.7)
    ax.text(ledger.declared_bytes / scale * 0.99, n + 1, f"declared {format_bytes(ledger.declared_bytes)}",
            va="center", ha="right", fontsize=9, color="white")
    ax.axvline(budget / scale, color="0.4", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(n + 2), labels + ["budget", "declared"])
    ax.invert_yaxis()
    ax.set_xlim(0, max(budget, ledger.declared_bytes) / scale * 1.3)  # room for the text of the last rows
    ax.set_xlabel(unit)
    share = f", {100 * budget / ledger.total_bytes:.1f}% of the device" if ledger.total_bytes else ""
    ax.set_title(f"zoom on the budget ({format_bytes(budget)}{share})")
