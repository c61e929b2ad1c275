"""After attaching, `record`, `run` and `doctor` hold exactly the runtime
capabilities and no longer run as root, and still profile: the real CLI,
real BPF, a real target (root)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from tramprof.commands.privileges import NOBODY, cap_mask, parse_status, runtime_capabilities
from tramprof.export.formats.folded import parse_folded

from tests.conftest import TRAMPROF, requires_root
from tests.e2e.test_daemon import Daemon, value

pytestmark = requires_root

CHAIN = ("main", "chain_a", "chain_b", "chain_c")


def chain_stack(stack: tuple[str, ...]) -> bool:
    """The target's exact user stack (kernel frames of an interrupt may follow)."""
    if stack[0] != "chain" or "main" not in stack:
        return False
    at = stack.index("main")
    return stack[at:at + 4] == CHAIN


def share_of_chain(stacks: dict[tuple[str, ...], int]) -> float:
    total = sum(stacks.values())
    return sum(n for stack, n in stacks.items() if chain_stack(stack)) / max(total, 1)


def thread_statuses(pid: int) -> list[str]:
    """/proc/PID/task/*/status of every thread (capabilities are per thread)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.append(Path(f"/proc/{pid}/task/{tid}/status").read_text())
        except OSError:
            continue
    return out


def ids(status: str, key: str) -> list[int]:
    line = next(line for line in status.splitlines() if line.startswith(key + ":"))
    return [int(x) for x in line.split()[1:]]


def dropped(status: str) -> bool:
    caps = parse_status(status)
    return caps["CapEff"] == cap_mask(runtime_capabilities())


def assert_runtime_only(status: str) -> None:
    caps = parse_status(status)
    runtime = cap_mask(runtime_capabilities())
    assert caps["CapEff"] == caps["CapPrm"] == caps["CapBnd"] == runtime, status
    assert caps["CapInh"] == caps["CapAmb"] == 0 and caps["NoNewPrivs"] == 1, status
    assert ids(status, "Uid") == [NOBODY] * 4, status
    assert ids(status, "Gid") == [NOBODY] * 4, status
    assert ids(status, "Groups") == [], status


def test_record_drops_after_attaching_and_still_profiles(targets, start_target):
    target = start_target(str(targets / "chain"), "60")
    recorder = subprocess.Popen(
        [TRAMPROF, "--log-level", "info", "record", "--pid", str(target.pid),
         "--duration", "2", "--frequency", "499"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    deadline = time.monotonic() + 120
    while recorder.poll() is None and time.monotonic() < deadline:
        try:
            seen.extend(thread_statuses(recorder.pid))
        except OSError:
            break  # exited meanwhile
        time.sleep(0.02)
    out, err = recorder.communicate(timeout=60)
    assert recorder.returncode == 0, err
    # Root with everything while compiling and attaching, then only the
    # runtime set as nobody, and never anything more again.
    assert parse_status(seen[0])["CapEff"] != cap_mask(runtime_capabilities())
    first = next(i for i, status in enumerate(seen) if dropped(status))
    for status in seen[first:]:
        assert_runtime_only(status)
    assert len(seen) - first > 20, "the drop must come right after attaching"
    assert "capabilities kept: " in err and "CAP_BPF" in err.split("dropped: ")[1]
    stacks = parse_folded(out)
    assert sum(stacks.values()) > 300 and share_of_chain(stacks) >= 0.95, \
        sorted(stacks.items(), key=lambda kv: -kv[1])[:5]


def test_record_refuses_to_run_as_root_when_dropping_fails(targets, start_target):
    """A drop that fails (here: another thread is reported, so capabilities
    cannot be dropped for the whole process) stops record after attaching,
    with the reason and exit status 1; nothing is sampled or printed."""
    target = start_target(str(targets / "chain"), "30")
    code = (
        "import sys\n"
        "from tramprof.commands.cli import main\n"
        "import tramprof.commands.privileges as p\n"
        "p._other_threads = lambda: ['1 (injected)']\n"
        f"sys.exit(main(['record', '--pid', '{target.pid}', '--duration', '2']))\n")
    python = str(Path(TRAMPROF).parent / "python")
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result
    assert "cannot drop privileges after start-up" in result.stderr
    assert result.stdout == ""


def test_daemon_drops_after_attaching_and_still_serves_stacks(targets, start_target):
    target = start_target(str(targets / "chain"), "60")
    d = Daemon("--interval", "1", "--frequency", "199", "--pid", str(target.pid))
    try:
        # /healthz answers only after the drop: every thread (HTTP ones
        # included) holds the runtime set as nobody.
        for status in thread_statuses(d.proc.pid):
            assert_runtime_only(status)
        metrics = d.wait_for_drains(3)
        assert value(metrics, "tramprof_samples_total", process="chain") > 100
        assert "chain_c" in d.get("/metrics")
        folded = parse_folded(d.get(f"/profile?seconds=60&pid={target.pid}"))
        assert share_of_chain(folded) >= 0.95, folded
        for status in thread_statuses(d.proc.pid):
            assert_runtime_only(status)
    finally:
        code = d.stop()
    assert code == 0
    assert "capabilities kept: " in "".join(d.log)


def test_doctor_reports_the_drop_and_samples_after_it(targets, start_target):
    target = start_target(str(targets / "chain"), "30")
    result = subprocess.run([TRAMPROF, "doctor", "--pid", str(target.pid),
                             "--sample-seconds", "1"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"[ok  ] privilege drop: uid 0 -> {NOBODY}" in result.stdout
    assert f"[ok  ] process {target.pid} (chain)" in result.stdout
    assert "[ok  ] sampled frames: " in result.stdout
