"""Scenario 5, vLLM's own ledger: vLLM (CUDA) started with the vramledger vLLM plugin and the pair;
its GET /vramledger/memory checked against the checkpoints, vLLM's own KV cache figures and the
device's per-process view (NVML). Skipped, saying why, without a GPU or without vLLM and the plugin
(docs/vllm.md): vLLM's CPU build runs no memory profile, so the CUDA path can only run on a GPU."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile

import httpx
from prometheus_client.parser import text_string_to_metric_families

from vramledger.ledger_document import ServerDocument
from vramledger.ledger_reading import LedgerError, parse_server_document
from vramledger.units import MiB, format_bytes
from vramledger.vllm_plugin.gate import PLUGIN_NAME, unsupported_reason
from vramledger.worker.selfcheck.context import Context
from vramledger.worker.selfcheck.processes import free_port, wait_http
from vramledger.worker.selfcheck.report import CannotRun, Check, ScenarioResult
from vramledger.worker.selfcheck.scale import Scale
from vramledger.worker.selfcheck.view import settle

TITLE = "vLLM's own ledger (the vLLM plugin)"
WEIGHTS_TOLERANCE, VIEW_TOLERANCE = 0.02, 0.05
# Nothing else starts on the device meanwhile: what vLLM's profile charges beyond its own process's
# growth is the gap between the device's free memory and NVML's per-process count.
CHARGED_TOLERANCE = 64 * MiB
MAX_SHARE, MARGIN_SHARE = 0.5, 0.05  # vLLM's gpu_memory_utilization: at most half, within what is free
PROBE = """
import importlib.metadata as md, json, vllm.version
groups = ("vllm.general_plugins", "vllm.endpoint_plugins")
points = {g: [e.name for e in md.entry_points(group=g)] for g in groups}
plugin = None
for name in ("vramledger-vllm-plugin", "vramledger"):  # the plugin's own wheel, or the whole project
    try:
        plugin = md.version(name)
        break
    except md.PackageNotFoundError:
        pass
print(json.dumps({"vllm": vllm.version.__version__, "plugin": plugin, "entry_points": points}))
"""


def vllm_python(given: str | None) -> str:
    """The interpreter that runs vLLM: --vllm-python, else this one when it has vLLM; CannotRun otherwise."""
    if given:
        return given
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise CannotRun("vLLM is not installed for this Python: give the interpreter of vLLM's environment "
                        "with --vllm-python")
    return sys.executable


def probe(python: str) -> dict:
    """vLLM's version and the plugin installed beside it, asked of vLLM's interpreter (isolated: -I)."""
    with tempfile.TemporaryDirectory() as away:
        out = subprocess.run([python, "-I", "-c", PROBE], capture_output=True, text=True, cwd=away,
                             timeout=300, check=False)
    if out.returncode != 0:
        lines = (out.stderr or out.stdout).strip().splitlines()
        raise CannotRun(f"{python} cannot import vLLM: {lines[-1] if lines else f'exit {out.returncode}'}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_environment(python: str, found: dict, ours: str) -> None:
    """CannotRun unless vLLM's environment has this version of the plugin, on a vLLM it was built for."""
    install = (f"install the vramledger vLLM plugin {ours} there (`make plugin-wheel` builds it): {python} -m pip "
               f"install dist/vramledger_vllm_plugin-{ours}-py3-none-any.whl")
    if found["plugin"] is None or any(PLUGIN_NAME not in names for names in found["entry_points"].values()):
        raise CannotRun(f"the vramledger vLLM plugin is not installed for {python}: {install}")
    if found["plugin"] != ours:
        raise CannotRun(f"vLLM's environment has vramledger {found['plugin']}, this selfcheck is {ours}: "
                        f"{install}")
    reason = unsupported_reason(found["vllm"])
    if reason is not None:
        raise CannotRun(reason)


