"""The pods on the exporter's node, through the Kubernetes API (the `kubernetes` client).

Two uses: the engines to read (pods labelled vramledger.io/engine: <a registered kind's name>, read on
the port in the vramledger.io/port annotation), and the namespace, pod and container behind a process,
from its cgroup (exporter/cgroups.py). One list of this node's pods is cached; a pod UID it does not
know (a new pod) lists again, at most every `min_interval` seconds, and a container id it does not know
(a restarted container) reads that one pod again. When the API fails, the error is counted and the
cache is dropped: a process is then in no known pod, never in the pod it was in before.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

from vramledger.exporter.cgroups import CgroupIdentity, read_cgroup, strip_runtime
from vramledger.exporter.engines.kinds import POD_LABEL
from vramledger.exporter.engines.registry import kind_named
from vramledger.exporter.errors import ErrorLog

log = logging.getLogger(__name__)
SOURCE = "kubernetes"
PORT_ANNOTATION = "vramledger.io/port"  # without it, the kind's default port (EngineKind.port)


@dataclass(frozen=True)
class PodLabels:
    """The labels a process series gains; empty strings for a process in no (known) pod."""

    namespace: str = ""
    pod: str = ""
    container: str = ""


NO_POD = PodLabels()


@dataclass(frozen=True)
class Engine:
    """An engine found on this node: its kind (a registered kind's name), base URL and pod."""

    kind: str
    url: str
    namespace: str
    pod: str
    uid: str = ""  # the pod's UID: its processes are those whose cgroup names it


@dataclass
class _Pod:
    namespace: str
    name: str
    uid: str
    phase: str
    ip: str | None
    labels: dict[str, str]
    annotations: dict[str, str]
    containers: dict[str, str] = field(default_factory=dict)  # container id -> container name


class PodDirectory:
    """This node's pods, listed through the API and cached; resolves cgroup identities to pod labels."""

    def __init__(self, api, node_name: str, errors: ErrorLog, *, max_age: float = 30.0,
                 min_interval: float = 5.0, timeout: float = 2.0, clock=time.monotonic,
                 proc_root: str = "/proc"):
        if not node_name:
            raise ValueError("the node name is empty: set NODE_NAME from the downward API (spec.nodeName)")
        self._api = api  # a kubernetes.client.CoreV1Api
        self.node_name = node_name
        self._errors = errors
        self._max_age, self._min_interval, self._timeout = max_age, min_interval, timeout
        self._clock = clock
        self._proc_root = proc_root  # the host's /proc: the exporter runs with hostPID
        self._lock = threading.Lock()  # scrapes may run concurrently
        self._pods: dict[str, _Pod] = {}  # by UID
        self._listed_at: float | None = None  # None: no good list (never, or the last one failed)
        self._tried_at = float("-inf")
        self._reread_at: dict[tuple[str, str], float] = {}  # (pod UID, container id) -> last get

    @classmethod
    def connect(cls, node_name: str, errors: ErrorLog, **kwargs) -> PodDirectory:
        """Credentials from the pod's service account, or from a kubeconfig outside a cluster."""
        try:
            from kubernetes import client, config
        except ImportError as e:  # an optional extra: only --kubernetes needs it
            raise RuntimeError("the Kubernetes client is not installed: pip install 'vramledger[kubernetes]'") from e

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # None: ~/.kube/config
        return cls(client.CoreV1Api(), node_name, errors, **kwargs)

    # -- queries ---------------------------------------------------------------------------
    def labels_of_pid(self, pid: int | str) -> PodLabels:
        """The pod behind a host pid (as NVML reports it); NO_POD for "other" or a process in no pod."""
        if not str(pid).isdigit():
            return NO_POD
        return self.labels(read_cgroup(int(pid), self._proc_root))

    def labels(self, identity: CgroupIdentity | None) -> PodLabels:
        """The pod behind a process's cgroup identity; NO_POD when it is in none, or none we know."""
        if identity is None or identity.pod_uid is None:
            return NO_POD
        with self._lock:
            self._refresh_if_stale()
            pod = self._pods.get(identity.pod_uid)
            if pod is None and self._may_list():  # a pod newer than our list
                self._list()
                pod = self._pods.get(identity.pod_uid)
            if pod is None:
                return NO_POD
            container = pod.containers.get(identity.container_id or "")
            if container is None and identity.container_id and self._may_reread(pod, identity.container_id):
                pod = self._reread(pod)  # a container newer than our copy of the pod (a restart)
                if pod is None:
                    return NO_POD
                container = pod.containers.get(identity.container_id)
            return PodLabels(pod.namespace, pod.name, container or "")

    def engines(self) -> list[Engine]:
        """The running engines on this node, by their label; [] while the API cannot be read."""
        with self._lock:
            self._refresh_if_stale()
            found = []
            for pod in self._pods.values():
                kind = kind_named(pod.labels.get(POD_LABEL, ""))
                if kind is None or pod.phase != "Running" or not pod.ip:
                    continue
                port = pod.annotations.get(PORT_ANNOTATION, str(kind.port))
                if not port.isdigit():
                    self._errors.record(SOURCE, f"bad_port {pod.namespace}/{pod.name}",
                                        f"{pod.namespace}/{pod.name}: {PORT_ANNOTATION} {port!r} is no port")
                    continue
                host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
                found.append(Engine(kind.name, f"http://{host}:{port}", pod.namespace, pod.name, pod.uid))
            return sorted(found, key=lambda e: (e.namespace, e.pod))

    def refresh(self) -> bool:
        """List this node's pods now; False (counted, cache dropped) when the API fails."""
        with self._lock:
            return self._list()

    # -- the API -----------------------------------------------------------------------------
    def _refresh_if_stale(self) -> None:
        stale = self._listed_at is None or self._clock() - self._listed_at >= self._max_age
        if stale and self._may_list():
            self._list()

    def _may_list(self) -> bool:
        return self._clock() - self._tried_at >= self._min_interval

    def _may_reread(self, pod: _Pod, container_id: str) -> bool:
        # A pod sandbox's id (its pause process) is in no container status: ask once per interval.
        now, key = self._clock(), (pod.uid, container_id)
        if now - self._reread_at.get(key, float("-inf")) < self._min_interval:
            return False
        self._reread_at = {k: t for k, t in self._reread_at.items() if now - t < self._max_age}
        self._reread_at[key] = now
        return True

    def _list(self) -> bool:
        self._tried_at = self._clock()
        try:
            result = self._api.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.node_name}",
                                                           _request_timeout=self._timeout)
        except Exception as e:  # noqa: BLE001 - ApiException, urllib3's errors, bad JSON: all counted
            self._fail("list", e)
            return False
        self._pods = {pod.uid: pod for pod in map(_pod, result.items or []) if pod.uid}
        self._listed_at = self._clock()
        return True

    def _reread(self, pod: _Pod) -> _Pod | None:
        try:
            fresh = _pod(self._api.read_namespaced_pod(pod.name, pod.namespace,
                                                       _request_timeout=self._timeout))
        except Exception as e:  # noqa: BLE001
            if getattr(e, "status", None) == 404:  # the pod went away
                self._pods.pop(pod.uid, None)
                return None
            self._fail("get", e)
            return None
        if fresh.uid != pod.uid:  # deleted and created again under the same name: another pod
            self._pods.pop(pod.uid, None)
            return None
        self._pods[pod.uid] = fresh
        return fresh

    def _fail(self, call: str, error: Exception) -> None:
        # Last known pods are dropped: labels from an API we cannot read could name the wrong pod.
        self._pods, self._listed_at = {}, None
        status = getattr(error, "status", None)
        kind = f"http_{status}" if status else type(error).__name__
        self._errors.record(SOURCE, f"{call} {kind}", f"pods {call} on node {self.node_name}: {kind}: "
                                                      f"{str(error).splitlines()[0] if str(error) else ''}")


def _pod(pod) -> _Pod:
    """The fields used here of a kubernetes.client.V1Pod."""
    meta, status = pod.metadata, pod.status
    statuses = [s for group in (status.container_statuses, status.init_container_statuses,
                                status.ephemeral_container_statuses) if status for s in group or []]
    return _Pod(namespace=meta.namespace or "", name=meta.name or "", uid=meta.uid or "",
                phase=(status.phase if status else None) or "", ip=status.pod_ip if status else None,
                labels=dict(meta.labels or {}), annotations=dict(meta.annotations or {}),
                containers={strip_runtime(s.container_id): s.name for s in statuses if s.container_id})
