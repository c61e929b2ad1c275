"""tramprof.procfs.events: lifecycle events and the identity-keyed process table."""

from __future__ import annotations

import functools
import logging
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tramprof.procfs import events as processes
from tramprof.procfs.events import (
    ConnectorUnavailable,
    ProcConnectorSource,
    ProcessEvent,
    ProcPollingSource,
    decode_connector_datagram,
    open_event_source,
)
from tramprof.procfs.identity import ProcessGone, ProcessIdentity, ProcStat, read_stat
from tramprof.procfs.table import ProcessTable

from .test_procinfo import make_proc

requires_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="needs root: subscribing to the netlink proc connector needs CAP_NET_ADMIN "
    "(on kernels before 6.6)",
)


# --- ProcessEvent ------------------------------------------------------------------


def test_event_kind_is_checked() -> None:
    assert ProcessEvent("fork", 2, 1).ppid == 1
    with pytest.raises(ValueError):
        ProcessEvent("clone", 2)  # type: ignore[arg-type]


# --- connector message decoding (no root) -------------------------------------------

# The kernel pads every event to sizeof(struct proc_event): 16 + 20 + 40 bytes.
KERNEL_MSG_SIZE = 76


def encode(cls_name: str, **fields: int | bytes) -> bytes:
    """A connector message as pyroute2 lays it out, padded like the kernel's."""
    from pyroute2.netlink.connector import cn_proc

    msg: Any = getattr(cn_proc, cls_name)()
    msg["header"]["type"] = 3  # NLMSG_DONE
    msg["idx"] = cn_proc.CN_IDX_PROC
    msg["val"] = cn_proc.CN_VAL_PROC
    msg["len"] = KERNEL_MSG_SIZE - 36
    for key, value in fields.items():
        msg[key] = value
    msg.encode()
    data = bytearray(msg.data)
    data.extend(bytes(KERNEL_MSG_SIZE - len(data)))
    struct.pack_into("=I", data, 0, KERNEL_MSG_SIZE)
    return bytes(data)


def decode(data: bytes, acks: dict[int, int] | None = None) -> list[ProcessEvent]:
    out: list[ProcessEvent] = []
    decode_connector_datagram(data, out, acks)
    return out


def test_decode_agrees_with_pyroute2_layout() -> None:
    fork = encode(
        "proc_event_fork", what=1, parent_pid=11, parent_tgid=10, child_pid=20, child_tgid=20
    )
    execd = encode("proc_event_exec", what=2, process_pid=20, process_tgid=20)
    exit_ = encode(
        "proc_event_exit",
        what=0x80000000,
        process_pid=20,
        process_tgid=20,
        exit_code=256,
        exit_signal=17,
        parent_pid=10,
        parent_tgid=10,
    )
    assert decode(fork) == [ProcessEvent("fork", 20, 10)]
    assert decode(execd) == [ProcessEvent("exec", 20)]
    assert decode(exit_) == [ProcessEvent("exit", 20)]
    # Several messages in one datagram, in order.
    assert decode(fork + execd + exit_) == [
        ProcessEvent("fork", 20, 10),
        ProcessEvent("exec", 20),
        ProcessEvent("exit", 20),
    ]


def test_decode_drops_thread_events() -> None:
    # A new thread of process 30: the kernel reports the *process's* parent
    # (1) as parent, so only pid != tgid tells a thread from a process.
    thread_fork = encode(
        "proc_event_fork", what=1, parent_pid=1, parent_tgid=1, child_pid=31, child_tgid=30
    )
    thread_exit = encode("proc_event_exit", what=0x80000000, process_pid=31, process_tgid=30)
    assert decode(thread_fork) == []
    assert decode(thread_exit) == []
    # A process forked by a non-leader thread (pid 31) of process 30.
    fork_from_thread = encode(
        "proc_event_fork", what=1, parent_pid=31, parent_tgid=30, child_pid=40, child_tgid=40
    )
    assert decode(fork_from_thread) == [ProcessEvent("fork", 40, 30)]


