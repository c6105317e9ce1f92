"""Who a process is, as the exporter finds it: its pid, its pid on the host, its container, its host."""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

from vramledger.ledger_document import ProcessIdentityDoc

# PROC_PID_INIT_INO: the inode of the host's (initial) pid namespace, fixed in the kernel.
HOST_PID_NAMESPACE = "pid:[4026531836]"


@dataclass(frozen=True)
class ProcessIdentity:
    """How the exporter finds a process: pid, host pid, container and host."""

    pid: int
    host_pid: int | None
    container_id: str | None
    hostname: str

    @classmethod
    def current(cls) -> ProcessIdentity:
        return cls(os.getpid(), host_pid(), container_id(), socket.gethostname())

    def to_dict(self) -> ProcessIdentityDoc:
        return {"pid": self.pid, "host_pid": self.host_pid, "container_id": self.container_id,
                "hostname": self.hostname}


def in_host_pid_namespace() -> bool:
    try:
        return os.readlink("/proc/self/ns/pid") == HOST_PID_NAMESPACE
    except OSError:
        return False


def host_pid() -> int | None:
    """Our pid as the host sees it (NVML reports host pids), None where it is not visible."""
    if in_host_pid_namespace():
        return os.getpid()
    # NSpid lists our pid from the outermost namespace /proc can see to our own.
    nspid = (proc_status_field("NSpid") or "").split()
    return int(nspid[0]) if len(nspid) > 1 else None


def proc_status_field(field: str) -> str | None:
    """One field of /proc/self/status, None where there is none."""
    for line in _read("/proc/self/status").splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return None


def container_id() -> str | None:
    """Our container's id (64 hex digits) from /proc/self/cgroup or mountinfo, None outside one."""
    return container_id_from(_read("/proc/self/cgroup"), _read("/proc/self/mountinfo"))


def container_id_from(cgroup: str, mountinfo: str = "") -> str | None:
    # docker: /docker/<id>, systemd: docker-<id>.scope, containerd/CRI: cri-containerd-<id>.scope;
    # with a private cgroup namespace ("0::/") only docker's mounts of /etc/hostname show the id.
    found = re.findall(r"[0-9a-f]{64}", cgroup) or re.findall(r"/containers/([0-9a-f]{64})/", mountinfo)
    return found[-1] if found else None  # the container id follows the pod id in kubepods paths


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""
