"""Memory snapshots and measurement windows: what each load, profile run and capture costs."""
from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vramledger.worker.memory.device import Device

log = logging.getLogger(__name__)

# The CPU weights check: parameter bytes and the RSS delta of a load may differ this much.
WEIGHTS_RSS_TOLERANCE = 0.25


@dataclass(frozen=True)
class MemorySnapshot:
    """Every memory counter of a device at one moment."""

    timestamp: float
    total: int
    free: int
    process: int
    process_peak: int
    torch_allocated: int
    torch_reserved: int
    torch_peak: int

    @classmethod
    def take(cls, device: Device) -> MemorySnapshot:
        device.synchronize()
        return cls(timestamp=time.time(), total=device.total_bytes(), free=device.free_bytes(),
                   process=device.process_bytes(), process_peak=device.process_peak_bytes(),
                   torch_allocated=device.torch_allocated_bytes(),
                   torch_reserved=device.torch_reserved_bytes(),
                   torch_peak=device.torch_peak_allocated_bytes())


@contextlib.contextmanager
def collecting_only_new_objects() -> Iterator[None]:
    """Inside, garbage collections skip every object that existed before (gc.freeze), and those
    return to the collector after. Startup's measurements collect a dozen times to free what loads
    leave behind; a full collection of everything imported before took ~0.2 s each (2.4 s of a 3 s
    engine start with the test models), and nothing made before startup is the engine's to free."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def runtime_bytes(snapshot: MemorySnapshot) -> int:
    """The "runtime" entry: what the process held before any model was loaded."""
    return snapshot.process


def foreign_bytes(snapshot: MemorySnapshot) -> int:
    """Memory in use on the device that is not ours: device used minus our process."""
    return max(0, snapshot.total - snapshot.free - snapshot.process)


def module_tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each shared storage counted once."""
    storages: dict[tuple, int] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_meta:
            continue
        if tensor.is_mkldnn:  # packed weights (models/packed_linear.py): opaque, their layout's padding included
            storages[(tensor.device, id(tensor))] = torch.ops.mkldnn._nbytes(tensor)
            continue
        storage = tensor.untyped_storage()
        storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def measure_weights(device: Device, load_fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run load_fn (which returns the model) and return (model, bytes its weights hold)."""
    if device.kind == "cuda":
        device.synchronize()
        before = MemorySnapshot.take(device)
        model = load_fn()
        # A loader's temporaries (unfused copies, casts) must not stay in the allocator's cache.
        device.empty_cache()
        after = MemorySnapshot.take(device)
        weights = after.torch_allocated - before.torch_allocated
        kept = after.torch_reserved - before.torch_reserved - weights
        if kept > max(WEIGHTS_RSS_TOLERANCE * weights, 64 << 20):
            log.warning("weights of %s: the load left %.1f MiB reserved beyond the %.1f MiB its tensors "
                        "hold (fragmentation); it shows as allocator memory in the ledger",
                        type(model).__name__, kept / 2**20, weights / 2**20)
        return model, weights
    device.empty_cache()
    rss_before = device.process_bytes()
    model = load_fn()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"load_fn must return a torch.nn.Module on the CPU, not {type(model).__name__}")
    weights = module_tensor_bytes(model)
    device.empty_cache()  # loader temporaries should not count against the check
    rss_delta = device.process_bytes() - rss_before
    # Small models: imports and allocator pools dwarf the weights; only large gaps mean something.
    if abs(rss_delta - weights) > max(WEIGHTS_RSS_TOLERANCE * weights, 64 << 20):
        log.warning("weights of %s: parameters and buffers hold %.1f MiB but RSS grew %.1f MiB "
                    "during the load; the ledger counts the parameters",
                    type(model).__name__, weights / 2**20, rss_delta / 2**20)
    return model, weights


@dataclass
class WindowResult:
    """What a profile window measured; filled when the window closes."""

    activation_peak_bytes: int = 0
    non_torch_bytes: int = 0
    allocator_bytes: int = 0
    start: MemorySnapshot | None = None
    end: MemorySnapshot | None = None
    _peak: Callable[[], int] | None = None
    _marked_peak: int | None = None

    def mark(self) -> None:
        """The first pass ends here: what runs after it, untrimmed, measures allocator slack."""
        self._marked_peak = self._peak() if self._peak else None


@contextlib.contextmanager
def profile_window(device: Device) -> Iterator[WindowResult]:
    """Measure the transient peak (activations), the lasting non-torch growth of the block and,
    after `mark()`, what the allocator keeps beyond that peak when other steps follow untrimmed."""
    result = WindowResult()
    device.empty_cache()
    peak_was_reset = device.reset_peak()
    sampler = None if peak_was_reset else PeakSampler(device).start()
    if device.kind == "cuda":
        result._peak = device.torch_peak_allocated_bytes
    else:
        result._peak = (lambda: sampler.peak) if sampler else device.process_peak_bytes
    result.start = MemorySnapshot.take(device)
    try:
        yield result
    finally:
        sampled = sampler.stop() if sampler else None
        first = result._marked_peak
        if device.kind == "cpu":
            peak = sampled if sampled is not None else device.process_peak_bytes()
            held_free = device.allocator_free_bytes()
            device.empty_cache()  # freed tensors still in malloc's arenas did not "stay"
        result.end = end = MemorySnapshot.take(device)
        start = result.start
        if device.kind == "cuda":
            result.activation_peak_bytes = max(0, end.torch_peak - start.torch_allocated)
            torch_growth = end.torch_reserved - start.torch_reserved
            result.non_torch_bytes = max(0, end.process - start.process - torch_growth)
            # Cached segments beyond the most ever allocated at once: fragmentation.
            result.allocator_bytes = max(0, end.torch_reserved - max(end.torch_peak, start.torch_reserved))
        else:
            first = peak if first is None else first
            result.non_torch_bytes = max(0, end.process - start.process)  # what stays
            result.activation_peak_bytes = max(0, first - start.process - result.non_torch_bytes)
            # The steps after the mark reuse freed memory; what they could not reuse raised the peak. The
            # blocks malloc holds free after them may be resident at a later peak beside what it uses
            # (serving's peak passed the first figure alone by up to 0.4 MiB in 3 of 20 runs).
            result.allocator_bytes = max(0, peak - first, held_free)


def measure_held(device: Device, build: Callable[[], Any], peak: bool = False) -> int:
    """Bytes the process grows by while it holds what build() returns (dropped afterwards); with
    `peak`, the most it grew by while build() ran (a build whose work frees what it needed)."""
    device.empty_cache()
    before = device.process_bytes()
    sampler = None
    if peak and device.kind == "cpu" and not device.reset_peak():
        sampler = PeakSampler(device).start()
    held = build()
    grown = device.process_bytes() - before
    if peak and device.kind == "cpu":
        grown = max(grown, (sampler.stop() if sampler else device.process_peak_bytes()) - before)
    del held
    device.empty_cache()
    return max(0, grown)


class PeakSampler:
    """Polls process memory in a thread: the fallback where the kernel's peak cannot be reset."""

    def __init__(self, device: Device, interval_s: float = 0.001):
        self.device, self.interval_s = device, interval_s
        self.peak = device.process_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-sampler", daemon=True)

    def start(self) -> PeakSampler:
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.device.process_bytes())
        return self.peak

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.device.process_bytes())
