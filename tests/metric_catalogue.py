"""docs/metrics.md read as data: each process's metric families with their type, labels and condition."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

CATALOGUE = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
# The page's "## <heading>" -> key; "vllm" holds the series of vLLM's own /metrics that the rules read.
PROCESSES = {"Worker": "worker", "Exporter": "exporter", "vLLM": "vllm"}
_CODE = re.compile(r"`([^`]+)`")


@dataclass(frozen=True)
class Family:
    """One catalogued family: `name` as queried (counters with _total), `family` as the text parser names it."""

    name: str
    type: str
    labels: frozenset[str]
    optional_labels: frozenset[str]  # only in the case the page names in parentheses
    always: bool

    @property
    def family(self) -> str:
        return self.name.removesuffix("_total") if self.type == "counter" else self.name


def _labels(cell: str) -> tuple[frozenset[str], frozenset[str]]:
    optional = " ".join(re.findall(r"\(([^)]*)\)", cell))
    required = re.sub(r"\([^)]*\)", "", cell)

    def names(text: str) -> frozenset[str]:
        return frozenset(n for n in _CODE.findall(text) if not n.startswith("-"))

    return names(required), names(optional)


def catalogue() -> dict[str, dict[str, Family]]:
    """{"worker": {name: Family}, "exporter": {...}, "vllm": {...}}, in the page's order."""
    out: dict[str, dict[str, Family]] = {}
    section = None
    for line in CATALOGUE.read_text().splitlines():
        if line.startswith("## "):
            section = PROCESSES.get(line[3:].split(" (")[0].strip())
            if section:
                out[section] = {}
            continue
        if section is None or not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name, kind, labels, _unit, when = cells[:5]
        required, optional = _labels(labels)
        family = Family(_CODE.search(name).group(1), kind, required, optional, when.startswith("always"))
        out[section][family.name] = family
    return out
