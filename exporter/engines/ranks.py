"""An engine's ledger per rank, for an engine that publishes none itself (vLLM, through the vLLM plugin):
the exporter publishes each rank's entries, and declares each rank's bytes on the device it uses."""
from __future__ import annotations

from dataclasses import dataclass

from vramledger.exporter.sources import HOST, DeviceMemory

WEIGHTS = ("weights", "kernels")  # what a model's weights hold: its parameters and their kernel-only copies


@dataclass(frozen=True)
class Entry:
    """One ledger entry: a component's bytes, of one model or ("") of the whole rank."""
    component: str
    model: str
    bytes: int
    in_budget: bool | None  # None where the engine sized against no budget


@dataclass(frozen=True)
class Sizing:
    """How a vLLM rank sized its KV cache (the plugin's VRAMLEDGER_VLLM_SIZING): what each arithmetic
    charged its budget before the KV cache, and the one that ran."""
    ran: str  # "vllm" or "own-process"
    fallback: str  # why own-process sizing was asked for and vLLM's ran; "" when it was not
    vllm_charged_bytes: int
    own_process_bytes: int | None  # None where NVML could not see the rank's process
    charged_bytes: int  # the one that ran

    @property
    def foreign_charged_bytes(self) -> int | None:
        """What the rank charged beyond its own process's memory: other processes' memory."""
        return None if self.own_process_bytes is None else max(0, self.charged_bytes - self.own_process_bytes)


@dataclass(frozen=True)
class RankLedger:
    """One rank: a process holding memory on one device, and what its ledger says it holds there."""
    rank: int
    device_kind: str  # "cuda" or "cpu"
    device_uuid: str | None  # NVML's, on CUDA; None where the rank could not read it
    declared_bytes: int
    entries: tuple[Entry, ...]
    budget_bytes: int | None = None  # what it sized its KV cache against; None when given a KV size
    sizing: Sizing | None = None  # None where no profile run sized the KV cache

    @property
    def foreign_charged_bytes(self) -> int | None:
        """Other processes' memory the rank charged itself; None unmeasured."""
        return None if self.sizing is None else self.sizing.foreign_charged_bytes

    def on(self, device: DeviceMemory) -> bool:
        """Whether the rank's memory is on this device: the host for a CPU rank, a GPU by its UUID."""
        if self.device_kind == "cpu":
            return device.device == HOST
        return self.device_uuid is not None and _bare_uuid(device.uuid) == _bare_uuid(self.device_uuid)

    def weights_outside_budget(self) -> dict[str, int]:
        """Per model, the bytes of its weights that are outside the budget (0 when inside); {} without one."""
        outside: dict[str, int] = {}
        for e in self.entries:
            if e.component in WEIGHTS and e.in_budget is not None:
                outside[e.model] = outside.get(e.model, 0) + (0 if e.in_budget else e.bytes)
        return outside

    def components(self) -> dict[tuple[str, str], int]:
        """Bytes per (component, model): one series each."""
        total: dict[tuple[str, str], int] = {}
        for e in self.entries:
            total[e.component, e.model] = total.get((e.component, e.model), 0) + e.bytes
        return total


@dataclass(frozen=True)
class ServerProcess:
    """A process of a vLLM server besides its ranks (its API server, its engine core, a helper): the host
    memory it declares, what it held when the server became ready."""
    role: str  # vramledger.ledger_vocabulary.SERVER_ROLES
    pid: int
    bytes: int


def _bare_uuid(uuid: str) -> str:
    # NVML says "GPU-<uuid>", torch the bare UUID.
    return uuid.removeprefix("GPU-").removeprefix("MIG-")
