"""What a rank charges its budget before the KV cache: vLLM's figure, or this process's own.

vLLM's figure (vllm/utils/mem_utils.py memory_profiling) is the drop in the device's free memory
from its start snapshot to after the profile run, plus the run's transient torch peak: a neighbour
that allocates meanwhile is charged to vLLM, one that frees memory trips vLLM's check that free
memory did not grow. With VRAMLEDGER_VLLM_SIZING=own-process the rank charges instead what its own
process grew by over the same window (torch's allocator, and NVML's count for its pid beyond it)
plus the same peak, by rewriting the profile result before vLLM's worker reads it. Where NVML cannot
see the process, vLLM's figure stands and the ledger says why.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Final

from vramledger.ledger_document import Sizer, SizingDoc

if TYPE_CHECKING:
    from vramledger.vllm_plugin.record import ProfileFacts

log = logging.getLogger("vllm.plugins.vramledger")

SETTING = "VRAMLEDGER_VLLM_SIZING"
VLLM: Final = "vllm"
OWN_PROCESS: Final = "own-process"
CHOICES: tuple[Sizer, ...] = (VLLM, OWN_PROCESS)
# Why own-process sizing was asked for and vLLM's arithmetic ran.
UNSEEN, BAD_SETTING, FAILED = "own_memory_unseen", "bad_setting", "sizing_failed"


@dataclass
class Sizing:
    """The sizing a rank asked for, the one that ran, and both figures side by side."""

    requested: Sizer
    ran: Sizer | None = None  # None until a profile run sized the KV cache (never, given a KV size)
    fallback: str | None = None  # UNSEEN, BAD_SETTING or FAILED where own-process was asked and vllm ran
    fallback_reason: str | None = None
    vllm_charged_bytes: int | None = None  # what vLLM's arithmetic charges before the KV cache
    own_process_bytes: int | None = None  # what this process's own memory charges; None where unseen

    @classmethod
    def from_environment(cls) -> Sizing:
        value = os.environ.get(SETTING, VLLM).strip() or VLLM
        sizing = cls(next((choice for choice in CHOICES if choice == value), VLLM))
        if value not in CHOICES:
            sizing.fall_back(BAD_SETTING, f"{SETTING}={value!r} is not one of {', '.join(CHOICES)}")
        return sizing

    @property
    def charged_bytes(self) -> int | None:
        return self.own_process_bytes if self.ran == OWN_PROCESS else self.vllm_charged_bytes

    def fall_back(self, code: str, reason: str) -> None:
        """vLLM's arithmetic sizes this rank; said once in vLLM's log and kept for the ledger."""
        if self.fallback is not None:
            return
        self.fallback, self.fallback_reason = code, reason
        log.warning("vramledger: %s=%s asked for, but %s; the KV cache is sized by vLLM's own arithmetic "
                    "(the device's free memory)", SETTING, OWN_PROCESS, reason)

    def to_dict(self) -> SizingDoc:
        charged = self.charged_bytes
        given_back = None if charged is None or self.vllm_charged_bytes is None else self.vllm_charged_bytes - charged
        return {"requested": self.requested, "ran": self.ran, "fallback": self.fallback,
                "fallback_reason": self.fallback_reason, "vllm_charged_bytes": self.vllm_charged_bytes,
                "own_process_bytes": self.own_process_bytes, "charged_bytes": charged,
                "kv_bytes_given_back": given_back}


def own_charge(torch_increase: int, process_growth: int | None) -> tuple[int, int] | None:
    """(consumed, non-torch) of this process over the profile window, None where its growth is unknown:
    torch's reserved increase plus what NVML counts for the pid beyond it (never below nothing)."""
    if process_growth is None:
        return None
    non_torch = max(0, process_growth - torch_increase)
    return torch_increase + non_torch, non_torch


def size(sizing: Sizing, profile: ProfileFacts, unseen: str | None,
         charge: Callable[[int, int, int], None]) -> None:
    """Record both figures; with own-process, charge(consumed, non-torch, charged before the KV cache)
    makes vLLM's profile result (the running version's, vramledger/vllm_plugin/versions/) charge this
    process's own."""
    own = own_charge(profile.torch_increase_bytes, profile.process_growth_bytes)
    sizing.vllm_charged_bytes = profile.non_kv_bytes
    if own is not None:
        sizing.own_process_bytes = own[0] + profile.peak_headroom_bytes
    if sizing.requested != OWN_PROCESS or sizing.fallback is not None:
        sizing.ran = VLLM
        return
    if own is None:
        sizing.ran = VLLM
        sizing.fall_back(UNSEEN, f"NVML cannot see this process's memory: {unseen or 'no reading'}")
        return
    consumed, non_torch = own
    charged = consumed + profile.peak_headroom_bytes  # own_process_bytes, as recorded above
    charge(consumed, non_torch, charged)
    sizing.ran = OWN_PROCESS
    log.info("vramledger: %s sizing charged %d bytes before the KV cache, where vLLM's arithmetic charged %d",
             OWN_PROCESS, charged, sizing.vllm_charged_bytes)
