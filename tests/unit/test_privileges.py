"""Dropping capabilities: exact resulting sets, and that the kept set is both
sufficient (other users' /proc files still readable) and necessary (without
each kept capability, what it is kept for fails).

The drops are irreversible, so each runs in a fresh interpreter as root.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from unittest import mock

import pytest
from tramprof.commands import privileges
from tramprof.commands.privileges import (
    CAPABILITIES,
    RUNTIME_CAPABILITIES,
    PrivilegeError,
    cap_mask,
    cap_names,
    drop_after_start,
    parse_status,
    runtime_capabilities,
)

from tests.conftest import requires_root

NOBODY = 65534

# Runs in the child: drop, then try what the daemon does while running (and a
# few things it must no longer be able to do); prints a JSON report.
CHILD = textwrap.dedent("""
    import json, os, socket, subprocess, sys
    from tramprof.commands.privileges import drop_capabilities, current_capabilities

    keep, target = json.loads(sys.argv[1]), int(sys.argv[2])
    run_as = json.loads(sys.argv[3])
    run_as = tuple(run_as) if run_as else None
    root_dir = sys.argv[4]
    # Addresses to try, looked up while still privileged.
    with open(f"/proc/{target}/maps") as f:
        maps = f.read().splitlines()
    vdso = int(next(l for l in maps if l.endswith("[vdso]")).split("-")[0], 16)
    text = next(l for l in maps if "/" in l and " r-xp " in l).split()[0]
    out = {"kept": drop_capabilities(keep, run_as), "status": current_capabilities(),
           "ids": [os.getresuid(), os.getresgid(), os.getgroups()]}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "ok"
        except OSError as exc:
            out[name] = exc.errno

    def bind_80():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", 80))

    def read_maps():
        with open(f"/proc/{target}/maps") as f:
            assert f.read()

    def read_vdso():
        fd = os.open(f"/proc/{target}/mem", os.O_RDONLY)
        try:
            assert os.pread(fd, 4, vdso) == b"\\x7fELF"
        finally:
            os.close(fd)

    def list_map_files():
        assert os.listdir(f"/proc/{target}/map_files")

    def open_map_file():
        with open(f"/proc/{target}/map_files/{text}", "rb") as f:
            assert f.read(4) == b"\\x7fELF"

    def read_root():
        os.listdir(f"/proc/{target}/root/")

    attempt("bind_80", bind_80)
    attempt("maps", read_maps)
    attempt("vdso", read_vdso)
    attempt("map_files_list", list_map_files)
    attempt("map_files_open", open_map_file)
    attempt("proc_root", read_root)
    attempt("chown", lambda: os.chown("/proc/self/fd/0", 1, 1))
    attempt("setuid_root", lambda: os.setuid(0))
    if root_dir:
        attempt("write_root_dir",
                lambda: open(os.path.join(root_dir, "planted"), "w").close())
    # exec as uid 0 must not bring capabilities back (NoNewPrivs, securebits)
    exec_status = subprocess.run(["cat", "/proc/self/status"], capture_output=True,
                                 text=True).stdout
    out["exec_status"] = exec_status
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def other_user_process() -> Iterator[int]:
    """A process of another user (nobody), as the daemon's targets are."""
    proc = subprocess.Popen(["sleep", "300"], user=NOBODY, group=NOBODY,
                            extra_groups=[], stdin=subprocess.DEVNULL)
    yield proc.pid
    proc.kill()
    proc.wait()


def run_dropped(keep: set[str], target: int, run_as: tuple[int, int] | None = None,
                root_dir: str = "") -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(sorted(keep)),
                             str(target), json.dumps(run_as), root_dir],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def root_process() -> Iterator[int]:
    """A root process with every capability (only CAP_SYS_PTRACE reaches it)."""
    proc = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL)
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def third_user_process() -> Iterator[int]:
    """A process of a uid that is neither root nor the one the drop switches to."""
    proc = subprocess.Popen(["sleep", "300"], user=4242, group=4242, extra_groups=[],
                            stdin=subprocess.DEVNULL)
    yield proc.pid
    proc.kill()
    proc.wait()


def bits(names: set[str]) -> int:
    return cap_mask(names)


