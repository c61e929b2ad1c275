"""Process lifecycle events: fork, exec and exit (one job, over 400 lines: the
netlink decoder and the /proc polling fallback behind one protocol).

They come from the kernel's netlink process connector when we may subscribe
to it, else from diffing ``/proc``; both sources have one interface
(``ProcessEventSource``) and ``open_event_source`` picks one. The state they
keep right lives in ``procfs.table``.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import importlib.util
import logging
import os
import select
import socket
import struct
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, Protocol

from tramprof.model import ProcessGone
from tramprof.procfs.identity import ExecSignature, ProcStat, list_pids, read_stat

__all__ = [
    "ConnectorUnavailable",
    "EventKind",
    "ProcConnectorSource",
    "ProcPollingSource",
    "ProcessEvent",
    "ProcessEventSource",
    "decode_connector_datagram",
    "open_event_source",
]

_log = logging.getLogger(__name__)

EventKind = Literal["fork", "exec", "exit"]
_KINDS = frozenset(("fork", "exec", "exit"))


@dataclass(frozen=True, slots=True)
class ProcessEvent:
    """A process-level lifecycle event; thread creation and exit are not reported.

    ``pid`` is the thread-group id (what user space calls the pid). ``ppid``
    is set for forks only: the parent process (its tgid).
    """

    kind: EventKind
    pid: int
    ppid: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown process event kind {self.kind!r}")


class ProcessEventSource(Protocol):
    """What the daemon's main loop needs from an event source."""

    @property
    def overruns(self) -> int:
        """How many times events were lost (self-metric)."""
        ...

    def fileno(self) -> int | None:
        """An fd to wait on for readability, or None: call read_events() periodically."""
        ...

    def read_events(self) -> list[ProcessEvent]:
        """Events since the last call, oldest first; never blocks."""
        ...

    def poll(self) -> list[ProcessEvent]:
        """Same as read_events()."""
        ...

    def take_resync_request(self) -> bool:
        """True once after events were lost: the caller must resync from /proc."""
        ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------
# Netlink process connector
# --------------------------------------------------------------------------

# UAPI values (linux/cn_proc.h, linux/connector.h); pyroute2 names the same.
_PROC_EVENT_NONE = 0x0
_PROC_EVENT_FORK = 0x1
_PROC_EVENT_EXEC = 0x2
_PROC_EVENT_EXIT = 0x80000000
_CN_IDX_PROC = 0x1
_CN_VAL_PROC = 0x1
# Not exported by the socket module; 33 on x86, arm, arm64, riscv, s390, mips.
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)

# One connector message: nlmsghdr (len, type, flags, seq, pid), cn_msg (idx,
# val, seq, ack, len, flags), the proc_event head (what, cpu, timestamp_ns)
# and the first four u32 of the event union, which hold everything we need:
#   fork: parent_pid, parent_tgid, child_pid, child_tgid
#   exec/exit: process_pid, process_tgid, ...
#   none (ack): err, ...
# Decoding with struct costs ~0.1 us per message; pyroute2's generic decoder
# ~7 us, too much for a profiler on a host that forks thousands of times a
# second. The layout is kernel ABI; a unit test checks it against pyroute2's.
_MSG = struct.Struct("=IHHII IIIIHH IIQ IIII")
_NLMSG_ALIGNTO = 4


def _nlmsg_align(n: int) -> int:
    return (n + _NLMSG_ALIGNTO - 1) & ~(_NLMSG_ALIGNTO - 1)


def decode_connector_datagram(
    data: bytes | bytearray | memoryview,
    out: list[ProcessEvent],
    acks: dict[int, int] | None = None,
) -> None:
    """Append the process-level events in one datagram from the connector to ``out``.

    Thread events are dropped: a task is a thread when its pid differs from
    its tgid. (The parent tgid of a fork does not tell: for a new thread the
    kernel reports the *process's* parent, not the process itself.) The exit
    of a thread-group leader whose other threads keep running is reported as
    a process exit; dropping that process's state early only costs a rebuild.
    When ``acks`` is given, subscription acknowledgements are stored in it as
    ``cn_msg.ack -> error``.
    """
    view = memoryview(data)
    end = len(view)
    offset = 0
    while end - offset >= _MSG.size:
        (
            length,
            _nl_type,
            _nl_flags,
            _nl_seq,
            _nl_pid,
            idx,
            val,
            _cn_seq,
            cn_ack,
            _cn_len,
            _cn_flags,
            what,
            _cpu,
            _timestamp_ns,
            a,
            b,
            c,
            d,
        ) = _MSG.unpack_from(view, offset)
        if length < _MSG.size or length > end - offset:
            break  # truncated or not a connector message: nothing more to trust
        offset += _nlmsg_align(length)
        if idx != _CN_IDX_PROC or val != _CN_VAL_PROC:
            continue
        if what == _PROC_EVENT_FORK:
            # a, b = parent pid/tgid; c, d = child pid/tgid
            if c == d:
                out.append(ProcessEvent("fork", d, b))
        elif what == _PROC_EVENT_EXEC:
            # After de_thread() the exec'ing task is the leader: pid == tgid.
            out.append(ProcessEvent("exec", b))
        elif what == _PROC_EVENT_EXIT:
            if a == b:
                out.append(ProcessEvent("exit", b))
        elif what == _PROC_EVENT_NONE and acks is not None:
            acks[cn_ack] = a


