"""The ledger document (docs/ledger.md), defined once: what the worker's GET /v1/memory serves, what one
vLLM rank's plugin builds, and the vLLM server's document that gathers the ranks.

One definition for both producers: a field only vLLM's plugin knows (an entry's scope, the profile, the
sizing) is an optional part of it, as is the worker's foreign memory at start. The JSON Schema shipped
beside this module (ledger.schema.json) is generated from these types, so any engine can publish the
document and the exporter can read it:

    python -m vramledger.ledger_document > vramledger/ledger.schema.json

Torch-free and free of pydantic at import (vLLM's processes load it); only the generator imports pydantic.
"""
from __future__ import annotations

import json
from typing import Annotated, Literal, Union

# typing_extensions, not typing: pydantic builds a schema from TypedDicts only with these before Python 3.12.
from typing_extensions import NotRequired, TypedDict

from vramledger.ledger_bounds import (
    MAX_BYTES,
    MAX_ENTRIES,
    MAX_RANKS,
    MAX_TOKENS,
    PID_MAX,
    LabelText,
    Most,
    Within,
)

SCHEMA_FILE = "ledger.schema.json"

# What a number or a text may be (ledger_bounds.py): the schema states it, the reader refuses beyond it.
Bytes = Annotated[int, Within(0, MAX_BYTES)]
Change = Annotated[int, Within(-MAX_BYTES, MAX_BYTES)]  # a difference of two measures: may be below 0
Pid = Annotated[int, Within(1, PID_MAX)]
Count = Annotated[int, Within(0, MAX_TOKENS)]  # blocks, tokens, an index
RankNumber = Annotated[int, Within(0, MAX_RANKS - 1)]
Share = Annotated[float, Within(0, 1)]
Seconds = Annotated[float, Within(0, 1 << 40)]  # a Unix time
Label = Annotated[str, LabelText()]  # republished as a label, or named in one

# Written out, as a type must be; tests/test_ledger_schema.py holds each to ledger_vocabulary's words.
Version = Literal[1]  # LEDGER_VERSION
Component = Literal["runtime", "weights", "kernels", "compiled", "activation_peak", "non_torch", "allocator",
                    "sequence_state", "server", "cuda_graph", "kv_cache"]  # COMPONENTS
Scope = Literal["process", "device"]  # SCOPE_PROCESS, SCOPE_DEVICE
Sizer = Literal["vllm", "own-process"]  # the plugin's sizing arithmetics (vllm_plugin/sizing.py CHOICES)
ServerRole = Literal["api_server", "engine_core", "other"]  # SERVER_ROLES
DeviceKind = Literal["cuda", "cpu"]  # what the exporter places a ledger on


class ProcessIdentityDoc(TypedDict):
    """Who the process is (vramledger/identity.py)."""

    pid: Pid
    host_pid: Pid | None
    container_id: Label | None
    hostname: Label


class ModelsDoc(TypedDict):
    target: Label
    draft: Label | None


class DeviceDoc(TypedDict):
    kind: DeviceKind
    index: Count
    uuid: Label | None
    name: str
    total_bytes: Bytes | None  # None: the plugin's rank did not see vLLM's start snapshot
    free_at_start_bytes: Bytes | None


class BudgetDoc(TypedDict):
    bytes: Bytes | None
    utilization: Share | None
    kv_cache_memory: Bytes | None
    sized_by: NotRequired[str | None]  # plugin: "utilization" or "kv_cache_memory"


class EntryDoc(TypedDict):
    """One owner of memory: a component, its model ("" for none) and its bytes."""

    component: Annotated[Component, LabelText()]  # no label at all: beyond bounds before out of vocabulary
    model: Label
    bytes: Bytes
    scope: NotRequired[Scope]  # plugin: measured for the process, or read from the device's free memory
    in_budget: NotRequired[bool | None]  # plugin: charged to vLLM's budget (None: no budget)


class ForeignProcessDoc(TypedDict):
    pid: Pid
    name: str
    bytes: Bytes | None  # None: the device could not say


