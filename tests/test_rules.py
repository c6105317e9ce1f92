"""Prometheus config, alert and recording rules: promtool clean, every alert tested and documented."""
from __future__ import annotations

import re
import shutil
import subprocess
from urllib.parse import urlsplit

import pytest
import yaml
from dashboard_queries import ROOT, known_series, metric_names

PROM = ROOT / "prometheus"
RULE_FILES = sorted((PROM / "rules").glob("*.yml"))
TEST_FILES = sorted((PROM / "tests").glob("*.yml"))
RUNBOOKS = ROOT / "docs" / "runbooks"

ALERTS = {
    "VramledgerForeignMemoryOnDevice",
    "VramledgerUnaccountedMemoryHigh",
    "VramledgerKVCacheNearlyFull",
    "VramledgerDeviceMemoryNearlyFull",
    "VramledgerWeightsOutsideBudget",
    "VramledgerForeignMemoryCharged",
    "VramledgerWorkerDown",
    "VramledgerWorkerNotServing",
    "VramledgerSpecDecodeAcceptanceLow",
    "VramledgerPreemptionsHigh",
    "VramledgerExporterErrors",
}
RECORDINGS = {
    "vramledger:spec_decode_acceptance_rate:rate5m",
    "vramledger:spec_decode_mean_acceptance_length:rate5m",
}
RUNBOOK_SECTIONS = ("Meaning", "Impact", "Diagnosis", "Mitigation")
# One base URL a deployment sets (an external label), then the runbook's file name.
RUNBOOK_URL = "{{{{ $externalLabels.runbook_base_url }}}}/{}.md"


def _rules(kind: str) -> dict[str, list[dict]]:
    """Each name with its definitions, in file order."""
    found: dict[str, list[dict]] = {}
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if kind in rule:
                    found.setdefault(rule[kind], []).append(rule)
    return found


def _alert_rules() -> dict[str, dict]:
    found = _rules("alert")
    assert all(len(rules) == 1 for rules in found.values()), [name for name, r in found.items() if len(r) > 1]
    return {name: rules[0] for name, rules in found.items()}


ALERT_RULES = _alert_rules()
# A recorded series may come from several engines' counters: one definition per source, told apart
# by a static label (`kind`), so their series never collide.
RECORDING_RULES = _rules("record")
ENGINE_SOURCES = {"": "vramledger_spec_decode_", "vllm": "vllm:spec_decode_"}  # kind label -> prefix