@requires_root
def test_runtime_set_is_exact_and_sufficient(other_user_process):
    keep = set(RUNTIME_CAPABILITIES)
    report = run_dropped(keep, other_user_process)
    status = report["status"]
    assert sorted(report["kept"]) == sorted(keep)
    assert status["CapEff"] == status["CapPrm"] == bits(keep)
    assert status["CapInh"] == 0 and status["CapAmb"] == 0
    assert status["CapBnd"] == bits(keep)
    assert status["NoNewPrivs"] == 1
    # Still works: everything the daemon reads about another user's process.
    for what in ("maps", "vdso", "map_files_list", "map_files_open", "proc_root"):
        assert report[what] == "ok", (what, report[what])
    # Dropped: binding a privileged port (CAP_NET_BIND_SERVICE), chown (CAP_CHOWN).
    assert report["bind_80"] == 13  # EACCES
    assert report["chown"] == 1  # EPERM
    # A program exec'ed as root gets nothing back.
    after_exec = parse_status(report["exec_status"])
    assert after_exec["CapEff"] == after_exec["CapPrm"] == 0, report["exec_status"]
    assert after_exec["NoNewPrivs"] == 1


@pytest.mark.parametrize("owner", ["root", "third_user"])
@requires_root
def test_runtime_set_as_nobody_is_exact_and_sufficient(request, owner, tmp_path):
    """Root switches to nobody keeping exactly the runtime set; everything
    the daemon reads about other processes (root's too) still works."""
    target = request.getfixturevalue(f"{owner}_process")
    root_dir = tmp_path / "root-owned"
    root_dir.mkdir(mode=0o755)
    keep = set(RUNTIME_CAPABILITIES)
    report = run_dropped(keep, target, (NOBODY, NOBODY), str(root_dir))
    status = report["status"]
    assert sorted(report["kept"]) == sorted(keep)
    assert status["CapEff"] == status["CapPrm"] == status["CapBnd"] == bits(keep)
    assert status["CapInh"] == 0 and status["CapAmb"] == 0 and status["NoNewPrivs"] == 1
    assert report["ids"] == [[NOBODY] * 3, [NOBODY] * 3, []]
    for what in ("maps", "vdso", "map_files_list", "map_files_open", "proc_root"):
        assert report[what] == "ok", (owner, what, report[what])
    assert report["setuid_root"] == 1  # EPERM: no way back to root
    assert report["write_root_dir"] == 13  # EACCES: root's files are not ours any more
    assert report["bind_80"] == 13 and report["chown"] == 1
    after_exec = parse_status(report["exec_status"])
    assert after_exec["CapEff"] == after_exec["CapPrm"] == 0, report["exec_status"]
    assert f"Uid:\t{NOBODY}\t" in report["exec_status"]


@requires_root
def test_keep_nothing(other_user_process):
    report = run_dropped(set(), other_user_process)
    assert report["kept"] == []
    assert report["status"]["CapEff"] == report["status"]["CapPrm"] == 0
    assert report["status"]["CapBnd"] == 0
    assert report["maps"] == 13  # EACCES: ptrace_may_access fails


@pytest.mark.parametrize(("missing", "fails"), [
    # Without it, another user's /proc/PID/{maps,mem,map_files,root} are closed.
    ("CAP_SYS_PTRACE", ("maps", "map_files_list", "proc_root")),
    # Without it, the 0600/0500 /proc files owned by the target's user are closed.
    ("CAP_DAC_READ_SEARCH", ("vdso", "map_files_list")),
    # Without it, map_files links cannot be followed (deleted files, memfds).
    ("CAP_CHECKPOINT_RESTORE", ("map_files_open",)),
])
@requires_root
def test_each_kept_capability_is_needed(other_user_process, missing, fails):
    report = run_dropped(set(RUNTIME_CAPABILITIES) - {missing}, other_user_process)
    for what in fails:
        assert report[what] in (1, 13), (missing, what, report[what])  # EPERM / EACCES