def test_decode_ignores_other_events_and_collects_acks() -> None:
    comm = encode("proc_event_comm", what=0x200, process_pid=5, process_tgid=5, comm=b"x")
    uid = encode("proc_event_uid", what=0x4, process_pid=5, process_tgid=5, ruid=0, euid=0)
    assert decode(comm + uid) == []
    ack = encode("proc_event_base", what=0, ack=1235)  # padding: err == 0
    acks: dict[int, int] = {}
    assert decode(ack, acks) == []
    assert acks == {1235: 0}
    refused = bytearray(ack)
    struct.pack_into("=I", refused, 52, 1)  # EPERM in proc_event.event_data.ack.err
    acks.clear()
    decode(bytes(refused), acks)
    assert acks == {1235: 1}


def test_decode_stops_at_garbage() -> None:
    execd = encode("proc_event_exec", what=2, process_pid=20, process_tgid=20)
    assert decode(execd[:40]) == []
    bogus_len = bytearray(execd)
    struct.pack_into("=I", bogus_len, 0, 10_000)
    assert decode(bytes(bogus_len)) == []
    not_proc = bytearray(execd)
    struct.pack_into("=I", not_proc, 16, 7)  # another connector index
    assert decode(bytes(not_proc) + execd) == [ProcessEvent("exec", 20)]


# --- ProcessTable on a fixture /proc ------------------------------------------------


class Recorder:
    """Factory and on_drop callback that remember what happened."""

    def __init__(self) -> None:
        self.gathered = 0
        self.made = 0
        self.started: list[int] = []  # start time in the stat each build got
        self.dropped: list[tuple[ProcessIdentity, str]] = []

    def factory(self, label: str) -> tuple[Callable[[], str], Callable[[ProcStat, str], str]]:
        """``get_or_create``'s gather and build."""
        def gather() -> str:
            self.gathered += 1
            return label

        def build(stat: ProcStat, gathered: str) -> str:
            self.made += 1
            self.started.append(stat.start_ticks)
            return gathered

        return gather, build

    def on_drop(self, identity: ProcessIdentity, value: str) -> None:
        self.dropped.append((identity, value))


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture
def table(tmp_path: Path, rec: Recorder) -> ProcessTable[str]:
    return ProcessTable(str(tmp_path), on_drop=rec.on_drop)


def test_table_pid_reuse_never_returns_the_old_state(
    tmp_path: Path, table: ProcessTable[str], rec: Recorder
) -> None:
    make_proc(tmp_path, 42, start=100)
    assert table.get_or_create(42, 100, *rec.factory("old")) == "old"
    assert table.get_or_create(42, 100, *rec.factory("again")) == "old"  # cached
    assert rec.made == 1
    # pid 42 is reused by a process that started at tick 200
    make_proc(tmp_path, 42, start=200)
    assert table.get(42, 200) is None
    assert ProcessIdentity(42, 200) not in table
    assert table.get_or_create(42, 200, *rec.factory("new")) == "new"
    assert rec.dropped == [(ProcessIdentity(42, 100), "old")]
    assert table.get(42, 100) is None
    assert len(table) == 1
    # A late request for the old process must not evict the new one.
    with pytest.raises(ProcessGone):
        table.get_or_create(42, 100, *rec.factory("zombie of the past"))
    assert table.get(42, 200) == "new"
    assert rec.made == 2 and rec.started == [100, 200]


def test_table_refuses_to_build_state_from_another_process(
    tmp_path: Path, table: ProcessTable[str], rec: Recorder
) -> None:
    make_proc(tmp_path, 42, start=300)  # /proc already shows the pid's next owner
    with pytest.raises(ProcessGone):
        table.get_or_create(42, 100, *rec.factory("wrong"))
    with pytest.raises(ProcessGone):
        table.get_or_create(43, 100, *rec.factory("gone"))  # no such pid at all
    assert rec.gathered == 2 and rec.made == 0  # read by pid, checked, never built
    assert len(table) == 0


def test_table_pid_reused_while_building(
    tmp_path: Path, table: ProcessTable[str], rec: Recorder
) -> None:
    make_proc(tmp_path, 42, start=100)

    def racing_gather() -> str:
        make_proc(tmp_path, 42, start=101)  # exited and reused meanwhile
        return "mixed"

    with pytest.raises(ProcessGone):
        table.get_or_create(42, 100, racing_gather, rec.factory("")[1])
    assert len(table) == 0
    assert rec.made == 0 and rec.dropped == []  # what was gathered is dropped, unbuilt
    # A process that becomes a zombie meanwhile is refused the same way.
    make_proc(tmp_path, 43, start=100)

    def dying_gather() -> str:
        make_proc(tmp_path, 43, start=100, state="Z")
        return "dead"

    with pytest.raises(ProcessGone):
        table.get_or_create(43, 100, dying_gather, rec.factory("")[1])
    assert len(table) == 0 and rec.made == 0