def _duration_s(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    parts = re.findall(r"(\d+)(ms|s|m|h|d)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"bad duration {text!r}"
    return sum(int(n) * units[u] for n, u in parts)


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: run `make system-deps` (installs Debian's `prometheus` package, "
                    "which brings promtool)")
    return path


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------- promtool
def test_promtool_check_rules_clean():
    promtool = _promtool()
    assert RULE_FILES, "no rule files in prometheus/rules"
    out = _run([promtool, "check", "rules", *map(str, RULE_FILES)])
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "WARNING" not in text.upper(), text


def test_promtool_unit_tests_pass():
    promtool = _promtool()
    assert TEST_FILES, "no promtool test files in prometheus/tests"
    out = _run([promtool, "test", "rules", *map(str, TEST_FILES)])
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_check_config():
    promtool = _promtool()
    out = _run([promtool, "check", "config", str(PROM / "prometheus.yml")])
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_config_loads_every_rule_file_and_scrapes_both_jobs():
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    loaded = {p for pattern in config["rule_files"] for p in (PROM).glob(pattern)}
    assert set(RULE_FILES) <= loaded, "prometheus.yml does not load every file in prometheus/rules"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert {"vramledger-worker", "vramledger-exporter"} <= set(jobs)
    targets = lambda job: [t for sc in jobs[job]["static_configs"] for t in sc["targets"]]
    assert targets("vramledger-worker") == ["worker:8000"]
    assert targets("vramledger-exporter") == ["exporter:9400"]


# ---------------------------------------------------------------- alerts
def test_exactly_the_documented_alerts_exist():
    assert set(ALERT_RULES) == ALERTS


def _by_source(record: str) -> dict[str, str]:
    """{kind label ("" for the worker's own): expr} of one recorded series."""
    rules = RECORDING_RULES[record]
    by_kind = {rule.get("labels", {}).get("kind", ""): rule["expr"] for rule in rules}
    assert len(by_kind) == len(rules), f"{record}: two definitions with the same kind label"
    return by_kind


def test_recording_rules_exist():
    assert RECORDINGS <= set(RECORDING_RULES)
    # Each engine's counters under its own names: (accepted, proposed tokens, drafts).
    names = {"": ("vramledger_spec_decode_accepted_tokens_total", "vramledger_spec_decode_draft_tokens_total",
                  "vramledger_spec_decode_drafts_total"),
             "vllm": ("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
                      "vllm:spec_decode_num_drafts_total")}
    length = _by_source("vramledger:spec_decode_mean_acceptance_length:rate5m")
    rate = _by_source("vramledger:spec_decode_acceptance_rate:rate5m")
    assert set(length) == set(rate) == set(names) == set(ENGINE_SOURCES)
    for kind, (accepted, proposed, drafts) in names.items():
        assert re.match(r"\s*1\s*\+", length[kind]), "mean acceptance length is 1 + accepted / drafts"
        assert metric_names(length[kind]) == {accepted, drafts}, kind
        assert metric_names(rate[kind]) == {accepted, proposed}, kind


def test_every_recorded_series_has_one_definition_per_engine_source():
    for record in RECORDING_RULES:
        by_kind = _by_source(record)
        for kind, expr in by_kind.items():
            prefix = ENGINE_SOURCES[kind]
            assert all(name.startswith(prefix) for name in metric_names(expr)), (record, kind, expr)


@pytest.mark.parametrize("name", sorted(ALERTS))
def test_alert_metadata_and_runbook(name):
    rule = ALERT_RULES[name]
    assert rule.get("labels", {}).get("severity") in ("warning", "critical"), f"{name}: severity label"
    annotations = rule.get("annotations", {})
    for key in ("summary", "description", "runbook_url"):
        assert str(annotations.get(key, "")).strip(), f"{name}: annotation {key} missing"
    assert annotations["runbook_url"] == RUNBOOK_URL.format(name), annotations["runbook_url"]
    if "for" in rule:
        assert 60 <= _duration_s(rule["for"]) <= 15 * 60, f"{name}: for {rule['for']} outside 1m..15m"

    runbook = RUNBOOKS / f"{name}.md"
    assert runbook.is_file(), f"missing runbook {runbook}"
    text = runbook.read_text()
    headings = re.findall(r"^##\s+(.+?)\s*$", text, re.MULTILINE)
    for section in RUNBOOK_SECTIONS:
        assert section in headings, f"{runbook.name}: section '## {section}' missing"
        body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
        assert len(body.strip()) > 40, f"{runbook.name}: section {section} is empty"
    diagnosis = text.split("## Diagnosis", 1)[1].split("\n## ", 1)[0]
    assert "```" in diagnosis, f"{runbook.name}: Diagnosis needs concrete queries or commands"


def _absolute(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and bool(parts.netloc)


def test_runbook_urls_are_absolute_and_name_a_runbook():
    base = yaml.safe_load((PROM / "prometheus.yml").read_text())["global"]["external_labels"]["runbook_base_url"]
    assert _absolute(base), f"prometheus.yml: runbook_base_url {base!r} is not an absolute URL"
    # As promtool renders them in prometheus/tests (test_promtool_unit_tests_pass): absolute, one per alert.
    rendered: dict[str, set[str]] = {}
    for path in TEST_FILES:
        for test in yaml.safe_load(path.read_text()).get("tests", []):
            for case in test.get("alert_rule_test", []) or []:
                for alert in case.get("exp_alerts") or []:
                    rendered.setdefault(case["alertname"], set()).add(alert["exp_annotations"]["runbook_url"])
    assert set(rendered) == ALERTS
    for name, urls in rendered.items():
        [url] = urls
        assert _absolute(url) and url.endswith(f"/{name}.md"), url
        assert (RUNBOOKS / url.rsplit("/", 1)[1]).is_file(), url


def test_no_orphan_runbooks():
    assert {p.stem for p in RUNBOOKS.glob("*.md")} <= ALERTS


def test_rules_use_only_known_metrics():
    known = known_series()
    rules = [(name, rule) for name, rule in ALERT_RULES.items()]
    rules += [(name, rule) for name, defined in RECORDING_RULES.items() for rule in defined]
    for name, rule in rules:
        unknown = metric_names(rule["expr"]) - known
        assert not unknown, f"{name} uses metrics nobody publishes: {sorted(unknown)}"


# ---------------------------------------------------------------- promtool test coverage
def _alert_cases() -> dict[str, dict[str, int]]:
    cases = {name: {"fires": 0, "quiet": 0} for name in ALERT_RULES}
    for path in TEST_FILES:
        for test in yaml.safe_load(path.read_text()).get("tests", []):
            for case in test.get("alert_rule_test", []) or []:
                name = case["alertname"]
                assert name in cases, f"{path.name}: test for unknown alert {name}"
                cases[name]["fires" if case.get("exp_alerts") else "quiet"] += 1
    return cases


@pytest.mark.parametrize("name", sorted(ALERTS))
def test_alert_has_firing_and_quiet_promtool_case(name):
    cases = _alert_cases()[name]
    assert cases["fires"] >= 1, f"{name}: no promtool case where it fires"
    assert cases["quiet"] >= 1, f"{name}: no promtool case where it does not fire"


def test_promtool_tests_load_every_rule_file():
    loaded = set()
    for path in TEST_FILES:
        for rel in yaml.safe_load(path.read_text()).get("rule_files", []):
            loaded.add((path.parent / rel).resolve())
    assert {p.resolve() for p in RULE_FILES} <= loaded


def test_recording_rules_have_promtool_cases():
    """Each recorded series from each engine's counters: a case expects a sample of that source."""
    tested = set()
    for path in TEST_FILES:
        for test in yaml.safe_load(path.read_text()).get("tests", []):
            for case in test.get("promql_expr_test", []) or []:
                for sample in case.get("exp_samples") or []:
                    kind = re.search(r'\bkind="([^"]*)"', sample["labels"])
                    tested |= {(name, kind.group(1) if kind else "") for name in metric_names(case["expr"])}
    assert {(record, kind) for record in RECORDINGS for kind in _by_source(record)} <= tested
