"""Grafana dashboards and provisioning: valid, variable-driven, units set, no metric drift."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml
from dashboard_queries import (
    DASHBOARDS,
    ROOT,
    dashboard_queries,
    iter_panels,
    known_series,
    load_dashboard,
    metric_names,
    recording_rule_names,
    variable_queries,
)

from vramledger.ledger_vocabulary import WORKER_COMPONENTS

PROVISIONING = ROOT / "dashboards" / "provisioning"
INFO = {"vramledger_engine_info", "vramledger_serving_info"}
DS_UIDS = ("${datasource}", "$datasource")
UNIT_PANELS = {"timeseries", "stat", "gauge", "bargauge", "heatmap", "table"}
REQUIRED_VARIABLES = {
    "memory-ledger": {"datasource", "instance", "kind", "engine", "vllm", "device"},
    "serving": {"datasource", "instance", "device"},
}
# What each dashboard must show (issue 6), as the series it must query.
REQUIRED_SERIES = {
    "memory-ledger": {
        "vramledger_memory_bytes", "vramledger_memory_budget_bytes", "vramledger_memory_device_total_bytes",
        "vramledger_process_memory_bytes", "vramledger_unaccounted_memory_bytes",
        "vramledger_foreign_memory_at_start_bytes", "vramledger_kv_cache_usage_ratio",
        "vramledger_kv_cache_blocks_used", "vramledger_kv_cache_blocks",
        "vramledger_kv_cache_blocks_cached", "vramledger_kv_cache_blocks_free",
        "vramledger_device_memory_used_bytes", "vramledger_device_memory_total_bytes",
        "vramledger_device_process_memory_bytes",
        "vramledger_device_foreign_memory_bytes", "vramledger_engine_observed_memory_bytes",
        "vramledger_engine_declared_memory_bytes", "vramledger_engine_unaccounted_memory_bytes",
        "vramledger_engine_up", "vramledger_engine_info", "vramledger_engine_kv_cache_usage_ratio",
        "vramledger_engine_weights_outside_budget_bytes", "vramledger_engine_foreign_charged_bytes",
        "vramledger_engine_memory_bytes", "vramledger_engine_memory_budget_bytes",
        "vramledger_engine_sizing_info", "vramledger_engine_sizing_charge_bytes",
        "vramledger_engine_sizing_given_back_bytes", "vramledger_engine_process_declared_bytes",
    },
    "serving": {
        "vramledger_requests_running", "vramledger_requests_waiting", "vramledger_prompt_tokens_total",
        "vramledger_generation_tokens_total", "vramledger_time_to_first_token_seconds_bucket",
        "vramledger_inter_token_latency_seconds_bucket", "vramledger_request_latency_seconds_bucket",
        "vramledger:spec_decode_acceptance_rate:rate5m", "vramledger:spec_decode_mean_acceptance_length:rate5m",
        "vramledger_spec_decode_accepted_tokens_per_position_total",
        "vramledger_spec_decode_request_acceptance_ratio_bucket", "vramledger_preemptions_total",
        "vramledger_spec_decode_num_speculative_tokens", "vramledger_prefix_cache_queries_total",
        "vramledger_prefix_cache_hits_total", "vramledger_serving_info",
    },
}


@pytest.fixture(scope="module", params=sorted(DASHBOARDS))
def dashboard(request):
    return request.param, load_dashboard(request.param)


def _panels(dashboard):
    return [p for p in iter_panels(dashboard) if p.get("type") != "row"]


def test_dashboards_are_valid_json_with_unique_uids():
    uids = set()
    for name, path in DASHBOARDS.items():
        data = json.loads(path.read_text())
        assert data.get("uid") and data.get("title"), f"{name}: uid and title"
        assert data["uid"] not in uids
        uids.add(data["uid"])
        assert isinstance(data.get("schemaVersion"), int)


def test_panels_have_ids_positions_and_queries(dashboard):
    name, data = dashboard
    ids = [p["id"] for p in iter_panels(data)]
    assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
    for panel in _panels(data):
        title = panel.get("title")
        assert title, f"{name}: panel {panel['id']} has no title"
        assert {"h", "w", "x", "y"} <= set(panel.get("gridPos", {})), f"{name}/{title}: gridPos"
        targets = panel.get("targets") or []
        assert targets and all(t.get("expr") for t in targets), f"{name}/{title}: no queries"
        refs = [t["refId"] for t in targets]
        assert len(refs) == len(set(refs)), f"{name}/{title}: duplicate refIds"


def test_every_panel_uses_the_datasource_variable(dashboard):
    name, data = dashboard
    for panel in _panels(data):
        assert panel.get("datasource", {}).get("uid") in DS_UIDS, f"{name}/{panel['title']}: datasource"
        for target in panel["targets"]:
            if "datasource" in target:
                assert target["datasource"].get("uid") in DS_UIDS, f"{name}/{panel['title']}: target datasource"
    for var in data["templating"]["list"]:
        if var["type"] == "query":
            assert var["datasource"]["uid"] in DS_UIDS, f"{name}: variable {var['name']} datasource"


def test_units_are_set(dashboard):
    name, data = dashboard
    for panel in _panels(data):
        if panel["type"] in UNIT_PANELS:
            unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
            assert unit, f"{name}/{panel['title']}: no unit"


def _expected_unit(exprs: list[str]) -> str | None:
    """The unit the metrics imply: seconds, bytes, bytes/bytes or ratios; None when mixed."""
    names = set().union(*(metric_names(e) for e in exprs)) - INFO  # info: a filter
    if not names:
        return None
    if all(re.search(r"_seconds(_bucket|_sum|_count)?$", n) for n in names):
        return "s"
    if all(n.endswith("_bytes") for n in names):
        return "percentunit" if any("/" in e for e in exprs) else "bytes"
    if all(re.search(r"(_ratio|_ratio_bucket|acceptance_rate:rate5m)$", n) for n in names):
        return "percentunit"
    return None


def test_units_match_the_metrics(dashboard):
    name, data = dashboard
    for panel in _panels(data):
        if panel["type"] not in UNIT_PANELS - {"heatmap"}:
            continue
        expected = _expected_unit([t["expr"] for t in panel["targets"]])
        if expected:
            assert panel["fieldConfig"]["defaults"]["unit"] == expected, f"{name}/{panel['title']}"


def test_required_variables(dashboard):
    name, data = dashboard
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert REQUIRED_VARIABLES[name] <= set(variables), f"{name}: variables {sorted(variables)}"
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for var_name in REQUIRED_VARIABLES[name] - {"datasource"}:
        var = variables[var_name]
        assert var["type"] == "query" and var.get("includeAll") and var.get("multi"), f"{name}: ${var_name}"
        used = any(re.search(rf"\${{?{var_name}\b", t["expr"]) for p in _panels(data) for t in p["targets"])
        used |= any(f"${var_name}" in str(v.get("query")) for v in data["templating"]["list"])
        assert used, f"{name}: variable ${var_name} is not used by any query"


def test_queries_use_only_known_metrics():
    known = known_series()
    for query in dashboard_queries(raw=True):
        unknown = metric_names(query.expr) - known
        assert not unknown, f"{query.dashboard}/{query.panel}/{query.ref_id} uses unknown {sorted(unknown)}"
    for dashboard, var, selector, _ in variable_queries(raw=True):
        unknown = metric_names(selector) - known
        assert not unknown, f"{dashboard}: variable {var} uses unknown {sorted(unknown)}"


def test_dashboards_show_what_the_issue_asks_for():
    used = {name: set() for name in DASHBOARDS}
    for query in dashboard_queries(raw=True):
        used[query.dashboard] |= metric_names(query.expr)
    for name, required in REQUIRED_SERIES.items():
        assert required <= used[name], f"{name} misses {sorted(required - used[name])}"
    assert recording_rule_names() >= {n for n in used["serving"] if ":" in n}


def test_the_ledger_panel_stacks_every_entry_the_worker_records():
    """One stacked target per component of the worker's ledger, in the ledger's order: a component added to
    the ledger without its target here fails."""
    [panel] = [p for p in iter_panels(load_dashboard("memory-ledger"))
               if p.get("title") == "Ledger vs budget and device total"]
    stacked = [t for t in panel["targets"] if "component=" in t["expr"]]
    components = [re.search(r'component="(\w+)"', t["expr"]).group(1) for t in stacked]
    assert components == list(WORKER_COMPONENTS)
    assert all(metric_names(t["expr"]) == {"vramledger_memory_bytes"} for t in stacked)
    unstacked = {o["matcher"]["options"] for o in panel["fieldConfig"]["overrides"]
                 if {"id": "custom.stacking", "value": {"mode": "none", "group": "A"}} in o["properties"]}
    assert unstacked == {t["refId"] for t in panel["targets"]} - {t["refId"] for t in stacked}, \
        "only the budget and the device total are drawn unstacked"


def test_device_legends_name_the_node(dashboard):
    """Two nodes' device 0 differ only by the node the exporter runs on (monitors.yaml, prometheus.yml)."""
    name, data = dashboard
    for panel in _panels(data):
        for target in panel["targets"]:
            legend = target.get("legendFormat", "")
            if "{{device}}" in legend and "vramledger_serving_info" not in target["expr"]:
                assert "{{node}}" in legend, f"{name}/{panel['title']}/{target['refId']}: {legend}"