@requires_root
def test_refuses_with_other_threads():
    code = textwrap.dedent("""
        import threading, time
        from tramprof.commands.privileges import PrivilegeError, drop_capabilities
        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
        try:
            drop_capabilities({"CAP_SYS_PTRACE"})
        except PrivilegeError as exc:
            print("refused:", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30)
    assert out.stdout.startswith("refused: capabilities are per thread"), out


def test_unknown_name_is_rejected_before_anything_changes():
    code = ("from tramprof.commands.privileges import drop_capabilities as d\n"
            "try:\n    d({'CAP_SYS_PTRACE', 'CAP_MAGIC'})\n"
            "except ValueError as e:\n    print(e)\n"
            "print(open('/proc/self/status').read())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30)
    assert "unknown capability 'CAP_MAGIC'" in out.stdout
    with open("/proc/self/status") as f:
        before = parse_status(f.read())
    after = parse_status(out.stdout)
    assert after["CapEff"] == before["CapEff"] and after["NoNewPrivs"] == before["NoNewPrivs"]


def test_names_and_masks_round_trip():
    assert cap_names(cap_mask({"CAP_BPF", "CAP_SYS_PTRACE"})) == ["CAP_SYS_PTRACE", "CAP_BPF"]
    assert cap_names(1 << 63) == ["cap_63"]
    assert len(set(CAPABILITIES.values())) == len(CAPABILITIES) == 41


def test_parse_status():
    text = ("Name:\tx\nCapInh:\t0000000000000000\nCapPrm:\t0000000000080000\n"
            "CapEff:\t0000000000080000\nCapBnd:\t000001ffffffffff\nCapAmb:\t0000000000000000\n"
            "NoNewPrivs:\t1\n")
    status = parse_status(text)
    assert status["CapEff"] == 1 << 19 and status["CapBnd"] == (1 << 41) - 1
    assert status["NoNewPrivs"] == 1


@pytest.mark.parametrize(("kernel", "sysctl", "with_bpf"), [
    ((6, 18), 2, False),
    ((6, 1), 2, False),   # Debian 12: map access through our fds needs no capability
    ((5, 19), 1, False),
    ((5, 15), 2, True),   # every bpf() command needs CAP_BPF there
    ((5, 15), 0, False),
])
def test_runtime_capabilities_by_kernel(kernel, sysctl, with_bpf):
    keep = runtime_capabilities(kernel, sysctl)
    assert ("CAP_BPF" in keep) == with_bpf
    assert keep >= RUNTIME_CAPABILITIES
    assert "CAP_SYS_ADMIN" not in keep


# -- fail closed: the drop sequence against a fake kernel ----------------------------
#
# Every credential call of tramprof.commands.privileges goes through _prctl,
# _capget, _capset, _get_ids, _set_ids, current_capabilities and
# _other_threads. FakeKernel replaces exactly those (and makes any direct
# libc use fail), so these tests run in-process, as any user, and change
# nothing real.

ALL_CAPS = (1 << 41) - 1
SETPCAP = 1 << CAPABILITIES["CAP_SETPCAP"]
SETIDS = 1 << CAPABILITIES["CAP_SETUID"] | 1 << CAPABILITIES["CAP_SETGID"]
STARTUP = cap_mask({"CAP_BPF", "CAP_PERFMON", "CAP_SYSLOG", "CAP_NET_ADMIN"})
EPERM = 1


class FakeKernel:
    """One thread's credentials, with the kernel's rules that matter here."""

    def __init__(self, uid: int = 0, caps: int = ALL_CAPS, bounding: int = ALL_CAPS,
                 fail: dict[str, int] | None = None) -> None:
        self.eff = self.prm = caps
        self.inh = self.amb = 0
        self.bnd = bounding
        self.securebits = 0
        self.nnp = 0
        self.keepcaps = False
        self.uids = (uid, uid, uid)
        self.gids = (uid, uid, uid)
        self.groups = [0, 4, 6] if uid == 0 else []
        self.fail = fail or {}  # step -> errno
        self.sticky = 0  # bits capset cannot remove (a kernel that lies)
        self.ignore_setids = False
        self.threads: list[str] = []
        self.steps: list[str] = []

    def _step(self, name: str) -> None:
        self.steps.append(name)
        if name in self.fail:
            errno = self.fail[name]
            raise OSError(errno, os.strerror(errno))

    def prctl(self, option: int, arg2: int = 0, arg3: int = 0) -> int:
        if option == privileges._PR_CAP_AMBIENT:
            self._step("ambient")
            self.amb = 0
            return 0
        if option == privileges._PR_CAPBSET_READ:
            if arg2 > 40:
                raise OSError(22, "Invalid argument")
            return self.bnd >> arg2 & 1
        if option == privileges._PR_CAPBSET_DROP:
            self._step("capbset_drop")
            if not self.eff & SETPCAP:
                raise OSError(EPERM, "Operation not permitted")
            self.bnd &= ~(1 << arg2)
            return 0
        if option == privileges._PR_GET_SECUREBITS:
            return self.securebits | (privileges._SECBIT_KEEP_CAPS if self.keepcaps else 0)
        if option == privileges._PR_SET_SECUREBITS:
            self._step("securebits")
            if not self.eff & SETPCAP:
                raise OSError(EPERM, "Operation not permitted")
            self.securebits = arg2
            self.keepcaps = bool(arg2 & privileges._SECBIT_KEEP_CAPS)
            return 0
        if option == privileges._PR_SET_KEEPCAPS:
            self._step("keepcaps")
            self.keepcaps = bool(arg2)
            return 0
        if option == privileges._PR_SET_NO_NEW_PRIVS:
            self._step("nnp")
            self.nnp = 1
            return 0
        raise AssertionError(f"unexpected prctl {option}")

    def capget(self) -> tuple[int, int, int]:
        try:
            self._step("capget")
        except OSError as exc:
            raise PrivilegeError(exc.errno, f"capget: {exc.strerror}") from exc
        return self.eff, self.prm, self.inh

    def capset(self, effective: int, permitted: int, inheritable: int) -> None:
        try:
            self._step("capset")
        except OSError as exc:
            raise PrivilegeError(exc.errno, f"capset: {exc.strerror}") from exc
        if permitted & ~self.prm or effective & ~permitted:
            raise PrivilegeError(EPERM, "capset: Operation not permitted")
        self.prm = permitted | (self.sticky & self.prm)
        self.eff = effective | (self.sticky & self.eff)
        self.inh = inheritable

    def get_ids(self) -> tuple[tuple[int, int, int], tuple[int, int, int], list[int]]:
        return self.uids, self.gids, list(self.groups)

    def set_ids(self, uid: int, gid: int) -> None:
        try:
            self._step("setids")
        except OSError as exc:
            raise PrivilegeError(exc.errno, f"setresuid({uid}): {exc.strerror}") from exc
        if self.eff & SETIDS != SETIDS:
            raise PrivilegeError(EPERM, "setgroups([]): Operation not permitted")
        if self.ignore_setids:
            return
        was_root = 0 in self.uids
        self.groups, self.gids, self.uids = [], (gid,) * 3, (uid,) * 3
        if was_root and 0 not in self.uids:
            self.amb = 0
            if not self.keepcaps:
                self.prm = 0
            self.eff = 0

    def status(self) -> dict[str, int]:
        self._step("status")
        return {"CapInh": self.inh, "CapPrm": self.prm, "CapEff": self.eff,
                "CapBnd": self.bnd, "CapAmb": self.amb, "NoNewPrivs": self.nnp}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeKernel:
        def no_libc() -> None:
            raise AssertionError("a real credential call escaped the fake kernel")

        monkeypatch.setattr(privileges, "_lib", no_libc)
        monkeypatch.setattr(privileges, "_prctl", self.prctl)
        monkeypatch.setattr(privileges, "_capget", self.capget)
        monkeypatch.setattr(privileges, "_capset", self.capset)
        monkeypatch.setattr(privileges, "_get_ids", self.get_ids)
        monkeypatch.setattr(privileges, "_set_ids", self.set_ids)
        monkeypatch.setattr(privileges, "current_capabilities", self.status)
        monkeypatch.setattr(privileges, "_other_threads", lambda: list(self.threads))
        return self


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Callable[..., FakeKernel]:
    def make(**kwargs: object) -> FakeKernel:
        return FakeKernel(**kwargs).install(monkeypatch)  # type: ignore[arg-type]
    return make


def runtime_mask() -> int:
    return cap_mask(runtime_capabilities())


def test_root_drops_to_runtime_set_and_nobody(kernel, caplog):
    k = kernel()
    with caplog.at_level(logging.INFO, logger="tramprof.commands.privileges"):
        dropped = drop_after_start()
    assert dropped is not None
    assert k.eff == k.prm == k.bnd == runtime_mask() and k.inh == k.amb == 0
    assert k.uids == (NOBODY,) * 3 and k.gids == (NOBODY,) * 3 and k.groups == []
    assert k.nnp == 1 and not k.keepcaps
    assert k.securebits & privileges._LOCKED_SECUREBITS == privileges._LOCKED_SECUREBITS
    assert set(dropped.kept) == runtime_capabilities()
    assert "CAP_BPF" in dropped.dropped and "CAP_SETUID" in dropped.dropped
    assert (dropped.uid_before, dropped.uid, dropped.gid) == (0, NOBODY, NOBODY)
    # The uid changes before the last capset, after the bounding set.
    assert k.steps.index("setids") > max(i for i, s in enumerate(k.steps) if s == "capbset_drop")
    line = next(r.getMessage() for r in caplog.records if "capabilities kept" in r.getMessage())
    assert "dropped: " in line and "CAP_PERFMON" in line and "uid 0 -> 65534" in line


def test_configured_uid(kernel):
    k = kernel()
    dropped = drop_after_start(run_as=(4321, 4322))
    assert dropped is not None and (dropped.uid, dropped.gid) == (4321, 4322)
    assert k.uids == (4321,) * 3 and k.gids == (4322,) * 3


def test_root_without_setuid_keeps_uid_0_but_drops_capabilities(kernel, caplog):
    k = kernel(caps=ALL_CAPS & ~SETIDS)
    with caplog.at_level(logging.WARNING):
        dropped = drop_after_start()
    assert dropped is not None and dropped.stayed_root and "CAP_SETUID" in dropped.uid_note
    assert k.uids == (0, 0, 0) and "setids" not in k.steps
    assert k.eff == k.prm == runtime_mask() and k.nnp == 1
    assert any("staying uid 0" in r.getMessage() for r in caplog.records)


def test_run_as_none_keeps_root(kernel):
    k = kernel()
    dropped = drop_after_start(run_as=None)
    assert dropped is not None and dropped.uid == 0 and not dropped.uid_note
    assert "setids" not in k.steps and k.eff == runtime_mask()


def test_systemd_dynamic_user_keeps_its_uid(kernel):
    """DynamicUser=: not root, the unit's capabilities, no CAP_SETPCAP."""
    granted = STARTUP | cap_mask(RUNTIME_CAPABILITIES)
    k = kernel(uid=61234, caps=granted, bounding=granted)
    dropped = drop_after_start()
    assert dropped is not None and dropped.uid == 61234
    assert k.uids == (61234,) * 3 and "setids" not in k.steps
    assert k.eff == k.prm == runtime_mask() and k.nnp == 1
    assert not dropped.bounding_reduced


def test_nothing_to_drop_without_root_or_capabilities(kernel):
    k = kernel(uid=1000, caps=0)
    assert drop_after_start() is None
    assert "capset" not in k.steps


def test_permitted_but_not_effective_capabilities_are_still_dropped(kernel):
    k = kernel(uid=1000, caps=STARTUP)
    k.eff = 0
    assert drop_after_start() is not None
    assert k.prm == 0 and k.nnp == 1


def test_old_kernel_without_ambient_capabilities_is_fine(kernel):
    kernel(fail={"ambient": 22})  # EINVAL
    assert drop_after_start() is not None


@pytest.mark.parametrize(("setup", "message"), [
    (lambda k: k.fail.update(capget=EPERM), "capget"),
    (lambda k: k.fail.update(ambient=EPERM), "clearing ambient capabilities"),
    (lambda k: k.fail.update(capbset_drop=EPERM), "bounding set"),
    (lambda k: k.fail.update(keepcaps=EPERM), "PR_SET_KEEPCAPS"),
    (lambda k: k.fail.update(setids=EPERM), "setresuid(65534)"),
    (lambda k: k.fail.update(nnp=EPERM), "PR_SET_NO_NEW_PRIVS"),
    (lambda k: k.fail.update(capset=EPERM), "capset"),
    (lambda k: k.fail.update(status=2), "No such file"),
    (lambda k: k.threads.append("77 (worker)"), "per thread"),
    # The kernel reports more than asked: caught by the final check.
    (lambda k: setattr(k, "sticky", 1 << CAPABILITIES["CAP_SYS_ADMIN"]), "not as requested"),
    (lambda k: setattr(k, "ignore_setids", True), "identity not as requested"),
])
def test_every_failure_is_fatal(kernel, caplog, setup, message):
    k = kernel()
    setup(k)
    with pytest.raises(PrivilegeError) as raised:
        drop_after_start()
    assert "cannot drop privileges after start-up" in str(raised.value)
    assert message in str(raised.value)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING
                and "keeping" in r.getMessage()]


