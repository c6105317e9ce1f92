"""Pod UID and container id from /proc/<pid>/cgroup, on the path formats kubelets and runtimes write."""
from __future__ import annotations

import os

import pytest

from vramledger.exporter.cgroups import CgroupIdentity, parse_cgroup, pids_in_pod, read_cgroup, strip_runtime

UID = "7c1f5c5a-3b9e-4f8e-9d6c-2a1b0c9d8e7f"
SYSTEMD_UID = UID.replace("-", "_")  # the systemd driver cannot have "-" inside a slice name
CID = "4c7f0e6b2d1a9f8e7d6c5b4a39281706f5e4d3c2b1a09f8e7d6c5b4a3928170a"
STATIC_UID = "6b3ba8e1b06d2dbb0d7a3d3e1f1f1f1f"  # a static pod's UID: the hash of its manifest

V1_CONTROLLERS = ["hugetlb", "memory", "cpu,cpuacct", "devices", "pids", "blkio", "freezer", "net_cls,net_prio",
                  "perf_event", "cpuset", "rdma"]


def v1(path: str, hybrid: bool = True) -> str:
    """A cgroup v1 document: one line per controller (and the empty v2 line of a hybrid host)."""
    lines = [f"{i}:{c}:{path}" for i, c in zip(range(12, 0, -1), V1_CONTROLLERS)] + [f"1:name=systemd:{path}"]
    return "\n".join(lines + (["0::/"] if hybrid else [])) + "\n"


def v2(path: str) -> str:
    return f"0::{path}\n"


CASES = {
    # --- Kubernetes, cgroup v1 ---
    "v1 cgroupfs docker (dockershim)": (v1(f"/kubepods/burstable/pod{UID}/{CID}", hybrid=False),
                                        CgroupIdentity(UID, CID)),
    "v1 cgroupfs containerd guaranteed": (v1(f"/kubepods/pod{UID}/{CID}"), CgroupIdentity(UID, CID)),
    "v1 systemd containerd": (v1("/kubepods.slice/kubepods-burstable.slice/"
                                 f"kubepods-burstable-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope"),
                              CgroupIdentity(UID, CID, "containerd")),
    "v1 systemd docker": (v1("/kubepods.slice/kubepods-besteffort.slice/"
                             f"kubepods-besteffort-pod{SYSTEMD_UID}.slice/docker-{CID}.scope", hybrid=False),
                          CgroupIdentity(UID, CID, "docker")),
    "v1 systemd cri-o": (v1(f"/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/crio-{CID}.scope"),
                         CgroupIdentity(UID, CID, "cri-o")),
    # --- Kubernetes, cgroup v2 ---
    "v2 systemd containerd": (v2("/kubepods.slice/kubepods-burstable.slice/"
                                 f"kubepods-burstable-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope"),
                              CgroupIdentity(UID, CID, "containerd")),
    "v2 systemd cri-o": (v2("/kubepods.slice/kubepods-besteffort.slice/"
                            f"kubepods-besteffort-pod{SYSTEMD_UID}.slice/crio-{CID}.scope"),
                         CgroupIdentity(UID, CID, "cri-o")),
    "v2 systemd guaranteed": (v2(f"/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope"),
                              CgroupIdentity(UID, CID, "containerd")),
    "v2 cgroupfs containerd": (v2(f"/kubepods/burstable/pod{UID}/{CID}"), CgroupIdentity(UID, CID)),
    "v2 cgroupfs besteffort": (v2(f"/kubepods/besteffort/pod{UID}/{CID}"), CgroupIdentity(UID, CID)),
    # read from a process in another cgroup namespace (the exporter's own container)
    "v2 from another cgroup namespace": (v2(f"/../../kubepods-besteffort-pod{SYSTEMD_UID}.slice/"
                                            f"cri-containerd-{CID}.scope"), CgroupIdentity(UID, CID, "containerd")),
    # kind and other kubelets nested under a slice of their own
    "v2 nested kubelet (kind)": (v2("/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
                                    f"kubelet-kubepods-besteffort-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope"),
                                 CgroupIdentity(UID, CID, "containerd")),
    "v2 static pod": (v2("/kubepods.slice/kubepods-burstable.slice/"
                         f"kubepods-burstable-pod{STATIC_UID}.slice/cri-containerd-{CID}.scope"),
                      CgroupIdentity(STATIC_UID, CID, "containerd")),
    # CRI-O's conmon monitors a container from the pod's cgroup, in no container itself
    "v2 cri-o conmon": (v2(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/"
                           f"crio-conmon-{CID}.scope"), CgroupIdentity(UID, None)),
    # --- containers outside Kubernetes: a container id, no pod ---
    "v1 docker cgroupfs": (v1(f"/docker/{CID}", hybrid=False), CgroupIdentity(None, CID, "docker")),
    "v2 docker systemd": (v2(f"/system.slice/docker-{CID}.scope"), CgroupIdentity(None, CID, "docker")),
    # --- no container ---
    "v2 login session": (v2("/user.slice/user-1000.slice/session-3.scope"), None),
    "v2 systemd service": (v2("/system.slice/nvidia-persistenced.service"), None),
    "v1 host root": (v1("/"), None),
    "v2 root": (v2("/"), None),
    "empty": ("", None),
}