def test_table_zombies(tmp_path: Path, table: ProcessTable[str], rec: Recorder) -> None:
    make_proc(tmp_path, 42, start=100, state="Z")
    with pytest.raises(ProcessGone):
        table.get_or_create(42, 100, *rec.factory("dead"))
    # Leader exited, other threads still run: alive.
    make_proc(tmp_path, 43, start=100, state="Z", num_threads=5)
    assert table.get_or_create(43, 100, *rec.factory("alive")) == "alive"


def test_table_events(tmp_path: Path, table: ProcessTable[str], rec: Recorder) -> None:
    for pid in (10, 11, 12):
        make_proc(tmp_path, pid, start=pid * 10)
        table.get_or_create(pid, pid * 10, *rec.factory(f"s{pid}"))
    table.on_event(ProcessEvent("fork", 10, 1))
    table.on_event(ProcessEvent("fork", 99, 10))
    table.on_event(ProcessEvent("exit", 99))
    assert len(table) == 3
    make_proc(tmp_path, 11, start=110, start_stack=0x1234)  # the exec: a new stack
    table.on_event(ProcessEvent("exec", 11))
    assert table.get(11, 110) is None
    table.on_event(ProcessEvent("exit", 12))
    assert sorted(table.identities(), key=lambda i: i.pid) == [ProcessIdentity(10, 100)]
    assert table.pids() == {10}
    assert [v for _, v in rec.dropped] == ["s11", "s12"]
    # exec'd process: state is rebuilt on demand
    assert table.get_or_create(11, 110, *rec.factory("s11-after-exec")) == "s11-after-exec"
    # An exec event applied after the state of the new image was built (events
    # take effect after the next drain) leaves that state alone.
    table.on_event(ProcessEvent("exec", 11))
    assert table.get(11, 110) == "s11-after-exec"
    table.clear()
    assert len(table) == 0
    assert len(rec.dropped) == 4
    assert [v for _, v in rec.dropped][2:] == ["s10", "s11-after-exec"]


def test_table_resync(tmp_path: Path, table: ProcessTable[str], rec: Recorder) -> None:
    make_proc(tmp_path, 1, start=10)  # stays
    make_proc(tmp_path, 2, start=20)  # exits
    make_proc(tmp_path, 3, start=30)  # pid reused
    make_proc(tmp_path, 4, start=40, start_stack=0x1000)  # execs (exec event lost)
    make_proc(tmp_path, 5, start=50)  # becomes a zombie
    make_proc(tmp_path, 6, start=60, start_code=1, end_code=1, start_stack=0)  # hidden
    make_proc(tmp_path, 7, start=70)  # setuid exec: addresses become hidden
    for pid in range(1, 8):
        table.get_or_create(pid, pid * 10, *rec.factory(f"s{pid}"))
    assert table.resync() == 0
    for name in ("stat", "comm"):
        (tmp_path / "2" / name).unlink()
    (tmp_path / "2").rmdir()
    make_proc(tmp_path, 3, start=31)
    make_proc(tmp_path, 4, start=40, start_stack=0x2000)
    make_proc(tmp_path, 5, start=50, state="Z")
    make_proc(tmp_path, 6, start=60, start_code=1, end_code=1, start_stack=0, comm="renamed")
    make_proc(tmp_path, 7, start=70, start_code=1, end_code=1, start_stack=0)
    assert table.resync() == 5
    assert sorted(i.pid for i in table.identities()) == [1, 6]
    assert table.pids() == {1, 6}
    assert sorted(v for _, v in rec.dropped) == ["s2", "s3", "s4", "s5", "s7"]


