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
from vramledger.exporter.engines.bounds import shown
from vramledger.exporter.engines.fetch import HttpClient, WrongStatus, fetch
from vramledger.exporter.engines.ranks import Entry, RankLedger, ServerProcess, Sizing
from vramledger.exporter.engines.vramledger import LedgerError, is_int, parse_ledger
from vramledger.exporter.errors import ErrorLog
from vramledger.ledger_vocabulary import SERVER_ROLES

log = logging.getLogger(__name__)

PATH = "/vramledger/memory"
SOURCE = "vllm"


@dataclass(frozen=True)
class ServerLedger:
    """What a vLLM server with the plugin declares: its ranks' ledgers and its other processes."""
    ranks: tuple[RankLedger, ...] = ()
    processes: tuple[ServerProcess, ...] = ()


NO_LEDGER = ServerLedger()


def parse(url: str, doc: object) -> ServerLedger:
    """The plugin's document; raises LedgerError where it is not that document."""
    return ServerLedger(parse_ranks(url, doc), parse_processes(doc))


def parse_processes(doc: object) -> tuple[ServerProcess, ...]:
    """The server's other processes; () from a plugin that lists none (null: it could not measure them)."""
    listed = doc.get("processes") if isinstance(doc, dict) else None
    if listed is None:
        return ()
    if not isinstance(listed, list):
        raise LedgerError(f"processes {shown(listed)} is no list")
    return tuple(_process(p) for p in listed)


def _process(doc: object) -> ServerProcess:
    role, pid, size = (doc.get(k) for k in ("role", "pid", "bytes")) if isinstance(doc, dict) else (None,) * 3
    if role not in SERVER_ROLES or not is_int(pid) or not is_int(size) or size < 0:
        raise LedgerError(f"bad process {shown(doc)} (a role of {', '.join(SERVER_ROLES)}, a pid, bytes)")
    return ServerProcess(role, pid, size)


def parse_ranks(url: str, doc: object) -> tuple[RankLedger, ...]:
    """The ranks of the plugin's document; raises LedgerError where it is not that document."""
    if not isinstance(doc, dict) or doc.get("engine") != "vllm" or not isinstance(doc.get("ranks"), list):
        raise LedgerError("not the vLLM plugin's ledger (no engine \"vllm\" with a list of ranks)")
    return tuple(_rank(url, rank) for rank in doc["ranks"])


def _rank(url: str, doc: object) -> RankLedger:
    ledger = parse_ledger(url, doc)  # each rank is a ledger of docs/ledger.md
    assert isinstance(doc, dict)  # parse_ledger has checked it
    rank, entries = doc.get("rank"), doc.get("entries")
    if not is_int(rank) or rank < 0:  # its upper bound is checked with the others' (engines/bounds.py)
        raise LedgerError(f"bad rank {shown(rank)}")
    if not isinstance(entries, list):
        raise LedgerError(f"rank {rank}: no list of entries")
    uuid = doc["device"].get("uuid")
    budget = doc.get("budget")
    size = budget.get("bytes") if isinstance(budget, dict) else None
    return RankLedger(rank, ledger.device_kind, uuid if isinstance(uuid, str) and uuid else None,
                      ledger.declared_bytes, tuple(_entry(rank, e) for e in entries),
                      size if is_int(size) and size >= 0 else None, _sizing(rank, doc.get("sizing")))


def _entry(rank: int, doc: object) -> Entry:
    if not isinstance(doc, dict):
        raise LedgerError(f"rank {rank}: an entry that is no object")
    component, model, size, in_budget = (doc.get(k) for k in ("component", "model", "bytes", "in_budget"))
    if not isinstance(component, str) or not component or not isinstance(model, str):
        raise LedgerError(f"rank {rank}: bad entry {shown(doc)}")
    if not is_int(size) or size < 0:
        raise LedgerError(f"rank {rank}: bad bytes in entry {shown(doc)}")
    if in_budget is not None and not isinstance(in_budget, bool):
        raise LedgerError(f"rank {rank}: bad in_budget in entry {shown(doc)}")
    return Entry(component, model, size, in_budget)


def _sizing(rank: int, doc: object) -> Sizing | None:
    """The rank's sizing (docs/vllm.md); None where no profile run sized its KV cache, or a plugin
    older than the block."""
    if not isinstance(doc, dict) or doc.get("ran") is None:
        return None
    ran, fallback, vllm, own, charged = (doc.get(k) for k in ("ran", "fallback", "vllm_charged_bytes",
                                                              "own_process_bytes", "charged_bytes"))
    if ran not in ("vllm", "own-process") or not (fallback is None or isinstance(fallback, str)) \
            or not is_int(vllm) or not (own is None or is_int(own)) or not is_int(charged) or charged not in (vllm, own):
        raise LedgerError(f"rank {rank}: bad sizing {doc!r}")
    return Sizing(ran, fallback or "", vllm, own, charged)


class LedgerReader:
    """The ledger of one vLLM server, asked once per process tree; NO_LEDGER when there is none to read."""

    def __init__(self, url: str, client: HttpClient, errors: ErrorLog):
        self.url = url
        self._client = client
        self._errors = errors
        self._tree: frozenset[int] | None = None  # the processes the kept answer is theirs
        self._ledger = NO_LEDGER
        self._said = ""  # the last outcome logged, so that a restart with the same one logs nothing

    def read(self, tree: frozenset[int]) -> ServerLedger:
        """The ledger of the server whose processes are tree (frozenset() where unknown)."""
        if tree == self._tree:
            return self._ledger
        try:
            ledger = parse(self.url, fetch(self._client, self.url + PATH).json())
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
        self._tree, self._ledger = None, NO_LEDGER

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
