"""Start-up of ``tramprof run``: memory while the BPF program is compiled,
memory once running, and time until the daemon is healthy (root).

Three variants run side by side, alternating round by round so that load
on the machine affects them alike, each a fresh ``tramprof run`` with its
defaults but for ``program_cache_dir``:

* ``cached``: the daemon as it is, restarted: the program's image is in its
  cache (filled by one uncounted run first), no compiler runs;
* ``child``: the daemon as it is at its first start on a kernel (no cache:
  bcc compiles and loads in a short-lived compiler child, before kallsyms is
  parsed);
* ``in-process``: the same daemon with ``sampler/program.py`` as it was
  before the compiler child (bcc compiled inside the daemon). That file is
  read from git (``--baseline``, default: the revision before the one that
  brought in ``compile_and_load``, or HEAD while that is not committed) and
  imported in place of the current module; nothing in the work tree or the
  repository changes.

Every 5 ms during start-up the daemon's process tree is read from /proc
(VmRSS, RssAnon, VmHWM of the daemon and of each descendant). Reported per
variant (median over rounds, worst in brackets):

* start-up: exec to the first ``/healthz`` that answers 200, and the CPU
  time the tree used until then (user + system, the compiler child's
  included; steadier than wall time on a shared machine);
* peak tree RSS: the largest sum of the tree's VmRSS at one instant (shared
  library pages count once per process, so this over-counts a little), with
  the daemon's and the children's parts at that instant (a child that has
  not called exec yet shares the daemon's pages and is left out), and the
  largest sum of RssAnon (anonymous memory: without swap the kernel cannot
  reclaim it, unlike file pages, so it is what a memory limit must cover);
* VmHWM of the daemon and of the compiler child (exact, not sampled);
* after ``--steady`` seconds: the daemon's VmRSS (RssAnon) and the whole
  tree's (the chunk maker child lives on).

Also, each round, ``tramprof prepare`` as the DaemonSet's init container
runs it: into an empty cache (it compiles: the peak the init container
carries instead of the daemon's) and into the filled one (it only loads the
image): time until it exits, the same peaks. This one depends on what else
  runs on the machine (the daemon profiles every process); start-up figures
  are taken until a second after the first healthy ``/healthz``.

Last, each round, the first start (``child``, empty cache) and a start from
the cache (``cached``), each inside a memory cgroup of its own (v2 or v1),
once limited to ``--limit-mib`` (150 by default) with no swap and once
unlimited: does it become healthy under the limit (within 120 s), how long
it takes, the cgroup's own peak (what the kernel charged: anonymous memory
and the file pages it read first, which it reclaims under the limit) and
its OOM kills. Page cache is dropped before
each of these runs (``/proc/sys/vm/drop_caches``), as on a node where the
compiler's libraries were never read; ``--keep-page-cache`` leaves it.

Run (root): ``.venv/bin/python benchmarks/bench_startup.py [--rounds 3]``
(~7 minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from common import free_port, median

REPO = Path(__file__).resolve().parent.parent
PROGRAM = "daemon/tramprof/sampler/program.py"
MARKER = "compile_and_load"  # only the compiler-child version of program.py has it
MiB = 1024  # KiB in a MiB (/proc reports KiB)
MIB_BYTES = MiB * 1024

# Runs the CLI, first putting the given program.py (if any) in place of
# tramprof.sampler.program. The old Sampler compiled in start(); the current
# profiler calls load() first, which for it has nothing to do.
BOOTSTRAP = """
import importlib.util, sys
path = sys.argv.pop(1)
if path:
    spec = importlib.util.spec_from_file_location("tramprof.sampler.program", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if not hasattr(module.Sampler, "load"):
        module.Sampler.load = lambda self: None
    if not hasattr(module.Sampler, "loaded_from"):  # before the program cache
        original = module.SamplerConfig
        module.SamplerConfig = lambda program_cache_dir="", **settings: original(**settings)
from tramprof.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


def baseline_revision(requested: str | None) -> str:
    if requested:
        return requested
    introduced = subprocess.run(
        ["git", "-C", str(REPO), "log", "--format=%H", "-S", MARKER, "--", PROGRAM],
        capture_output=True, text=True, check=True).stdout.split()
    return f"{introduced[-1]}^" if introduced else "HEAD"


def baseline_program(revision: str, folder: str) -> str:
    text = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:{PROGRAM}"],
                          capture_output=True, text=True, check=True).stdout
    if MARKER in text:
        raise SystemExit(f"{PROGRAM} at {revision} already compiles in a child; "
                         f"pass --baseline REV of an older revision")
    path = Path(folder) / "program.py"
    path.write_text(text)
    return str(path)


def status(pid: int) -> dict[str, int] | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "VmHWM"):
            values[key] = int(rest.split()[0])
    return values if len(values) == 3 else None


