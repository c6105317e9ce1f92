"""Finding an engine's processes: by a container pid (NSpid), or by the port it listens on.

NVML reports host pids, so every pid found here is a pid of the exporter's pid namespace: run the
exporter in the host pid namespace (`pid: host`) when engines run in containers.
"""
from __future__ import annotations

import ipaddress
import socket
import time
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

import psutil

from vramledger.exporter.procfs import children_files, descendants
from vramledger.procfs import read_start


class NotFound(LookupError):
    """No process could be found; the message says why (reason) and, for vLLM, what to pass instead."""

    def __init__(self, reason: str, vllm_hint: str = ""):
        super().__init__(f"{reason}; {vllm_hint}" if vllm_hint else reason)
        self.reason = reason


class Locator(Protocol):
    """How an engine's processes are found (by port here; a cluster may know them otherwise)."""

    def pids(self) -> frozenset[int]:
        """Host pids of every process of the engine; raises NotFound, saying why, when there is none."""
        ...

    def listeners(self) -> frozenset[int]:
        """The processes among pids() that may answer the URL themselves (a worker is one of them);
        raises NotFound as pids() does."""
        ...

    def forget(self) -> None:
        """The engine stopped answering: find its processes anew next time."""
        ...


# --- by port ----------------------------------------------------------------------------------

