"""Every reason to leave a process alone is given, with its label, and a
daemon killed in the middle of an injection leaves the target running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tramprof.inject.injector import RuntimeStore, inject

from .conftest import finish, make_python

TRAMPROF = str(Path(sys.executable).parent / "tramprof")
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: ptrace, chroots"),
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 only"),
]


def test_not_cpython_and_self() -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        assert inject(sleeper.pid).result == "not_cpython"
    finally:
        sleeper.kill()
        sleeper.wait()
    assert inject(os.getpid()).result == "self"


@pytest.mark.parametrize("name", ["sid-3.14", "host-3.11"])
@pytest.mark.parametrize("how", ["env", "-X"])
def test_remote_debugging_disabled(name: str, how: str, runtime_dir: Path) -> None:
    python = make_python(name)
    if how == "env":
        proc, pid = python.start_workload(env={"PYTHON_DISABLE_REMOTE_DEBUG": "1"})
    else:
        proc, pid = python.start_workload(options=("-X", "disable-remote-debug"))
    try:
        result = inject(pid, runtimes=RuntimeStore(runtime_dir))
        assert result.result == "remote_debug_disabled", result.render()
    finally:
        finish(proc)


def test_already_active_perf(runtime_dir: Path) -> None:
    python = make_python("trixie-3.13")
    proc, pid = python.start_workload(options=("-X", "perf"))
    try:
        time.sleep(0.3)
        result = inject(pid, runtimes=RuntimeStore(runtime_dir))
        assert result.result == "already_active", result.render()
    finally:
        finish(proc)


def test_already_active_after_injection_then_off(runtime_dir: Path) -> None:
    python = make_python("host-3.11")
    proc, pid = python.start_workload()
    try:
        assert inject(pid, runtimes=RuntimeStore(runtime_dir)).ok
        assert inject(pid, runtimes=RuntimeStore(runtime_dir)).result == "already_active"
        off = inject(pid, off=True)
        assert off.ok and off.detail == "chain trampolines off", off.render()
        assert inject(pid, off=True).result == "not_active"
    finally:
        finish(proc)


def test_no_runtime_for_the_version_is_unsupported(tmp_path: Path) -> None:
    python = make_python("bullseye-3.9")
    proc, pid = python.start_workload()
    try:
        result = inject(pid, runtimes=RuntimeStore(tmp_path))
        assert result.result == "unsupported_version", result.render()
        assert "no prebuilt runtime for CPython 3.9" in result.detail
    finally:
        finish(proc)


def test_ptrace_denied_without_capability(runtime_dir: Path) -> None:
    python = make_python("trixie-3.13")
    proc, pid = python.start_workload()
    try:
        out = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
             "--inh-caps=-all", "--bounding-set=-all", TRAMPROF, "inject", "--json", str(pid)],
            capture_output=True, text=True, timeout=60)
        assert out.returncode == 1, out.stderr
        assert json.loads(out.stdout)["result"] == "ptrace_denied", out.stdout
    finally:
        finish(proc)


@pytest.mark.parametrize("name,point", [("host-3.11", "seized"), ("host-3.11", "marker"),
                                        ("trixie-3.13", "marker"), ("sid-3.14", "scheduled")])
def test_injector_killed_midway_leaves_the_target_running(name: str, point: str,
                                                          runtime_dir: Path) -> None:
    python = make_python(name)
    reference = finish(python.start_workload()[0])
    proc, pid = python.start_workload()
    env = {**os.environ, "TRAMPROF_INJECT_PAUSE_AT": point,
           "TRAMPROF_INJECT_RUNTIME_DIR": str(runtime_dir)}
    injector = subprocess.Popen([TRAMPROF, "inject", str(pid)], env=env,
                                stdout=subprocess.PIPE, text=True)
    try:
        assert injector.stdout is not None
        assert injector.stdout.readline().strip() == f"tramprof-inject: paused at {point}"
        injector.send_signal(signal.SIGKILL)
        injector.wait()
        time.sleep(0.5)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state in ("R", "S"), state   # running, not stopped or traced
    finally:
        output = finish(proc)
    assert output == reference


# 3.14+: a timeout says whether any thread took the request.
BLOCKED_IN_C = """\
import sys
print("ready", flush=True)
sys.stdin.readline()                      # in C, without the GIL, until told
print(sys.is_stack_trampoline_active(), flush=True)
"""
REFUSES_REMOTE_SCRIPTS = """\
import sys, time

def refuse(event, args):
    if event == "cpython.remote_debugger_script":
        raise PermissionError("no remote scripts here")

sys.addaudithook(refuse)
print("ready", flush=True)
end = time.monotonic() + 4.0              # Python code all along: safe points
while time.monotonic() < end:
    sum(range(100))
print(sys.is_stack_trampoline_active(), flush=True)
"""


def _start_script(name: str, source: str) -> tuple[subprocess.Popen[str], int]:
    python = make_python("sid-3.14")
    python.host_path(f"{python.workdir}/{name}.py").write_text(source)
    proc, pid = python.start(f"{python.workdir}/{name}.py")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc, pid


def test_timeout_when_no_thread_reaches_a_safe_point(runtime_dir: Path) -> None:
    proc, pid = _start_script("blocked", BLOCKED_IN_C)
    try:
        time.sleep(0.2)   # inside readline
        result = inject(pid, timeout=1.5, runtimes=RuntimeStore(runtime_dir))
    finally:
        out, err = proc.communicate("go\n", timeout=60)
    assert result.result == "timeout", result.render()
    assert "no thread took the request" in result.detail, result.detail
    # The withdrawn request does not run once the thread is back in Python.
    assert (proc.returncode, out.split(), err) == (0, ["False"], "")


def test_timeout_when_the_target_refuses_the_script(runtime_dir: Path) -> None:
    proc, pid = _start_script("refusing", REFUSES_REMOTE_SCRIPTS)
    try:
        result = inject(pid, timeout=1.5, runtimes=RuntimeStore(runtime_dir))
    finally:
        out, err = proc.communicate(timeout=60)
    assert result.result == "timeout", result.render()
    assert "a thread took the request but the script reported nothing" in result.detail
    assert (proc.returncode, out.split()) == (0, ["False"]), err[-3000:]
    assert "Audit hook failed for remote debugger script" in err, err[-3000:]


# 3.9-3.13: the main thread waits in C while another thread ends the process.
# The call queued again once nothing answers finds the process gone, and
# says so: never a timeout, never a call into another process given its pid.
EXITS_WHILE_MAIN_WAITS = """\
import os, threading, time
print("ready", flush=True)
def leave():
    time.sleep(1.5)
    os._exit(0)
threading.Thread(target=leave).start()
threading.Event().wait()
"""


def test_gone_when_the_target_exits_before_its_main_thread_runs_the_call(
        runtime_dir: Path) -> None:
    python = make_python("host-3.11")
    python.host_path(f"{python.workdir}/exits.py").write_text(EXITS_WHILE_MAIN_WAITS)
    proc, pid = python.start(f"{python.workdir}/exits.py")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        began = time.monotonic()
        result = inject(pid, timeout=20.0, runtimes=RuntimeStore(runtime_dir))
        took = time.monotonic() - began
    finally:
        out, err = proc.communicate(timeout=60)
    assert result.result == "gone", result.render()
    assert "exited" in result.detail, result.detail
    assert took < 10.0, result.render()      # found at the next call, not at the deadline
    assert (proc.returncode, out, err) == (0, "", ""), err[-3000:]