def test_a_lost_permitted_set_at_the_uid_change_is_fatal(kernel, monkeypatch):
    k = kernel()
    original = k.prctl

    def no_keepcaps(option: int, arg2: int = 0, arg3: int = 0) -> int:
        if option == privileges._PR_SET_KEEPCAPS:
            return 0  # ignored: the uid change then clears the permitted set
        return original(option, arg2, arg3)

    monkeypatch.setattr(privileges, "_prctl", no_keepcaps)
    with pytest.raises(PrivilegeError, match="took capabilities"):
        drop_after_start()


# -- the commands stop when the drop fails -------------------------------------------


class FakeProfiler:
    """Stands in for Profiler: records what the command did with it, and the
    kernel state whenever the command touched other processes' data."""

    def __init__(self, kernel: FakeKernel) -> None:
        self.kernel = kernel
        self.events: list[str] = []
        self.caps_when_used: list[int] = []
        self.sampler = types.SimpleNamespace(event_name="cpu-clock")

    def start(self) -> None:
        self.events.append("start")

    def wait(self, timeout: float) -> None:
        self.events.append("wait")
        self.caps_when_used.append(self.kernel.eff)

    def collect(self) -> list:
        self.events.append("collect")
        self.caps_when_used.append(self.kernel.eff)
        return []

    def close(self) -> None:
        self.events.append("close")