def descendants(pid: int) -> list[int]:
    found = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found.append(child)
            found.extend(descendants(child))
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def role(pid: int, daemon: int) -> str:
    """What a process of the tree is; "fork" for a child that has not called
    exec yet (subprocess's fork or vfork): it shows the daemon's own pages."""
    if pid == daemon:
        return "daemon"
    line = cmdline(pid)
    if line == cmdline(daemon):
        return "fork"
    for name in ("compiler", "chunkmaker"):
        if f"tramprof.sampler.{name}".encode() in line:
            return name
    return "other"


def cpu_seconds(pid: int) -> float:
    """User and system time of the process and of its children that ended."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    startup: float = float("nan")
    startup_cpu: float = float("nan")  # CPU seconds of the tree until healthy
    peak_rss: int = 0
    peak_parts: dict[str, int] = field(default_factory=dict)
    peak_anon: int = 0
    hwm: dict[str, int] = field(default_factory=dict)  # by role, the largest
    steady_daemon: tuple[int, int] = (0, 0)  # VmRSS, RssAnon
    steady_tree: tuple[int, int] = (0, 0)


class TreeWatcher(threading.Thread):
    """Samples the daemon's process tree until stopped."""

    def __init__(self, daemon: int, period: float) -> None:
        super().__init__(daemon=True)
        self.pid = daemon
        self.period = period
        self.stopping = threading.Event()
        self.run_data = Run()
        self.roles: dict[int, str] = {}

    def run(self) -> None:
        data = self.run_data
        while not self.stopping.is_set():
            rss = anon = 0
            parts: dict[str, int] = {}
            for pid in [self.pid, *descendants(self.pid)]:
                name = role(pid, self.pid) if self.roles.get(pid) in (None, "fork") \
                    else self.roles[pid]
                self.roles[pid] = name
                values = status(pid)
                if values is None or name == "fork":
                    continue
                rss += values["VmRSS"]
                anon += values["RssAnon"]
                parts[name] = parts.get(name, 0) + values["VmRSS"]
                data.hwm[name] = max(data.hwm.get(name, 0), values["VmHWM"])
            if rss > data.peak_rss:
                data.peak_rss, data.peak_parts = rss, parts
            data.peak_anon = max(data.peak_anon, anon)
            time.sleep(self.period)


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@dataclass(frozen=True)
class Variant:
    program: str  # a program.py to use in place of the current one, or ""
    config: str  # the configuration file (program_cache_dir)


def one_run(variant: Variant, steady: float, cgroup: MemoryCgroup | None = None) -> Run:
    with tempfile.TemporaryFile(mode="w+") as log:  # a pipe nobody reads could block it
        return measure(variant, steady, log, cgroup)


class MemoryCgroup:
    """A memory cgroup of its own for one run (cgroup v2, else v1's memory
    hierarchy): a limit without swap, or none; its peak and OOM kills."""

    def __init__(self, name: str, limit_bytes: int | None) -> None:
        unified = Path("/sys/fs/cgroup")
        if (unified / "cgroup.controllers").exists():
            self.v2, parent = True, unified
            if "memory" not in (unified / "cgroup.subtree_control").read_text().split():
                raise SystemExit("cgroup v2 without the memory controller enabled at the root")
        elif (unified / "memory" / "memory.limit_in_bytes").exists():
            self.v2, parent = False, unified / "memory"
        else:
            raise SystemExit("no memory cgroup controller mounted")
        self.path = parent / name
        self.path.mkdir()
        if limit_bytes is not None:
            if self.v2:
                self._write("memory.max", limit_bytes)
                if (self.path / "memory.swap.max").exists():
                    self._write("memory.swap.max", 0)
            else:
                self._write("memory.limit_in_bytes", limit_bytes)
                if (self.path / "memory.memsw.limit_in_bytes").exists():
                    self._write("memory.memsw.limit_in_bytes", limit_bytes)

    def _write(self, name: str, value: int) -> None:
        (self.path / name).write_text(f"{value}\n")

    def enter(self) -> None:
        """In the child between fork and exec: move itself in."""
        (self.path / "cgroup.procs").write_text(f"{os.getpid()}\n")

    def peak_bytes(self) -> int:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        return int((self.path / name).read_text())

    def oom_kills(self) -> int:
        name = "memory.events" if self.v2 else "memory.oom_control"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        """Ends what is left in it (a compiler child whose daemon was
        stopped), then removes it."""
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.path.rmdir()
                return
            except OSError:  # the last task is still leaving
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


@dataclass
class LimitedRun:
    healthy: bool
    startup: float          # seconds until healthy (nan if it was not)
    peak: int               # the cgroup's peak, bytes
    oom_kills: int
    failure: str = ""


