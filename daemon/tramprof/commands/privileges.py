"""Give up the capabilities that only start-up needed (one job, over 400 lines:
every step of the drop is checked against what the kernel reports).

Start-up (compiling and loading the BPF program, creating its maps, opening
one perf event per CPU, subscribing to the process connector, reading
kallsyms) needs CAP_BPF, CAP_PERFMON, CAP_SYSLOG and, before Linux 6.6,
CAP_NET_ADMIN. Once those descriptors are open the kernel checks nothing
more on them: map lookups, updates and deletes on a map fd, reading the perf
ring buffers, receiving on the bound netlink socket and closing everything
on shutdown are all capability-free. Two older-kernel exceptions:

* before Linux 5.19, ``kernel.unprivileged_bpf_disabled`` != 0 made *every*
  bpf() command, map access through an existing fd included, require
  CAP_BPF (or CAP_SYS_ADMIN); 5.19 ("bpf: refine
  kernel.unprivileged_bpf_disabled behaviour") limited that to creating
  objects. ``runtime_capabilities()`` keeps CAP_BPF there.
* /proc/kallsyms shows real addresses only to a reader that had CAP_SYSLOG
  when it *opened* the file (or with perf_event_paranoid <= 1); the daemon
  reads it during start-up.

What the running daemon does need, every drain, is to look at other
processes (``runtime_capabilities()``):

CAP_SYS_PTRACE
    /proc/PID/maps, /proc/PID/mem (the vdso image), /proc/PID/root (the
    process's own view of its files and /tmp/perf-PID.map) and
    /proc/PID/map_files are guarded by ptrace_may_access(); for processes of
    other users, and for any process whose capabilities are not a subset of
    ours (every root service), only CAP_SYS_PTRACE passes it.
CAP_DAC_READ_SEARCH
    The ptrace check comes on top of plain file permissions: /proc/PID/mem
    is mode 0600 and /proc/PID/map_files mode 0500, both owned by the
    process's user, and a binary may sit below a 0700 home directory. The
    daemon only reads these files, so the read/search override is enough;
    CAP_DAC_OVERRIDE (write anywhere) is not kept. Its writes into a process
    (a runtime's duty cycle under a budget, an injection's request) go
    through process_vm_writev, which the ptrace check alone guards.
CAP_CHECKPOINT_RESTORE
    Following a /proc/PID/map_files/START-END link (how every mapped object
    is opened first; the only way to deleted binaries and memfd JIT code) needs
    ``checkpoint_restore_ns_capable(&init_user_ns)``: CAP_CHECKPOINT_RESTORE
    (Linux >= 5.9) or CAP_SYS_ADMIN. The narrow one is enough; CAP_SYS_ADMIN
    is never kept. Without either, objects are opened below /proc/PID/root
    (slower), and deleted binaries and memfds stay unnamed.

``drop_capabilities(keep, run_as)`` clears the ambient set, removes every
other capability from the bounding set (needs CAP_SETPCAP, which it then
drops too), switches a root process to the ``run_as`` uid/gid with no
supplementary groups (see below), locks the securebits so that an exec as
uid 0 cannot regain capabilities, sets PR_SET_NO_NEW_PRIVS, and finally sets
effective = permitted = ``keep`` and inheritable = nothing. Anything that
does not end exactly as asked raises PrivilegeError: the commands then exit
instead of carrying on with more privileges than intended (``drop_after_start``).

Leaving uid 0
    Capabilities alone leave a root process root: it owns every root file,
    and with CAP_SYS_PTRACE kept a code-execution bug is host root anyway.
    So a process running as uid 0 (bare root, Kubernetes) also switches to
    ``run_as`` (``nobody``, 65534, by default) while keeping exactly ``keep``:
    PR_SET_KEEPCAPS keeps the permitted set across setresuid(), the
    effective set (which the uid change clears) is set again, and
    PR_SET_KEEPCAPS is then cleared and locked. Nothing the running daemon
    does depends on the uid: /proc/PID/{maps,mem,root,map_files} are checked
    by ptrace_may_access() (CAP_SYS_PTRACE) and file modes
    (CAP_DAC_READ_SEARCH), map_files links by CAP_CHECKPOINT_RESTORE, and the
    BPF map, perf event and netlink descriptors opened at start-up are used
    without any check. The uid change also makes the process non-dumpable:
    processes of the new uid cannot read its /proc files nor ptrace it (their
    capabilities are not a superset of ours either). They can still send it
    signals, so a uid of its own is better than the shared ``nobody``.
    Changing the uid needs CAP_SETUID and CAP_SETGID; without them the uid
    stays 0, with a warning (``tramprof run`` does not even start:
    ``check_start_capabilities()``; ``run_as = ""`` stays root on purpose).
    A process that is not root (systemd's DynamicUser=) keeps its uid.

``check_start_capabilities()``, before anything is loaded, refuses to start
without any capability the daemon will use, naming each one, instead of
failing later with the kernel's "Operation not permitted" or running with
frames it cannot name.

Capabilities are per thread: call it from the main thread before any other
thread exists (it refuses otherwise), so that threads started later inherit
the reduced set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import threading
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# linux/capability.h
CAPABILITIES: dict[str, int] = {
    "CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3,
    "CAP_FSETID": 4, "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8,
    "CAP_LINUX_IMMUTABLE": 9, "CAP_NET_BIND_SERVICE": 10, "CAP_NET_BROADCAST": 11,
    "CAP_NET_ADMIN": 12, "CAP_NET_RAW": 13, "CAP_IPC_LOCK": 14, "CAP_IPC_OWNER": 15,
    "CAP_SYS_MODULE": 16, "CAP_SYS_RAWIO": 17, "CAP_SYS_CHROOT": 18, "CAP_SYS_PTRACE": 19,
    "CAP_SYS_PACCT": 20, "CAP_SYS_ADMIN": 21, "CAP_SYS_BOOT": 22, "CAP_SYS_NICE": 23,
    "CAP_SYS_RESOURCE": 24, "CAP_SYS_TIME": 25, "CAP_SYS_TTY_CONFIG": 26, "CAP_MKNOD": 27,
    "CAP_LEASE": 28, "CAP_AUDIT_WRITE": 29, "CAP_AUDIT_CONTROL": 30, "CAP_SETFCAP": 31,
    "CAP_MAC_OVERRIDE": 32, "CAP_MAC_ADMIN": 33, "CAP_SYSLOG": 34, "CAP_WAKE_ALARM": 35,
    "CAP_BLOCK_SUSPEND": 36, "CAP_AUDIT_READ": 37, "CAP_PERFMON": 38, "CAP_BPF": 39,
    "CAP_CHECKPOINT_RESTORE": 40,
}
_NAMES = {bit: name for name, bit in CAPABILITIES.items()}

# What the daemon needs after start-up on every kernel (see the module doc).
RUNTIME_CAPABILITIES = frozenset({"CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH",
                                  "CAP_CHECKPOINT_RESTORE"})

# A root process switches to this uid/gid after start-up (``run_as``).
NOBODY = 65534
DEFAULT_RUN_AS: tuple[int, int] = (NOBODY, NOBODY)

# linux/prctl.h, linux/securebits.h, linux/capability.h
_PR_SET_KEEPCAPS = 8
_PR_CAPBSET_READ = 23
_PR_CAPBSET_DROP = 24
_PR_GET_SECUREBITS = 27
_PR_SET_SECUREBITS = 28
_PR_SET_NO_NEW_PRIVS = 38
_PR_GET_NO_NEW_PRIVS = 39
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_SECBIT_NOROOT = 1 << 0
_SECBIT_NOROOT_LOCKED = 1 << 1
_SECBIT_NO_SETUID_FIXUP = 1 << 2
_SECBIT_NO_SETUID_FIXUP_LOCKED = 1 << 3
_SECBIT_KEEP_CAPS = 1 << 4
_SECBIT_KEEP_CAPS_LOCKED = 1 << 5
_SECBIT_NO_CAP_AMBIENT_RAISE = 1 << 6
_SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED = 1 << 7
# No capabilities from exec'ing as root or from file capabilities; no
# ambient raising. NO_SETUID_FIXUP and KEEP_CAPS are locked off: a later
# setuid away from 0 would clear capabilities, not keep them (the uid switch
# here uses KEEP_CAPS before these are locked).
_LOCKED_SECUREBITS = (_SECBIT_NOROOT | _SECBIT_NOROOT_LOCKED
                      | _SECBIT_NO_SETUID_FIXUP_LOCKED | _SECBIT_KEEP_CAPS_LOCKED
                      | _SECBIT_NO_CAP_AMBIENT_RAISE | _SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED)
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_EINVAL = 22


class PrivilegeError(OSError):
    """Privileges could not be reduced as asked; the message says why."""


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                              ctypes.c_ulong]
        lib.prctl.restype = ctypes.c_int
        lib.capget.argtypes = [ctypes.POINTER(_CapHeader), ctypes.POINTER(_CapData)]
        lib.capget.restype = ctypes.c_int
        lib.capset.argtypes = [ctypes.POINTER(_CapHeader), ctypes.POINTER(_CapData)]
        lib.capset.restype = ctypes.c_int
        _libc = lib
    return _libc


# -- kernel calls ------------------------------------------------------------------
# Every call that reads or changes this process's credentials goes through one
# of these functions (and current_capabilities, _other_threads): the unit
# tests replace exactly these with a fake kernel.


def _prctl(option: int, arg2: int = 0, arg3: int = 0) -> int:
    result = int(_lib().prctl(option, arg2, arg3, 0, 0))
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return result


def _capget() -> tuple[int, int, int]:
    """This thread's (effective, permitted, inheritable) masks."""
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if _lib().capget(ctypes.byref(header), data) != 0:
        errno = ctypes.get_errno()
        raise PrivilegeError(errno, f"capget: {os.strerror(errno)}")
    return (data[0].effective | data[1].effective << 32,
            data[0].permitted | data[1].permitted << 32,
            data[0].inheritable | data[1].inheritable << 32)


