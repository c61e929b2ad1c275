"""The daemon's cost on a busy node: 200 processes with thousands of distinct
stacks per interval, and short-lived processes starting all the time.

Workload (generated, see ``busy_workloads.py``), all running at once and
duty-cycled so that together they keep about ``--load`` CPUs busy:

* Python applications under the trampoline runtime (``python3 -m
  tramprof_trampolines app.py``): 300 functions each, random call paths
  6-40 calls deep (new ones all the time, or ``--paths`` fixed ones per
  process: the same stacks interval after interval, as a service's);
* native applications of 300 functions, half built with frame pointers and
  half without (unwind tables);
* ``node --perf-basic-prof`` applications, when ``node`` is installed;
* short-lived native processes, ``--spawn-rate`` fork+exec per second.

One ``tramprof run`` (default settings but the frequency, all CPUs) is
started with the workers stopped (its BPF compile is not what is measured),
left to warm up (at least ``--warmup`` s and until its helper threads, the
unwind table compiler, are idle and the windows it keeps for ``/profile``
have stopped growing, at most ``--max-warmup`` s), then measured at each
frequency in turn (a configuration reload switches it; the kept windows are
refilled at the new frequency first): before each window, the last
minute is fetched from ``/profile`` as folded stacks and as pprof (timed;
what a render leaves resident shows in the steady RSS), then over a
steady window, its CPU (utime+stime of it and its children, % of one core;
and of its main thread alone, the one that drains), each drain's duration
(``tramprof_drain_duration_seconds``: the drain and symbolization, not the
series update after it, and ``tramprof_drain_cpu_seconds``, the part of it
the drain ran rather than waited for a CPU; read from whole ``/metrics`` scrapes every
``--scrape-interval`` seconds, as the shipped Prometheus configuration scrapes,
and nothing else asks the daemon for anything in the window), RSS (steady
VmRSS at the window's end and how fast it grew over the window, its median
and maximum over the window's scrapes, peak VmHWM; with the addresses the
symbol caches hold and their growth: they grow up to their bound while
programs keep meeting new return addresses, so a steady RSS read before may
not be where the daemon settles),
whole-heap collections of the garbage collector in the window (one adds
~0.4 s of CPU: the first comes 5 minutes after start, later ones more and
more rarely, so the CPU is also shown without them), the process images
sampled for the first time a second (``tramprof_new_processes_total``: warmed
while they ran, or gone first; each wakes the daemon's loop, whose scheduler
slice is shown too) and the main thread's process-events CPU per new one
(side by side, the daemon that reads a new process's /proc files second
finds them cache-warm); then full ``/metrics`` scrape latency (OpenMetrics
and gzip, as Prometheus asks) and
the distinct folded stacks of single drained windows; and the sampling
program's own cost in the kernel, paid in the sampled processes (bpf_stats,
which the daemon turns on as root: microseconds a run and % of one core).

Every worker runs in one process group that is killed on exit, failure or
Ctrl-C, and dies with this script anyway (``PR_SET_PDEATHSIG``).

Run (root): ``.venv/bin/python benchmarks/bench_busy_node.py`` (about 12
minutes; ``--tramprof`` measures another build, e.g. a checkout of an older
revision). For before/after figures, ``--compare`` runs a second build side
by side with the first, both measured in the same windows: on a shared
machine, runs minutes apart differ by more than most changes. Side by side,
the two daemons can still record 10-15% different numbers of samples in one
window (one build on both sides: 120 vs 102 a second), and in some runs the
one started first drained ~10 ms slower; the daemon's CPU per sample
recorded (its CPU over the window's recorded samples) compares builds
across the first.
"""

from __future__ import annotations

import argparse
import ctypes
import gzip
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import busy_workloads
from common import HERE, TRAMPROF, Daemon, free_port, install_trampolines, median, percentile
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families
from tramprof.pipeline.stats import MAIN_THREAD_STAGES

# What Prometheus sends with a scrape by default: OpenMetrics first, gzip.
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0;q=0.5,"
              "application/openmetrics-text;version=0.0.1;q=0.4,"
              "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "Accept-Encoding": "gzip",
}
#: The daemon's collections of its whole heap: count and seconds (pipeline.heap).
HEAP_COLLECTIONS = ("tramprof_heap_full_collections_total",
                    "tramprof_heap_full_collection_seconds_total")
