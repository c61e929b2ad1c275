"""CPU cost of the export paths: series tracking, flame graph page, kallsyms.

Measures, in this process:

* ``SeriesTracker.add`` of 10,000 Python-like stacks (100 processes, 5-45
  frames of ~60 bytes) into a tracker already filled to its budget of 1k and
  10k series; ``collect()``; and a Prometheus text scrape of it
  (``prometheus_client.generate_latest``);
* ``render_flamegraph_html`` of 10,000 stacks of 30 frames: time and page size;
* ``/profile``'s pprof and folded bodies of a busy node's minute
  (``--window`` such stacks from 200 processes, each frame with its place):
  time and size, and the pprof body's gzip at level 1 (what the daemon
  writes) beside level 6;
* ``KernelSymbols`` on this machine's ``/proc/kallsyms``: loading the table,
  and lookups per second (ns per lookup), of the addresses of a few core
  functions and of random kernel text addresses. Real addresses need root
  (``kernel.kptr_restrict``); when they read as zero this part is skipped.

Every figure is CPU time (``time.process_time``), the least of ``--runs``
runs: load from other processes on the host inflates it less than wall time.

Run: ``.venv/bin/python benchmarks/bench_export.py [--runs N]``
"""

from __future__ import annotations

import argparse
import gzip
import random
import time
from collections.abc import Callable
from functools import partial

from prometheus_client import CollectorRegistry, generate_latest
from tramprof.export.formats import encode_folded
from tramprof.export.formats.flamegraph import render_flamegraph_html
from tramprof.export.formats.pprof import encode_pprof
from tramprof.export.series import SeriesConfig, SeriesTracker
from tramprof.model import FrameSource, MappedFile, Profile, Stack
from tramprof.symbols.kallsyms import KernelSymbols

ADD_TARGET_MS = 100.0  # add of 10k stacks (not shown for other --stacks)
SCRAPE_TARGET_MS = 50.0  # text scrape at 10k series
KALLSYMS = "/proc/kallsyms"
CORE_FUNCTIONS = ("vfs_read", "schedule", "do_sys_openat2")

Row = tuple[str, str, str]  # measurement, result, target


def best_of(runs: int, fn: Callable[[], object]) -> float:
    """Least CPU time of ``runs`` calls of ``fn``, in seconds."""
    best = float("inf")
    for _ in range(runs):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def within(value: float, target: float) -> str:
    return f"< {target:.0f} ms ({'met' if value < target else 'MISSED'})"


def synthetic_stacks(n: int, groups: int, seed: int = 1) -> list[Stack]:
    """Python-like stacks: 5-45 frames of ~60 bytes from 300 names per process."""
    rng = random.Random(seed)
    vocab = {g: [f"py::mod{g % 7}.Class{j % 13}.method_{j}:/srv/app/pkg{j % 9}/mod.py"
                 for j in range(300)] for g in range(groups)}
    return [Stack(1000 + i % groups, f"proc{i % groups}", f"proc{i % groups}",
                  tuple(rng.choice(vocab[i % groups]) for _ in range(rng.randint(5, 45))),
                  rng.randint(1, 50)) for i in range(n)]


def bench_series(runs: int, n_stacks: int) -> list[Row]:
    rows: list[Row] = []
    stacks = synthetic_stacks(n_stacks, 100)
    other = synthetic_stacks(n_stacks, 100, seed=2)
    for max_series in (1_000, 10_000):
        t = SeriesTracker(SeriesConfig(max_series=max_series))
        t.add(stacks, now=0)
        t.add(other, now=1)  # the budget is full from here on
        registry = CollectorRegistry()
        registry.register(t)
        clock = [1.0]

        def add(t: SeriesTracker = t, clock: list[float] = clock) -> None:
            clock[0] += 1
            t.add(stacks, now=clock[0])

        def collect(t: SeriesTracker = t) -> None:
            list(t.collect())

        add_ms = best_of(runs, add) * 1000
        collect_ms = best_of(runs, collect) * 1000
        size = len(generate_latest(registry))
        scrape_ms = best_of(runs, partial(generate_latest, registry)) * 1000
        label = f"series, {t.series_count():,} live (budget {max_series:,})"
        rows.append((label, "", ""))
        rows.append((f"  add {n_stacks:,} stacks", f"{add_ms:.1f} ms",
                     within(add_ms, ADD_TARGET_MS) if n_stacks == 10_000 else ""))
        rows.append(("  collect()", f"{collect_ms:.1f} ms", ""))
        rows.append(("  text scrape (generate_latest)",
                     f"{scrape_ms:.1f} ms ({size / 1024:,.0f} KiB)",
                     within(scrape_ms, SCRAPE_TARGET_MS)))
    return rows


def bench_flamegraph(runs: int, n_stacks: int) -> list[Row]:
    stacks = tuple(Stack(i % 50, f"proc{i % 50}", "t",
                         tuple(f"mod{i % 7}::fn{(i * 31 + d) % 997}" for d in range(30)),
                         1 + i % 5)
                   for i in range(n_stacks))
    profile = Profile(stacks, 1_700_000_000_123_456_789, 10**10, 99)
    size = len(render_flamegraph_html(profile, "large"))
    ms = best_of(runs, lambda: render_flamegraph_html(profile, "large")) * 1000
    return [(f"flame graph page, {n_stacks:,} stacks of 30 frames",
             f"{ms:.1f} ms ({size:,} bytes)", "")]


