"""Our worker: its ledger (GET <url>/v1/memory, docs/ledger.md) declares every byte it holds."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import psutil
from prometheus_client.parser import text_string_to_metric_families

from vramledger.exporter.engines.base import EngineInfo, EngineState, NotServing, Wrong
from vramledger.exporter.engines.fetch import HttpClient, WrongStatus, fetch
from vramledger.exporter.engines.kinds import EngineKind
from vramledger.exporter.engines.wrong_kind import other_kind_at
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.processes import TREE_MAX_AGE, HostPidResolver, Locator, NotFound, PortLocator
from vramledger.ledger_document import KvCacheDoc
from vramledger.ledger_reading import parse_ledger

log = logging.getLogger(__name__)

NAME = "vramledger"
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
    model: str = ""
    kv_usage: float | None = None


def worker_ledger(url: str, document: object) -> WorkerLedger:
    """What the exporter joins on, from a worker's ledger; raises LedgerError where it is none."""
    doc = parse_ledger(document)
    worker, models, kv = doc["worker"], doc.get("models"), doc.get("kv_cache")
    return WorkerLedger(url, worker["pid"], worker.get("host_pid"), worker.get("container_id") or None,
                        doc["device"]["kind"], doc["declared_bytes"], models.get("target", "") if models else "",
                        None if kv is None else _kv_usage(kv))


def _kv_usage(kv: KvCacheDoc) -> float | None:
    """Blocks in use of all; None where the ledger gives no live counts (a vLLM rank's)."""
    used, total = kv.get("blocks_used"), kv.get("blocks_total")
    if used is None or not total or used > total:
        return None
    return used / total


class VramledgerEngine:
    """Reads one worker's ledger each scrape; its version once per worker process (from /metrics).

    A ledger that cannot be read says why through NotServing: a 503 while the worker loads, no answer
    while it is down, anything but a ledger (a vLLM server, say) is wrong.
    """
    kind, source = NAME, SOURCE

    def __init__(self, url: str, client: HttpClient, errors: ErrorLog,
                 resolver: HostPidResolver | None = None, locator: Locator | None = None):
        self.url = url.rstrip("/")
        self._client = client
        self._errors = errors
        self._resolver = resolver or HostPidResolver()
        self._locator = locator or PortLocator(self.url)  # its listeners: the processes its pid must be one of
        self._versions: dict[int, str] = {}  # worker pid -> its version
        self._unchecked_at = float("-inf")  # when its port's process was last found out of sight
        # The listeners last looked at, and why they are out of sight ("" where they are not): their
        # names are read once per listening process, not every scrape.
        self._forwarding: tuple[frozenset[int], str] | None = None

    def read(self) -> EngineState:
        try:
            ledger = self.read_ledger()
        except NotServing:
            self._locator.forget()  # a restarted worker listens from another process
            raise
        return self.state(ledger, self._version(ledger.pid))

    def state(self, ledger: WorkerLedger, version: str = "") -> EngineState:
        """The engine state a ledger tells: its host pid, declared bytes, KV usage and model. The pid is
        refused (Wrong) unless it is a process behind the worker's port, where those can be seen."""
        pid = self._resolver.host_pid(ledger.pid, ledger.host_pid, ledger.container_id)
        if pid is None:
            self._errors.record(SOURCE, f"pid_unresolved {self.url}",
                                f"{self.url}: no host process is pid {ledger.pid} of container "
                                f"{ledger.container_id} (is the exporter in the host pid namespace?)")
        behind = self._behind_port()
        if pid is not None and behind is not None and pid not in behind:
            raise Wrong(f"{self.url}: its ledger claims pid {pid}, which is not behind its port (that is pid "
                        f"{', '.join(map(str, sorted(behind)[:8]))})")
        info = EngineInfo(NAME, version, ledger.model)
        return EngineState(frozenset() if pid is None else frozenset([pid]), info, ledger.kv_usage,
                           declared_bytes=ledger.declared_bytes, claimed=behind is None)

    def _behind_port(self) -> frozenset[int] | None:
        """The process listening on the worker's port (the worker serves HTTP itself; in a pod, any of
        its processes); None where it cannot be seen (another network namespace, say): then its
        ledger's pid is taken at its word."""
        if time.monotonic() - self._unchecked_at < TREE_MAX_AGE:  # not looked for on every scrape
            return None
        try:
            return self._not_forwarded(self._locator.listeners())
        except (NotFound, ValueError) as e:
            if self._unchecked_at == float("-inf"):  # once: a lasting fact of the deployment, no fault
                log.info("vramledger %s: its pid taken from its ledger, unchecked: %s", self.url,
                         e.reason if isinstance(e, NotFound) else e)
            self._unchecked_at = time.monotonic()
            return None

    def _not_forwarded(self, listeners: frozenset[int]) -> frozenset[int]:
        """_not_forwarded(listeners), asked once per set of listening processes."""
        if self._forwarding is None or self._forwarding[0] != listeners:
            try:
                _not_forwarded(listeners)
                self._forwarding = listeners, ""
            except NotFound as e:
                self._forwarding = listeners, e.reason
        if self._forwarding[1]:
            raise NotFound(self._forwarding[1])  # anew: one raised again would grow its traceback
        return listeners

    def read_ledger(self) -> WorkerLedger:
        """GET /v1/memory, parsed; raises NotServing."""
        try:
            response = fetch(self._client, self.url + "/v1/memory")
            return worker_ledger(self.url, response.json())
        except WrongStatus as e:  # no /v1/memory: another kind of engine, maybe
            raise other_kind_at(self._client, self.url, KIND) or e from None
        except ValueError as e:  # invalid JSON or ledger
            raise other_kind_at(self._client, self.url, KIND) or Wrong(
                f"{self.url}/v1/memory: not a ledger: {e}") from None

    def close(self) -> None:
        pass

    def _version(self, pid: int) -> str:
        # The ledger carries no version; the worker's own vramledger_serving_info does. A worker's
        # version changes only with its process, so it is read once per pid.
        if pid not in self._versions:
            try:
                version = _info_version(fetch(self._client, self.url + "/metrics").text)
            except (NotServing, ValueError) as e:  # the ledger still counts: only the label is lost
                log.debug("%s/metrics: no version: %s", self.url, e)
                version = ""
            self._versions = {pid: version}
        return self._versions[pid]


