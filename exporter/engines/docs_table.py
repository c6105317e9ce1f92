"""docs/exporter.md's table of engine kinds, generated from the registry: `python -m
vramledger.exporter.engines.docs_table` rewrites it in place (tests/test_exporter_engine_kinds.py fails while the
file differs)."""
from __future__ import annotations

import sys
from pathlib import Path

from vramledger.exporter.engines.kinds import POD_LABEL, EngineKind
from vramledger.exporter.engines.registry import kinds

BEGIN = "<!-- engine kinds: generated from exporter/engines by python -m vramledger.exporter.engines.docs_table -->"
END = "<!-- end of engine kinds -->"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "exporter.md"


def table(of: tuple[EngineKind, ...] | None = None) -> str:
    """The markdown table of the kinds (every registered kind by default)."""
    rows = ["| kind | flag | pod label (default port) | what it declares | what the exporter can flag |",
            "|---|---|---|---|---|"]
    for kind in kinds() if of is None else of:
        metavar = "URL[=PID]" if kind.takes_pid else "URL"
        cells = (kind.title, f"`{kind.flag} {metavar}`", f"`{POD_LABEL}: {kind.name}` ({kind.port})", kind.declares,
                 kind.flags or "its processes' memory only")
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows)


def with_table(text: str, generated: str) -> str:
    """text with the part between the markers replaced by the generated table."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN!r} ... {END!r} markers")
    return text[:start + len(BEGIN)] + "\n" + generated + "\n" + text[end:]


def main() -> int:
    text = DOCS.read_text()
    new = with_table(text, table())
    if new != text:
        DOCS.write_text(new)
        print(f"{DOCS}: engine kinds table rewritten", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