#: Unwind tables compiled, by result (each in a child process: unwind.cfibuild).
TABLE_BUILDS = "tramprof_unwind_table_builds_total"
#: The main thread's CPU seconds by stage (MAIN_THREAD_STAGES).
STAGE_CPU = "tramprof_main_thread_cpu_seconds_total"
#: Newly sampled process images, warmed while they ran or gone first.
NEW_PROCESSES = "tramprof_new_processes_total"
SCHEDULER_SLICE = "tramprof_scheduler_slice_seconds"
#: Addresses the symbol caches hold (Result.address_cache).
ADDRESS_CACHE = "tramprof_address_cache_entries"
#: Processes whose address caches were emptied to keep all within their bound.
ADDRESS_CACHE_EVICTIONS = "tramprof_address_cache_evictions_total"
#: The sampling program's kernel run time and runs (bpf_stats, which the
#: daemon turns on while it runs as root).
BPF_RUN_SECONDS = "tramprof_bpf_run_time_seconds_total"
BPF_RUNS = "tramprof_bpf_runs_total"
TARGETS = {99: {"cpu": 1.0, "drain_ms": 200.0, "rss_mib": 150.0}}
FUNCTIONS = 300
PERIOD_S = 0.25
SHORT_BUSY_US = 5000
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Workers:
    """The workload processes, all in one process group."""

    def __init__(self, cwd: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.kinds: dict[int, str] = {}
        self.pgid = 0
        self.cwd = cwd  # whatever the runtimes leave behind goes there

    def start(self, kind: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        proc = subprocess.Popen(argv, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, process_group=self.pgid,
                                preexec_fn=_die_with_parent)
        if not self.pgid:
            self.pgid = proc.pid
        self.procs.append(proc)
        self.kinds[proc.pid] = kind

    def pause(self, paused: bool) -> None:
        """Stop or continue every worker (the daemon's start-up is not measured)."""
        if self.pgid:
            os.killpg(self.pgid, signal.SIGSTOP if paused else signal.SIGCONT)

    def dead(self) -> list[str]:
        return [f"{self.kinds[p.pid]} pid {p.pid} (exit {p.returncode})"
                for p in self.procs if p.poll() is not None]

    def stop(self) -> None:
        if self.pgid:
            with suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGKILL)
        for proc in self.procs:
            proc.kill()
            proc.wait()
            # Trampoline runtimes and node leave their perf maps behind.
            Path(f"/tmp/perf-{proc.pid}.map").unlink(missing_ok=True)


def stat_seconds(stat: Path, first: int, end: int) -> float:
    """Seconds in the clock-tick fields ``first`` up to ``end`` of a /proc
    stat file, counted from the field after the process name (utime is 11,
    stime 12, cutime 13, cstime 14); 0 when the task is gone."""
    with suppress(OSError):
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return sum(int(f) for f in fields[first:end]) / os.sysconf("SC_CLK_TCK")
    return 0.0


class LoggedDaemon(Daemon):
    """``common.Daemon`` with its log kept in a file (budget warnings matter here)."""

    def __init__(self, log: IO[bytes], *args: str, tramprof: str = TRAMPROF,
                 label: str = "") -> None:
        self.label = label
        self.port = free_port()
        self.proc = subprocess.Popen(
            [tramprof, "run", "--listen", f"127.0.0.1:{self.port}", *args],
            stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 120
        while True:
            try:
                self.get("/healthz")
                return
            except urllib.error.HTTPError:
                return  # serving; unhealthy only until its first drain
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop_quietly()
                    raise RuntimeError(f"daemon did not start (exit "
                                       f"{self.proc.returncode})") from None
                time.sleep(0.2)

    def stop_quietly(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cpu_with_children(self) -> float:
        """CPU seconds of the daemon, its reaped children and its live ones."""
        return sum(stat_seconds(stat, 11, 15)
                   for stat in [Path(f"/proc/{self.proc.pid}/stat"), *self._child_stats()])

    def helper_threads_cpu(self, main: bool = False) -> float:
        """CPU seconds of the daemon's threads but its main one (``main``: of
        the main one alone)."""
        return sum(stat_seconds(task / "stat", 11, 13)
                   for task in Path(f"/proc/{self.proc.pid}/task").iterdir()
                   if (task.name == str(self.proc.pid)) == main)

    def reaped_children_cpu(self) -> float:
        """CPU seconds of the daemon's child processes that have exited: the
        unwind table compilers (the long-lived children never exit)."""
        return stat_seconds(Path(f"/proc/{self.proc.pid}/stat"), 13, 15)  # cutime, cstime

    def children_cpu(self) -> float:
        """CPU seconds of the daemon's child processes, live (the unwind
        table compilers) and reaped."""
        return (self.reaped_children_cpu()
                + sum(stat_seconds(stat, 11, 13) for stat in self._child_stats()))

    def _child_stats(self) -> Iterator[Path]:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with suppress(OSError):
                    if int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1]) \
                            == self.proc.pid:
                        yield entry / "stat"

    def metrics(self, *names: str, gzip_body: bool = False
                ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The ``names`` families (all when none: what Prometheus asks for,
        gzipped with ``gzip_body``) by (name, labels)."""
        query = "&".join(f"name[]={n}" for n in names)
        path = f"/metrics?{query}" if names else "/metrics"
        if gzip_body:
            request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                             headers=PROMETHEUS_HEADERS)
            with urllib.request.urlopen(request, timeout=30) as response:
                text = gzip.decompress(response.read()).decode()
            families = openmetrics_families(text)
        else:
            families = text_string_to_metric_families(self.get(path))
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in families for s in family.samples}

    def status(self, key: str) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
        return float("nan")


def build(work: Path, args: argparse.Namespace) -> tuple[dict[str, list[str]],
                                                                      list[str]]:
    """Generate and build the applications; returns argv prefixes by kind
    (each to be completed with its duty cycle and seed) and the spawner's argv."""
    cc = ["gcc", "-O2", "-fno-inline", "-fno-optimize-sibling-calls"]
    apps: dict[str, list[str]] = {"python": [], "native": [], "node": []}
    for index in range(4):
        src = work / f"napp{index}.c"
        busy_workloads.native_app(src, FUNCTIONS, seed=100 + index)
        fp = "-fno-omit-frame-pointer" if index % 2 == 0 else "-fomit-frame-pointer"
        exe = work / f"napp{index}{'' if index % 2 == 0 else '_nofp'}"
        subprocess.run([*cc, fp, "-o", str(exe), str(src)], check=True)
        apps["native"].append(str(exe))
        script = work / f"pyapp{index}.py"
        busy_workloads.python_app(script, f"pyapp{index}", FUNCTIONS, seed=200 + index)
        apps["python"].append(str(script))
    for index in range(2):
        script = work / f"nodeapp{index}.js"
        busy_workloads.node_app(script, f"nodeapp{index}", FUNCTIONS, seed=300 + index)
        apps["node"].append(str(script))
    busy_workloads.native_app(work / "shortjob.c", FUNCTIONS, seed=400)
    subprocess.run([*cc, "-fno-omit-frame-pointer", "-o", str(work / "shortjob"),
                    str(work / "shortjob.c")], check=True)
    subprocess.run(["gcc", "-O2", "-o", str(work / "spawner"), str(HERE / "spawner.c")],
                   check=True)
    spawner = [str(work / "spawner"), str(args.spawn_rate), str(work / "shortjob"),
               str(SHORT_BUSY_US), "0", "7"]
    return apps, spawner


def start_workers(workers: Workers, apps: dict[str, list[str]], spawner: list[str],
                  counts: dict[str, int], load: float, spawn_rate: float,
                  py_env: dict[str, str], paths: int = 0) -> None:
    short_load = spawn_rate * SHORT_BUSY_US / 1e6
    per_process = max(0.0, load - short_load) / sum(counts.values())
    busy = per_process * PERIOD_S
    rng = random.Random(1)
    plan = [(kind, i) for kind, n in counts.items() for i in range(n)]
    rng.shuffle(plan)
    node = shutil.which("node")
    for kind, i in plan:
        seed = str(rng.randrange(1 << 30))
        app = apps[kind][i % len(apps[kind])]
        if kind == "python":
            workers.start(kind, ["/usr/bin/python3", "-m", "tramprof_trampolines", app,
                                 f"{busy:.6f}", str(PERIOD_S), seed, str(paths)], py_env)
        elif kind == "native":
            workers.start(kind, [app, f"{busy * 1e6:.0f}", f"{PERIOD_S * 1e6:.0f}", seed,
                                 str(paths)])
        else:
            assert node is not None
            # --perf-basic-prof also turns on V8's log: not into a file.
            workers.start(kind, [node, "--perf-basic-prof", "--no-logfile-per-isolate",
                                 "--logfile=/dev/null", app, f"{busy * 1e3:.3f}",
                                 f"{PERIOD_S * 1e3:.0f}", seed, str(paths)])
        time.sleep(0.01)
    workers.start("spawner", spawner)


def host_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def runnable() -> int:
    """Tasks running or waiting for a CPU right now (``procs_running``)."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("procs_running "):
            return int(line.split()[1])
    return 0


@dataclass
class Result:
    frequency: int
    daemon: str = ""  # which executable, when two are compared
    cpu_percent: float = 0.0
    main_cpu_percent: float = 0.0
    host_busy_cpus: float = 0.0
    run_queue: list[int] = field(default_factory=list)
    drains_ms: list[float] = field(default_factory=list)
    drains_cpu_ms: list[float] = field(default_factory=list)  # the same drains' own CPU
    unique_stacks: list[int] = field(default_factory=list)
    window_samples: list[int] = field(default_factory=list)
    rss_peak: float = 0.0
    rss_steady: float = 0.0
    rss_growth: float = 0.0  # MiB a minute over the window
    # VmRSS read at every scrape of the window: one reading moves by a few
    # MiB from drain to drain, its median and maximum do not.
    rss_window: list[float] = field(default_factory=list)
    # Addresses the symbol caches hold at the window's end, and their growth
    # a minute over it (None: the build does not tell). They grow up to
    # address_cache_bytes: a steady RSS read while they still grow may not
    # be where the daemon settles.
    address_cache: tuple[float, float] | None = None
    # Process images whose address caches were emptied in the window (None:
    # the build does not tell).
    address_evictions: float | None = None
    scrape_ms: list[float] = field(default_factory=list)
    scrape_bytes: int = 0
    # /profile of the last minute before the window, by format: (ms, bytes)
    renders: dict[str, tuple[float, int]] = field(default_factory=dict)
    recorded_per_s: float = 0.0
    stacks_reused: float | None = None  # share of the drained stacks found again whole
    # Whole-heap collections in the window and their seconds (None: the build
    # does not tell): one adds ~0.4 s of CPU to the window.
    heap_collections: tuple[float, float] | None = None
    # CPU of the daemon's child processes that exited in the window (the
    # unwind table compilers of objects first sampled then) and the builds
    # that finished.
    children_cpu_percent: float = 0.0
    table_builds: float = 0.0
    # Newly sampled process images a second: (warmed, gone before warmed).
    new_processes: tuple[float, float] | None = None
    # The main loop's scheduler slice as the kernel reports it, ms (None: not told).
    scheduler_slice_ms: float | None = None
    # The main thread's CPU by stage, % of a core (empty: the build does not tell).
    stages_percent: dict[str, float] = field(default_factory=dict)
    window_s: float = 0.0
    lost: float = 0.0
    # The sampling program in the kernel: (us a run, % of one core), between
    # the same two drains as recorded_per_s (None: not accounted).
    bpf: tuple[float, float] | None = None
    series: float = 0.0
    processes: float = 0.0

    @property
    def heap_collection_percent(self) -> float | None:
        """The window's CPU in whole-heap collections (None: not told)."""
        if self.heap_collections is None:
            return None
        return self.heap_collections[1] / self.window_s * 100

    @property
    def steady_cpu_percent(self) -> float:
        """The window's CPU without the one-off work in it: table builds and
        whole-heap collections."""
        return (self.cpu_percent - self.children_cpu_percent
                - (self.heap_collection_percent or 0.0))


def drain_count(daemon: LoggedDaemon) -> tuple[float, float]:
    m = daemon.metrics("tramprof_drains_total", "tramprof_drain_duration_seconds")
    return m[("tramprof_drains_total", ())], m[("tramprof_drain_duration_seconds", ())]


def next_drain(daemon: LoggedDaemon, timeout: float = 60, poll: float = 0.5) -> bool:
    """Wait for the daemon's next drain; False if none came in ``timeout`` s."""
    count, deadline = drain_count(daemon)[0], time.monotonic() + timeout
    while drain_count(daemon)[0] == count:
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
    return True


@dataclass
class DrainMark:
    """The daemon's counters at one drain, and when it was seen."""
    seen: float
    recorded: float
    lost: float
    # The sampling program's kernel run time (ns) and runs (None: the kernel
    # does not account them, or the build does not tell).
    bpf: tuple[float, float] | None


def at_next_drain(daemon: LoggedDaemon, timeout: float = 60) -> DrainMark:
    """The daemon's counters at its next drain. They move only at a drain,
    so rates are taken between two drains seen as they happen (to a quarter
    second), not over the wall-clock window: that would count up to an
    interval's samples too few."""
    if not next_drain(daemon, timeout, poll=0.25):
        raise RuntimeError(f"no drain of {daemon.label or 'the daemon'} in {timeout} s")
    seen = time.monotonic()
    m = daemon.metrics("tramprof_perf_events_total", BPF_RUN_SECONDS, BPF_RUNS)
    bpf_seconds, runs = m.get((BPF_RUN_SECONDS, ())), m.get((BPF_RUNS, ()))
    return DrainMark(seen, m[("tramprof_perf_events_total", (("outcome", "recorded"),))],
                     m[("tramprof_perf_events_total", (("outcome", "lost"),))],
                     None if bpf_seconds is None or runs is None else (bpf_seconds * 1e9, runs))


class StoreFilling:
    """Whether the windows kept for /profile still grow: until they reach
    the retention or their memory bound, the daemon's memory grows with them
    (minutes at the default 300 s), and RSS read before is not steady. Full
    once a drain leaves the seconds they cover where they were."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None  # (drains, seconds held)
        self.full = False

    def look(self, daemon: LoggedDaemon) -> None:
        m = daemon.metrics("tramprof_drains_total", "tramprof_profile_store_seconds")
        now = (m[("tramprof_drains_total", ())], m[("tramprof_profile_store_seconds", ())])
        if self._last is not None and now[0] > self._last[0]:
            self.full = now[1] > 0 and now[1] <= self._last[1] + 1.0
        if self._last is None or now[0] > self._last[0]:
            self._last = now


def settle(daemon: LoggedDaemon, args: argparse.Namespace) -> float:
    """Wait out the start-up work: at least ``--warmup`` seconds and two
    drains, then until the daemon's threads other than its main one and its
    child processes (the unwind table compilers: ~15 CPU seconds for node's
    binary, once per object) were idle for two polls and the windows kept
    for /profile stopped growing (``StoreFilling``); at most ``--max-warmup``
    seconds. Returns the seconds waited."""
    began = time.monotonic()
    time.sleep(args.warmup)
    last, quiet = daemon.helper_threads_cpu() + daemon.children_cpu(), 0
    store = StoreFilling()
    while time.monotonic() - began < args.max_warmup:
        time.sleep(args.poll)
        now = daemon.helper_threads_cpu() + daemon.children_cpu()
        quiet = quiet + 1 if now - last < 0.05 * args.poll else 0
        last = now
        store.look(daemon)
        if quiet >= 2 and drain_count(daemon)[0] >= 2 and store.full:
            break
    return time.monotonic() - began


#: Formats fetched from /profile before each window (a flame graph's
#: exchange format, and what pprof tools read).
RENDERED_FORMATS = ("folded", "pprof")


def render_profiles(daemon: LoggedDaemon) -> dict[str, tuple[float, int]]:
    """Fetch the last minute in each of ``RENDERED_FORMATS``: (ms, bytes)."""
    renders = {}
    for fmt in RENDERED_FORMATS:
        began = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon.port}/profile?seconds=60"
                                    f"&format={fmt}", timeout=60) as response:
            size = len(response.read())
        renders[fmt] = ((time.perf_counter() - began) * 1e3, size)
    return renders


def measure(frequency: int, daemons: list[LoggedDaemon], args: argparse.Namespace
            ) -> list[Result]:
    """One steady window at the running frequency for every daemon at once
    (side by side: the same workload and machine state), then each one's
    scrapes and windows."""
    results = [Result(frequency, daemon.label) for daemon in daemons]
    # Someone looks at the node's last minute first, as users of /profile
    # do: what a render leaves resident belongs in the steady RSS. Then a
    # drain, so the window starts after the render's memory could go back.
    for daemon, result in zip(daemons, results, strict=True):
        result.renders = render_profiles(daemon)
    first_drain = [at_next_drain(daemon) for daemon in daemons]
    before = [daemon.metrics("tramprof_stacks_named_total",
                             *HEAP_COLLECTIONS, TABLE_BUILDS, STAGE_CPU, ADDRESS_CACHE,
                             ADDRESS_CACHE_EVICTIONS, NEW_PROCESSES, SCHEDULER_SLICE)
              for daemon in daemons]
    # drains done -> the last one's (wall, CPU) seconds; CPU None from a
    # build that does not export it
    drains: list[dict[float, tuple[float, float | None]]] = [{} for _ in daemons]
    main0 = [daemon.helper_threads_cpu(main=True) for daemon in daemons]
    children0 = [daemon.reaped_children_cpu() for daemon in daemons]
    rss0 = [daemon.status("VmRSS") for daemon in daemons]
    cpu0 = [daemon.cpu_with_children() for daemon in daemons]
    busy0, t0 = host_busy(), time.monotonic()
    # Scraped as the shipped Prometheus configuration does (whole /metrics,
    # OpenMetrics, gzip, every --scrape-interval s); each scrape also tells the last
    # drain's duration. Nothing else asks the daemons for anything meanwhile.
    # Side by side, the daemon scraped first alternates: neither is always
    # the one whose scrape meets the other's still running.
    next_scrape = t0
    run_queue: list[int] = []
    order = list(range(len(daemons)))
    while time.monotonic() - t0 < args.steady:
        time.sleep(max(0.0, next_scrape - time.monotonic()))
        next_scrape += args.scrape_interval
        for at in order:
            metrics = daemons[at].metrics(gzip_body=True)
            drains[at][metrics[("tramprof_drains_total", ())]] = (
                metrics[("tramprof_drain_duration_seconds", ())],
                metrics.get(("tramprof_drain_cpu_seconds", ())))
            results[at].rss_window.append(daemons[at].status("VmRSS"))
        order.reverse()
        run_queue.append(runnable())
    cpu1 = [daemon.cpu_with_children() for daemon in daemons]
    main1 = [daemon.helper_threads_cpu(main=True) for daemon in daemons]
    children1 = [daemon.reaped_children_cpu() for daemon in daemons]
    busy1, t1 = host_busy(), time.monotonic()
    # Everything of the window is read before any daemon's scrapes and windows.
    rss = [(daemon.status("VmHWM"), daemon.status("VmRSS")) for daemon in daemons]
    after = [daemon.metrics() for daemon in daemons]
    last_drain = [at_next_drain(daemon) for daemon in daemons]
    for at, daemon in enumerate(daemons):
        results[at].rss_peak, results[at].rss_steady = rss[at]
        results[at] = _finish(results[at], daemon, args, t1 - t0, cpu1[at] - cpu0[at],
                              main1[at] - main0[at], rss0[at], drains[at], before[at],
                              after[at])
        results[at].run_queue = run_queue
        began, ended = first_drain[at], last_drain[at]
        results[at].recorded_per_s = (ended.recorded - began.recorded) / (ended.seen - began.seen)
        results[at].lost = ended.lost - began.lost
        if began.bpf is not None and ended.bpf is not None and ended.bpf[1] > began.bpf[1]:
            ns, runs = ended.bpf[0] - began.bpf[0], ended.bpf[1] - began.bpf[1]
            results[at].bpf = (ns / runs / 1e3, ns / 1e9 / (ended.seen - began.seen) * 100)
        results[at].children_cpu_percent = (children1[at] - children0[at]) / (t1 - t0) * 100
        results[at].host_busy_cpus = ((busy1[0] - busy0[0]) / (busy1[1] - busy0[1])
                                      * (os.cpu_count() or 1))
    return results


def _finish(result: Result, daemon: LoggedDaemon, args: argparse.Namespace, seconds: float,
            cpu: float, main_cpu: float, rss0: float,
            drains: dict[float, tuple[float, float | None]],
            before: dict[tuple[str, tuple[tuple[str, str], ...]], float],
            after: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> Result:
    """The rest of one daemon's figures, after the window: memory, counters,
    scrape latency, distinct stacks of single windows."""
    frequency = result.frequency
    result.cpu_percent = cpu / seconds * 100
    result.window_s = seconds
    result.main_cpu_percent = main_cpu / seconds * 100
    first = min(drains)  # may have drained before the window began
    measured = [v for k, v in drains.items() if k > first]
    result.drains_ms = [wall * 1e3 for wall, _cpu in measured]
    result.drains_cpu_ms = [cpu * 1e3 for _wall, cpu in measured if cpu is not None]
    result.rss_growth = (result.rss_steady - rss0) / seconds * 60
    if (ADDRESS_CACHE, ()) in after and (ADDRESS_CACHE, ()) in before:
        cached = after[(ADDRESS_CACHE, ())]
        result.address_cache = (cached, (cached - before[(ADDRESS_CACHE, ())]) / seconds * 60)
    if (ADDRESS_CACHE_EVICTIONS, ()) in after and (ADDRESS_CACHE_EVICTIONS, ()) in before:
        result.address_evictions = (after[(ADDRESS_CACHE_EVICTIONS, ())]
                                    - before[(ADDRESS_CACHE_EVICTIONS, ())])
    named = {dict(k[1]).get("how"): v - before.get(k, 0.0) for k, v in after.items()
             if k[0] == "tramprof_stacks_named_total"}
    if named:  # (older builds do not tell)
        result.stacks_reused = named.get("reused", 0.0) / max(1.0, sum(named.values()))
    if all((name, ()) in after for name in HEAP_COLLECTIONS):
        count, seconds_in = (after[(name, ())] - before.get((name, ()), 0.0)
                             for name in HEAP_COLLECTIONS)
        result.heap_collections = (count, seconds_in)
    result.table_builds = sum(v - before.get(k, 0.0) for k, v in after.items()
                              if k[0] == TABLE_BUILDS)
    result.stages_percent = {dict(k[1])["stage"]: (v - before.get(k, 0.0)) / seconds * 100
                             for k, v in after.items() if k[0] == STAGE_CPU}
    new = {dict(k[1])["result"]: v - before.get(k, 0.0) for k, v in after.items()
           if k[0] == NEW_PROCESSES}
    if new:  # (older builds do not tell)
        result.new_processes = (new.get("warmed", 0.0) / seconds, new.get("exited", 0.0) / seconds)
    if (SCHEDULER_SLICE, ()) in after:  # (older builds do not tell)
        result.scheduler_slice_ms = after[(SCHEDULER_SLICE, ())] * 1e3
    result.series = sum(v for k, v in after.items() if k[0] == "tramprof_series")
    result.processes = after[("tramprof_processes", ())]
    for _ in range(args.scrapes):
        request = urllib.request.Request(f"http://127.0.0.1:{daemon.port}/metrics",
                                         headers=PROMETHEUS_HEADERS)
        began = time.perf_counter()
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        result.scrape_ms.append((time.perf_counter() - began) * 1e3)
        result.scrape_bytes = len(gzip.decompress(body))
        time.sleep(0.1)
    for _ in range(args.windows):
        if not next_drain(daemon):
            break  # no drain for a minute: nothing to count
        folded = daemon.get("/profile?seconds=0.001&format=folded").splitlines()
        result.unique_stacks.append(len(folded))
        result.window_samples.append(sum(int(line.rsplit(" ", 1)[1]) for line in folded))
    if args.py_spy:
        out = Path(args.py_spy) / f"daemon{daemon.label and '-'}{daemon.label}-{frequency}hz.folded"
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(Path(TRAMPROF).parent / "py-spy"), "record", "-p",
                        str(daemon.proc.pid), "-d", str(int(args.steady)), "-r", "1000",
                        "-f", "raw", "-o", str(out), "--nonblocking"], check=True,
                       stdout=subprocess.DEVNULL)
        print(f"py-spy profile of the daemon at {frequency} Hz: {out}", flush=True)
    return result


def session(frequencies: list[int], work: Path, args: argparse.Namespace, log: IO[bytes],
            workers: Workers) -> list[Result]:
    """One daemon for every frequency (two side by side with ``--compare``):
    started at the first, switched by a configuration reload (SIGHUP), so
    start-up work is paid and excluded once."""
    config = work / "tramprof.toml"
    config.write_text(f"frequency = {frequencies[0]}\n")
    config.chmod(0o644)  # re-read after the daemon left root
    executables = [("", args.tramprof)]
    if args.compare:
        executables = [("A", args.tramprof), ("B", args.compare)]
    daemons: list[LoggedDaemon] = []
    # The BPF compile (seconds of CPU) would crawl behind 200 busy processes.
    workers.pause(True)
    try:
        for label, executable in executables:
            daemons.append(LoggedDaemon(log, "--config", str(config), tramprof=executable,
                                        label=label))
    except BaseException:
        for daemon in daemons:
            daemon.stop_quietly()
        raise
    finally:
        workers.pause(False)
    results: list[Result] = []
    try:
        start_cpu = [daemon.cpu_with_children() for daemon in daemons]
        for daemon, began_cpu in zip(daemons, start_cpu, strict=True):
            waited = settle(daemon, args)
            built = daemon.metrics("tramprof_unwind_table_build_seconds_total").get(
                ("tramprof_unwind_table_build_seconds_total", ()), 0.0)
            print(f"  {daemon.label or 'daemon'} start-up: {began_cpu:.1f} CPU s until "
                  f"serving; warm-up {waited:.0f} s, {daemon.cpu_with_children() - began_cpu:.1f}"
                  f" CPU s (unwind table builds {built:.1f})", flush=True)
        for index, frequency in enumerate(frequencies):
            if index:
                config.write_text(f"frequency = {frequency}\n")
                for daemon in daemons:
                    daemon.proc.send_signal(signal.SIGHUP)
                time.sleep(args.switch)
                # Windows of the new frequency replace the old ones.
                for daemon in daemons:
                    store, deadline = StoreFilling(), time.monotonic() + args.max_warmup
                    while not store.full and time.monotonic() < deadline:
                        store.look(daemon)
                        time.sleep(args.poll)
            results.extend(measure(frequency, daemons, args))
            print(f"  {frequency} Hz done", flush=True)
            dead = workers.dead()
            if dead:
                raise RuntimeError(f"workers died during the run: {', '.join(dead[:5])}")
    finally:
        for daemon in daemons:
            daemon.stop_quietly()
    return results


def report(results: list[Result]) -> None:
    def row(name: str, values: list[str], target: str = "") -> None:
        print(f"  {name:<34}" + "".join(f"{v:>18}" for v in values) + f"  {target}")

    print(f"  {'':<34}" + "".join(f"{str(r.frequency) + ' Hz ' + r.daemon:>18}"
                                   for r in results))
    t = TARGETS[99]

    def mark(ok: bool) -> str:
        return "met" if ok else "MISSED"

    r99 = next((r for r in results if r.frequency == 99), None)  # the first daemon's
    row("daemon CPU, % of one core", [f"{r.cpu_percent:.2f}" for r in results],
        f"99 Hz target <= {t['cpu']:.0f}% ({mark(r99.cpu_percent <= t['cpu'])})"
        if r99 else "")
    row("  of it the main thread", [f"{r.main_cpu_percent:.2f}" for r in results])
    # The daemon's own account (as of the window's last drain).
    for stage in MAIN_THREAD_STAGES:
        row(f"    {stage.replace('_', ' ')}", [
            f"{r.stages_percent[stage]:.2f}" if stage in r.stages_percent else "n/a"
            for r in results])
    # Steady state meets one every hour at most: the window's CPU without them.
    row("  less whole-heap collections", [
        "n/a" if r.heap_collection_percent is None
        else f"{r.cpu_percent - r.heap_collection_percent:.2f}" for r in results])
    # An object first sampled in the window has its unwind table compiled
    # then (once per object for the daemon's life: 0.1-1 CPU s each).
    row("  of it unwind table builds (children)", [
        f"{r.children_cpu_percent:.2f} ({r.table_builds:.0f} built)" for r in results])
    row("  less both: the steady loop", [f"{r.steady_cpu_percent:.2f}" for r in results])
    # Every newly sampled process wakes the loop; a wake runs cache-cold.
    row("new processes / s, warmed / gone", [
        "n/a" if r.new_processes is None
        else f"{r.new_processes[0]:.1f} / {r.new_processes[1]:.1f}"
        + (f" ({r.new_processes[1] / sum(r.new_processes):.0%})" if sum(r.new_processes) else "")
        for r in results])
    # A short slice lets the loop run at once when it is woken for one.
    row("  main loop scheduler slice, ms", [
        "n/a" if r.scheduler_slice_ms is None else f"{r.scheduler_slice_ms:.2f}"
        for r in results])
    row("  process events CPU per new, us", [
        "n/a" if not r.new_processes or not sum(r.new_processes)
        or "process_events" not in r.stages_percent
        else f"{r.stages_percent['process_events'] / 100 / sum(r.new_processes) * 1e6:.0f}"
        for r in results])
    row("drain ms p50 / p99", [f"{median(r.drains_ms):.0f} / "
                                   f"{percentile(r.drains_ms, 0.99):.0f}"
                                   if r.drains_ms else "n/a" for r in results],
        f"99 Hz target <= {t['drain_ms']:.0f} ms "
        f"({mark(percentile(r99.drains_ms, 0.99) <= t['drain_ms'])})"
        if r99 and r99.drains_ms else "")
    row("  of it the drain's own CPU, ms p50 / p99",
        [f"{median(r.drains_cpu_ms):.0f} / {percentile(r.drains_cpu_ms, 0.99):.0f}"
         if r.drains_cpu_ms else "n/a" for r in results])
    row("drains measured", [str(len(r.drains_ms)) for r in results])
    row("distinct folded stacks / window",
        [" ".join(str(n) for n in r.unique_stacks) for r in results])
    row("samples / window", [" ".join(str(n) for n in r.window_samples) for r in results])
    row("samples recorded / s", [f"{r.recorded_per_s:.0f}" for r in results])
    row("daemon CPU per sample recorded, us",
        [f"{r.cpu_percent / 100 / r.recorded_per_s * 1e6:.0f}" if r.recorded_per_s else "n/a"
         for r in results])
    # Spent in the sampled processes, not in the daemon: the kernel's own
    # accounting of the program (bpf_stats).
    row("BPF program us / run, % of one core", [
        "n/a" if r.bpf is None else f"{r.bpf[0]:.2f}, {r.bpf[1]:.2f}" for r in results])
    row("stacks found again (not named)", ["n/a" if r.stacks_reused is None
                                           else f"{r.stacks_reused:.1%}" for r in results])
    row("samples lost in window", [f"{r.lost:.0f}" for r in results])
    row("whole-heap collections in window, s", [
        "n/a" if r.heap_collections is None
        else f"{r.heap_collections[0]:.0f}, {r.heap_collections[1]:.2f}" for r in results])
    row("RSS steady MiB", [f"{r.rss_steady:.1f}" for r in results])
    # The target is checked on the window's highest reading, not on one
    # taken at a moment of the drain cycle.
    row("RSS in window MiB, median / max", [
        f"{median(r.rss_window):.1f} / {max(r.rss_window):.1f}" if r.rss_window else "n/a"
        for r in results],
        f"99 Hz target <= {t['rss_mib']:.0f} MiB ({mark(max(r99.rss_window) <= t['rss_mib'])})"
        if r99 and r99.rss_window else "")
    row("RSS peak (VmHWM) MiB", [f"{r.rss_peak:.1f}" for r in results])
    row("RSS growth in window MiB/min", [f"{r.rss_growth:+.1f}" for r in results])
    row("address cache entries, end / a min", [
        "n/a" if r.address_cache is None
        else f"{r.address_cache[0]:.0f} / {r.address_cache[1]:+.0f}" for r in results])
    row("  processes' caches emptied", [
        "n/a" if r.address_evictions is None else f"{r.address_evictions:.0f}" for r in results])
    row("/metrics ms p50 / p99 (OM, gzip)", [f"{median(r.scrape_ms):.1f} / "
                                             f"{percentile(r.scrape_ms, 0.99):.1f}"
                                             for r in results])
    row("/metrics size (KiB, plain)", [f"{r.scrape_bytes / 1024:.0f}" for r in results])
    for fmt in RENDERED_FORMATS:
        row(f"/profile?seconds=60 {fmt}: ms, MB", [
            f"{r.renders[fmt][0]:.0f}, {r.renders[fmt][1] / 1e6:.1f}" if fmt in r.renders
            else "n/a" for r in results])
    row("stack+function series", [f"{r.series:.0f}" for r in results])
    row("processes held", [f"{r.processes:.0f}" for r in results])
    row("host CPUs busy (all processes)", [f"{r.host_busy_cpus:.2f}" for r in results])
    row("runnable tasks, median / max", [f"{median([float(n) for n in r.run_queue]):.0f} / "
                                         f"{max(r.run_queue)}"
                                         for r in results])


@contextmanager
def terminate_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so every finally block runs."""
    def stop(signum: int, frame: object) -> None:
        raise SystemExit(f"signal {signum}")

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frequencies", default="99,999")
    parser.add_argument("--python", type=int, default=80, help="Python processes")
    parser.add_argument("--native", type=int, default=80, help="native processes")
    parser.add_argument("--node", type=int, default=40,
                        help="node processes (native ones instead when node is missing)")
    parser.add_argument("--spawn-rate", type=float, default=20.0,
                        help="short-lived processes started per second")
    parser.add_argument("--paths", type=int, default=0,
                        help="call paths per process (a service's hot paths, the same in "
                             "every interval); 0: a new random path at every call")
    parser.add_argument("--load", type=float, default=1.0,
                        help="CPUs the workers keep busy together")
    parser.add_argument("--warmup", type=float, default=30.0,
                        help="seconds at least between the daemon's start and measuring")
    parser.add_argument("--max-warmup", type=float, default=600.0,
                        help="longest wait for the unwind table builds to finish and the "
                             "windows kept for /profile to stop growing")
    parser.add_argument("--switch", type=float, default=15.0,
                        help="seconds between a frequency change and its window")
    parser.add_argument("--steady", type=float, default=90.0,
                        help="seconds of the measured window")
    parser.add_argument("--scrape-interval", type=float, default=15.0,
                        help="seconds between whole scrapes in the window (deploy/prometheus's)")
    parser.add_argument("--poll", type=float, default=5.0,
                        help="seconds between looks at the daemon during the warm-up")
    parser.add_argument("--scrapes", type=int, default=40)
    parser.add_argument("--windows", type=int, default=2,
                        help="drained windows whose distinct stacks are counted")
    parser.add_argument("--py-spy", metavar="DIR",
                        help="also record the daemon with py-spy for --steady seconds")
    parser.add_argument("--tramprof", default=TRAMPROF,
                        help="the tramprof executable to measure (default: this checkout's)")
    parser.add_argument("--compare", metavar="TRAMPROF",
                        help="a second tramprof executable run side by side with the first "
                             "(A: --tramprof, B: this), both measured in the same windows")
    parser.add_argument("--keep-log", metavar="FILE", help="keep the daemons' logs here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench_busy_node.py needs root (the daemon loads BPF programs)")
    counts = {"python": args.python, "native": args.native, "node": args.node}
    if counts["node"] and shutil.which("node") is None:
        print(f"node is not installed (Debian package nodejs): its {counts['node']} "
              "processes are native ones instead")
        counts["native"] += counts.pop("node")
    work = Path(tempfile.mkdtemp(prefix="tramprof-busy-"))
    workers = Workers(work)
    py_env: dict[str, str] = {}
    try:
        with terminate_on_signals():
            apps, spawner = build(work, args)
            py_env = install_trampolines()
            py_env.pop("TRAMPROF_TRAMPOLINES")  # -m tramprof_trampolines activates it
            start_workers(workers, apps, spawner, counts, args.load, args.spawn_rate, py_env,
                          args.paths)
            print(f"workers: {counts} + {args.spawn_rate:g} short-lived/s, "
                  f"{FUNCTIONS} functions per application, "
                  f"{args.paths or 'random'} call paths per process, duty cycle for {args.load:g} "
                  f"CPUs; warm-up {args.warmup:g} s, steady window {args.steady:g} s",
                  flush=True)
            time.sleep(5)
            log_path = Path(args.keep_log) if args.keep_log else work / "daemon.log"
            work.chmod(0o755)
            with log_path.open("ab") as log:
                results = session([int(f) for f in args.frequencies.split(",")], work, args,
                                  log, workers)
            warnings = [line for line in log_path.read_text(errors="replace").splitlines()
                        if " WARNING " in line or " ERROR " in line]
            report(results)
            if warnings:
                print(f"daemon warnings/errors ({len(warnings)}), first ones:")
                for line in warnings[:5]:
                    print("  " + line[:300])
    finally:
        workers.stop()
        shutil.rmtree(work, ignore_errors=True)
        if "PYTHONUSERBASE" in py_env:
            shutil.rmtree(py_env["PYTHONUSERBASE"], ignore_errors=True)


if __name__ == "__main__":
    main()
