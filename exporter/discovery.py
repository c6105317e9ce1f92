"""--kubernetes: the engines of this node, found through the API before each scrape.

It answers like exporter.engines.Engines (urls, sources, read(), close()), but its members change:
a pod that appears gets an adapter, one that goes away loses it; both kinds are read together. A vLLM server's processes are the
processes of its pod (their cgroups name it): the exporter cannot see a socket in the pod's network
namespace, so finding them by port would fail.
"""
from __future__ import annotations

from pathlib import Path

import httpx

from exporter.cgroups import pids_in_pod
from exporter.engines import Engine, Engines, Reading, VllmEngine, VramledgerEngine
from exporter.engines.vllm import SOURCE as VLLM_SOURCE
from exporter.engines.vramledger import SOURCE as WORKER_SOURCE
from exporter.errors import ErrorLog
from exporter.kubernetes import SOURCE as KUBERNETES_SOURCE
from exporter.kubernetes import Engine as FoundEngine
from exporter.kubernetes import PodDirectory
from exporter.processes import NotFound


class PodLocator:
    """The processes of one pod, by their cgroups (exporter.processes.Locator)."""

    def __init__(self, pod_uid: str, name: str, proc_root: str | Path = "/proc"):
        self.pod_uid, self.name, self._proc_root = pod_uid, name, proc_root

    def pids(self) -> frozenset[int]:
        found = pids_in_pod(self.pod_uid, self._proc_root)
        if not found:
            raise NotFound(f"no process of pod {self.name} is visible (is the exporter in the host pid "
                           "namespace?)")
        return found

    def forget(self) -> None:
        pass  # nothing cached


class DiscoveredEngines:
    """The --worker / --vllm engines given, plus those the API lists on this node, read in parallel."""

    def __init__(self, pods: PodDirectory, given: Engines, timeout: float, errors: ErrorLog):
        self._pods = pods
        self._engines = given  # the found ones are added to it while the API lists them
        self._given = set(given.urls)
        self._errors = errors
        # trust_env=False: a proxy from the environment must not sit between the exporter and its engines.
        self._client = httpx.Client(timeout=timeout, trust_env=False)
        self._found: dict[str, str] = {}  # URL -> pod UID, while listed
        self.sources = tuple(dict.fromkeys((*given.sources, WORKER_SOURCE, VLLM_SOURCE, KUBERNETES_SOURCE)))

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
        if found.kind == "vllm":
            return VllmEngine(found.url, self._client, self._errors,
                              PodLocator(found.uid, f"{found.namespace}/{found.pod}"))
        return VramledgerEngine(found.url, self._client, self._errors)