@pytest.fixture
def no_signal_handlers(monkeypatch):
    monkeypatch.setattr(signal, "signal", lambda *args: None)


def test_record_exits_when_the_drop_fails(kernel, monkeypatch, capsys, tmp_path,
                                          no_signal_handlers):
    from tramprof.commands import record as record_cmd
    from tramprof.config import Config

    k = kernel(fail={"capset": EPERM})
    profiler = FakeProfiler(k)
    monkeypatch.setattr(record_cmd, "Profiler", lambda config: profiler)
    out = tmp_path / "profile.folded"
    assert record_cmd.record(Config(), 1.0, "folded", str(out)) == 1
    assert profiler.events == ["start", "close"]  # nothing sampled or read
    err = capsys.readouterr().err
    assert "cannot drop privileges after start-up" in err and "capset" in err
    assert not out.exists()


def test_record_samples_only_after_dropping(kernel, monkeypatch, capsys, no_signal_handlers):
    from tramprof.commands import record as record_cmd
    from tramprof.config import Config

    k = kernel()
    profiler = FakeProfiler(k)
    monkeypatch.setattr(record_cmd, "Profiler", lambda config: profiler)
    assert record_cmd.record(Config(interval=0.1), 0.2, "folded", None) == 0
    assert profiler.events[0] == "start" and profiler.events[-1] == "close"
    assert profiler.caps_when_used and set(profiler.caps_when_used) == {runtime_mask()}
    assert k.uids == (NOBODY,) * 3


