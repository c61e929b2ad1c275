"""tramprof.procfs.metadata: container ids and pod uids from real-world cgroup paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tramprof.procfs.metadata import (
    UNKNOWN,
    ProcessMetadata,
    container_id_from_cgroup,
    pod_uid_from_cgroup,
    read_metadata,
)

CID = "3f2a9c1b8e7d6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a"
CID2 = "a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90"
UID = "1234abcd-56ef-78ab-90cd-ef1234567890"
UID_ = UID.replace("-", "_")
STATIC_UID = "4e5d5e2c2f9b5b6c3a3e7f1d9b7a2c11"  # mirror pods: hash of the manifest

# (cgroup text, container id, pod uid)
CASES = [
    # --- Kubernetes, cgroup v2, systemd driver -------------------------------
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
     f"cri-containerd-{CID}.scope", CID, UID),
    (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
     f"cri-containerd-{CID}.scope", CID, UID),
    (f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope", CID, UID),
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
     f"crio-{CID}.scope", CID, UID),
    # CRI-O's conmon sits beside the container, in the pod: pod uid, no container.
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
     f"crio-conmon-{CID}.scope", "", UID),
    # dockershim / cri-dockerd
    (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
     f"docker-{CID}.scope", CID, UID),
    # pause container and pod-level slice only
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice", "", UID),
    # a process in a child cgroup of its container (systemd inside the container)
    (f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope/"
     "init.scope", CID, UID),
    # static pod
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{STATIC_UID}.slice/"
     f"cri-containerd-{CID}.scope", CID, STATIC_UID),
    # --- Kubernetes, cgroupfs driver (v1 and v2) ------------------------------
    (f"0::/kubepods/besteffort/pod{UID}/{CID}", CID, UID),
    (f"0::/kubepods/burstable/pod{UID}/{CID}", CID, UID),
    (f"0::/kubepods/pod{UID}/{CID}", CID, UID),
    (f"/kubepods/burstable/pod{STATIC_UID}/{CID}", CID, STATIC_UID),
    (f"0::/kubepods/burstable/pod{UID}/crio-{CID}", CID, UID),
    (f"0::/kubepods/burstable/pod{UID}/crio-conmon-{CID}", "", UID),
    # k3s / kind nest kubepods below their own cgroup
    (f"0::/k3s/kubepods/besteffort/pod{UID}/{CID}", CID, UID),
    # --- Docker ----------------------------------------------------------------
    (f"0::/system.slice/docker-{CID}.scope", CID, ""),
    (f"0::/docker/{CID}", CID, ""),
    (f"/docker/{CID}", CID, ""),
    # Docker-in-Docker: the innermost container is the process's own.
    (f"0::/docker/{CID}/docker/{CID2}", CID2, ""),
    # the daemon itself is not in a container
    ("0::/system.slice/docker.service", "", ""),
    ("0::/system.slice/containerd.service", "", ""),
    # --- podman ---------------------------------------------------------------
    (f"0::/machine.slice/libpod-{CID}.scope", CID, ""),
    (f"0::/machine.slice/libpod-{CID}.scope/container", CID, ""),
    (f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{CID}.scope", CID, ""),
    (f"0::/machine.slice/libpod-conmon-{CID}.scope", "", ""),
    (f"0::/libpod_parent/libpod-{CID}", CID, ""),
    # --- nerdctl / plain containerd ---------------------------------------------
    (f"0::/system.slice/nerdctl-{CID}.scope", CID, ""),
    (f"0::/default/{CID}", CID, ""),
    # --- not containers -----------------------------------------------------------
    ("0::/", "", ""),
    ("0::/init.scope", "", ""),
    ("0::/user.slice/user-1000.slice/session-3.scope", "", ""),
    ("0::/system.slice/ssh.service", "", ""),
    ("", "", ""),
    # 63 and 65 hex digits are not container ids; a uid with a digit missing is no uid
    (f"0::/docker/{CID[:-1]}", "", ""),
    (f"0::/docker/{CID}0", "", ""),
    (f"0::/kubepods/pod{UID[:-1]}/x", "", ""),
    # upper-case hex is accepted and normalised
    (f"0::/docker/{CID.upper()}", CID, ""),
]


@pytest.mark.parametrize(("cgroup", "container", "pod"), CASES)
def test_cgroup_paths(cgroup: str, container: str, pod: str) -> None:
    assert container_id_from_cgroup(cgroup) == container
    assert pod_uid_from_cgroup(cgroup) == pod
    # The same path without the "0::" prefix, as procinfo.read_cgroup returns it.
    bare = cgroup.removeprefix("0::")
    assert container_id_from_cgroup(bare) == container
    assert pod_uid_from_cgroup(bare) == pod


V1_FILE = f"""\
12:hugetlb:/kubepods/burstable/pod{UID}/{CID}
11:memory:/kubepods/burstable/pod{UID}/{CID}
10:cpu,cpuacct:/kubepods/burstable/pod{UID}/{CID}
9:pids:/kubepods/burstable/pod{UID}/{CID}
1:name=systemd:/kubepods/burstable/pod{UID}/{CID}
"""

V1_SYSTEMD_FILE = f"""\
11:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/docker-{CID}.scope
10:cpu,cpuacct:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/docker-{CID}.scope
1:name=systemd:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/docker-{CID}.scope
"""

# Hybrid: the unified hierarchy only holds systemd's view ("/"), the ids live in v1.
HYBRID_FILE = f"""\
12:memory:/docker/{CID}
11:cpu,cpuacct:/docker/{CID}
1:name=systemd:/docker/{CID}
0::/
"""


@pytest.mark.parametrize(("text", "container", "pod"), [
    (V1_FILE, CID, UID),
    (V1_SYSTEMD_FILE, CID, UID),
    (HYBRID_FILE, CID, ""),
    (V1_FILE.splitlines()[1], CID, UID),  # one v1 line
    (f"0::/docker/{CID2}\n12:memory:/docker/{CID}\n", CID2, ""),  # v2 line wins
    # procinfo.read_cgroup's form when v1 hierarchies disagree
    (f"memory:/docker/{CID};name=systemd:/system.slice/docker.service", CID, ""),
])
def test_cgroup_files(text: str, container: str, pod: str) -> None:
    assert container_id_from_cgroup(text) == container
    assert pod_uid_from_cgroup(text) == pod


def make_proc(root: Path, pid: int, *, comm: str | None = "app", exe: str | None = None,
              cgroup: str | None = None) -> Path:
    d = root / str(pid)
    d.mkdir(parents=True)
    if comm is not None:
        (d / "comm").write_text(comm + "\n")
    if exe is not None:
        os.symlink(exe, d / "exe")
    if cgroup is not None:
        (d / "cgroup").write_text(cgroup)
    return d


def test_read_metadata_everything(tmp_path: Path) -> None:
    make_proc(tmp_path, 10, comm="nginx", exe="/usr/sbin/nginx",
              cgroup=f"0::/kubepods.slice/kubepods-besteffort.slice/"
                     f"kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n")
    assert read_metadata(10, str(tmp_path)) == ProcessMetadata("nginx", "/usr/sbin/nginx", CID,
                                                               UID)


def test_read_metadata_v1_host(tmp_path: Path) -> None:
    make_proc(tmp_path, 11, comm="java", exe="/opt/jdk/bin/java", cgroup=V1_FILE)
    assert read_metadata(11, str(tmp_path)) == ProcessMetadata("java", "/opt/jdk/bin/java",
                                                               CID, UID)


def test_read_metadata_deleted_exe_keeps_its_group(tmp_path: Path) -> None:
    make_proc(tmp_path, 12, exe="/usr/bin/app (deleted)", cgroup="0::/\n")
    assert read_metadata(12, str(tmp_path)).exe == "/usr/bin/app"


def test_read_metadata_undecodable_exe_is_valid_text(tmp_path: Path) -> None:
    make_proc(tmp_path, 13, exe=os.fsdecode(b"/opt/caf\xe9"), cgroup="0::/\n")
    assert read_metadata(13, str(tmp_path)).exe == "/opt/caf\ufffd"


def test_read_metadata_missing_pieces_are_empty(tmp_path: Path) -> None:
    # a kernel thread: reading its exe link fails with ENOENT, cgroup at the root
    make_proc(tmp_path, 2, comm="kthreadd", cgroup="0::/\n")
    assert read_metadata(2, str(tmp_path)) == ProcessMetadata("kthreadd", "", "", "")
    # cgroup file unreadable, comm missing
    make_proc(tmp_path, 3, comm=None, exe="/bin/sh")
    assert read_metadata(3, str(tmp_path)) == ProcessMetadata("", "/bin/sh", "", "")


def test_read_metadata_takes_the_name_the_caller_read(tmp_path: Path) -> None:
    """The comm of the stat that found the process alive, not a second read."""
    make_proc(tmp_path, 14, comm="from comm", exe="/bin/sh", cgroup="0::/\n")
    assert read_metadata(14, str(tmp_path), comm="from stat").comm == "from stat"


def test_read_metadata_of_a_gone_process(tmp_path: Path) -> None:
    assert read_metadata(999, str(tmp_path)) == UNKNOWN


def test_read_metadata_of_this_process() -> None:
    md = read_metadata(os.getpid())
    assert md.comm  # whatever pytest's thread group leader is called
    assert os.path.samefile(md.exe, "/proc/self/exe")
    with open("/proc/self/cgroup") as f:
        assert md.container_id == container_id_from_cgroup(f.read())
