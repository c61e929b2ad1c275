"""Per-process metadata for grouping metric labels: name, executable, container, pod.

Container and pod identities come from the process's cgroup path, the only
place the kernel records them. Container runtimes and kubelet name cgroups in
a handful of shapes, depending on the cgroup driver:

systemd driver (unit names; ``-`` separates slice levels, so kubelet writes
the pod uid with ``_`` instead of ``-``)::

    /kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/cri-containerd-<id>.scope
    /kubepods.slice/kubepods-pod<uid_>.slice/crio-<id>.scope
    /system.slice/docker-<id>.scope
    /machine.slice/libpod-<id>.scope
    /user.slice/user-1000.slice/user@1000.service/user.slice/libpod-<id>.scope

cgroupfs driver (plain directories)::

    /kubepods/besteffort/pod<uid>/<id>
    /kubepods/pod<uid>/<id>
    /docker/<id>

``<id>`` is the runtime's 64-hex container id. A process may sit in a child
cgroup of its container's (systemd inside a container, podman's
``/container`` leaf, Docker-in-Docker), so the *innermost* container id on
the path wins. Runtime helper processes that sit beside a container
(``crio-conmon-<id>.scope``, ``libpod-conmon-<id>.scope``) are not inside it
and get no container id; their pod uid is still found.

Static (mirror) pods have a 32-hex uid (kubelet's hash of the manifest)
instead of a UUID; both are accepted.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

from tramprof.model import ProcessGone
from tramprof.procfs.identity import read_cgroup, read_comm, read_exe

__all__ = [
    "UNKNOWN",
    "ProcessMetadata",
    "container_id_from_cgroup",
    "pod_uid_from_cgroup",
    "read_metadata",
]


@dataclass(frozen=True, slots=True)
class ProcessMetadata:
    """What a process is grouped by; a piece that is unknown is ``""``."""

    comm: str  # the thread-group leader's name
    exe: str  # path of the main executable, without the kernel's " (deleted)"
    container_id: str  # full 64-hex container id
    pod_uid: str  # Kubernetes pod uid, with dashes


#: Metadata of a process nothing is known about.
UNKNOWN = ProcessMetadata("", "", "", "")

# One cgroup path component that names a container:
#   <64hex>                      cgroupfs driver (kubelet, docker, containerd)
#   <runtime>-<64hex>[.scope]    systemd driver (and podman's cgroupfs "libpod-<id>")
_RUNTIME_PREFIXES = ("cri-containerd", "crio", "docker", "libpod", "containerd", "nerdctl")
_CONTAINER_RE = re.compile(
    r"(?:(?:" + "|".join(re.escape(p) for p in _RUNTIME_PREFIXES) + r")-)?"
    r"([0-9a-fA-F]{64})(?:\.scope)?")

_HEX = "[0-9a-fA-F]"
_UUID = rf"{_HEX}{{8}}[-_]{_HEX}{{4}}[-_]{_HEX}{{4}}[-_]{_HEX}{{4}}[-_]{_HEX}{{12}}"
# pod<uid> (cgroupfs) or kubepods[-<qos>]-pod<uid_>.slice (systemd).
_POD_RE = re.compile(rf"(?:kubepods(?:-[a-z]+)*-)?pod({_UUID}|{_HEX}{{32}})(?:\.slice)?")

# Separators of everything the functions accept: path components, the
# "hierarchy:controllers:path" of /proc/PID/cgroup lines, and the
# "controllers:path;controllers:path" form of procfs.identity.read_cgroup.
_SPLIT_RE = re.compile(r"[/:;]")


def _paths(cgroup: str) -> list[str]:
    """The cgroup paths in ``cgroup``, the unified (v2) path first.

    Accepts a bare path, one ``/proc/PID/cgroup`` line, a whole file, or
    :func:`tramprof.procfs.identity.read_cgroup`'s output.
    """
    unified: list[str] = []
    others: list[str] = []
    for line in cgroup.splitlines():
        if line.startswith("0::"):
            unified.append(line[3:])
        elif line:
            others.append(line)
    return unified + others


def _innermost(cgroup: str, pattern: re.Pattern[str]) -> str:
    for path in _paths(cgroup):
        for component in reversed(_SPLIT_RE.split(path)):
            m = pattern.fullmatch(component)
            if m:
                return m.group(1).lower()
    return ""


def container_id_from_cgroup(cgroup: str) -> str:
    """The full 64-hex id of the innermost container on a cgroup path, or ``""``.

    ``cgroup`` is a path, a ``/proc/PID/cgroup`` line or file (cgroup v1, v2
    or hybrid; the v2 line is looked at first), or ``read_cgroup``'s output.
    """
    return _innermost(cgroup, _CONTAINER_RE)


def pod_uid_from_cgroup(cgroup: str) -> str:
    """The Kubernetes pod uid on a cgroup path (dashes, lower case), or ``""``.

    Accepts what :func:`container_id_from_cgroup` accepts. The systemd
    driver's ``_`` separators are turned back into ``-``.
    """
    return _innermost(cgroup, _POD_RE).replace("_", "-")


_DELETED = " (deleted)"


def _label_text(path: str) -> str:
    """A path as valid UTF-8 text (``os`` paths may carry surrogate escapes)."""
    return os.fsencode(path).decode("utf-8", "replace")


def read_metadata(pid: int, proc_root: str = "/proc", *, comm: str | None = None
                  ) -> ProcessMetadata:
    """Everything :class:`ProcessMetadata` holds for ``pid``, read from ``proc_root``.

    Never raises for a process that exits or cannot be read: what could not
    be read is ``""`` (kernel threads have no exe; a process that exited
    midway keeps what was read before). The exe loses the kernel's
    ``" (deleted)"`` suffix so an upgraded binary stays in its group.
    ``comm``: the name, when the caller has read it already (the comm field
    of ``/proc/PID/stat`` is the same).
    """
    if comm is None:
        try:
            comm = read_comm(pid, proc_root)
        except (ProcessGone, OSError):
            comm = ""
    try:
        exe = read_exe(pid, proc_root) or ""
    except (ProcessGone, OSError):
        exe = ""
    exe = _label_text(exe.removesuffix(_DELETED))
    try:
        cgroup = read_cgroup(pid, proc_root)
    except (ProcessGone, OSError):
        cgroup = ""
    labels = (_cgroup_labels(cgroup) if len(cgroup) <= _MAX_REMEMBERED_CGROUP
              else _cgroup_labels.__wrapped__(cgroup))
    return ProcessMetadata(comm, exe, *labels)


#: Longer cgroups (any process with a delegated subtree may name its own)
#: are matched every time, so the memo below stays under a MiB.
_MAX_REMEMBERED_CGROUP = 512


@functools.lru_cache(maxsize=1024)
def _cgroup_labels(cgroup: str) -> tuple[str, str]:
    """Container id and pod uid of a cgroup: a busy node starts most of its
    processes in a few cgroups, each of whose paths is matched once."""
    return container_id_from_cgroup(cgroup), pod_uid_from_cgroup(cgroup)
