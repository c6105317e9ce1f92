"""Which pod and container a process runs in, read from /proc/<pid>/cgroup.

The kubelet puts each pod in a cgroup named after its UID and each container in one named after
its id, in one of two spellings (its cgroup driver), under cgroup v1 (one line per controller) or
v2 (one line, "0::"):

    cgroupfs  /kubepods/burstable/pod<uid>/<container id>
    systemd   /kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid, _ for ->.slice/
              <runtime>-<container id>.scope      runtime: cri-containerd, crio, docker

Paths read from inside another cgroup namespace start with "/../.."; only the names matter here.
A process outside Kubernetes can still be in a container (docker, containerd): it then has a
container id and no pod.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# A pod UID ("_" for "-" under the systemd driver), or a static pod's: 32 hex digits.
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32}"
_ID = r"[0-9a-f]{64}"
# pod<uid> as a path component (cgroupfs) or at the end of a slice name (systemd).
_POD = re.compile(rf"(?:^|[/-])pod({_UID})(?:\.slice)?(?=/|$)")
# The container: a runtime's systemd scope, or a bare id component (cgroupfs driver, docker's /docker/<id>).
_SCOPE = re.compile(rf"/(cri-containerd|crio|docker)-({_ID})\.scope(?=/|$)")
_BARE = re.compile(rf"/({_ID})(?=/|$)")
_CONMON = re.compile(rf"/crio-conmon-{_ID}\.scope(?=/|$)")  # CRI-O's monitor: in the pod, in no container
RUNTIMES = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker"}


@dataclass(frozen=True)
class CgroupIdentity:
    """A process's pod UID and container id (either may be unknown); runtime when the path names one."""

    pod_uid: str | None
    container_id: str | None
    runtime: str | None = None  # "containerd", "cri-o" or "docker"; None with the cgroupfs driver


def parse_cgroup(text: str) -> CgroupIdentity | None:
    """The identity in a /proc/<pid>/cgroup document; None for a process in no pod and no container."""
    found = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        identity = parse_path(parts[2])
        if identity is not None and (found is None or _better(identity, found)):
            found = identity
    return found


def parse_path(path: str) -> CgroupIdentity | None:
    """The identity in one cgroup path."""
    pod = _POD.search(path)
    pod_uid = pod.group(1).replace("_", "-") if pod else None
    scope = _SCOPE.search(path)
    if scope:
        return CgroupIdentity(pod_uid, scope.group(2), RUNTIMES[scope.group(1)])
    bare = _BARE.search(path) if not _CONMON.search(path) else None
    if bare:
        return CgroupIdentity(pod_uid, bare.group(1), "docker" if "/docker/" in path else None)
    return CgroupIdentity(pod_uid, None) if pod_uid else None


def _better(new: CgroupIdentity, old: CgroupIdentity) -> bool:
    """v1 lists each controller; some (e.g. a controller the runtime does not delegate) say less."""
    return (new.pod_uid is not None, new.container_id is not None) > (old.pod_uid is not None,
                                                                      old.container_id is not None)


def read_cgroup(pid: int, proc_root: str | Path = "/proc") -> CgroupIdentity | None:
    """The identity of a running process; None when it is in no container or is gone."""
    try:
        return parse_cgroup((Path(proc_root) / str(pid) / "cgroup").read_text())
    except OSError:  # exited meanwhile, or /proc hides it
        return None


def pids_in_pod(pod_uid: str, proc_root: str | Path = "/proc") -> frozenset[int]:
    """Every process whose cgroup names the pod: in a host pid namespace, the pod's host pids."""
    found = []
    for entry in _listdir(Path(proc_root)):
        if entry.isdigit():
            identity = read_cgroup(int(entry), proc_root)
            if identity is not None and identity.pod_uid == pod_uid:
                found.append(int(entry))
    return frozenset(found)


def _listdir(path: Path) -> list[str]:
    try:
        return [p.name for p in path.iterdir()]
    except OSError:
        return []


def strip_runtime(container_id: str) -> str:
    """The bare id of a pod status's containerID ("containerd://<id>", "cri-o://<id>", "docker://<id>")."""
    return container_id.rpartition("://")[2]