class ConnectorUnavailable(Exception):
    """The process connector cannot be used here; the message says why."""


class ProcConnectorSource:
    """Process events from the kernel's netlink process connector (cn_proc).

    Needs the initial pid and user namespaces (the kernel reports pids as
    the initial namespace sees them and ignores subscription requests from
    other namespaces) and, before Linux 6.6, CAP_NET_ADMIN. Either failure
    raises ConnectorUnavailable.

    pyroute2's ``ProcEventSocket`` creates the NETLINK_CONNECTOR socket and
    binds it to the CN_IDX_PROC multicast group; the subscription requests
    are pyroute2 ``proc_event_control`` messages. Reading is done on our own
    duplicate of the socket, non-blocking: pyroute2 >= 0.9 would otherwise
    read through an asyncio loop that only runs inside its calls, and an
    ENOBUFS there poisons the pyroute2 socket for good.

    When the receive buffer overflowed (we were too slow and the kernel
    dropped events) ``overruns`` is incremented and ``take_resync_request()``
    returns True once: the caller must then reconcile its state with /proc.
    """

    def __init__(
        self,
        *,
        rcvbuf_bytes: int = 8 << 20,
        ack_timeout: float = 1.0,
        max_batch: int = 4096,
    ) -> None:
        self.overruns = 0
        self._max_batch = max_batch
        self._resync = False
        self._pending: list[ProcessEvent] = []
        self._buf = bytearray(8192)
        self._closed = False
        try:
            cn_proc = _pyroute2("netlink.connector.cn_proc")
        except ImportError as e:
            raise ConnectorUnavailable(
                f"the installed pyroute2 has no process connector support "
                f"(pyroute2.netlink.connector.cn_proc): {e}"
            ) from e
        self._cn_proc: Any = cn_proc
        try:
            self._nl: Any = cn_proc.ProcEventSocket()
        except OSError as e:
            raise ConnectorUnavailable(
                f"cannot create a NETLINK_CONNECTOR socket: {e.strerror or e}"
            ) from e
        self._sock: socket.socket | None = None
        try:
            self._setup(rcvbuf_bytes, ack_timeout)
        except BaseException:
            self.close()
            raise

    # -- setup ---------------------------------------------------------------

    def _setup(self, rcvbuf_bytes: int, ack_timeout: float) -> None:
        try:
            self._nl.bind()
        except PermissionError as e:
            raise ConnectorUnavailable(
                "joining the proc connector group needs CAP_NET_ADMIN before Linux 6.6"
            ) from e
        except OSError as e:
            raise ConnectorUnavailable(
                f"cannot bind to the proc connector group: {e.strerror or e}"
            ) from e
        except KeyError as e:
            # pyroute2 0.9 tries port ids one after another whatever bind()
            # says (EPERM included) and reports only that none was taken.
            raise ConnectorUnavailable(
                f"cannot bind to the proc connector group (pyroute2: {e}): refused "
                "for every netlink port id (no CAP_NET_ADMIN before Linux 6.6, or a "
                "container's namespaces)"
            ) from e
        try:
            self._sock = socket.socket(fileno=os.dup(self._nl.fileno()))
            self._sock.setblocking(False)
            self._set_rcvbuf(rcvbuf_bytes)
            self._subscribe(ack_timeout)
        except OSError as e:
            raise ConnectorUnavailable(f"subscribing failed: {e.strerror or e}") from e

    def _set_rcvbuf(self, size: int) -> None:
        """A big buffer rides out pauses (GC, a large symbol load) without loss."""
        assert self._sock is not None
        try:
            # Exceeds net.core.rmem_max; allowed with CAP_NET_ADMIN.
            self._sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, size)
        except OSError:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)

    def _send_control(self, listen: bool, ack: int, event_mask: int | None) -> None:
        assert self._sock is not None
        cn_proc = self._cn_proc
        done = _pyroute2("netlink").NLMSG_DONE

        op = cn_proc.PROC_CN_MCAST_LISTEN if listen else cn_proc.PROC_CN_MCAST_IGNORE
        msg: Any
        if event_mask is None:
            msg = cn_proc.proc_event_control()
            msg["action"] = op
            msg["len"] = 4
        else:
            msg = _filtered_control_class()()
            msg["mcast_op"] = op
            msg["event_type"] = event_mask
            msg["len"] = 8
        msg["header"]["type"] = done
        msg["header"]["flags"] = 0
        msg["idx"] = cn_proc.CN_IDX_PROC
        msg["val"] = cn_proc.CN_VAL_PROC
        msg["seq"] = 0
        msg["ack"] = ack
        msg["flags"] = 0
        msg.encode()
        self._sock.send(bytes(msg.data))

    def _subscribe(self, timeout: float) -> None:
        """Ask for events and wait for the kernel's acknowledgement.

        Without an acknowledgement there is no way to tell a working
        subscription from one the kernel silently ignored (other pid/user
        namespace, CONFIG_PROC_EVENTS off), so it is required.
        """
        assert self._sock is not None
        cookie = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        self._send_control(True, cookie, None)
        acks: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN)
        while cookie + 1 not in acks:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ConnectorUnavailable(
                    f"the kernel did not acknowledge the subscription within {timeout:g}s "
                    "(not in the initial pid/user namespace, or CONFIG_PROC_EVENTS is off)"
                )
            if poller.poll(remaining * 1000):
                # Events that arrive meanwhile are real: keep them.
                self._drain(self._pending, acks)
        err = acks[cookie + 1]
        if err:
            raise ConnectorUnavailable(
                f"the kernel refused the subscription: {os.strerror(err)} ({err})"
            )
        # Kernels >= 6.6 can filter by event type; older ones ignore this
        # 8-byte request and keep sending everything, which we filter here.
        # (The kernel's acknowledgement of it is filtered out, so don't wait.)
        self._send_control(True, 0, _PROC_EVENT_FORK | _PROC_EVENT_EXEC | _PROC_EVENT_EXIT)

    # -- reading -------------------------------------------------------------

    def _drain(self, out: list[ProcessEvent], acks: dict[int, int] | None) -> None:
        assert self._sock is not None
        sock, buf = self._sock, self._buf
        for _ in range(self._max_batch):
            try:
                n = sock.recv_into(buf, len(buf), socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    # Reported once per overflow; queued events follow.
                    self.overruns += 1
                    self._resync = True
                    continue
                raise
            decode_connector_datagram(memoryview(buf)[:n], out, acks)

    def fileno(self) -> int:
        """Readable when events are queued."""
        if self._sock is None:
            raise ValueError("process connector source is closed")
        return self._sock.fileno()

    def read_events(self) -> list[ProcessEvent]:
        """Queued process events, oldest first. Returns at most ``max_batch``
        datagrams' worth; the fd stays readable if more are queued."""
        if self._sock is None:
            raise ValueError("process connector source is closed")
        events, self._pending = self._pending, []
        self._drain(events, None)
        return events

    def poll(self) -> list[ProcessEvent]:
        """Same as read_events(), so both sources can be driven alike."""
        return self.read_events()

    def take_resync_request(self) -> bool:
        resync, self._resync = self._resync, False
        return resync

    def close(self) -> None:
        """Unsubscribe (so old kernels stop generating events) and close."""
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._send_control(False, 0, None)
            self._sock.close()
            self._sock = None
        with contextlib.suppress(Exception):
            self._nl.close()

    def __enter__(self) -> ProcConnectorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pyroute2(name: str) -> ModuleType:
    """``pyroute2.<name>``, imported without running ``pyroute2/__init__.py``
    when pyroute2 was not imported yet: that file imports the whole library
    (~370 modules, 9 MiB of the daemon's heap), the process connector needs
    ~60 of them (2.4 MiB). Importing ``pyroute2`` itself later in the same
    process then gives that package without its top-level names."""
    if "pyroute2" not in sys.modules:
        spec = importlib.util.find_spec("pyroute2")
        if spec is None:
            raise ImportError("pyroute2 is not installed")
        sys.modules["pyroute2"] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"pyroute2.{name}")


