"""--kubernetes: the engines of this node, found through the API before each scrape.

It answers like exporter.engines.Engines (urls, sources, read(), close()), but its members change:
a pod that appears gets an adapter, one that goes away loses it; given and found engines are read
together. A found engine's processes are the processes of its pod (their cgroups name it): the
exporter cannot see a socket in the pod's network namespace, so finding them by port would fail.
"""
from __future__ import annotations

import time
from pathlib import Path

from vramledger.exporter.cgroups import pids_in_pod
from vramledger.exporter.engines import Engine, Engines, Reading
from vramledger.exporter.engines.fetch import HttpClient
from vramledger.exporter.engines.registry import kind_named, kinds
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.kubernetes import SOURCE as KUBERNETES_SOURCE
from vramledger.exporter.kubernetes import Engine as FoundEngine
from vramledger.exporter.kubernetes import PodDirectory
from vramledger.exporter.processes import TREE_MAX_AGE, NotFound


class PodLocator:
    """The processes of one pod, by their cgroups (exporter.processes.Locator); kept TREE_MAX_AGE seconds,
    as a scan reads the cgroup of every process on the node."""

    def __init__(self, pod_uid: str, name: str, proc_root: str | Path = "/proc", clock=time.monotonic):
        self.pod_uid, self.name, self._proc_root = pod_uid, name, proc_root
        self._clock = clock
        self._found: frozenset[int] = frozenset()
        self._found_at = float("-inf")

    def pids(self) -> frozenset[int]:
        if self._clock() - self._found_at >= TREE_MAX_AGE:
            self._found, self._found_at = pids_in_pod(self.pod_uid, self._proc_root), self._clock()
        if not self._found:
            self.forget()
            raise NotFound(f"no process of pod {self.name} is visible (is the exporter in the host pid "
                           "namespace?)")
        return self._found

    def listeners(self) -> frozenset[int]:
        return self.pids()  # any process of the pod may listen: the pod is what is known

    def forget(self) -> None:
        self._found, self._found_at = frozenset(), float("-inf")


class DiscoveredEngines:
    """The engines given (--worker, --vllm, ...), plus those the API lists on this node, read in parallel."""

    def __init__(self, pods: PodDirectory, given: Engines, timeout: float, errors: ErrorLog):
        self._pods = pods
        self._engines = given  # the found ones are added to it while the API lists them
        self._given = set(given.urls)
        self._errors = errors
        self._client = HttpClient(timeout)
        self._found: dict[str, str] = {}  # URL -> pod UID, while listed
        self.sources = tuple(dict.fromkeys((*given.sources, *(k.source for k in kinds()), KUBERNETES_SOURCE)))

    @property
    def urls(self) -> list[str]:
        return self._engines.urls

    def read(self) -> dict[str, Reading]:
        self._update(self._pods.engines())
        return self._engines.read()

    def close(self) -> None:
        self._engines.close()
        self._client.close()

    def _update(self, listed: list[FoundEngine]) -> None:
        wanted = {e.url: e for e in listed if e.url not in self._given}
        for url, uid in list(self._found.items()):
            if url not in wanted or wanted[url].uid != uid:  # its pod went away (or another took its IP)
                del self._found[url]
                self._engines.remove(url)
        for url, found in wanted.items():
            if url not in self._found:
                self._found[url] = found.uid
                self._engines.add(self._adapter(found))

    def _adapter(self, found: FoundEngine) -> Engine:
        kind = kind_named(found.kind)
        if kind is None:  # listed only with a registered kind's label (PodDirectory.engines)
            raise ValueError(f"no engine kind {found.kind!r}")
        return kind.adapter(found.url, self._client, self._errors,
                            PodLocator(found.uid, f"{found.namespace}/{found.pod}"))
