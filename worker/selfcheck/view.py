"""The device's own view of each process (NVML per pid on CUDA, RSS on the CPU), and its peak."""
from __future__ import annotations

import threading
import time

from vramledger.processes import ProcessMemory
from vramledger.worker.memory.device import Device


class DeviceView:
    """What the device says another process holds, read through worker/memory/device.py.

    Selfcheck's own process is never one of "the other processes"; workers and neighbours are.
    """

    def __init__(self, device: Device):
        self.device = device

    @property
    def kind(self) -> str:
        return self.device.kind

    def total_bytes(self) -> int:
        return self.device.total_bytes()

    def free_bytes(self) -> int:
        return self.device.free_bytes()

    def processes(self) -> dict[int, ProcessMemory]:
        return {p.pid: p for p in self.device.other_processes()}

    def process_bytes(self, pid: int) -> int | None:
        """Memory pid holds on the device; None when the device does not list it or cannot say."""
        found = self.processes().get(pid)
        return None if found is None else found.bytes

    def peak(self, pid: int) -> PeakWatch:
        """Track pid's peak from now on: the kernel's high-water mark on the CPU, sampling elsewhere."""
        if self.kind == "cpu":
            watch = KernelPeak(pid)
            if watch.reset():
                return watch
        return SampledPeak(self, pid)


class PeakWatch:
    """The most a process held since the watch started; stop() returns it (None if never seen)."""

    def stop(self) -> int | None:
        raise NotImplementedError


class KernelPeak(PeakWatch):
    """VmHWM of /proc/<pid>/status, reset at the start by writing 5 to /proc/<pid>/clear_refs."""

    def __init__(self, pid: int):
        self.pid = pid

    def reset(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def stop(self) -> int | None:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None


class SampledPeak(PeakWatch):
    """Polls the device view in a thread. On CUDA the caching allocator keeps what it once
    reserved, so a sample after the load still sees the peak; the polling catches the rest."""

    def __init__(self, view: DeviceView, pid: int, interval_s: float = 0.05):
        self.view, self.pid, self.interval_s = view, pid, interval_s
        self.peak: int | None = None
        self._stop = threading.Event()
        self._sample()
        self._thread = threading.Thread(target=self._run, name=f"peak-{pid}", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        value = self.view.process_bytes(self.pid)
        if value is not None:
            self.peak = value if self.peak is None else max(self.peak, value)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def stop(self) -> int | None:
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peak


def settle(view: DeviceView, pid: int, seconds: float = 0.5, tries: int = 10) -> int | None:
    """The process's memory once two readings `seconds` apart agree within 1% (idle, not moving)."""
    last = view.process_bytes(pid)
    for _ in range(tries):
        time.sleep(seconds)
        now = view.process_bytes(pid)
        if now is not None and last is not None and abs(now - last) <= 0.01 * max(now, 1):
            return now
        last = now
    return last
