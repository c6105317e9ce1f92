"""The metric catalogue and every PromQL expression of the dashboards, for tests.

`dashboard_queries()` returns each panel query with its template variables replaced
(each query variable by its "All" regex, `.+` or `.*`; $__rate_interval etc. by fixed
durations), so the result can be sent to a real Prometheus as is.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = {"memory-ledger": ROOT / "dashboards" / "memory-ledger.json",
              "serving": ROOT / "dashboards" / "serving.json"}
RULES_DIR = ROOT / "prometheus" / "rules"

# name -> type, exactly as the worker publishes them (job "vramledger-worker").
WORKER_METRICS = {
    "vramledger_memory_bytes": "gauge",  # {component, model}
    "vramledger_memory_budget_bytes": "gauge",
    "vramledger_device_memory_total_bytes": "gauge",
    "vramledger_foreign_memory_at_start_bytes": "gauge",
    "vramledger_process_memory_bytes": "gauge",
    "vramledger_unaccounted_memory_bytes": "gauge",
    "vramledger_kv_cache_blocks_total": "gauge",
    "vramledger_kv_cache_blocks_used": "gauge",
    "vramledger_kv_cache_blocks_cached": "gauge",
    "vramledger_kv_cache_blocks_free": "gauge",
    "vramledger_kv_cache_usage_ratio": "gauge",
    "vramledger_requests_running": "gauge",
    "vramledger_requests_waiting": "gauge",
    "vramledger_preemptions_total": "counter",
    "vramledger_prompt_tokens_total": "counter",
    "vramledger_generation_tokens_total": "counter",
    "vramledger_prefix_cache_queries_total": "counter",
    "vramledger_prefix_cache_hits_total": "counter",
    "vramledger_requests_total": "counter",  # {finish_reason}
    "vramledger_time_to_first_token_seconds": "histogram",
    "vramledger_inter_token_latency_seconds": "histogram",
    "vramledger_request_latency_seconds": "histogram",
    "vramledger_request_queue_seconds": "histogram",
    "vramledger_spec_decode_drafts_total": "counter",
    "vramledger_spec_decode_draft_tokens_total": "counter",
    "vramledger_spec_decode_accepted_tokens_total": "counter",
    "vramledger_spec_decode_accepted_tokens_per_position_total": "counter",  # {position}
    "vramledger_spec_decode_request_acceptance_ratio": "histogram",
    "vramledger_spec_decode_num_speculative_tokens": "gauge",
    "vramledger_worker_info": "gauge",  # {model, draft_model, device, num_speculative_tokens, version}
}

# name -> type, as the exporter publishes them (job "vramledger-exporter").
EXPORTER_METRICS = {
    "vramledger_device_memory_total_bytes": "gauge",  # {device, uuid}
    "vramledger_device_memory_used_bytes": "gauge",
    "vramledger_device_memory_reserved_bytes": "gauge",
    "vramledger_device_process_memory_bytes": "gauge",  # {device, uuid, pid, process, owner, worker, measure}
    "vramledger_device_foreign_memory_bytes": "gauge",
    "vramledger_device_unattributed_memory_bytes": "gauge",
    "vramledger_worker_up": "gauge",  # {worker}
    "vramledger_worker_state": "gauge",  # {worker, state}: 1 for serving|loading|unreachable|wrong
    "vramledger_worker_info": "gauge",  # {worker, engine, version, model}: same name as the worker's own
    "vramledger_worker_kv_cache_usage_ratio": "gauge",  # {worker}
    "vramledger_worker_declared_memory_bytes": "gauge",  # {worker}
    "vramledger_worker_observed_memory_bytes": "gauge",  # {worker, device}
    "vramledger_worker_unaccounted_memory_bytes": "gauge",  # {worker, device}
    # A vLLM rank's ledger (the vLLM plugin), {worker, rank, ...}: the first two named as the worker's own.
    "vramledger_memory_bytes": "gauge",  # {worker, rank, component, model}
    "vramledger_memory_budget_bytes": "gauge",  # {worker, rank}
    "vramledger_worker_weights_outside_budget_bytes": "gauge",  # {worker, rank, model}
    "vramledger_worker_foreign_charged_bytes": "gauge",  # {worker, rank}
    "vramledger_exporter_collect_seconds": "histogram",
    "vramledger_exporter_errors_total": "counter",  # {source}
}

# Series Prometheus itself adds to every target.
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}

BUILTIN_VARIABLES = ("__rate_interval", "__interval", "__range")


def recording_rule_names() -> set[str]:
    names = set()
    for path in sorted(RULES_DIR.glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            names.update(r["record"] for r in group["rules"] if "record" in r)
    return names


def known_series() -> set[str]:
    """Every series name an expression may select: metrics, histogram parts, recording rules."""
    names = set(PROMETHEUS_SERIES) | recording_rule_names()
    for name, kind in {**WORKER_METRICS, **EXPORTER_METRICS}.items():
        if kind == "histogram":
            names.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(name)
    return names


# ---------------------------------------------------------------- PromQL parsing
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_CLAUSES = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
             "bool", "offset", "atan2", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The series names an expression selects (functions, keywords and labels left out)."""
    text = _STRINGS.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges, subqueries
    text = _CLAUSES.sub(" ", text)  # grouping label lists
    names = set()
    for m in _IDENT.finditer(text):
        rest = text[m.end():].lstrip()
        if rest.startswith("("):  # function or aggregation
            continue
        if m.group(1).lower() in _KEYWORDS:
            continue
        names.add(m.group(1))
    return names