def _capset(effective: int, permitted: int, inheritable: int) -> None:
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    for i in range(2):
        data[i].effective = effective >> (32 * i) & 0xFFFFFFFF
        data[i].permitted = permitted >> (32 * i) & 0xFFFFFFFF
        data[i].inheritable = inheritable >> (32 * i) & 0xFFFFFFFF
    if _lib().capset(ctypes.byref(header), data) != 0:
        errno = ctypes.get_errno()
        raise PrivilegeError(errno, f"capset: {os.strerror(errno)}")


def _get_ids() -> tuple[tuple[int, int, int], tuple[int, int, int], list[int]]:
    """(real, effective, saved) uids, the same gids, supplementary groups."""
    return os.getresuid(), os.getresgid(), os.getgroups()


def _set_ids(uid: int, gid: int) -> None:
    """No supplementary groups, then every gid, then every uid (the order
    matters: changing the uid first would give up the right to the rest)."""
    step = "setgroups([])"
    try:
        os.setgroups([])
        step = f"setresgid({gid})"
        os.setresgid(gid, gid, gid)
        step = f"setresuid({uid})"
        os.setresuid(uid, uid, uid)
    except OSError as exc:
        raise PrivilegeError(exc.errno, f"{step}: {exc.strerror}") from exc


def current_capabilities() -> dict[str, int]:
    """This thread's CapInh/CapPrm/CapEff/CapBnd/CapAmb masks and NoNewPrivs."""
    with open("/proc/thread-self/status") as f:
        return parse_status(f.read())