_filtered_control: Any = None


def _filtered_control_class() -> Any:
    """pyroute2 message for ``struct proc_input`` (mcast op + event filter).

    pyroute2 only models the 4-byte form of the request; built on first use
    so that importing this module does not import pyroute2.
    """
    global _filtered_control
    if _filtered_control is None:
        cn_msg: Any = _pyroute2("netlink.connector").cn_msg

        class proc_input_control(cn_msg):  # type: ignore[misc]
            fields = (*cn_msg.fields, ("mcast_op", "I"), ("event_type", "I"))

        _filtered_control = proc_input_control
    return _filtered_control


# --------------------------------------------------------------------------
# /proc polling fallback
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Seen:
    start_ticks: int
    comm: str
    signature: ExecSignature | None


def _exec_happened(old: _Seen, new: _Seen) -> bool:
    if old.signature is not None:
        # Addresses that vanish mean an exec too: mid-exec (the new image is
        # not mapped yet) or a setuid exec that we may no longer inspect.
        return new.signature != old.signature
    return old.comm != new.comm


class ProcPollingSource:
    """Process events by diffing ``/proc`` snapshots, for when the connector
    is unavailable (a container with its own pid or user namespace, or no
    CAP_NET_ADMIN on kernels before 6.6).

    Each call reads ``/proc/PID/stat`` of every process. Forks and exits are
    found by comparing (pid, start time) sets; a pid reused between two calls
    shows up as an exit followed by a fork. Processes that live and die
    between two calls are never seen, and the reported parent is the current
    one (an orphan has been reparented already).

    Exec detection is best-effort: exec replaces the code and stack
    addresses, which the kernel shows to readers allowed to ptrace the
    process, so an exec is a change of (start_code, end_code, start_stack).
    That misses an exec of the same non-PIE binary with ASLR disabled.
    Addresses that become hidden also count as an exec (a setuid exec, or
    caught mid-exec). For processes whose addresses are hidden from us, a
    change of comm is used instead, which misses an exec of a program with
    the same name and mistakes a rename (prctl PR_SET_NAME) for an exec; the
    latter only costs rebuilding state.
    """

    overruns = 0

    def __init__(self, proc_root: str = "/proc") -> None:
        self._proc_root = proc_root
        self._known, _ = self._scan()

    def _scan(self) -> tuple[dict[int, _Seen], dict[int, int]]:
        seen: dict[int, _Seen] = {}
        ppids: dict[int, int] = {}
        for pid in list_pids(self._proc_root):
            try:
                st: ProcStat = read_stat(pid, self._proc_root)
            except (ProcessGone, OSError, ValueError):
                continue
            seen[pid] = _Seen(st.start_ticks, st.comm, st.exec_signature)
            ppids[pid] = st.ppid
        return seen, ppids

    def fileno(self) -> int | None:
        """None: there is no fd to wait on, call poll() on a timer."""
        return None

    def poll(self) -> list[ProcessEvent]:
        """Changes since the previous call (or since construction): exits first,
        then forks, then execs, each in pid order."""
        current, ppids = self._scan()
        exits: list[ProcessEvent] = []
        forks: list[ProcessEvent] = []
        execs: list[ProcessEvent] = []
        for pid in sorted(self._known.keys() - current.keys()):
            exits.append(ProcessEvent("exit", pid))
        for pid in sorted(current):
            new = current[pid]
            old = self._known.get(pid)
            if old is None or old.start_ticks != new.start_ticks:
                if old is not None:
                    exits.append(ProcessEvent("exit", pid))
                forks.append(ProcessEvent("fork", pid, ppids[pid]))
            elif _exec_happened(old, new):
                execs.append(ProcessEvent("exec", pid))
        self._known = current
        return exits + forks + execs

    def read_events(self) -> list[ProcessEvent]:
        """Same as poll()."""
        return self.poll()

    def take_resync_request(self) -> bool:
        """Never: every poll is a full resync already."""
        return False

    def close(self) -> None:
        self._known = {}

    def __enter__(self) -> ProcPollingSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_event_source(logger: logging.Logger, proc_root: str = "/proc") -> ProcessEventSource:
    """The process connector if we may use it, else /proc polling (logged once)."""
    try:
        source = ProcConnectorSource()
    except ConnectorUnavailable as e:
        logger.warning(
            "process events: netlink proc connector unavailable (%s); polling %s instead",
            e,
            proc_root,
        )
        return ProcPollingSource(proc_root)
    logger.info("process events: subscribed to the netlink proc connector")
    return source