def test_substituted_queries_have_no_template_variables():
    queries = dashboard_queries()
    assert len(queries) >= 20
    for query in queries:
        assert "$" not in query.expr and "[[" not in query.expr, query


def test_substituted_queries_parse_with_promtool(tmp_path):
    """Every query Grafana will send is valid PromQL (promtool parses it as a recording rule)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: run `make system-deps` (installs Debian's `prometheus` package)")
    rules = [{"record": f"dashboard:query_{i}", "expr": q.expr} for i, q in enumerate(dashboard_queries())]
    rules += [{"record": f"dashboard:variable_{i}", "expr": sel}
              for i, (_, _, sel, _) in enumerate(variable_queries())]
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_node_label_is_set_wherever_the_exporter_is_scraped():
    config = yaml.safe_load((ROOT / "prometheus" / "prometheus.yml").read_text())
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "vramledger-exporter"]
    assert [r["target_label"] for r in job["relabel_configs"]] == ["node"]
    monitors = yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "base" / "monitors.yaml").read_text())
    [monitor] = [m for m in monitors if m["metadata"]["name"] == "vramledger-exporter"]
    assert [r["targetLabel"] for e in monitor["spec"]["endpoints"] for r in e["relabelings"]] == ["node"]


# ---------------------------------------------------------------- provisioning
def _provisioning(kind: str) -> list[dict]:
    files = sorted((PROVISIONING / kind).glob("*.yml")) + sorted((PROVISIONING / kind).glob("*.yaml"))
    assert files, f"no provisioning files in dashboards/provisioning/{kind}"
    return [yaml.safe_load(f.read_text()) for f in files]


def test_datasource_provisioning():
    sources = [ds for doc in _provisioning("datasources") for ds in doc["datasources"]]
    prometheus = [ds for ds in sources if ds["type"] == "prometheus"]
    assert len(prometheus) == 1
    assert prometheus[0]["url"] == "http://prometheus:9090"
    assert prometheus[0].get("isDefault") is True


def test_dashboard_provisioning():
    providers = [p for doc in _provisioning("dashboards") for p in doc["providers"]]
    assert providers and all(p["type"] == "file" and p["options"]["path"] for p in providers)


def test_the_engine_rows_repeat_per_kind_and_split_what_engines_declare():
    """The exporter's per-engine panels work for every kind: their row repeats per $kind and each query
    keeps only that kind's engines; observed memory is drawn against what is declared only for engines
    that declare, and alone for those that declare nothing."""
    panels = load_dashboard("memory-ledger")["panels"]
    [start] = [i for i, p in enumerate(panels) if p.get("type") == "row" and p.get("repeat") == "kind"]
    end = next(i for i in range(start + 1, len(panels)) if panels[i].get("type") == "row")
    rows = panels[start + 1:end]
    assert rows and all("$kind" in t["expr"] for p in rows for t in p["targets"]), "a query of every kind"
    by_title = {p["title"]: [t["expr"] for t in p["targets"]] for p in rows}
    observed = "vramledger_engine_observed_memory_bytes"
    declaring = by_title["Declared vs observed memory (engines that declare)"]
    assert any(observed in e and "and on (job, instance, engine) vramledger_engine_declared_memory_bytes" in e
               for e in declaring)
    assert any(metric_names(e) - INFO == {"vramledger_engine_declared_memory_bytes"} for e in declaring)
    [alone] = by_title["Observed memory (engines that declare nothing)"]
    assert observed in alone and "unless on (job, instance, engine) vramledger_engine_declared_memory_bytes" in alone