def _other_threads() -> list[str]:
    """Names of the other threads of this process (they would keep their caps)."""
    me = threading.get_native_id()
    names = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    for tid in tids:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f"{tid} ({f.read().strip()})")
        except OSError:
            continue  # exited meanwhile
    return names


# -- reading ---------------------------------------------------------------------


def cap_last_cap() -> int:
    """The highest capability number this kernel knows."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except (OSError, ValueError):
        return max(CAPABILITIES.values())


def cap_names(mask: int) -> list[str]:
    """Capability names in a bit mask, in bit order (unknown bits as ``cap_N``)."""
    return [_NAMES.get(bit, f"cap_{bit}") for bit in range(64) if mask >> bit & 1]


def cap_mask(names: Iterable[str]) -> int:
    mask = 0
    for name in names:
        mask |= 1 << CAPABILITIES[name]
    return mask


def parse_status(text: str) -> dict[str, int]:
    """The ``Cap*:`` masks and ``NoNewPrivs`` of a /proc/PID/status text."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.startswith("Cap") and value.strip():
            out[key] = int(value.strip(), 16)
        elif key == "NoNewPrivs":
            out[key] = int(value.strip())
    return out


def _normalize(names: Iterable[str]) -> set[str]:
    out = set()
    for name in names:
        full = name.upper() if name.upper().startswith("CAP_") else "CAP_" + name.upper()
        if full not in CAPABILITIES:
            raise ValueError(f"unknown capability {name!r}")
        out.add(full)
    return out


