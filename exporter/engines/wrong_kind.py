"""The hint for a server watched as the wrong kind: which registered kind it answers as, and the flag (or
pod label) to watch it with."""
from __future__ import annotations

from vramledger.exporter.engines.base import NotServing, Wrong
from vramledger.exporter.engines.fetch import HttpClient, fetch
from vramledger.exporter.engines.kinds import POD_LABEL, EngineKind
from vramledger.exporter.engines.registry import kinds


def other_kind(url: str, metrics: bytes | str, watched_as: EngineKind) -> Wrong | None:
    """Wrong, naming the right flag, when a /metrics text carries another registered kind's signature;
    None when it carries none (then it is no engine the exporter knows)."""
    text = metrics.encode() if isinstance(metrics, str) else metrics
    for kind in kinds():
        if kind.name != watched_as.name and kind.signature is not None and kind.signature in text:
            return Wrong(f"{url} is {kind.title}, not {watched_as.title}: watch it with {kind.flag} {url} "
                         f"(in a cluster: pod label {POD_LABEL}: {kind.name})", wrong_kind=True)
    return None


def other_kind_at(client: HttpClient, url: str, watched_as: EngineKind) -> Wrong | None:
    """other_kind() of the server's GET /metrics, for an adapter whose own reads found no engine of its
    kind there; None where /metrics cannot be read either (only the hint is lost)."""
    try:
        text = fetch(client, url + "/metrics").content
    except (NotServing, OSError, ValueError):
        return None
    return other_kind(url, text, watched_as)
