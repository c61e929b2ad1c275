"""``tramprof doctor``: checks the host (and optionally one process) and says
what to do about every failure, instead of leaving users to decode a bcc
stack trace.

The host checks run with the privileges doctor was started with (they are
what is being checked, and /proc/kallsyms shows addresses only to a reader
holding CAP_SYSLOG). Then doctor gives up everything but the runtime
capabilities and leaves uid 0, exactly as ``tramprof run`` does after
attaching (and reports how that went): after loading the program when it
samples, right away when it does not. Only then does it read the process
under examination, whose files are the attacker's to choose. If the drop
fails, the process is not examined.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tramprof.commands.privileges import (
    DEFAULT_RUN_AS,
    PrivilegeError,
    drop_after_start,
)
from tramprof.sampler.btf import VMLINUX_BTF, BtfError, KernelBtf
from tramprof.speedups import naming_passes

CAP_SYS_ADMIN = 21
CAP_SYS_PTRACE = 19
CAP_PERFMON = 38
CAP_BPF = 39


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    warning: bool = False  # degrades results but does not stop profiling

    def render(self) -> str:
        mark = "ok  " if self.ok else ("warn" if self.warning else "FAIL")
        text = f"[{mark}] {self.name}: {self.detail}"
        if not self.ok and self.fix:
            text += f"\n       fix: {self.fix}"
        return text


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def effective_caps(status_text: str | None) -> int:
    for line in (status_text or "").splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def check_kernel() -> Check:
    release = platform.release()
    try:
        major, minor = (int(x) for x in release.split(".")[:2])
    except ValueError:
        return Check("kernel", False, f"cannot parse kernel release {release!r}")
    ok = (major, minor) >= (5, 15)
    return Check("kernel", ok, f"Linux {release}",
                 "tramprof needs Linux >= 5.15 (bpf_task_pt_regs, bounded loops)")


def check_btf(path: str = VMLINUX_BTF) -> Check:
    try:
        with KernelBtf(path) as btf:
            btf.field("task_struct.start_boottime")
            btf.field("pt_regs.bp")
    except BtfError as exc:
        return Check("BTF", False, str(exc),
                     "use a kernel built with CONFIG_DEBUG_INFO_BTF=y (all major distros)")
    return Check("BTF", True, f"{path}: kernel struct offsets readable")


def check_headers() -> Check:
    build = f"/lib/modules/{platform.release()}/build"
    if os.path.exists(os.path.join(build, "include")) or os.path.exists(
            os.path.join(build, "Makefile")):
        target = os.path.realpath(build)
        exact = platform.release() in target
        detail = f"{build} -> {target}" + ("" if exact else " (generic headers, not this "
                                                          "kernel's; fine for bcc)")
        return Check("kernel headers", True, detail)
    return Check("kernel headers", False, f"{build} missing; bcc cannot compile the program",
                 "run `make setup` (or deploy/install-deps.sh) as root")


def _uid(status_text: str | None) -> str:
    for line in (status_text or "").splitlines():
        if line.startswith("Uid:"):
            return line.split()[2]  # real, effective, saved, fs
    return "?"


def check_privileges(status_text: str | None = None) -> Check:
    status_text = status_text if status_text is not None else _read("/proc/self/status")
    caps = effective_caps(status_text)
    has = {name for bit, name in ((CAP_SYS_ADMIN, "CAP_SYS_ADMIN"), (CAP_BPF, "CAP_BPF"),
                                  (CAP_PERFMON, "CAP_PERFMON"),
                                  (CAP_SYS_PTRACE, "CAP_SYS_PTRACE")) if caps >> bit & 1}
    bpf_ok = "CAP_SYS_ADMIN" in has or {"CAP_BPF", "CAP_PERFMON"} <= has
    ptrace_ok = "CAP_SYS_PTRACE" in has
    detail = f"uid {_uid(status_text)}, effective: " + (
        ", ".join(sorted(has)) or "none of the needed capabilities")
    if not bpf_ok:
        return Check("privileges", False, detail,
                      "run as root, or grant CAP_BPF + CAP_PERFMON (+ CAP_SYS_PTRACE to read "
                      "other users' /proc/PID/maps and perf maps)")
    if not ptrace_ok:
        return Check("privileges", False, detail,
                     "grant CAP_SYS_PTRACE, or other users' processes stay unsymbolized",
                     warning=True)
    return Check("privileges", True, detail)


def check_paranoid(text: str | None = None) -> Check:
    value = text if text is not None else _read("/proc/sys/kernel/perf_event_paranoid")
    if value is None:
        return Check("perf_event_paranoid", False, "unreadable", "mount /proc")
    level = int(value.strip())
    # With CAP_PERFMON (or root) any level works; without it, system-wide
    # sampling needs <= 0. Levels > 2 (Debian's 3) block unprivileged use entirely.
    detail = f"{level} (privileged users are unaffected)"
    return Check("perf_event_paranoid", True, detail)


def check_bcc() -> Check:
    try:
        import bcc

        version = getattr(bcc, "__version__", "unknown version")
    except ImportError as exc:
        return Check("bcc", False, f"not importable: {exc}",
                     "install python3-bpfcc (`make setup`) and use a venv with "
                     "--system-site-packages")
    return Check("bcc", True, f"bcc {version}")


def check_kallsyms(path: str = "/proc/kallsyms") -> Check:
    try:
        with open(path) as f:
            for line in f:
                addr = line.split(" ", 1)[0]
                if int(addr, 16) != 0:
                    return Check("kernel symbols", True, f"{path} readable")
                break
    except OSError as exc:
        return Check("kernel symbols", False, f"{path}: {exc.strerror}", "mount /proc",
                     warning=True)
    return Check("kernel symbols", False, f"{path} shows zero addresses",
                 "run as root or set kernel.kptr_restrict=0; kernel frames stay unnamed",
                 warning=True)


def check_compiled_naming() -> Check:
    """The compiled part only saves CPU: without it every stack is named the
    same, in Python."""
    if naming_passes() == "compiled":
        return Check("compiled naming", True, "tramprof._speedups names the frames of a stack")
    return Check("compiled naming", False,
                 "tramprof._speedups is not built: stacks are named in Python alone "
                 "(the same names, ~2.5x the CPU a stack)",
                 "install gcc and python3-dev, then reinstall tramprof (`make setup`)",
                 warning=True)


HOST_CHECKS: tuple[Callable[[], Check], ...] = (
    check_kernel, check_btf, check_headers, check_privileges, check_paranoid, check_bcc,
    check_kallsyms, check_compiled_naming,
)


def check_process(pid: int, proc_root: str = "/proc") -> list[Check]:
    """What tramprof can see of one process, and how it will unwind it."""
    from tramprof.procfs.identity import read_comm
    from tramprof.procfs.maps import read_maps

    checks = []
    try:
        comm = read_comm(pid, proc_root)
        maps = read_maps(pid, proc_root)
    except Exception as exc:
        return [Check(f"process {pid}", False, f"cannot read /proc/{pid}: {exc}",
                      "check the pid; reading other users' processes needs CAP_SYS_PTRACE")]
    exec_maps = [m for m in maps if m.is_exec]
    files = [m for m in exec_maps if m.is_file_backed]
    anon = [m for m in exec_maps if m.is_anonymous_exec]
    checks.append(Check(f"process {pid} ({comm})", True,
                        f"{len(files)} executable file mappings, {len(anon)} anonymous "
                        "executable mappings (JIT code or trampolines)"))
    checks.append(check_unwinding_mode(pid, maps, proc_root))
    checks.append(check_native_unwinding(pid, maps, proc_root))
    checks.append(check_injection(pid, proc_root))
    checks.extend(check_jit_files(pid, proc_root, expect=bool(anon)))
    return checks


def check_injection(pid: int, proc_root: str = "/proc") -> Check:
    """Could ``tramprof inject`` (or the daemon's inject policy) turn
    trampolines on in this process, and how; nothing is changed."""
    from tramprof.inject.target import PEP768_FROM, Refused, inspect

    try:
        target = inspect(pid, proc_root)
    except Refused as refused:
        fine = refused.reason in ("already_active", "not_cpython", "self")
        return Check("injection", fine, f"not injectable: {refused.reason}: {refused.detail}",
                     "see README, Injection", warning=not fine)
    how = "PEP 768 remote execution" if target.version >= PEP768_FROM else \
        "a ptrace-scheduled pending call"
    return Check("injection", True, f"CPython {target.version_text}: `tramprof inject "
                 f"{pid}` would use {how}")


def check_unwinding_mode(pid: int, maps: list[Any], proc_root: str = "/proc") -> Check:
    """The mode the daemon would choose, asked of the same modes it runs
    (installing nothing: no BPF program is loaded)."""
    from tramprof.pipeline.profiler import unwind_modes
    from tramprof.unwind.mode import DryRunMaps

    modes = unwind_modes(DryRunMaps(), proc_root)
    modes.consider(pid, maps)
    report = modes.report(pid)
    return Check("unwinding mode", not report.problem, f"{report.mode}: {report.detail}",
                 report.problem, warning=bool(report.problem))


def check_native_unwinding(pid: int, maps: list[Any], proc_root: str = "/proc",
                           timeout: float = 120.0) -> Check:
    """Which of the process's objects keep frame pointers, which get an unwind
    table and why one cannot: their call-frame information is compiled here
    as the daemon would (nothing is loaded)."""
    from tramprof.config import Config
    from tramprof.unwind.mode import DryRunMaps
    from tramprof.unwind.tables import TableMode

    mode = TableMode(DryRunMaps(), Config().unwind_table_bytes, proc_root)
    try:
        mode.consider(pid, maps)
        mode.want_all(pid)
        mode.refresh({pid})
        mode.wait_for_builds(timeout)
        mode.refresh({pid})
        report = mode.report(pid)
    finally:
        mode.close()
    if report is None:
        return Check("native unwinding", True, "no executable objects to look at")
    return Check("native unwinding", not report.problem, report.detail, report.problem,
                 warning=bool(report.problem))


_REFUSAL_FIX = {
    "missing": "the runtime writes no perf map: CPython 3.12+ `-X perf`, node "
               "`--perf-basic-prof`, JVM perf-map-agent, .NET DOTNET_PerfMapEnabled=1",
    "stale": "the file is older than the process (left by an earlier process with this "
             "pid); it is used once the process writes to it",
    "foreign_owner": "the file is not owned by the process's user or root: something else "
                     "planted it; it is ignored",
    "symlink": "the path is a symlink; perf maps are opened without following links",
    "permission": "the daemon may not read it: grant CAP_DAC_READ_SEARCH or run as root",
}


def check_jit_files(pid: int, proc_root: str, expect: bool) -> list[Check]:
    """Where the perf map / jitdump were looked for and whether they are used."""
    from tramprof.procfs.identity import read_start_ticks
    from tramprof.symbols.jit import JitSymbols

    try:
        ticks = read_start_ticks(pid, proc_root)
        jit = JitSymbols(pid, ticks * (1_000_000_000 // os.sysconf("SC_CLK_TCK")),
                         proc_root=proc_root)
        sources = jit.report()
    except Exception as exc:
        return [Check("JIT symbols", False, f"cannot look for perf maps: {exc}")]
    checks = []
    any_used = any(source.used for source in sources)
    for name, source in zip(("perf map", "jitdump"), sources, strict=True):
        if source.used:
            checks.append(Check(name, True, f"{source.path}: used, {source.entries} symbols"))
        elif source.refused is None:
            checks.append(Check(name, True, f"{source.path}: present, no symbols yet"))
        else:
            # A missing file is fine when the other one names the code, or
            # when the process has no anonymous code to name.
            fine = source.refused == "missing" and (any_used or not expect)
            checks.append(Check(name, fine, f"{source.path}: not used ({source.refused})",
                                _REFUSAL_FIX.get(source.refused, ""), warning=True))
    return checks


def check_privilege_drop(run_as: tuple[int, int] | None = DEFAULT_RUN_AS) -> Check:
    """Drop to what ``tramprof run`` keeps after start-up, and say how it went.
    Irreversible: call it once, after the host checks (and after loading the
    program, if sampling)."""
    name = "privilege drop"
    try:
        dropped = drop_after_start(run_as)
    except PrivilegeError as exc:
        return Check(name, False, f"{exc}; not examining any process with more privileges "
                     "than intended", "`tramprof run` refuses to start here for the same "
                     "reason: run it from the main thread, as root or with the capabilities "
                     "of deploy/systemd/tramprof.service")
    if dropped is None:
        return Check(name, True, f"nothing to drop: uid {os.geteuid()}, no capabilities")
    detail = (f"{dropped.identity()}; kept {', '.join(dropped.kept) or 'nothing'}, "
              f"dropped {len(dropped.dropped)} others, as `tramprof run` does after attaching")
    if dropped.stayed_root and dropped.uid_note:
        return Check(name, False, detail,
                     "grant CAP_SETUID and CAP_SETGID for start-up (dropped right after it) "
                     "so that tramprof leaves uid 0", warning=True)
    return Check(name, True, detail)


def start_sampling(pid: int) -> Any:
    """Load and attach the sampler for one process (needs the start-up privileges)."""
    from tramprof.config import Config
    from tramprof.pipeline.profiler import Profiler

    profiler = Profiler(Config(pids=(pid,), frequency=199))
    try:
        profiler.start()
    except BaseException:
        profiler.close()
        raise
    return profiler


def check_sampled_resolution(pid: int, seconds: float, profiler: Any) -> Check:
    """Samples the process briefly and reports how many JIT frames got names.
    ``profiler`` comes from ``start_sampling``, privileges dropped since
    (``run`` does both); it is closed here."""
    try:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            profiler.wait(left)
        stacks = profiler.collect()
        jit = profiler.registry.jit_for(pid)
    except Exception as exc:
        return Check("sampled frames", False, f"cannot sample pid {pid}: {exc}", warning=True)
    finally:
        profiler.close()
    samples = sum(s.count for s in stacks)
    if jit is None or jit.lookups == 0:
        return Check("sampled frames", True,
                     f"{samples} samples in {seconds:.0f} s; none in anonymous executable memory")
    share = jit.resolved / jit.lookups
    return Check("sampled frames", share >= 0.9,
                 f"{samples} samples; {share:.0%} of frames in anonymous executable memory "
                 "named from the perf map / jitdump",
                 "unnamed JIT frames: the runtime has not written names for that code "
                 "(see the perf map lines above)", warning=True)


def run(pid: int | None = None, proc_root: str = "/proc",
        sample_seconds: float = 0.0,
        run_as: tuple[int, int] | None = DEFAULT_RUN_AS) -> tuple[list[Check], bool]:
    checks = [check() for check in HOST_CHECKS]
    profiler = None
    sampled: Check | None = None
    if pid is not None and sample_seconds > 0 and os.geteuid() == 0:
        try:
            profiler = start_sampling(pid)
        except Exception as exc:
            sampled = Check("sampled frames", False, f"cannot sample pid {pid}: {exc}",
                            warning=True)
    drop = check_privilege_drop(run_as)
    checks.append(drop)
    if not drop.ok and not drop.warning:
        if profiler is not None:
            profiler.close()
        return checks, False
    if pid is not None:
        checks.extend(check_process(pid, proc_root))
        if profiler is not None:
            sampled = check_sampled_resolution(pid, sample_seconds, profiler)
        if sampled is not None:
            checks.append(sampled)
    ok = all(c.ok or c.warning for c in checks)
    return checks, ok