def _kernel_version() -> tuple[int, int]:
    try:
        major, minor = platform.release().split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return (0, 0)


def runtime_capabilities(kernel: tuple[int, int] | None = None,
                         unprivileged_bpf_disabled: int | None = None) -> set[str]:
    """What the daemon must keep after start-up on this kernel."""
    keep = set(RUNTIME_CAPABILITIES)
    kernel = kernel or _kernel_version()
    if unprivileged_bpf_disabled is None:
        try:
            with open("/proc/sys/kernel/unprivileged_bpf_disabled") as f:
                unprivileged_bpf_disabled = int(f.read())
        except (OSError, ValueError):
            unprivileged_bpf_disabled = 1
    if kernel < (5, 19) and unprivileged_bpf_disabled != 0:
        keep.add("CAP_BPF")  # map reads through our own fds are checked too
    return keep


# -- dropping --------------------------------------------------------------------


@dataclass(frozen=True)
class Dropped:
    """What a drop did: capabilities kept and given up, the uid/gid before
    and after, and why the uid stayed 0 if it did."""

    kept: tuple[str, ...]
    dropped: tuple[str, ...]
    uid_before: int
    gid_before: int
    uid: int
    gid: int
    uid_note: str = ""
    bounding_reduced: bool = True

    @property
    def stayed_root(self) -> bool:
        return self.uid == 0

    def identity(self) -> str:
        if (self.uid, self.gid) == (self.uid_before, self.gid_before):
            text = f"uid {self.uid}, gid {self.gid} (unchanged)"
            return text + (f": {self.uid_note}" if self.uid_note else "")
        return (f"uid {self.uid_before} -> {self.uid}, gid {self.gid_before} -> {self.gid}, "
                "no supplementary groups")

    def describe(self) -> str:
        return (f"capabilities kept: {', '.join(self.kept) or 'none'}; dropped: "
                f"{', '.join(self.dropped) or 'none'}; {self.identity()}; bounding set "
                f"{'reduced' if self.bounding_reduced else 'unchanged'}; no_new_privs")


def _has_root_id(uids: Iterable[int]) -> bool:
    return 0 in tuple(uids)


def drop_capabilities(keep: Iterable[str], run_as: tuple[int, int] | None = None
                      ) -> list[str]:
    """Reduce this process to ``keep`` (names like ``CAP_SYS_PTRACE``).

    Effective and permitted become ``keep`` ∩ what we have; inheritable and
    ambient become empty; the bounding set shrinks to ``keep`` where we may
    change it (CAP_SETPCAP); a root process switches to the ``run_as``
    (uid, gid) if given (and possible: CAP_SETUID and CAP_SETGID);
    securebits are locked so that exec cannot regain anything; NO_NEW_PRIVS
    is set. Returns the names kept (sorted by bit) and logs what was kept and
    dropped. Raises PrivilegeError when the result differs from what was
    asked, ValueError for an unknown name.
    """
    return list(drop_privileges(keep, run_as).kept)


