"""Reads each worker's ledger (GET <url>/v1/memory, docs/ledger.md) with a short timeout."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from exporter.errors import ErrorLog

SOURCE = "worker"


@dataclass(frozen=True)
class WorkerLedger:
    """The fields of a worker's ledger that the exporter joins on."""
    url: str
    pid: int
    host_pid: int | None
    container_id: str | None
    device_kind: str  # "cuda" or "cpu"
    declared_bytes: int


class LedgerError(ValueError):
    """A ledger document that does not follow docs/ledger.md."""


def parse_ledger(url: str, doc: object) -> WorkerLedger:
    """Validates the fields the exporter uses; anything else in the document is ignored."""
    if not isinstance(doc, dict) or doc.get("version") != 1:
        raise LedgerError("not a version-1 ledger")
    worker, device = doc.get("worker"), doc.get("device")
    if not isinstance(worker, dict) or not isinstance(device, dict):
        raise LedgerError("missing 'worker' or 'device'")
    pid, host_pid, declared = worker.get("pid"), worker.get("host_pid"), doc.get("declared_bytes")
    container_id, kind = worker.get("container_id"), device.get("kind")
    if not _is_int(pid) or pid <= 0:
        raise LedgerError(f"bad worker.pid {pid!r}")
    if host_pid is not None and (not _is_int(host_pid) or host_pid <= 0):
        raise LedgerError(f"bad worker.host_pid {host_pid!r}")
    if container_id is not None and not isinstance(container_id, str):
        raise LedgerError(f"bad worker.container_id {container_id!r}")
    if not _is_int(declared) or declared < 0:
        raise LedgerError(f"bad declared_bytes {declared!r}")
    if kind not in ("cuda", "cpu"):
        raise LedgerError(f"bad device.kind {kind!r}")
    return WorkerLedger(url, pid, host_pid, container_id or None, kind, declared)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class LedgerFetcher:
    """Fetches every worker's ledger in parallel; a worker that fails maps to None.

    Garbage (an HTTP error status, invalid JSON, a document that is no ledger) counts in
    vramledger_exporter_errors_total{source="worker"}; a worker that is down or too slow only
    shows as vramledger_worker_up 0. Both are logged once per worker and kind.
    """

    def __init__(self, urls: list[str], timeout: float, errors: ErrorLog):
        self.urls = [u.rstrip("/") for u in urls]
        self._errors = errors
        # trust_env=False: a proxy from the environment must not sit between the exporter and its workers.
        self._client = httpx.Client(timeout=timeout, trust_env=False)
        self._pool = ThreadPoolExecutor(min(len(self.urls), 16)) if len(self.urls) > 1 else None

    def fetch(self) -> dict[str, WorkerLedger | None]:
        if self._pool is None:
            return {url: self._fetch_one(url) for url in self.urls}
        return dict(zip(self.urls, self._pool.map(self._fetch_one, self.urls)))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._client.close()

    def _fetch_one(self, url: str) -> WorkerLedger | None:
        try:
            response = self._client.get(url + "/v1/memory")
            response.raise_for_status()
            return parse_ledger(url, response.json())
        except httpx.HTTPStatusError as e:
            self._fail(url, f"http_{e.response.status_code}", e, count=True)
        except (httpx.TimeoutException, httpx.TransportError) as e:
            # A worker that is down is what vramledger_worker_up 0 says; counting it as an exporter
            # error too would page twice for one fault.
            self._fail(url, "timeout" if isinstance(e, httpx.TimeoutException) else "unreachable", e,
                       count=False)
        except (httpx.HTTPError, ValueError) as e:  # invalid JSON or ledger: an error, not a crash
            self._fail(url, "invalid_ledger", e, count=True)
        return None

    def _fail(self, url: str, kind: str, error: Exception, count: bool) -> None:
        report = self._errors.record if count else self._errors.note
        report(SOURCE, f"{kind} {url}", f"{url}/v1/memory: {type(error).__name__}: {error}")
