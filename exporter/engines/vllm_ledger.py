"""vLLM's own ledger: GET /vramledger/memory, which the vLLM plugin adds to vLLM's API server (docs/vllm.md).

Every entry of it is a start-up fact (the weights loaded, the KV cache allocated, the profile run's
result), so it is asked once per process tree of the server, not on every scrape: each ask costs
vLLM a call into every rank between two engine steps. What moves, the processes' memory and the KV
cache's use, the exporter reads itself on every scrape. A vLLM without the plugin answers 404: it is
not asked again until its processes change, and nothing is counted.

Besides its ranks, the document lists the server's other processes (the API server, the engine core,
vLLM's helpers), each declaring the host memory it held when the server became ready.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from vramledger.exporter.engines.base import Loading, NotServing, Unreachable
from vramledger.exporter.engines.bounds import OutOfBounds, shown
from vramledger.exporter.engines.fetch import HttpClient, WrongStatus, fetch
from vramledger.exporter.engines.ranks import Entry, RankLedger, ServerProcess, Sizing
from vramledger.exporter.errors import ErrorLog
from vramledger.ledger_document import LedgerDocument, SizingDoc
from vramledger.ledger_reading import LedgerError, parse_server_document

log = logging.getLogger(__name__)

PATH = "/vramledger/memory"
SOURCE = "vllm"


@dataclass(frozen=True)
class ServerLedger:
    """What a vLLM server with the plugin declares: its ranks' ledgers and its other processes."""
    ranks: tuple[RankLedger, ...] = ()
    processes: tuple[ServerProcess, ...] = ()


NO_LEDGER = ServerLedger()


def parse(document: object) -> ServerLedger:
    """The plugin's document; raises LedgerError where it is not that document (BeyondBounds, an
    OutOfBounds too, where it is and says what cannot be)."""
    doc = parse_server_document(document)
    if doc["engine"] != "vllm":
        raise LedgerError(f"engine {shown(doc['engine'])}: not the vLLM plugin's ledger")
    return ServerLedger(tuple(_rank(rank) for rank in doc["ranks"]),
                        tuple(ServerProcess(p["role"], p["pid"], p["bytes"]) for p in doc.get("processes") or ()))


def parse_ranks(document: object) -> tuple[RankLedger, ...]:
    """The ranks of the plugin's document; raises LedgerError where it is not that document."""
    return parse(document).ranks


def _rank(doc: LedgerDocument) -> RankLedger:
    rank, device, budget = doc["rank"], doc["device"], doc.get("budget")
    return RankLedger(rank, device["kind"], device.get("uuid") or None, doc["declared_bytes"],
                      tuple(Entry(e["component"], e["model"], e["bytes"], e.get("in_budget")) for e in doc["entries"]),
                      budget.get("bytes") if budget else None, _sizing(rank, doc.get("sizing")))


def _sizing(rank: int, doc: SizingDoc | None) -> Sizing | None:
    """The rank's sizing (docs/vllm.md); None where no profile run sized its KV cache, or a plugin
    older than the block."""
    ran = None if doc is None else doc.get("ran")
    if doc is None or ran is None:
        return None
    vllm, own, charged = doc.get("vllm_charged_bytes"), doc.get("own_process_bytes"), doc.get("charged_bytes")
    if vllm is None or charged is None or charged not in (vllm, own):  # the charge that ran is one of the two
        raise LedgerError(f"rank {rank}: sizing charged {shown(charged)}, neither vLLM's {shown(vllm)} nor its "
                          f"own process's {shown(own)}")
    return Sizing(ran, doc.get("fallback") or "", vllm, own, charged)


class LedgerReader:
    """The ledger of one vLLM server, asked once per process tree; NO_LEDGER when there is none to read."""

    def __init__(self, url: str, client: HttpClient, errors: ErrorLog):
        self.url = url
        self._client = client
        self._errors = errors
        self._tree: frozenset[int] | None = None  # the processes the kept answer is theirs
        self._ledger = NO_LEDGER
        self._false: str | None = None  # what the kept answer said that cannot be
        self._said = ""  # the last outcome logged, so that a restart with the same one logs nothing

    def read(self, tree: frozenset[int]) -> ServerLedger:
        """The ledger of the server whose processes are tree (frozenset() where unknown); raises
        OutOfBounds, for as long as that tree serves, where its ledger says what cannot be."""
        if tree == self._tree:
            if self._false is not None:  # raised anew: the one raised before keeps its traceback
                raise OutOfBounds(self._false)
            return self._ledger
        self._false = None
        try:
            ledger = parse(fetch(self._client, self.url + PATH).json())
        except OutOfBounds as e:  # the plugin's ledger, false: the server is wrong, not without a ledger
            self._tree, self._ledger, self._false = tree, NO_LEDGER, str(e)
            raise
        except WrongStatus as e:
            if e.status_code != 404:
                self._errors.record(SOURCE, f"ledger_status {self.url}", f"{self.url}{PATH}: {e}")
            ledger = NO_LEDGER
            self._say("absent" if e.status_code == 404 else "wrong")
        except (Loading, Unreachable) as e:  # a busy or stopping engine: asked again next scrape
            note = self._errors.record if e.counted else self._errors.note  # counted: it answered too slowly
            note(SOURCE, f"ledger_unanswered {self.url}", f"{e} (asked again next scrape)")
            return NO_LEDGER
        except (NotServing, ValueError) as e:  # not JSON, not the plugin's document
            self._errors.record(SOURCE, f"bad_ledger {self.url}", f"{self.url}{PATH}: not vLLM's ledger: {e}")
            ledger = NO_LEDGER
            self._say("wrong")
        else:
            self._say(f"{len(ledger.ranks)} ranks, {len(ledger.processes)} other processes")
        self._tree, self._ledger = tree, ledger
        return ledger

    def forget(self) -> None:
        """The server stopped answering: ask its ledger again once it serves."""
        self._tree, self._ledger, self._false = None, NO_LEDGER, None

    def _say(self, outcome: str) -> None:
        if outcome == self._said:
            return
        self._said = outcome
        if outcome == "absent":
            log.info("vllm %s serves no %s (the vramledger vLLM plugin is not enabled there): no ledger to "
                     "publish; what it declares is read from its /metrics", self.url, PATH)
        elif outcome != "wrong":  # a wrong answer logs its error instead
            log.info("vllm %s: its ledger read from %s (%s), declared and published per rank", self.url,
                     PATH, outcome)