def run(ctx: Context, result: ScenarioResult) -> None:
    if ctx.view.kind != "cuda":
        raise CannotRun("needs a GPU: vLLM's CPU build runs no memory profile, so the plugin's CUDA path "
                        "(profile, budget, per-process non-torch memory) cannot run here")
    python = vllm_python(ctx.vllm_python)
    from importlib.metadata import version

    check_environment(python, probe(python), version("vramledger"))
    s, view = ctx.scale, ctx.view
    total = view.total_bytes()
    share = math.floor(min(MAX_SHARE, view.free_bytes() / total - MARGIN_SHARE) * 100) / 100
    if share < 0.1:
        raise CannotRun(f"needs a tenth of {s.device} free for vLLM; {format_bytes(view.free_bytes())} "
                        "is free")
    port = free_port()
    ctx.say(f"scenario 5: vLLM with the vramledger plugin, the pair, gpu_memory_utilization {share:.2f}")
    server = ctx.procs.start("s5-vllm", server_command(python, s, port, share), env=server_env(s))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", ready_timeout(s), server)
        doc, blocks = read_server(url)
        worker = doc["ranks"][0]["worker"] if doc["ranks"] else None
        pid = (worker.get("host_pid") or worker["pid"]) if worker else None
        seen = settle(view, pid) if pid else None
        expected = {"target": s.weight_bytes(s.model), "draft": s.weight_bytes(s.draft_model)}
        check_ledger(result, doc, blocks, seen, expected, share)
    finally:
        ctx.procs.stop(server)


def server_command(python: str, s: Scale, port: int, share: float) -> list[str]:
    """vLLM's OpenAI server on the pair (the draft through --speculative-config), at `share` of the GPU."""
    speculative = {"model": s.draft_model, "num_speculative_tokens": s.num_speculative_tokens,
                   "method": "draft_model"}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", s.model, "--speculative-config",
           json.dumps(speculative), "--gpu-memory-utilization", f"{share:.2f}", "--max-model-len",
           str(s.max_model_len), "--host", "127.0.0.1", "--port", str(port)]
    return cmd + ["--dtype", s.dtype if s.dtype != "auto" else {4: "float32", 2: "bfloat16"}[s.element_bytes]]


def server_env(s: Scale, **more: str) -> dict[str, str]:
    """The plugin switched on, on the one GPU selfcheck checks."""
    return {"VLLM_PLUGINS": PLUGIN_NAME, "CUDA_VISIBLE_DEVICES": visible_device(s.device), **more}


def ready_timeout(s: Scale) -> float:
    return max(s.ready_timeout, 900.0)  # vLLM compiles and captures CUDA graphs before it serves


def read_server(url: str) -> tuple[ServerDocument, int | None]:
    """Its GET /vramledger/memory, read as every reader does, and vLLM's own count of its KV cache's blocks."""
    with httpx.Client(timeout=60, trust_env=False) as client:
        response = client.get(url + "/vramledger/memory")
        response.raise_for_status()
        return server_ledger(response.json()), vllm_blocks(client.get(url + "/metrics").text)


def server_ledger(document: object) -> ServerDocument:
    """The server's ledger, checked against its definition; a LedgerError naming the route and the field."""
    try:
        return parse_server_document(document)
    except LedgerError as e:
        raise LedgerError(f"vLLM's GET /vramledger/memory is no ledger: {e}") from e


