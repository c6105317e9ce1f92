"""The metric catalogue's names and every PromQL expression of the dashboards, for tests.

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
from metric_catalogue import catalogue

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = {"memory-ledger": ROOT / "dashboards" / "memory-ledger.json",
              "serving": ROOT / "dashboards" / "serving.json"}
RULES_DIR = ROOT / "prometheus" / "rules"

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
    for family in (f for process in catalogue().values() for f in process.values()):  # docs/metrics.md
        if family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
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