def test_daemon_exits_when_the_drop_fails(kernel, monkeypatch, caplog, no_signal_handlers):
    from tramprof.commands import run as run_cmd
    from tramprof.config import Config

    k = kernel(fail={"setids": EPERM})
    profiler = FakeProfiler(k)
    server = mock.MagicMock()
    monkeypatch.setattr(run_cmd, "Profiler", lambda config: profiler)
    monkeypatch.setattr(run_cmd, "MetricsServer", lambda *args, **kwargs: server)
    daemon = run_cmd.Daemon(Config())
    with caplog.at_level(logging.INFO):
        assert daemon.run() == 1
    assert profiler.events == ["start", "close"]
    server.start.assert_not_called()
    server.close.assert_called_once()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and "cannot drop privileges after start-up" in errors[0]
    assert "setresuid(65534)" in errors[0]


def test_doctor_examines_no_process_when_the_drop_fails(kernel, monkeypatch):
    from tramprof.commands import doctor

    kernel(fail={"nnp": EPERM})
    examined = []
    monkeypatch.setattr(doctor, "HOST_CHECKS", ())
    monkeypatch.setattr(doctor, "check_process", lambda *args: examined.append(args) or [])
    checks, ok = doctor.run(pid=os.getpid())
    assert not ok and examined == []
    (drop,) = checks
    assert drop.name == "privilege drop" and not drop.ok and not drop.warning
    assert "PR_SET_NO_NEW_PRIVS" in drop.detail


def test_doctor_examines_the_process_after_dropping(kernel, monkeypatch):
    from tramprof.commands import doctor

    k = kernel()
    seen = []
    monkeypatch.setattr(doctor, "HOST_CHECKS", ())
    monkeypatch.setattr(doctor, "check_process",
                        lambda *args: seen.append((k.eff, k.uids)) or [])
    checks, ok = doctor.run(pid=os.getpid())
    assert ok and seen == [(runtime_mask(), (NOBODY,) * 3)]
    assert "uid 0 -> 65534" in checks[0].detail