def located(stacks: list[Stack]) -> list[Stack]:
    """``stacks`` with a place for every frame: per process one binary and
    one shared object per name (as the pipeline's caches give them)."""
    places: dict[tuple[int, str], FrameSource] = {}
    binaries: dict[int, MappedFile] = {}
    out = []
    for stack in stacks:
        binary = binaries.get(stack.pid)
        if binary is None:
            binary = binaries[stack.pid] = MappedFile(
                f"/srv/app{stack.pid % 40}/bin/app", 0x55_0000_0000, 0x55_0040_0000, 0,
                f"{stack.pid % 40:040x}")
        sources = tuple(places.setdefault(
            (stack.pid, frame), FrameSource(0x55_0000_1000 + 64 * len(places), binary))
            for frame in stack.frames)
        out.append(Stack(stack.pid, stack.process, stack.comm, stack.frames, stack.count,
                         sources))
    return out


def bench_profile_formats(runs: int, n_stacks: int) -> list[Row]:
    profile = Profile(tuple(located(synthetic_stacks(n_stacks, 200, seed=4))),
                      1_700_000_000_000_000_000, 60 * 10**9, 99)
    frames = sum(len(stack.frames) for stack in profile.stacks)
    body = encode_pprof(profile)
    pprof_ms = best_of(runs, lambda: encode_pprof(profile)) * 1000
    raw = gzip.decompress(body)
    rows: list[Row] = [(f"/profile bodies, {n_stacks:,} stacks of {frames:,} frames", "", ""),
                       ("  pprof", f"{pprof_ms:.0f} ms ({len(body) / 1e6:.2f} MB)", "")]
    for level in (1, 6):
        size = len(gzip.compress(raw, compresslevel=level, mtime=0))
        ms = best_of(runs, lambda level=level: gzip.compress(raw, compresslevel=level,
                                                             mtime=0)) * 1000
        rows.append((f"    of it gzip level {level}{' (written)' if level == 1 else ''}",
                     f"{ms:.1f} ms ({size / 1e6:.2f} MB of {len(raw) / 1e6:.2f})", ""))
    folded = encode_folded(profile)
    folded_ms = best_of(runs, lambda: encode_folded(profile)) * 1000
    rows.append(("  folded", f"{folded_ms:.0f} ms ({len(folded) / 1e6:.2f} MB)", ""))
    return rows


def bench_kallsyms(runs: int, n_lookups: int) -> list[Row]:
    k = KernelSymbols()
    if not k.available:
        return [("kallsyms", f"skipped: {k.unavailable_reason}", "")]
    wanted = set(CORE_FUNCTIONS)
    found: dict[str, int] = {}
    text: list[int] = []
    with open(KALLSYMS) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[1] in "tT":
                addr = int(parts[0], 16)
                text.append(addr)
                if len(parts) == 3 and parts[2] in wanted:
                    found[parts[2]] = addr
    if not found:
        return [("kallsyms", f"skipped: none of {', '.join(CORE_FUNCTIONS)} in {KALLSYMS}",
                 "")]
    for name, addr in found.items():
        if k.resolve(addr + 1) != name:
            return [("kallsyms", f"skipped: {addr + 1:#x} does not resolve to {name}", "")]

    def load() -> None:
        k.reload()
        k.resolve(0)

    load_ms = best_of(runs, load) * 1000
    rows: list[Row] = [(f"kallsyms, {len(k):,} functions", "", ""),
                       ("  load the table", f"{load_ms:.0f} ms", "")]
    rng = random.Random(3)
    cases = (
        (f"lookups, {len(found)} core functions repeated",
         [a + 1 for a in found.values()] * (n_lookups // len(found))),
        ("lookups, random kernel text addresses",
         [rng.choice(text) + rng.randrange(16) for _ in range(n_lookups)]),
    )
    resolve = k.resolve
    for label, addrs in cases:
        def run(addrs: list[int] = addrs) -> None:
            for a in addrs:
                resolve(a)

        per = best_of(runs, run) / len(addrs)
        rows.append((f"  {label}", f"{1 / per:,.0f} /s ({per * 1e9:.0f} ns each)", ""))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=5, help="runs per figure; the least is kept")
    ap.add_argument("--stacks", type=int, default=10_000,
                    help="stacks per series add and in the flame graph")
    ap.add_argument("--window", type=int, default=6_900,
                    help="stacks in the /profile bodies (a busy node's minute)")
    ap.add_argument("--lookups", type=int, default=100_000, help="kallsyms lookups per run")
    args = ap.parse_args()

    rows = [*bench_series(args.runs, args.stacks),
            *bench_flamegraph(args.runs, args.stacks),
            *bench_profile_formats(args.runs, args.window),
            *bench_kallsyms(args.runs, args.lookups)]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows if r[2])  # long results without a target overhang
    print(f"CPU time (time.process_time), least of {args.runs} runs")
    print(f"{'measurement':<{w0}}  {'result':<{w1}}  target")
    print(f"{'-' * w0}  {'-' * w1}  {'-' * 18}")
    for name, result, target in rows:
        print(f"{name:<{w0}}  {result:<{w1}}  {target}".rstrip())


if __name__ == "__main__":
    main()
