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
from typing import Literal, Union

# typing_extensions, not typing: pydantic builds a schema from TypedDicts only with these before Python 3.12.
from typing_extensions import NotRequired, TypedDict

SCHEMA_FILE = "ledger.schema.json"

# Written out, as a type must be; tests/test_ledger_schema.py holds each to ledger_vocabulary's words.
Version = Literal[1]  # LEDGER_VERSION
Component = Literal["runtime", "weights", "kernels", "compiled", "activation_peak", "non_torch", "allocator",
                    "sequence_state", "server", "cuda_graph", "kv_cache"]  # COMPONENTS
Scope = Literal["process", "device"]  # SCOPE_PROCESS, SCOPE_DEVICE
ServerRole = Literal["api_server", "engine_core", "other"]  # SERVER_ROLES
DeviceKind = Literal["cuda", "cpu"]  # what the exporter places a ledger on


class ProcessIdentityDoc(TypedDict):
    """Who the process is (vramledger/identity.py)."""

    pid: int
    host_pid: int | None
    container_id: str | None
    hostname: str


class ModelsDoc(TypedDict):
    target: str
    draft: str | None


class DeviceDoc(TypedDict):
    kind: DeviceKind
    index: int
    uuid: str | None
    name: str
    total_bytes: int | None  # None: the plugin's rank did not see vLLM's start snapshot
    free_at_start_bytes: int | None


class BudgetDoc(TypedDict):
    bytes: int | None
    utilization: float | None
    kv_cache_memory: int | None
    sized_by: NotRequired[str | None]  # plugin: "utilization" or "kv_cache_memory"


class EntryDoc(TypedDict):
    """One owner of memory: a component, its model ("" for none) and its bytes."""

    component: Component
    model: str
    bytes: int
    scope: NotRequired[Scope]  # plugin: measured for the process, or read from the device's free memory
    in_budget: NotRequired[bool | None]  # plugin: charged to vLLM's budget (None: no budget)


class ForeignProcessDoc(TypedDict):
    pid: int
    name: str
    bytes: int | None  # None: the device could not say


class ForeignAtStartDoc(TypedDict):
    bytes: int
    processes: list[ForeignProcessDoc]


class KvCacheDoc(TypedDict):
    block_size: int
    bytes_per_block: int
    blocks_total: int
    capacity_tokens: int
    blocks_used: NotRequired[int]  # worker: live counts
    blocks_cached: NotRequired[int]
    blocks_free: NotRequired[int]
    blocks_reserved: NotRequired[int]  # plugin: vLLM's null block, never handed out
    sized_bytes: NotRequired[int | None]  # plugin: what vLLM's sizing gave the KV cache


class ProfileDoc(TypedDict):
    """vLLM's memory profile, with the rank's own growth (plugin only)."""

    consumed_bytes: int
    torch_increase_bytes: int
    non_torch_increase_bytes: int
    peak_headroom_bytes: int
    weights_bytes: int
    non_kv_bytes: int
    process_growth_bytes: int | None
    non_torch_process_bytes: int | None
    cuda_graph_estimate_bytes: int | None
    cuda_graph_estimate_counted: bool


class SizingDoc(TypedDict):
    """The KV sizing a rank asked for and the one that ran (plugin only)."""

    requested: str
    ran: str | None
    fallback: str | None
    fallback_reason: str | None
    vllm_charged_bytes: int | None
    own_process_bytes: int | None
    charged_bytes: int | None
    kv_bytes_given_back: int | None


class LiveDoc(TypedDict):
    process_bytes: int | None  # None: the plugin could not read its process's memory
    declared_bytes: int
    unaccounted_bytes: int | None
    measured_at: float
    process_source: NotRequired[str | None]  # plugin: how process_bytes was read ("pss", "nvml", ...)


class LedgerDocument(TypedDict):
    """One process's ledger: the worker's GET /v1/memory, or one vLLM rank's."""

    version: Version
    worker: ProcessIdentityDoc
    models: ModelsDoc
    device: DeviceDoc
    budget: BudgetDoc
    entries: list[EntryDoc]
    declared_bytes: int
    kv_cache: KvCacheDoc
    live: LiveDoc
    foreign_at_start: NotRequired[ForeignAtStartDoc]  # worker: other processes' memory when it started
    engine: NotRequired[str]  # plugin: "vllm"
    rank: NotRequired[int]
    local_rank: NotRequired[int]
    profile: NotRequired[ProfileDoc | None]
    sizing: NotRequired[SizingDoc]
    errors: NotRequired[list[str]]  # plugin: hooks that failed, whose entries stay absent


class ServerProcessDoc(TypedDict):
    """A process of a vLLM server besides its ranks, declaring what it held when the server was ready."""

    role: ServerRole
    pid: int
    name: str
    bytes: int
    measure: str  # "pss", or "rss" where PSS cannot be read
    scope: Scope
    measured: str
    measured_at: float
    live_bytes: int | None


class ServerDocument(TypedDict):
    """A vLLM server's GET /vramledger/memory: every rank's ledger and the server's other processes."""

    version: Version
    engine: str
    engine_version: str
    ranks: list[LedgerDocument]
    processes: NotRequired[list[ServerProcessDoc] | None]  # None: measuring them failed


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