def url_address(url: str) -> tuple[str, int]:
    """The host and port a URL points at (80/443 when it names none)."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"no host in URL {url!r}")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def local_addresses() -> set[str]:
    """The addresses of this network namespace's interfaces (loopback included)."""
    found = {"127.0.0.1", "::1"}
    for addrs in psutil.net_if_addrs().values():
        found.update(a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
    return found


def _resolve(host: str) -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except socket.gaierror as e:
        raise NotFound(f"cannot resolve {host!r}: {e}") from e


def _serves(listen_ip: str, targets: set[str]) -> bool:
    """True when a socket listening on listen_ip accepts connections to one of targets."""
    ip = ipaddress.ip_address(listen_ip)
    if ip.is_unspecified:  # 0.0.0.0 or ::, which also takes IPv4 unless IPV6_V6ONLY
        return True
    mapped = getattr(ip, "ipv4_mapped", None)
    return listen_ip in targets or (mapped is not None and str(mapped) in targets)


def listening_pid(url: str) -> int:
    """The pid of the process listening on the URL's port, in this network namespace."""
    host, port = url_address(url)
    targets = _resolve(host)
    if not targets & local_addresses() and not any(ipaddress.ip_address(t).is_loopback for t in targets):
        raise NotFound(f"{host} ({', '.join(sorted(targets))}) is no address of this network namespace: "
                       "the server listens in another one", "give its pid (--vllm URL=PID)")
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied as e:
        raise NotFound(f"no permission to list sockets ({e})", "give the pid (--vllm URL=PID)") from e
    listeners = {c.pid for c in connections if c.status == psutil.CONN_LISTEN and c.laddr
                 and c.laddr.port == port and _serves(c.laddr.ip, targets)}
    visible = listeners - {None}
    if not visible and listeners:  # a socket whose owner /proc hides from us
        raise NotFound(f"port {port} is open but its process is not visible (permissions, or another pid "
                       "namespace)", "give its pid (--vllm URL=PID)")
    if not visible:
        raise NotFound(f"no process listens on port {port}")
    # Several processes may share one listening socket (forked servers): the oldest is the parent.
    return min(visible, key=_create_time)


def _create_time(pid: int) -> float:
    """When the process started (clock ticks since boot), read straight from /proc: asked of every engine
    on every scrape, where a psutil.Process costs several times more."""
    started = read_start(pid)
    return float("inf") if started is None else started


CHILDREN_FILES = children_files()


def process_tree(pid: int) -> frozenset[int]:
    """pid and all of its descendants (an API server's engine-core and worker children): from the
    kernel's children files where it has them (a few reads per tree), else through psutil (a read of
    every process on the host, per tree)."""
    try:
        if CHILDREN_FILES:
            return descendants(pid)
        root = psutil.Process(pid)
        return frozenset([pid, *(child.pid for child in root.children(recursive=True))])
    except psutil.NoSuchProcess:
        return frozenset()
    except (psutil.AccessDenied, PermissionError):
        return frozenset([pid])


# Seconds a process tree is kept: a server's is set once it serves; a child started later shows late.
TREE_MAX_AGE = 10.0


class PortLocator:
    """The process tree serving a URL: found by its listening port, or from an explicit pid.

    The listening pid is kept while that process lives, so a scrape does not scan every socket; its
    tree is kept up to TREE_MAX_AGE seconds, so a scrape does not scan every process either.
    """

    def __init__(self, url: str, pid: int | None = None, clock=time.monotonic):
        self.url = url
        self.explicit_pid = pid
        self._clock = clock
        self._pid: int | None = None
        self._created: float | None = None
        self._tree: frozenset[int] = frozenset()
        self._tree_at = float("-inf")

    def pids(self) -> frozenset[int]:
        """Every process of the server; raises NotFound with the reason when there is none."""
        root = self._root()
        if self._clock() - self._tree_at >= TREE_MAX_AGE:
            self._tree, self._tree_at = process_tree(root), self._clock()
        if not self._tree:
            self.forget()
            if self.explicit_pid is not None:
                raise NotFound(f"the given pid {self.explicit_pid} does not exist")
            raise NotFound(f"the process listening on {self.url} exited")
        return self._tree

    def listeners(self) -> frozenset[int]:
        """The process listening on the port (or the given pid), without its descendants."""
        return frozenset([self._root()])

    def _root(self) -> int:
        if self._pid is None or _create_time(self._pid) != self._created:  # gone, or the pid reused
            self._pid = self.explicit_pid if self.explicit_pid is not None else listening_pid(self.url)
            self._created = _create_time(self._pid)
            self._tree_at = float("-inf")
        return self._pid

    def forget(self) -> None:
        """The server stopped answering: look for its process again at the next read."""
        self._pid = self._created = None
        self._tree, self._tree_at = frozenset(), float("-inf")


# --- by container pid (NSpid) -----------------------------------------------------------------

def parse_nspid(status: str) -> tuple[int, ...]:
    """The NSpid line of /proc/<pid>/status: the pid in each namespace, outermost first."""
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            return tuple(int(x) for x in line.split()[1:])
    return ()


def in_container(cgroup: str, container_id: str) -> bool:
    """True when /proc/<pid>/cgroup names the container (full or short id, docker or containerd)."""
    return bool(container_id) and container_id in cgroup


class HostPidResolver:
    """Finds the host pid (the pid NVML reports) of a process known by its pid inside a container."""

    def __init__(self, proc_root: str | Path = "/proc"):
        self._proc = Path(proc_root)
        self._cache: dict[tuple[str, int], int] = {}

    def host_pid(self, pid: int, host_pid: int | None = None, container_id: str | None = None) -> int | None:
        if host_pid is not None:
            return host_pid
        if container_id is None:  # same pid namespace as the exporter
            return pid
        key = (container_id, pid)
        cached = self._cache.get(key)
        if cached is not None and self._depth(cached, *key) > 0:  # pids are reused: check again
            return cached
        # The deepest namespace wins: a process that only shares the container's cgroup and happens to
        # carry the same pid in the exporter's own namespace is not the worker.
        depths = {p: self._depth(p, *key) for p in self._pids()}
        found = max((p for p, depth in depths.items() if depth), key=lambda p: depths[p], default=None)
        if found is None:
            self._cache.pop(key, None)
        else:
            self._cache[key] = found
        return found

    def _pids(self) -> list[int]:
        return [int(name) for name in _listdir(self._proc) if name.isdigit()]

    def _depth(self, host_pid: int, container_id: str, ns_pid: int) -> int:
        """How many pid namespaces deep host_pid is, if it is ns_pid in the container; else 0."""
        try:
            nspid = parse_nspid((self._proc / str(host_pid) / "status").read_text())
            if not nspid or nspid[-1] != ns_pid:
                return 0
            cgroup = (self._proc / str(host_pid) / "cgroup").read_text()
        except OSError:  # the process exited meanwhile, or /proc hides it
            return 0
        return len(nspid) if in_container(cgroup, container_id) else 0


def _listdir(path: Path) -> list[str]:
    try:
        return [p.name for p in path.iterdir()]
    except OSError:
        return []
