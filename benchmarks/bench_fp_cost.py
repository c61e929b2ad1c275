"""Cost of tramprof's frame-pointer path per sample, against bcc's `profile` (root).

1. BPF run time per sample, side by side: tramprof and `profile-bpfcc`
   (user stacks by bpf_get_stackid() into a stack map, counted in a hash;
   `-U`: user stacks only, default: kernel stacks too) run at the same time,
   at 999 Hz, filtered to one frame-pointer-built workload pinned to one CPU
   (benchmarks/deep.c at 5 and at 60 frames). The kernel's BPF statistics
   (run_time_ns, run_cnt of every program the profiler's process holds) give
   the time; a tail-called program (tramprof's table_step_run, scan_step)
   runs inside its caller's accounting, so it is counted in the entry
   program's time and its own run_cnt stays 0.
   Samples of other processes are filtered out by every profiler but still
   cost a little: each round first measures that with the workload stopped
   (SIGSTOP), then the workload running, and charges the difference to the
   workload's samples (its CPU time / the sampling period).
   Profilers sampling the same CPU interfere (one finds caches warmed by
   another, depending on the phase of their timers), so the profilers are
   started afresh for each of --setups setups, in rotated order; figures are
   medians over all rounds of all setups, ratios medians of per-round ratios.
   tramprof runs with unwind tables off: the plain frame-pointer path. With
   --tables, also a tramprof with them on, measured once it walks the libc
   frames (no frame pointers on Debian) with tables: the steady state of a
   frame-pointer-built program under the default settings.
   --baseline REV adds tramprof as of git revision REV (daemon and BPF).
2. Workload slowdown: benchmarks/work.c pinned to one CPU, alternately with
   no profiler, tramprof, `profile-bpfcc -U` and `profile-bpfcc`, all at
   999 Hz on every process (order rotated every round). The profilers' own
   processes are pinned to the other CPUs: what reaches the workload is the
   sampling interrupt and the BPF program. Its CPU time is compared (the
   kernel's run time, which includes the interrupts it suffered), and its
   wall time, which also holds the waits for its CPU that other processes
   cause on a shared machine.

    .venv/bin/python benchmarks/bench_fp_cost.py [--baseline HEAD] [--tables]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import itertools
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HERE = REPO / "benchmarks"
TRAMPROF = str(Path(sys.executable).parent / "tramprof")
FREQUENCY = 999
# cpu-clock turns a frequency into a fixed period (ns) when the event is opened.
PERIOD_NS = 1_000_000_000 // FREQUENCY
BPF_STATS_RUN_TIME = 0
REFERENCE = "profile-bpfcc -U"
TABLES = "tramprof, tables on"
EH_FRAME_SAMPLES = 'tramprof_unwind_samples_total{mode="eh_frame"}'


def profile_tool() -> str | None:
    bundled = Path("/usr/share/bcc/tools/profile")
    return shutil.which("profile-bpfcc") or (str(bundled) if bundled.exists() else None)


@contextlib.contextmanager
def bpf_run_time_stats() -> Iterator[None]:
    """The kernel accounts BPF run time while this descriptor is open."""
    lib = ctypes.CDLL(ctypes.util.find_library("bpf") or "libbpf.so.1", use_errno=True)
    lib.bpf_enable_stats.argtypes = [ctypes.c_int]
    fd = lib.bpf_enable_stats(BPF_STATS_RUN_TIME)
    if fd < 0:
        sys.exit(f"bench_fp_cost: cannot enable BPF run-time statistics (errno {-fd})")
    try:
        yield
    finally:
        os.close(fd)


def _fds(pid: int, kind: str) -> Iterator[str]:
    """Descriptor numbers of `pid` whose link is `kind`."""
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) == kind:
                    yield fd.name


def bpf_programs(pid: int) -> dict[int, tuple[int, int]]:
    """prog id -> (run_time_ns, run_cnt) of every BPF program `pid` holds."""
    programs = {}
    for fd in _fds(pid, "anon_inode:bpf-prog"):
        try:
            text = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except OSError:
            continue
        info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        programs[int(info["prog_id"])] = (int(info["run_time_ns"]), int(info["run_cnt"]))
    return programs


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ns(pid: int) -> int:
    """Time `pid` has run on a CPU (schedstat: ns, not clock ticks)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def other_cpus(cpu: int) -> str:
    cpus = [c for c in sorted(os.sched_getaffinity(0)) if c != cpu]
    return ",".join(map(str, cpus or [cpu]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def revision_root(rev: str, into: Path) -> Path:
    """A package root (for PYTHONPATH) holding tramprof as of git revision
    `rev`: its daemon with its BPF sources, which share record layouts."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "daemon/tramprof", "bpf"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "bpf").rename(into / "daemon" / "tramprof" / "bpf")
    return into / "daemon"


@dataclass
class Profiler:
    """One profiler process; its BPF programs are read through /proc."""

    label: str
    argv: list[str]
    env: dict[str, str] | None = None
    metrics_port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self, cpus: str) -> None:
        self.proc = subprocess.Popen(["taskset", "-c", cpus, *self.argv], env=self.env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def attached(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.label} exited with status {self.proc.returncode}")
        return (bool(bpf_programs(self.pid))
                and any(True for _ in _fds(self.pid, "anon_inode:[perf_event]")))

    def bpf(self) -> tuple[int, int]:
        """(run time ns, runs) of its programs; runs are the entry program's
        (tail-called programs run inside its accounting)."""
        programs = bpf_programs(self.pid).values()
        return sum(t for t, _ in programs), max((n for _, n in programs), default=0)

    def metric(self, name: str) -> float:
        """Sum of the tramprof metric lines starting with `name`."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=10) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name))

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass(frozen=True)
class Spec:
    """How to start one profiler: a fresh process per setup."""

    label: str
    kind: str                  # "tramprof" | "profile"
    config: str = ""           # tramprof: TOML text
    root: Path | None = None   # tramprof: package root of another revision
    user_only: bool = False    # profile: -U

    def make(self, pid: int | None, tmp: Path, tool: str | None) -> Profiler:
        if self.kind == "profile":
            assert tool is not None
            argv = [tool, "-F", str(FREQUENCY), "-f"] + (["-U"] if self.user_only else [])
            return Profiler(self.label, argv + ([] if pid is None else ["-p", str(pid)]))
        config = tmp / f"{abs(hash(self.config))}.toml"
        config.write_text(self.config)
        port = free_port()
        argv = [TRAMPROF, "run", "--config", str(config), "--frequency", str(FREQUENCY),
                "--listen", f"127.0.0.1:{port}", "--log-level", "warning"]
        env = None if self.root is None else {**os.environ, "PYTHONPATH": str(self.root)}
        return Profiler(self.label, argv + ([] if pid is None else ["--pid", str(pid)]),
                        env, port)


def wait_attached(profilers: list[Profiler], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    for p in profilers:
        while not p.attached():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{p.label} did not attach within {timeout:.0f} s")
            time.sleep(0.5)


def window(profilers: list[Profiler], workload: int, seconds: float
           ) -> tuple[dict[str, tuple[int, int]], int]:
    """(label -> (BPF ns, runs), workload CPU ns) over `seconds`."""
    before = {p.label: p.bpf() for p in profilers}
    cpu0 = cpu_ns(workload)
    time.sleep(seconds)
    after = {p.label: p.bpf() for p in profilers}
    cpu1 = cpu_ns(workload)
    return ({label: (after[label][0] - before[label][0], after[label][1] - before[label][1])
             for label in before}, cpu1 - cpu0)


@dataclass
class Costs:
    per_sample: dict[str, list[float]] = field(default_factory=dict)
    other: dict[str, list[float]] = field(default_factory=dict)
    table_share: list[float] = field(default_factory=list)

    def add(self, label: str, per_sample: float, other: float) -> None:
        self.per_sample.setdefault(label, []).append(per_sample)
        self.other.setdefault(label, []).append(other)


def one_setup(specs: list[Spec], workload: subprocess.Popen[bytes], cpu: int,
              args: argparse.Namespace, tool: str | None, tmp: Path, costs: Costs) -> None:
    profilers = [s.make(workload.pid, tmp, tool) for s in specs]
    try:
        for p in profilers:  # compiles run side by side on the other CPUs
            p.start(other_cpus(cpu))
        wait_attached(profilers)
        time.sleep(args.warmup)
        tabled = next((p for p in profilers if p.label == TABLES), None)
        if tabled is not None:  # until the libc table is in and used
            deadline = time.monotonic() + 180
            while tabled.metric(EH_FRAME_SAMPLES) < 200 and time.monotonic() < deadline:
                time.sleep(2)
            eh0, all0 = tabled.metric(EH_FRAME_SAMPLES), tabled.metric(
                "tramprof_unwind_samples_total")
        for _ in range(args.rounds):
            workload.send_signal(signal.SIGSTOP)
            time.sleep(0.2)
            idle, _ = window(profilers, workload.pid, args.stopped_seconds)
            workload.send_signal(signal.SIGCONT)
            time.sleep(0.2)
            busy, ran_ns = window(profilers, workload.pid, args.seconds)
            samples = ran_ns / PERIOD_NS
            for label, (ns, runs) in busy.items():
                idle_ns, idle_runs = idle[label]
                other = idle_ns / max(1, idle_runs)
                costs.add(label, (ns - max(0.0, runs - samples) * other) / max(1.0, samples),
                          other)
        if tabled is not None:
            # eh_frame stacks are counted under fp (or chain, scan) as well.
            eh = tabled.metric(EH_FRAME_SAMPLES) - eh0
            total = tabled.metric("tramprof_unwind_samples_total") - all0 - eh
            costs.table_share.append(eh / max(1.0, total))
    finally:
        workload.send_signal(signal.SIGCONT)
        for p in profilers:
            p.stop()


def per_sample_cost(exe: str, depth: int, cpu: int, specs: list[Spec], args: argparse.Namespace,
                    tool: str | None, tmp: Path) -> None:
    workload = subprocess.Popen(["taskset", "-c", str(cpu), exe, "100000", str(depth)],
                                stdout=subprocess.PIPE)
    assert workload.stdout is not None and workload.stdout.readline() == b"ready\n"
    costs = Costs()
    try:
        for setup in range(args.setups):
            shift = setup % len(specs)
            one_setup(specs[shift:] + specs[:shift], workload, cpu, args, tool, tmp, costs)
    finally:
        workload.kill()
        workload.wait()
    reference = REFERENCE if REFERENCE in costs.per_sample else specs[0].label
    rounds = len(costs.per_sample[reference])
    print(f"{depth} frames: {args.setups} setups x {args.rounds} rounds of {args.seconds:g} s "
          f"(each after {args.stopped_seconds:g} s with the workload stopped)")
    print(f"  {'profiler':22} {'ns/sample':>9} {'quartiles':>13} {'vs ' + reference:>20} "
          f"{'other runs ns':>13}")
    for spec in specs:
        values = costs.per_sample[spec.label]
        q1, q2, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
        ratios = [v / r for v, r in zip(values, costs.per_sample[reference], strict=True)
                  if r > 0]
        note = ""
        if spec.label == TABLES and costs.table_share:
            note = f"  (table walk: {statistics.median(costs.table_share):.0%} of samples)"
        other = statistics.median(costs.other[spec.label])
        print(f"  {spec.label:22} {q2:9.0f} {q1:6.0f}..{q3:<6.0f} "
              f"{statistics.median(ratios):20.2f} {other:13.0f}{note}")
    assert all(len(v) == rounds for v in costs.per_sample.values())


def run_timed(argv: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of one run. The CPU time (the kernel's exact run time:
    this kernel charges interrupt time, so the sampling interrupt's, to the
    task it interrupts) leaves out the time spent waiting for a CPU that
    other processes on a shared machine took."""
    began = time.perf_counter()
    proc = subprocess.Popen(argv)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, argv)
    return time.perf_counter() - began, usage.ru_utime + usage.ru_stime


def slowdown(work: str, cpu: int, specs: list[Spec], args: argparse.Namespace,
             tool: str | None, tmp: Path) -> None:
    modes: list[Spec | None] = [None, *(s for s in specs if s.label != TABLES)]
    argv = ["taskset", "-c", str(cpu), work, str(args.millions)]
    run_timed(argv)  # warm caches, CPU frequency
    runs: dict[str, list[tuple[float, float]]] = {}
    own: dict[str, list[float]] = {}  # the profiler's own CPU s during the run
    for r in range(args.slowdown_rounds):
        for spec in modes[r % len(modes):] + modes[:r % len(modes)]:
            profiler = None if spec is None else spec.make(None, tmp, tool)
            if profiler is not None:
                profiler.start(other_cpus(cpu))
                wait_attached([profiler])
                time.sleep(1)
            try:
                mode = "none" if spec is None else spec.label
                before = 0.0 if profiler is None else process_cpu_s(profiler.pid)
                runs.setdefault(mode, []).append(run_timed(argv))
                if profiler is not None:
                    own.setdefault(mode, []).append(process_cpu_s(profiler.pid) - before)
            finally:
                if profiler is not None:
                    profiler.stop()
    print(f"workload: work.c, {args.millions}M iterations, pinned to CPU {cpu}; profilers at "
          f"{FREQUENCY} Hz on every process, their processes pinned to CPUs {other_cpus(cpu)}; "
          f"{args.slowdown_rounds} rounds, order rotated. CPU: the workload's run time; "
          f"wall: includes waiting for its CPU")
    print(f"  {'mode':22} {'CPU s':>7} {'min':>7} {'max':>7} {'slowdown':>9}   "
          f"{'wall s':>7} {'slowdown':>9}   {'profiler CPU s':>14}")
    base_cpu = statistics.median(c for _, c in runs["none"])
    base_wall = statistics.median(w for w, _ in runs["none"])
    for mode in ["none", *(s.label for s in modes if s is not None)]:
        cpus = [c for _, c in runs[mode]]
        wall = statistics.median(w for w, _ in runs[mode])
        m = statistics.median(cpus)
        print(f"  {mode:22} {m:7.3f} {min(cpus):7.3f} {max(cpus):7.3f} "
              f"{(m / base_cpu - 1) * 100:8.2f}%   "
              f"{wall:7.3f} {(wall / base_wall - 1) * 100:8.2f}%   "
              f"{statistics.median(own.get(mode, [0.0])):14.2f}")
    none = [c for _, c in runs["none"]]
    spread = [abs(a - b) / base_cpu * 100 for a, b in itertools.pairwise(none)]
    if spread:
        print(f"  noise: the CPU time of consecutive no-profiler runs differs by "
              f"{statistics.median(spread):.2f}% (median), at most {max(spread):.2f}%")


def build(out: Path) -> dict[str, str]:
    made = {}
    for name, source in (("deep_fp", "deep.c"), ("work", "work.c")):
        subprocess.run(["gcc", "-O2", "-fno-omit-frame-pointer", "-o", str(out / name),
                        str(HERE / source)], check=True)
        made[name] = str(out / name)
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", type=int, default=3,
                        help="times every profiler is started afresh, in rotated order")
    parser.add_argument("--rounds", type=int, default=4, help="measurement rounds per setup")
    parser.add_argument("--seconds", type=float, default=3, help="running window per round")
    parser.add_argument("--stopped-seconds", type=float, default=1.5,
                        help="window with the workload stopped (other processes' samples)")
    parser.add_argument("--warmup", type=float, default=5,
                        help="seconds after every profiler attached")
    parser.add_argument("--baseline", metavar="REV",
                        help="also tramprof as of this git revision")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=ROOT",
                        help="also tramprof from this package root (PYTHONPATH); repeatable")
    parser.add_argument("--tables", action="store_true",
                        help="also tramprof with unwind tables on (waits for the libc table)")
    parser.add_argument("--depths", default="5,60")
    parser.add_argument("--millions", type=int, default=3000, help="slowdown workload size")
    parser.add_argument("--slowdown-rounds", type=int, default=5)
    parser.add_argument("--parts", default="cost,slowdown",
                        help="comma-separated subset of: cost, slowdown")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_fp_cost: needs root (loads BPF programs, reads their statistics)")
    parts = {p.strip() for p in args.parts.split(",")}
    tool = profile_tool()
    if tool is None:
        print("profile-bpfcc is not installed (Debian package bpfcc-tools): tramprof only")
    cpu = max(os.sched_getaffinity(0))
    no_tables = "unwind_table_bytes = 0\n"
    with tempfile.TemporaryDirectory(prefix="tramprof-fp-cost-") as tmpdir, \
            bpf_run_time_stats():
        tmp = Path(tmpdir)
        specs = [Spec("tramprof", "tramprof", no_tables)]
        if args.baseline:
            specs.append(Spec(f"tramprof@{args.baseline}", "tramprof", no_tables,
                              revision_root(args.baseline, tmp / "baseline")))
        for variant in args.variant:
            label, _, root = variant.partition("=")
            specs.append(Spec(label, "tramprof", no_tables, Path(root)))
        if args.tables:
            specs.append(Spec(TABLES, "tramprof", ""))
        if tool is not None:
            specs += [Spec(REFERENCE, "profile", user_only=True),
                      Spec("profile-bpfcc", "profile")]
        exes = build(tmp)
        if "cost" in parts:
            print(f"BPF run time per sample of a frame-pointer-built workload (deep.c) pinned "
                  f"to CPU {cpu}, cpu-clock at {FREQUENCY} Hz, profilers side by side:")
            for depth in (int(d) for d in args.depths.split(",")):
                per_sample_cost(exes["deep_fp"], depth, cpu, specs, args, tool, tmp)
        if "slowdown" in parts:
            slowdown(exes["work"], cpu, specs, args, tool, tmp)


if __name__ == "__main__":
    main()