# ---------------------------------------------------------------- dashboards
@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    ref_id: str
    expr: str
    instant: bool


def load_dashboard(name: str) -> dict:
    return json.loads(DASHBOARDS[name].read_text())


def iter_panels(dashboard: dict):
    """Every panel, rows included, descending into collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def variable_values(dashboard: dict) -> dict[str, str]:
    """name -> the regex its "All" selection stands for (datasource variables left out)."""
    values = {}
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "datasource":
            continue
        values[var["name"]] = var.get("allValue") or ".*"
    return values


_VAR = re.compile(r"\$\{(\w+)(?::[\w]+)?\}|\[\[(\w+)\]\]|\$(\w+)")


def substitute(expr: str, values: dict[str, str], rate_interval: str = "1m", interval: str = "15s",
               range_: str = "5m") -> str:
    builtins = {"__rate_interval": rate_interval, "__interval": interval, "__range": range_}

    def repl(m):
        name = m.group(1) or m.group(2) or m.group(3)
        if name in builtins:
            return builtins[name]
        if name in values:
            return values[name]
        raise KeyError(f"unknown template variable ${name} in {expr!r}")

    return _VAR.sub(repl, expr)


def dashboard_queries(rate_interval: str = "1m", interval: str = "15s", range_: str = "5m",
                      raw: bool = False) -> list[Query]:
    """Every panel query of both dashboards, variables substituted (unless raw)."""
    out = []
    for name in DASHBOARDS:
        dashboard = load_dashboard(name)
        values = variable_values(dashboard)
        for panel in iter_panels(dashboard):
            for target in panel.get("targets", []):
                expr = target.get("expr", "")
                if not expr or target.get("hide"):
                    continue
                if not raw:
                    expr = substitute(expr, values, rate_interval, interval, range_)
                out.append(Query(name, panel.get("title", ""), target.get("refId", ""), expr,
                                 bool(target.get("instant")) and not target.get("range")))
    return out


def expressions(**kwargs) -> list[str]:
    """Just the substituted PromQL of every panel query of both dashboards."""
    return [q.expr for q in dashboard_queries(**kwargs)]


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.*)\s*,\s*)?(\w+)\s*\)\s*$", re.DOTALL)


def variable_queries(raw: bool = False) -> list[tuple[str, str, str, str]]:
    """(dashboard, variable, series selector, label) for every label_values() variable."""
    out = []
    for name in DASHBOARDS:
        dashboard = load_dashboard(name)
        values = variable_values(dashboard)
        for var in dashboard.get("templating", {}).get("list", []):
            if var.get("type") != "query":
                continue
            query = var.get("query")
            query = query.get("query", "") if isinstance(query, dict) else query
            m = _LABEL_VALUES.match(query or "")
            if not m:
                raise ValueError(f"{name}: variable {var['name']} is not label_values(...): {query!r}")
            selector = (m.group(1) or "").strip()
            if not raw:
                selector = substitute(selector, values)
            out.append((name, var["name"], selector, m.group(2)))
    return out