class ForeignAtStartDoc(TypedDict):
    bytes: Bytes
    processes: list[ForeignProcessDoc]


class KvCacheDoc(TypedDict):
    block_size: Count
    bytes_per_block: Bytes
    blocks_total: Count
    capacity_tokens: Count
    blocks_used: NotRequired[Count]  # worker: live counts
    blocks_cached: NotRequired[Count]
    blocks_free: NotRequired[Count]
    blocks_reserved: NotRequired[Count]  # plugin: vLLM's null block, never handed out
    sized_bytes: NotRequired[Bytes | None]  # plugin: what vLLM's sizing gave the KV cache


class ProfileDoc(TypedDict):
    """vLLM's memory profile, with the rank's own growth (plugin only)."""

    consumed_bytes: Change
    torch_increase_bytes: Change
    non_torch_increase_bytes: Change
    peak_headroom_bytes: Change
    weights_bytes: Change
    non_kv_bytes: Change
    process_growth_bytes: Change | None
    non_torch_process_bytes: Change | None
    cuda_graph_estimate_bytes: Change | None
    cuda_graph_estimate_counted: bool


class SizingDoc(TypedDict):
    """The KV sizing a rank asked for and the one that ran (plugin only)."""

    requested: Sizer
    ran: Sizer | None
    fallback: Label | None
    fallback_reason: str | None
    vllm_charged_bytes: Bytes | None
    own_process_bytes: Bytes | None
    charged_bytes: Bytes | None
    kv_bytes_given_back: Change | None


class LiveDoc(TypedDict):
    process_bytes: Bytes | None  # None: the plugin could not read its process's memory
    declared_bytes: Bytes
    unaccounted_bytes: Bytes | None
    measured_at: Seconds
    process_source: NotRequired[str | None]  # plugin: how process_bytes was read ("pss", "nvml", ...)


class LedgerDocument(TypedDict):
    """One process's ledger: the worker's GET /v1/memory, or one vLLM rank's."""

    version: Version
    worker: ProcessIdentityDoc
    models: ModelsDoc
    device: DeviceDoc
    budget: BudgetDoc
    entries: Annotated[list[EntryDoc], Most(MAX_ENTRIES)]
    declared_bytes: Bytes
    kv_cache: KvCacheDoc
    live: LiveDoc
    foreign_at_start: NotRequired[ForeignAtStartDoc]  # worker: other processes' memory when it started
    engine: NotRequired[str]  # plugin: "vllm"
    rank: NotRequired[RankNumber]
    local_rank: NotRequired[RankNumber]
    profile: NotRequired[ProfileDoc | None]
    sizing: NotRequired[SizingDoc]
    errors: NotRequired[list[str]]  # plugin: hooks that failed, whose entries stay absent


class ServerProcessDoc(TypedDict):
    """A process of a vLLM server besides its ranks, declaring what it held when the server was ready."""

    role: ServerRole
    pid: Pid
    name: str
    bytes: Bytes
    measure: str  # "pss", or "rss" where PSS cannot be read
    scope: Scope
    measured: str
    measured_at: Seconds
    live_bytes: Bytes | None


class ServerDocument(TypedDict):
    """A vLLM server's GET /vramledger/memory: every rank's ledger and the server's other processes."""

    version: Version
    engine: str
    engine_version: str
    ranks: Annotated[list[LedgerDocument], Most(MAX_RANKS)]
    processes: NotRequired[Annotated[list[ServerProcessDoc], Most(MAX_RANKS)] | None]  # None: measuring them failed


def json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of either document, objects closed to fields not defined here."""
    from pydantic import TypeAdapter  # the generator's alone: the package imports without pydantic

    schema = TypeAdapter(Union[LedgerDocument, ServerDocument]).json_schema(ref_template="#/$defs/{model}")
    for definition in schema["$defs"].values():
        if definition.get("type") == "object":
            definition["additionalProperties"] = False  # a field a producer adds must be defined here first
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "vramledger memory ledger", **schema}


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(schema_text(), end="")