def test_table_survives_failing_on_drop(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def bad_drop(identity: ProcessIdentity, value: int) -> None:
        raise RuntimeError("close failed")

    t: ProcessTable[int] = ProcessTable(str(tmp_path), on_drop=bad_drop)
    make_proc(tmp_path, 7, start=1)
    t.get_or_create(7, 1, lambda: 1, lambda _stat, one: one)
    with caplog.at_level(logging.ERROR):
        assert t.drop(7)
    assert len(t) == 0
    assert "releasing the state of process 7 failed" in caplog.text


def test_table_factory_error_stores_nothing(tmp_path: Path, table: ProcessTable[str]) -> None:
    make_proc(tmp_path, 7, start=1)

    def broken_gather() -> str:
        raise OSError("cannot read maps")

    def broken_build(stat: ProcStat, gathered: str) -> str:
        raise OSError("cannot parse maps")

    with pytest.raises(OSError, match="read"):
        table.get_or_create(7, 1, broken_gather, lambda stat, gathered: gathered)
    with pytest.raises(OSError, match="parse"):
        table.get_or_create(7, 1, lambda: "x", broken_build)
    assert len(table) == 0


def test_table_resync_on_live_proc_catches_a_lost_exec() -> None:
    """An exec we were not told about is found by its changed code/stack addresses."""
    t: ProcessTable[str] = ProcessTable()
    child = subprocess.Popen(["/bin/sh", "-c", "read x; exec /bin/sleep 5"], stdin=subprocess.PIPE)

    def wait_for_image(comm: str) -> int:
        """Until the exec of ``comm`` has completed (its code is mapped)."""
        deadline = time.monotonic() + 5
        # The kernel sets the new name before the code and stack addresses:
        # wait until they are set and read the same twice.
        seen = None
        while True:
            st = read_stat(child.pid)
            if st.comm == comm and st.start_code > 1 and st.exec_signature is not None:
                if st.exec_signature == seen:
                    return st.start_ticks
                seen = st.exec_signature
            assert time.monotonic() < deadline
            time.sleep(0.002)

    try:
        start = wait_for_image("sh")
        t.get_or_create(child.pid, start, lambda: "sh state", lambda _stat, state: state)
        assert t.resync() == 0
        assert child.stdin is not None
        child.stdin.write(b"go\n")
        child.stdin.flush()
        wait_for_image("sleep")
        assert t.resync() == 1
        assert len(t) == 0
    finally:
        child.kill()
        child.wait()


# --- polling source on a fixture /proc ------------------------------------------------


def test_polling_fixture_events(tmp_path: Path) -> None:
    root = str(tmp_path)
    make_proc(tmp_path, 1, "init", start=1)
    make_proc(tmp_path, 10, "shell", start=100)
    make_proc(tmp_path, 11, "app", start=110)
    make_proc(tmp_path, 12, "hidden", start=120, start_code=1, end_code=1, start_stack=0)
    make_proc(tmp_path, 13, "sudo", start=130)
    src = ProcPollingSource(root)
    assert src.fileno() is None
    assert src.poll() == []

    make_proc(tmp_path, 20, "child", start=200, ppid=10)  # new
    for name in ("stat", "comm"):  # 10 exits
        (tmp_path / "10" / name).unlink()
    (tmp_path / "10").rmdir()
    make_proc(tmp_path, 1, "init", start=5, ppid=0)  # pid 1 reused (start changed)
    make_proc(tmp_path, 11, "app", start=110, start_stack=0x1234)  # exec
    make_proc(  # exec seen only as a comm change (addresses hidden)
        tmp_path, 12, "other", start=120, start_code=1, end_code=1, start_stack=0
    )
    make_proc(  # setuid exec of a same-named program: addresses become hidden
        tmp_path, 13, "sudo", start=130, start_code=1, end_code=1, start_stack=0
    )
    assert src.read_events() == [
        ProcessEvent("exit", 10),
        ProcessEvent("exit", 1),
        ProcessEvent("fork", 1, 0),
        ProcessEvent("fork", 20, 10),
        ProcessEvent("exec", 11),
        ProcessEvent("exec", 12),
        ProcessEvent("exec", 13),
    ]
    # A rename (prctl) of a process whose addresses we can see is not an exec.
    make_proc(tmp_path, 11, "renamed", start=110, start_stack=0x1234)
    assert src.poll() == []
    assert not src.take_resync_request()
    src.close()


def test_polling_live_new_and_exited_process() -> None:
    src = ProcPollingSource()
    r, w = os.pipe()
    child = subprocess.Popen(["/bin/cat"], stdin=r, stdout=subprocess.DEVNULL)
    os.close(r)
    try:
        events = src.poll()
        assert ProcessEvent("fork", child.pid, os.getpid()) in events
    finally:
        os.close(w)
        child.wait()
    assert ProcessEvent("exit", child.pid) in src.poll()
    src.close()


# --- open_event_source ------------------------------------------------------------------


def test_open_event_source_falls_back_to_polling(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def unavailable(**kwargs: object) -> ProcConnectorSource:
        raise ConnectorUnavailable("not in the initial pid namespace")

    monkeypatch.setattr(processes, "ProcConnectorSource", unavailable)
    logger = logging.getLogger("test.fallback")
    with caplog.at_level(logging.INFO, logger="test.fallback"):
        source = open_event_source(logger)
    assert isinstance(source, ProcPollingSource)
    assert source.fileno() is None
    assert len(caplog.records) == 1
    assert "not in the initial pid namespace" in caplog.records[0].getMessage()
    assert "polling" in caplog.records[0].getMessage()
    source.close()


def test_a_connector_bind_refused_for_every_port_id_falls_back_to_polling(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """pyroute2 turns a refused bind (EPERM in a container) into KeyError
    after trying every port id: the daemon polls /proc instead of dying."""
    cn_proc = processes._pyroute2("netlink.connector.cn_proc")

    def refused(self: object, *args: object, **kwargs: object) -> None:
        raise KeyError("no free address available")

    monkeypatch.setattr(cn_proc.ProcEventSocket, "bind", refused)
    logger = logging.getLogger("test.refused")
    with caplog.at_level(logging.INFO, logger="test.refused"):
        source = open_event_source(logger)
    assert isinstance(source, ProcPollingSource)
    assert "refused for every netlink port id" in caplog.records[0].getMessage()
    source.close()


# --- the real proc connector --------------------------------------------------------------


@functools.cache
def connector_unavailable_reason() -> str | None:
    """Probed once: a refused subscription costs the full acknowledgement timeout."""
    try:
        ProcConnectorSource().close()
    except ConnectorUnavailable as e:
        return str(e)
    return None


def open_connector() -> ProcConnectorSource:
    reason = connector_unavailable_reason()
    if reason is not None:
        pytest.skip(f"proc connector unavailable here: {reason}")
    return ProcConnectorSource()


@pytest.fixture
def connector() -> Iterator[ProcConnectorSource]:
    source = open_connector()
    try:
        yield source
    finally:
        source.close()


def collect_until(
    source: ProcConnectorSource,
    done: Callable[[list[ProcessEvent]], bool],
    timeout: float = 10.0,
    sink: Callable[[ProcessEvent], None] | None = None,
) -> list[ProcessEvent]:
    """Read events (waiting on the fd) until ``done`` says so."""
    events: list[ProcessEvent] = []
    deadline = time.monotonic() + timeout
    while not done(events):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"timed out; got {len(events)} events"
        readable, _, _ = select.select([source.fileno()], [], [], remaining)
        if readable:
            for ev in source.read_events():
                events.append(ev)
                if sink is not None:
                    sink(ev)
    return events


@requires_root
@pytest.mark.root
def test_connector_sees_fork_exec_exit_with_exact_pids(connector: ProcConnectorSource) -> None:
    child = subprocess.Popen(["/bin/sh", "-c", "exec /bin/true"])
    child.wait()
    mine = [
        ev
        for ev in collect_until(connector, lambda evs: ProcessEvent("exit", child.pid) in evs)
        if ev.pid == child.pid
    ]
    # fork; exec of /bin/sh by Popen; exec of /bin/true by the shell; exit
    assert mine == [
        ProcessEvent("fork", child.pid, os.getpid()),
        ProcessEvent("exec", child.pid),
        ProcessEvent("exec", child.pid),
        ProcessEvent("exit", child.pid),
    ]
    assert connector.overruns == 0


@requires_root
@pytest.mark.root
def test_connector_in_a_fresh_daemon_imports_only_what_it_uses() -> None:
    """pyroute2's package __init__ imports the whole library (~9 MiB of heap):
    a daemon's connector imports the netlink modules it needs and still reads
    the fork, exec and exit of a child exactly."""
    open_connector().close()  # skips with the reason when it is unavailable
    script = """
import subprocess, sys, time
from tramprof.procfs.events import ProcConnectorSource, ProcessEvent
source = ProcConnectorSource()
child = subprocess.Popen(["/bin/true"]); child.wait()
deadline = time.monotonic() + 10
events = []
while ProcessEvent("exit", child.pid) not in events and time.monotonic() < deadline:
    time.sleep(0.05)
    events += [e for e in source.read_events() if e.pid == child.pid]
print([e.kind for e in events])
print(len([m for m in sys.modules if m.startswith("pyroute2")]))
print("pyroute2.iproute" in sys.modules, hasattr(sys.modules["pyroute2"], "IPRoute"))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=60).stdout.splitlines()
    assert out[0] == "['fork', 'exec', 'exit']"
    assert int(out[1]) < 60, f"{out[1]} pyroute2 modules imported"
    assert out[2] == "False False"


@requires_root
@pytest.mark.root
def test_connector_ignores_threads(connector: ProcConnectorSource) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    tid = thread.native_id
    stop.set()
    thread.join()
    marker = subprocess.Popen(["/bin/true"])
    marker.wait()
    events = collect_until(connector, lambda evs: ProcessEvent("exit", marker.pid) in evs)
    assert tid is not None
    assert all(ev.pid != tid for ev in events)
    assert all(ev.pid != os.getpid() for ev in events if ev.kind == "fork")


@requires_root
@pytest.mark.root
def test_connector_overrun_requests_resync() -> None:
    with open_connector() as source:
        # Shrink the buffer (after subscribing, so the acknowledgement fits) to
        # the kernel's minimum, which holds a handful of events.
        with socket.socket(fileno=os.dup(source.fileno())) as alias:
            alias.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
        source.read_events()
        assert not source.take_resync_request()
        subprocess.run(
            ["/bin/sh", "-c", "i=0; while [ $i -lt 100 ]; do /bin/true; i=$((i+1)); done"],
            check=True,
        )
        source.read_events()
        assert source.overruns >= 1
        assert source.take_resync_request()
        assert not source.take_resync_request()  # reported once


@requires_root
@pytest.mark.root
def test_open_event_source_prefers_the_connector(caplog: pytest.LogCaptureFixture) -> None:
    open_connector().close()
    logger = logging.getLogger("test.connector")
    with caplog.at_level(logging.INFO, logger="test.connector"):
        source = open_event_source(logger)
    try:
        assert isinstance(source, ProcConnectorSource)
        assert isinstance(source.fileno(), int)
    finally:
        source.close()


@requires_root
@pytest.mark.root
def test_table_fed_by_connector_does_not_grow_with_churn(
    connector: ProcConnectorSource,
) -> None:
    """500 processes each get state; once they exit the table is back to its size."""
    n = 500
    dropped: list[ProcessIdentity] = []
    table: ProcessTable[object] = ProcessTable(on_drop=lambda ident, _: dropped.append(ident))
    baseline = len(table)
    r, w = os.pipe()
    # Every child blocks reading the pipe until we close its write end.
    script = (
        f"exec 3<&0; i=0; while [ $i -lt {n} ]; do /bin/cat <&3 >/dev/null & i=$((i+1)); done; wait"
    )
    shell = subprocess.Popen(["/bin/sh", "-c", script], stdin=r)
    os.close(r)
    created: set[ProcessIdentity] = set()

    def feed(ev: ProcessEvent) -> None:
        table.on_event(ev)
        if ev.kind != "exec":
            return
        try:
            st = read_stat(ev.pid)
            if st.ppid == shell.pid and st.comm == "cat":
                table.get_or_create(ev.pid, st.start_ticks, object, lambda _stat, state: state)
                created.add(ProcessIdentity(ev.pid, st.start_ticks))
        except ProcessGone:
            pass

    try:
        collect_until(connector, lambda _: len(created) == n, sink=feed)
        assert len(table) == baseline + n
    finally:
        os.close(w)
    collect_until(connector, lambda evs: ProcessEvent("exit", shell.pid) in evs, sink=feed)
    assert shell.wait() == 0
    if connector.take_resync_request():
        table.resync()  # events were lost: reconcile, as the daemon does
    assert len(table) == baseline
    assert set(dropped) == created
    assert connector.overruns == 0


def test_connector_close_is_idempotent() -> None:
    source = open_connector()
    source.close()
    source.close()
    with pytest.raises(ValueError):
        source.read_events()
    with pytest.raises(ValueError):
        source.fileno()
