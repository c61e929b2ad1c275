"""`tramprof record` end to end: the real CLI, real BPF, real targets (root)."""

from __future__ import annotations

import os
import subprocess
import time

from tramprof.export.formats.folded import parse_folded

from tests.conftest import TRAMPROF, requires_root

pytestmark = requires_root

# What may stand above main(): libc's start-up code, named if libc has a
# symbol table, else as libc.so.6+0xOFFSET (Debian strips .symtab).
LIBC_START = {"__libc_start_call_main", "__libc_start_main_impl", "__libc_start_main", "_start"}


def is_libc_start(frame: str) -> bool:
    return frame in LIBC_START or frame.startswith("libc.so.6+0x")


def record(pid: int, seconds: float, frequency: int = 999) -> dict[tuple[str, ...], int]:
    result = subprocess.run(
        [TRAMPROF, "record", "--pid", str(pid), "--duration", str(seconds),
         "--frequency", str(frequency)],
        capture_output=True, text=True, timeout=120, check=True)
    return dict(parse_folded(result.stdout))


def test_known_chain_is_exact(targets, start_target):
    target = start_target(str(targets / "chain"), "30")
    stacks = record(target.pid, 3)
    total = sum(stacks.values())
    assert total > 1500, f"expected ~3000 samples at 999 Hz for 3 s, got {total}"

    def exact(stack: tuple[str, ...]) -> bool:
        comm, *frames = stack
        if comm != "chain" or "main" not in frames:
            return False
        at = frames.index("main")
        return (frames[at:] == ["main", "chain_a", "chain_b", "chain_c"]
                and all(is_libc_start(f) for f in frames[:at]))

    good = sum(count for stack, count in stacks.items() if exact(stack))
    assert good / total >= 0.95, sorted(stacks.items(), key=lambda kv: -kv[1])[:5]


def test_a_process_whose_main_thread_exited_keeps_its_names(targets, start_target):
    """Its main thread's /proc entry shows no memory (empty maps, no root);
    the process runs on in another thread and is named through that one's."""
    target = start_target(str(targets / "chain"), "30", "orphan")
    stacks = record(target.pid, 3)
    total = sum(stacks.values())
    assert total > 1500, f"expected ~3000 samples at 999 Hz for 3 s, got {total}"
    good = sum(count for (comm, *frames), count in stacks.items()
               if comm == "chain" and frames[-4:] == ["orphan", "chain_a", "chain_b", "chain_c"])
    assert good / total >= 0.95, sorted(stacks.items(), key=lambda kv: -kv[1])[:5]


def wait_until_sampling(pid: int, timeout: float = 60.0) -> None:
    """Until the process holds perf events (the BPF program is attached)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            links = []
        if any("perf_event" in link for link in links):
            return
        time.sleep(0.05)
    raise AssertionError("the recorder never attached its perf events")


def test_short_lived_processes_are_symbolized(targets):
    """Processes that live 20 ms are named: the daemon reads their maps and
    binaries when they are first sampled, not at the next drain."""
    recorder = subprocess.Popen(
        [TRAMPROF, "record", "--all", "--duration", "8", "--frequency", "999"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until_sampling(recorder.pid)
    subprocess.run(["/bin/sh", "-c",
                    f"for i in $(seq 100); do {targets / 'chain'} 0.02 >/dev/null; done"],
                   check=True, timeout=60)
    out, err = recorder.communicate(timeout=60)
    assert recorder.returncode == 0, err
    stacks = {k: v for k, v in parse_folded(out).items() if k[0] == "chain"}
    total = sum(stacks.values())
    assert total > 500, total
    named = sum(count for stack, count in stacks.items()
                if stack[-4:] == ("main", "chain_a", "chain_b", "chain_c"))
    assert named / total >= 0.8, sorted(stacks.items(), key=lambda kv: -kv[1])[:5]


def test_syscall_shows_the_kernel_read_path(targets, start_target):
    target = start_target(str(targets / "syscall_read"), "30")
    stacks = record(target.pid, 3)
    total = sum(stacks.values())
    assert total > 1500

    def kernel_read(stack: tuple[str, ...]) -> bool:
        frames = stack[1:]
        # libc's read() has no frame of its own, so a frame-pointer walk
        # starting in it skips its caller (read_loop): main -> read is what an
        # FP unwinder can know. Below it, the system call as the kernel names it.
        return ("main" in frames and "read" in frames
                and bool({"ksys_read", "vfs_read"} & set(frames)))

    good = sum(count for stack, count in stacks.items() if kernel_read(stack))
    assert good / total >= 0.5, sorted(stacks.items(), key=lambda kv: -kv[1])[:5]
    # User frames come first (root), kernel frames after them.
    for stack in stacks:
        frames = stack[1:]
        if "vfs_read" in frames and "read" in frames:
            assert frames.index("main") < frames.index("read") < frames.index("vfs_read")