def drop_privileges(keep: Iterable[str], run_as: tuple[int, int] | None = None) -> Dropped:
    """``drop_capabilities``, returning the whole outcome."""
    wanted = _normalize(keep)
    others = _other_threads()
    if others:
        raise PrivilegeError(
            "capabilities are per thread: drop them before starting threads "
            f"(other threads: {', '.join(others)})")
    effective, permitted, _ = _capget()
    have = set(cap_names(permitted))
    kept = {name for name in wanted if name in have}
    missing = wanted - kept
    if missing:
        log.warning("cannot keep capabilities we do not have: %s", ", ".join(sorted(missing)))
    keep_mask = cap_mask(kept)
    setpcap = 1 << CAPABILITIES["CAP_SETPCAP"]
    setids = 1 << CAPABILITIES["CAP_SETUID"] | 1 << CAPABILITIES["CAP_SETGID"]
    uids, gids, _groups = _get_ids()
    target: tuple[int, int] | None = None
    uid_note = ""
    if run_as is not None and run_as[0] != 0 and _has_root_id(uids):
        if permitted & setids == setids:
            target = run_as
        else:
            uid_note = "no CAP_SETUID and CAP_SETGID to leave uid 0"
            log.warning("staying uid 0: no CAP_SETUID and CAP_SETGID to switch to uid %d "
                        "(grant both for start-up; they are dropped with the rest)",
                        run_as[0])

    # 1. Ambient capabilities would survive exec; clear them (Linux >= 4.3).
    try:
        _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError as exc:
        if exc.errno != _EINVAL:  # kernel without ambient capabilities
            raise PrivilegeError(exc.errno, f"clearing ambient capabilities: "
                                 f"{exc.strerror}") from exc

    # 2. Bounding set and securebits need CAP_SETPCAP in the effective set,
    #    the uid switch CAP_SETUID and CAP_SETGID.
    raise_now = permitted & (setpcap | (setids if target else 0)) & ~effective
    if raise_now:
        _capset(effective | raise_now, permitted, 0)
        effective |= raise_now
    can_setpcap = bool(effective & setpcap)
    undroppable = []
    for bit in range(cap_last_cap() + 1):
        if keep_mask >> bit & 1:
            continue
        try:
            if not _prctl(_PR_CAPBSET_READ, bit):
                continue
        except OSError:
            continue  # not a capability this kernel knows
        if not can_setpcap:
            undroppable.append(_NAMES.get(bit, f"cap_{bit}"))
            continue
        try:
            _prctl(_PR_CAPBSET_DROP, bit)
        except OSError as exc:
            raise PrivilegeError(exc.errno, f"dropping {_NAMES.get(bit, bit)} from the "
                                 f"bounding set: {exc.strerror}") from exc
    if undroppable:
        # Harmless with NO_NEW_PRIVS (exec cannot gain beyond permitted), so
        # not an error; the unit's CapabilityBoundingSet= normally did it.
        log.info("bounding set keeps %s (no CAP_SETPCAP to drop them)", ", ".join(undroppable))

    # 3. Leave uid 0, keeping the permitted set (the effective set is
    #    cleared by the kernel when the effective uid leaves 0).
    if target is not None:
        try:
            _prctl(_PR_SET_KEEPCAPS, 1)
        except OSError as exc:
            raise PrivilegeError(exc.errno, f"PR_SET_KEEPCAPS: {exc.strerror}") from exc
        _set_ids(*target)
        effective, permitted, _ = _capget()
        if permitted & keep_mask != keep_mask:
            raise PrivilegeError(f"the uid change took capabilities that must be kept: "
                                 f"CapPrm={permitted:016x} wanted {keep_mask:016x}")
        _capset(permitted, permitted, 0)
        effective = permitted
        try:
            _prctl(_PR_SET_KEEPCAPS, 0)
        except OSError as exc:
            raise PrivilegeError(exc.errno, f"PR_SET_KEEPCAPS: {exc.strerror}") from exc

    if can_setpcap:
        try:
            bits = _prctl(_PR_GET_SECUREBITS)
            if bits & _LOCKED_SECUREBITS != _LOCKED_SECUREBITS:
                _prctl(_PR_SET_SECUREBITS, bits & ~_SECBIT_KEEP_CAPS | _LOCKED_SECUREBITS)
        except OSError as exc:
            log.info("securebits not locked: %s", exc.strerror)

    # 4. No privilege from exec'ing setuid/file-capability programs, ever.
    try:
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    except OSError as exc:
        raise PrivilegeError(exc.errno, f"PR_SET_NO_NEW_PRIVS: {exc.strerror}") from exc

    # 5. The capability sets themselves (drops CAP_SETPCAP, CAP_SETUID, ...
    #    unless kept).
    _capset(keep_mask, keep_mask, 0)

    # 6. Check the result as the kernel reports it.
    status = current_capabilities()
    if status.get("CapEff") != keep_mask or status.get("CapPrm") != keep_mask \
            or status.get("CapInh", 0) != 0 or status.get("CapAmb", 0) != 0 \
            or status.get("NoNewPrivs") != 1:
        raise PrivilegeError(
            f"capabilities not as requested: CapEff={status.get('CapEff', 0):016x} "
            f"CapPrm={status.get('CapPrm', 0):016x} CapAmb={status.get('CapAmb', 0):016x} "
            f"NoNewPrivs={status.get('NoNewPrivs')} wanted {keep_mask:016x}")
    new_uids, new_gids, new_groups = _get_ids()
    if target is not None:
        uid, gid = target
        if set(new_uids) != {uid} or set(new_gids) != {gid} or new_groups:
            raise PrivilegeError(f"identity not as requested: uids {new_uids}, gids "
                                 f"{new_gids}, groups {new_groups}, wanted {uid}:{gid}")
    elif new_uids != uids or new_gids != gids:
        raise PrivilegeError(f"identity changed unexpectedly: uids {uids} -> {new_uids}")
    outcome = Dropped(kept=tuple(cap_names(keep_mask)),
                      dropped=tuple(cap_names(permitted & ~keep_mask)),
                      uid_before=uids[1], gid_before=gids[1], uid=new_uids[1],
                      gid=new_gids[1], uid_note=uid_note, bounding_reduced=can_setpcap)
    log.info("%s", outcome.describe())
    return outcome