@pytest.mark.parametrize("name", CASES)
def test_parse_cgroup(name):
    text, expected = CASES[name]
    assert parse_cgroup(text) == expected


def test_v1_controllers_that_say_less_do_not_hide_the_container():
    # A controller the runtime does not delegate can sit at the pod level (or the root).
    text = (f"12:rdma:/\n11:memory:/kubepods/burstable/pod{UID}\n"
            f"10:pids:/kubepods/burstable/pod{UID}/{CID}\n0::/\n")
    assert parse_cgroup(text) == CgroupIdentity(UID, CID)


def test_ids_that_only_look_similar_are_not_taken():
    assert parse_cgroup(v2(f"/kubepods/burstable/pod{UID}x/{CID}")) == CgroupIdentity(None, CID)
    assert parse_cgroup(v2(f"/system.slice/docker-{CID[:-1]}.scope")) is None  # 63 hex digits
    assert parse_cgroup(v2("/process_api/cbd311313509da4ac42d40aa429e7c9c")) is None  # a 32-hex job id


def test_read_cgroup_from_a_proc_tree(tmp_path):
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text(CASES["v2 systemd containerd"][0])
    assert read_cgroup(4242, tmp_path) == CgroupIdentity(UID, CID, "containerd")
    assert read_cgroup(4343, tmp_path) is None  # exited


def test_read_cgroup_of_this_process_reads_the_real_file():
    expected = parse_cgroup(open(f"/proc/{os.getpid()}/cgroup").read())
    assert read_cgroup(os.getpid()) == expected


@pytest.mark.parametrize("status_id", [f"containerd://{CID}", f"cri-o://{CID}", f"docker://{CID}", CID])
def test_strip_runtime(status_id):
    assert strip_runtime(status_id) == CID


def test_pids_in_pod_finds_every_process_of_the_pod(tmp_path):
    other_uid = "0b1c2d3e-4f50-4617-8293-a4b5c6d7e8f9"
    tree = {"100": CASES["v2 systemd containerd"][0],  # the pod's engine
            "101": CASES["v2 systemd containerd"][0].replace(CID, "e" * 64),  # its second container
            "102": v2(f"/kubepods/burstable/pod{other_uid}/{CID}"),  # another pod
            "103": v2("/system.slice/nvidia-persistenced.service")}
    for pid, text in tree.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cgroup").write_text(text)
    (tmp_path / "self").mkdir()  # not a pid
    assert pids_in_pod(UID, tmp_path) == {100, 101}
    assert pids_in_pod(other_uid, tmp_path) == {102}
    assert pids_in_pod(UID, tmp_path / "missing") == frozenset()
