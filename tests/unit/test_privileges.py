"""Dropping capabilities: exact resulting sets, and that the kept set is both
sufficient (other users' /proc files still readable) and necessary (without
each kept capability, what it is kept for fails).

The drops are irreversible, so each runs in a fresh interpreter as root.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
from tramprof.commands.privileges import (
    CAPABILITIES,
    RUNTIME_CAPABILITIES,
    cap_mask,
    cap_names,
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
    # Addresses to try, looked up while still privileged.
    with open(f"/proc/{target}/maps") as f:
        maps = f.read().splitlines()
    vdso = int(next(l for l in maps if l.endswith("[vdso]")).split("-")[0], 16)
    text = next(l for l in maps if "/" in l and " r-xp " in l).split()[0]
    out = {"kept": drop_capabilities(keep), "status": current_capabilities()}

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


def run_dropped(keep: set[str], target: int) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(sorted(keep)),
                             str(target)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


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