# What `tramprof run` uses each capability for: the start-up check names the
# missing ones with this (deploy/README.md has the long version).
PURPOSES: dict[str, str] = {
    "CAP_BPF": "create the BPF maps and load the program",
    "CAP_PERFMON": "attach it to a sampling perf event on every CPU",
    "CAP_SYSLOG": "read kernel symbol addresses in /proc/kallsyms (kernel frame names)",
    "CAP_SYS_PTRACE": "read other processes' /proc/PID/maps, mem, root and map_files",
    "CAP_DAC_READ_SEARCH": "open those 0600/0500 /proc files and binaries below 0700 "
                           "directories",
    "CAP_CHECKPOINT_RESTORE": "follow /proc/PID/map_files links (deleted binaries, memfd "
                              "JIT code)",
    "CAP_SETUID": "leave uid 0 for run_as once the program is attached",
    "CAP_SETGID": "leave gid 0 for run_as once the program is attached",
}


def _read_sysctl(name: str, default: int) -> int:
    try:
        with open(f"/proc/sys/kernel/{name}") as f:
            return int(f.read())
    except (OSError, ValueError):
        return default


def kallsyms_needs_syslog(kptr_restrict: int, perf_event_paranoid: int) -> bool:
    """Whether /proc/kallsyms shows real addresses only to CAP_SYSLOG holders
    (kallsyms_show_value()): with kptr_restrict 0 and perf_event_paranoid <= 1
    everyone sees them, with kptr_restrict >= 2 no one does."""
    return kptr_restrict == 1 or (kptr_restrict == 0 and perf_event_paranoid > 1)