def limited_run(config: str, limit_bytes: int | None, drop_cache: bool) -> LimitedRun:
    """One start with ``config`` in a cgroup of its own, limited or not."""
    if drop_cache:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    cgroup = MemoryCgroup(f"tramprof-bench-{os.getpid()}-{time.monotonic_ns()}", limit_bytes)
    try:
        try:
            startup, failure = one_run(Variant("", config), 1, cgroup).startup, ""
        except RuntimeError as exc:  # it ended before /healthz answered
            startup, failure = float("nan"), str(exc).splitlines()[-1][:200]
        return LimitedRun(not failure, startup, cgroup.peak_bytes(), cgroup.oom_kills(),
                          failure)
    finally:
        cgroup.remove()


def under_limit(uncached: str, cached: str, rounds: int, limit_mib: int,
                drop_cache: bool) -> None:
    """The first start on a node (configuration ``uncached``), and a start
    from the program cache (``cached``: the DaemonSet's daemon container after
    its init container), each under a tight memory limit next to the same
    start without one."""
    limit = limit_mib * MIB_BYTES
    cases = {f"first start, limit {limit_mib} MiB": (uncached, limit),
             "first start, no limit": (uncached, None),
             f"start from the cache, limit {limit_mib} MiB": (cached, limit),
             "start from the cache, no limit": (cached, None)}
    runs: dict[str, list[LimitedRun]] = {name: [] for name in cases}
    for r in range(rounds):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))
        for name in order:
            config, limit_bytes = cases[name]
            run = limited_run(config, limit_bytes, drop_cache)
            runs[name].append(run)
            print(f"  round {r + 1} {name}: " + (
                f"healthy in {run.startup:.2f} s" if run.healthy else
                f"never healthy ({run.failure})") +
                f", cgroup peak {run.peak / MIB_BYTES:.0f} MiB, OOM kills {run.oom_kills}",
                flush=True)
    for name, results in runs.items():
        started = [r.startup for r in results if r.healthy]
        print(f"{name}:")
        print(f"  healthy in {len(started)} of {len(results)} runs" + (
            f", after {stat(started, '{:.2f}')} s" if started else ""))
        print(f"  cgroup peak: {stat([r.peak / MIB_BYTES for r in results])} MiB, "
              f"OOM kills {sum(r.oom_kills for r in results)}")


def measure(variant: Variant, steady: float, log: IO[str],
            cgroup: MemoryCgroup | None = None) -> Run:
    port = free_port()
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", BOOTSTRAP, variant.program, "run",
                             "--config", variant.config, "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=log,
                            preexec_fn=cgroup.enter if cgroup else None)
    try:
        data = watch_startup(proc, port, began, log)
        # Later growth depends on what else runs on the machine (every
        # process is profiled), so it is read once, apart from start-up.
        time.sleep(max(0.0, steady - 1))
        values = status(proc.pid)
        tree = [v for v in map(status, [proc.pid, *descendants(proc.pid)]) if v]
        if values is not None:
            data.steady_daemon = (values["VmRSS"], values["RssAnon"])
        data.steady_tree = (sum(v["VmRSS"] for v in tree), sum(v["RssAnon"] for v in tree))
        return data
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def watch_startup(proc: subprocess.Popen[bytes], port: int, began: float,
                  log: IO[str]) -> Run:
    """The tree's memory from exec until a second after the first healthy
    /healthz (the last start-up work)."""
    watcher = TreeWatcher(proc.pid, 0.005)
    watcher.start()
    try:
        while not healthy(port):
            if proc.poll() is not None or time.monotonic() - began > 120:
                log.seek(0)
                raise RuntimeError(f"the daemon did not start:\n{log.read()[-3000:]}")
            time.sleep(0.02)
        startup = time.monotonic() - began
        startup_cpu = cpu_seconds(proc.pid)
        time.sleep(1)
    finally:
        watcher.stopping.set()
        watcher.join()
    watcher.run_data.startup = startup
    watcher.run_data.startup_cpu = startup_cpu
    return watcher.run_data


def prepare_run(config: str) -> Run:
    """``tramprof prepare --config``: its tree's memory until it exits."""
    began = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen([sys.executable, "-c", BOOTSTRAP, "", "prepare",
                                 "--config", config], stdout=subprocess.DEVNULL, stderr=log)
        watcher = TreeWatcher(proc.pid, 0.005)
        watcher.start()
        try:
            exit_status = proc.wait(timeout=600)
        finally:
            watcher.stopping.set()
            watcher.join()
        if exit_status != 0:
            log.seek(0)
            raise RuntimeError(f"tramprof prepare failed ({exit_status}):\n{log.read()[-3000:]}")
    watcher.run_data.startup = time.monotonic() - began
    return watcher.run_data