# Processes that listen on a published port and pass its connections on to a server in a container
# (Docker's userland proxy, rootless Podman's and containerd's): the worker is behind them, out of sight.
PORT_FORWARDERS = frozenset({"docker-proxy", "rootlessport", "slirp4netns", "pasta"})


def _not_forwarded(listeners: frozenset[int]) -> frozenset[int]:
    """The listeners, or NotFound when a port forwarder listens: a worker watched at its published port
    is as out of sight as one in another network namespace, not a liar."""
    for pid in listeners:
        try:
            name = psutil.Process(pid).name()
        except psutil.Error:
            continue
        if name in PORT_FORWARDERS:
            raise NotFound(f"its port is published by {name} (pid {pid}), which forwards to the worker")
    return listeners


def _info_version(text: str) -> str:
    for family in text_string_to_metric_families(text):
        if family.name == "vramledger_serving_info":
            for sample in family.samples:
                return sample.labels.get("version", "")
    return ""


def _adapter(url: str, client: HttpClient, errors: ErrorLog, locator: Locator | None) -> VramledgerEngine:
    return VramledgerEngine(url, client, errors, locator=locator)


KIND = EngineKind(
    name=NAME, flag="--worker", title="a vramledger worker", source=SOURCE, adapter=_adapter,
    signature=b"vramledger_serving_info",  # its own /metrics' identity series (worker/http/metrics.py)
    declares=("its ledger's total (`GET /v1/memory`): weights of each model, KV cache, activations and "
              "every other byte its process holds; its KV cache usage"),
    flags="unaccounted memory on its device; a ledger whose pid is not the process behind its port (`wrong`)")
