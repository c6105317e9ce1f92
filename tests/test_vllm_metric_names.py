"""The vLLM series the rules read (docs/metrics.md's vLLM section) are the ones each supported vLLM
version publishes: each family's name, and its labels, as that version's sources write them."""
from __future__ import annotations

import ast

import pytest
from metric_catalogue import catalogue
from test_vllm_versions import WHEELS, venv_sources, wheel
from vllm_sources import Sources

from vramledger.vllm_plugin.versions import MODULES

# Where vLLM 0.32 and 0.33 name them: SpecDecodingProm's counters, over the loggers' label names.
SPEC_DECODE = "vllm.v1.spec_decode.metrics"
LOGGERS = "vllm.v1.metrics.loggers"


def strings(sources: Sources, module: str) -> set[str]:
    tree = sources.tree(module)
    assert tree is not None, f"no module {module}"
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def label_names(sources: Sources) -> set[str]:
    """The labels of every per-engine family: the list assigned to `labelnames` in the logger."""
    tree = sources.tree(LOGGERS)
    assert tree is not None, f"no module {LOGGERS}"
    found = [ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
             and any(getattr(t, "id", "") == "labelnames" for t in n.targets) and isinstance(n.value, ast.List)]
    assert len(found) == 1, found
    return set(found[0])


@pytest.fixture(scope="module", params=sorted(MODULES))
def sources(request) -> Sources:
    version = request.param
    return Sources(wheel(*WHEELS[version]) if version in WHEELS else venv_sources())


def test_the_catalogue_names_what_the_rules_read_from_vllm():
    assert set(catalogue()["vllm"]) == {"vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                                        "vllm:spec_decode_num_accepted_tokens_total"}


def test_each_supported_version_publishes_them_with_their_labels(sources):
    families = catalogue()["vllm"].values()
    named = strings(sources, SPEC_DECODE)
    missing = [f.family for f in families if f.family not in named]
    assert missing == [], f"vLLM {sources.version()} names no {missing}"
    assert all(f.type == "counter" for f in families)  # prometheus_client adds _total to a counter
    assert all(f.labels == label_names(sources) for f in families), label_names(sources)