def mib(kib: float) -> str:
    return f"{kib / MiB:.0f}"


def stat(values: list[float], fmt: str = "{:.0f}") -> str:
    """Median [worst]."""
    return f"{fmt.format(median(values))} [{fmt.format(max(values))}]"


def mstat(values: list[int]) -> str:
    return stat([v / MiB for v in values])


def print_peaks(runs: list[Run]) -> None:
    worst = max(runs, key=lambda r: r.peak_rss)
    parts = ", ".join(f"{role} {mib(kib)}" for role, kib in sorted(worst.peak_parts.items()))
    print(f"  peak tree RSS:  {mstat([r.peak_rss for r in runs])} MiB "
          f"(at the worst instant: {parts})")
    print(f"  peak tree anon: {mstat([r.peak_anon for r in runs])} MiB")


def summary(name: str, runs: list[Run]) -> None:
    print(f"{name}:")
    print(f"  start-up (exec to healthy): {stat([r.startup for r in runs], '{:.2f}')} s, "
          f"CPU {stat([r.startup_cpu for r in runs], '{:.2f}')} s")
    print_peaks(runs)
    for role_name in ("daemon", "compiler", "chunkmaker"):
        values = [r.hwm[role_name] for r in runs if role_name in r.hwm]
        if values:
            print(f"  VmHWM {role_name + ':':11} {mstat(values)} MiB")
    print(f"  after the steady wait: daemon {mstat([r.steady_daemon[0] for r in runs])} MiB "
          f"(anon {mstat([r.steady_daemon[1] for r in runs])}), whole tree "
          f"{mstat([r.steady_tree[0] for r in runs])} MiB "
          f"(anon {mstat([r.steady_tree[1] for r in runs])})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steady", type=float, default=30,
                        help="seconds after /healthz before the steady reading")
    parser.add_argument("--baseline", metavar="REV",
                        help=f"git revision of the in-process {PROGRAM}")
    parser.add_argument("--limit-mib", type=int, default=150,
                        help="memory limit of the limited starts")
    parser.add_argument("--keep-page-cache", action="store_true",
                        help="do not drop the page cache before the limited runs")
    parser.add_argument("--only-limit", action="store_true",
                        help="only the starts with and without the limit")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench_startup.py needs root (the daemon loads BPF programs)")
    revision = baseline_revision(args.baseline)
    with tempfile.TemporaryDirectory(prefix="tramprof-bench-startup-") as folder:
        uncached, cached = Path(folder) / "uncached.toml", Path(folder) / "cached.toml"
        uncached.write_text('program_cache_dir = ""\n')
        cached.write_text(f'program_cache_dir = "{folder}/cache"\n')
        variants = {"in-process": Variant(baseline_program(revision, folder), str(uncached)),
                    "child": Variant("", str(uncached)), "cached": Variant("", str(cached))}
        warm = one_run(variants["cached"], 1)
        print(f"  filling the cache: healthy in {warm.startup:.2f} s", flush=True)
        if not args.only_limit:
            compare(variants, revision, args.rounds, args.steady)
            prepare(folder, args.rounds)
        under_limit(variants["child"].config, variants["cached"].config, args.rounds,
                    args.limit_mib, not args.keep_page_cache)


def prepare(folder: str, rounds: int) -> None:
    """The init container's command, compiling and on a cache hit."""
    runs: dict[str, list[Run]] = {"prepare, empty cache": [], "prepare, cache hit": []}
    for r in range(rounds):
        config = Path(folder) / f"prepare-{r}.toml"
        config.write_text(f'program_cache_dir = "{folder}/prepare-{r}"\n')
        for name in runs:
            run = prepare_run(str(config))
            runs[name].append(run)
            print(f"  round {r + 1} {name}: exited after {run.startup:.2f} s, peak tree "
                  f"{mib(run.peak_rss)} MiB (anon {mib(run.peak_anon)})", flush=True)
    for name, results in runs.items():
        print(f"{name}:")
        print(f"  until it exits: {stat([r.startup for r in results], '{:.2f}')} s")
        print_peaks(results)


def compare(variants: dict[str, Variant], revision: str, rounds: int, steady: float) -> None:
    print(f"baseline: {PROGRAM} at {revision}; {rounds} rounds, steady reading "
          f"{steady:.0f} s after /healthz", flush=True)
    runs: dict[str, list[Run]] = {name: [] for name in variants}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            run = one_run(variants[name], steady)
            runs[name].append(run)
            print(f"  round {r + 1} {name}: healthy in {run.startup:.2f} s "
                  f"({run.startup_cpu:.2f} s CPU), peak tree "
                  f"{mib(run.peak_rss)} MiB (anon {mib(run.peak_anon)})", flush=True)
    for name, results in runs.items():
        summary(name, results)


if __name__ == "__main__":
    main()