def visible_device(device: str) -> str:
    """CUDA_VISIBLE_DEVICES for vLLM: the one device selfcheck checks (vLLM then calls it cuda:0)."""
    index = int(device.partition(":")[2] or 0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


def vllm_blocks(metrics: str) -> int | None:
    """num_gpu_blocks of vllm:cache_config_info: vLLM's own count of its KV cache's blocks."""
    for family in text_string_to_metric_families(metrics):
        if family.name == "vllm:cache_config_info" and family.samples:
            value = family.samples[0].labels.get("num_gpu_blocks", "")
            return int(value) if value.isdigit() else None
    return None


def check_ledger(result: ScenarioResult, doc: ServerDocument, blocks: int | None, seen: int | None,
                 expected_weights: dict[str, int], share: float) -> None:
    """The checks of one rank's ledger: against the checkpoints, vLLM's blocks, NVML's view of its process."""
    ranks = doc.get("ranks", [])
    ok = len(ranks) == 1 and not ranks[0].get("errors")
    result.add(Check.compare("ledger served", ok, f"{len(ranks)} rank(s), hook errors: "
                             f"{'; '.join(e for r in ranks for e in r.get('errors', [])) or 'none'}",
                             "1 rank (one GPU), no hook errors"))
    if not ranks:
        return
    rank = ranks[0]
    entries = {(e["component"], e["model"]): e for e in rank["entries"]}
    for model, wanted in expected_weights.items():
        entry = entries.get(("weights", model))
        held = entry["bytes"] if entry else None
        near = held is not None and abs(held - wanted) <= WEIGHTS_TOLERANCE * wanted
        result.add(Check.compare(
            f"weights[{model}] vs checkpoint", near, format_bytes(held) if held is not None else "no entry",
            f"{format_bytes(wanted)} (checkpoint) ±{WEIGHTS_TOLERANCE:.0%}", measured_bytes=held,
            expected_bytes=wanted))
    draft = entries.get(("weights", "draft"))
    in_budget = draft.get("in_budget") if draft else None
    result.add(Check.compare("draft in the budget", in_budget is True, f"in_budget: {json.dumps(in_budget)}",
                             "true: vLLM measured the draft before it sized its KV cache"))
    budget, total = rank["budget"].get("bytes"), rank["device"].get("total_bytes")
    wanted_budget = math.ceil(share * total) if total else None
    result.add(Check.compare("budget", budget is not None and budget == wanted_budget,
                             format_bytes(budget) if budget is not None else "none",
                             f"{share:.2f} x {format_bytes(total or 0)} = "
                             f"{format_bytes(wanted_budget or 0)}"))
    kv_entry, cache = entries.get(("kv_cache", "")), rank["kv_cache"]
    kv = kv_entry["bytes"] if kv_entry else None
    allocated = cache["blocks_total"] + cache.get("blocks_reserved", 0)  # the blocks it hands out, its null block
    result.add(Check.compare(
        "KV cache allocated", kv is not None and blocks is not None and allocated == blocks
        and kv == blocks * cache["bytes_per_block"],
        f"{format_bytes(kv or 0)}: {allocated} blocks x {format_bytes(cache['bytes_per_block'])}",
        f"{blocks} blocks (vllm:cache_config_info)"))
    declared = rank["declared_bytes"]
    peak = entries.get(("activation_peak", ""))
    idle = declared - (peak["bytes"] if peak else 0)
    result.add(Check.compare(
        "device view at idle", seen is not None and abs(seen - idle) <= VIEW_TOLERANCE * idle,
        format_bytes(seen) if seen is not None else "not listed by the device",
        f"declared {format_bytes(declared)} - activation peak = {format_bytes(idle)} ±{VIEW_TOLERANCE:.0%}",
        measured_bytes=seen, expected_bytes=idle))
    live = rank["live"].get("process_bytes")
    result.add(Check.compare("live process memory",
                             live is not None and seen is not None and abs(live - seen) <= 0.01 * seen,
                             format_bytes(live) if live is not None else "unknown (no NVML in its process)",
                             f"the device's view {format_bytes(seen or 0)} ±1%"))
    profile: dict = dict(rank.get("profile") or {})  # plugin only: may be absent
    device, own = profile.get("non_torch_increase_bytes"), profile.get("non_torch_process_bytes")
    charged = None if device is None or own is None else max(0, device - max(0, own))
    result.add(Check.compare(
        "no neighbour charged", charged is not None and charged <= CHARGED_TOLERANCE,
        "no profile recorded" if not profile else
        f"non-torch {format_bytes(device)} (device) - {format_bytes(own)} (own) = {format_bytes(charged)}"
        if charged is not None else "own growth unknown (no NVML in vLLM's process)",
        f"<= {format_bytes(CHARGED_TOLERANCE)}: nothing else started on the device", charged_bytes=charged))