def missing_capabilities(run_as: tuple[int, int] | None = DEFAULT_RUN_AS,
                         kernel: tuple[int, int] | None = None,
                         kptr_restrict: int | None = None,
                         perf_event_paranoid: int | None = None) -> dict[str, str]:
    """The capabilities ``tramprof run`` needs and this process lacks, each
    with what it is for; empty when nothing is missing.

    Start-up ones must be effective (CAP_SYS_ADMIN stands in for CAP_BPF and
    CAP_PERFMON, as in the kernel); CAP_SYSLOG only where kallsyms hides
    addresses without it. The ones kept after start-up and, for a root
    process that leaves uid 0 for ``run_as``, CAP_SETUID and CAP_SETGID must
    be permitted (drop_privileges takes them from there). Capabilities this
    kernel does not know are not asked for.
    """
    effective, permitted, _ = _capget()
    have = set(cap_names(effective))
    may = set(cap_names(permitted))
    wanted: list[tuple[str, bool]] = []
    if "CAP_SYS_ADMIN" not in have:
        wanted += [("CAP_BPF", "CAP_BPF" in have), ("CAP_PERFMON", "CAP_PERFMON" in have)]
    if kallsyms_needs_syslog(
            _read_sysctl("kptr_restrict", 1) if kptr_restrict is None else kptr_restrict,
            _read_sysctl("perf_event_paranoid", 2) if perf_event_paranoid is None
            else perf_event_paranoid):
        wanted.append(("CAP_SYSLOG", "CAP_SYSLOG" in have))
    wanted += [(name, name in may) for name in runtime_capabilities(kernel)]
    uids, _, _ = _get_ids()
    if run_as is not None and run_as[0] != 0 and _has_root_id(uids):
        wanted += [(name, name in may) for name in ("CAP_SETUID", "CAP_SETGID")]
    last = cap_last_cap()
    missing = sorted({name for name, held in wanted
                      if not held and CAPABILITIES[name] <= last}, key=CAPABILITIES.__getitem__)
    return {name: PURPOSES[name] for name in missing}


def check_start_capabilities(run_as: tuple[int, int] | None = DEFAULT_RUN_AS) -> None:
    """Refuse to start without every capability ``missing_capabilities()``
    asks for, instead of failing later with an error of the kernel's or
    running with unnamed frames. Raises PrivilegeError naming each one."""
    missing = missing_capabilities(run_as)
    if missing:
        raise PrivilegeError(
            f"missing capabilities: {', '.join(missing)}; grant them (Kubernetes: "
            "securityContext.capabilities.add, systemd: AmbientCapabilities=) or run as "
            "root (deploy/README.md, Capabilities)\n"
            + "\n".join(f"  {name}: {why}" for name, why in missing.items()))


def nothing_to_drop() -> bool:
    """Not root and no capability: there is nothing to give up (and the
    runtime capabilities cannot be kept either)."""
    uids, _, _ = _get_ids()
    return not _has_root_id(uids) and not current_capabilities().get("CapPrm")


def drop_after_start(run_as: tuple[int, int] | None = DEFAULT_RUN_AS,
                     keep: Iterable[str] | None = None) -> Dropped | None:
    """What every command calls once its BPF program is loaded and attached:
    keep only the runtime capabilities (``runtime_capabilities()`` unless
    ``keep`` says otherwise) and leave uid 0 for ``run_as``.

    Fails closed: any failure, wherever it happens in the sequence, raises
    PrivilegeError naming the step; the caller must stop instead of carrying
    on with more privileges than intended. Returns None when the process
    had nothing to drop (not root, no capabilities).
    """
    try:
        if nothing_to_drop():
            log.info("no capabilities to drop (not root, none held)")
            return None
        return drop_privileges(runtime_capabilities() if keep is None else keep, run_as)
    except Exception as exc:
        raise PrivilegeError(f"cannot drop privileges after start-up: {exc}") from exc
