"""Unwind tables ("eh_frame" mode): BPF cost, memory, accuracy (root).

1. BPF run time per sample at 10/32/64 native frames: the same program built
   without frame pointers (table walk) and with them (FP walk), measured side
   by side, alternating, with the kernel's bpf_stats.
2. Table memory if every object mapped by every process on this machine had
   its table loaded (count, rows, bytes in 32 KiB chunks), and build
   throughput (rows/s).
3. Against `perf record --call-graph dwarf` on the same non-FP target:
   share of samples with the exact chain, profiler CPU time, bytes written.

    .venv/bin/python benchmarks/bench_tables.py [--seconds 4]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tramprof.config import Config  # noqa: E402
from tramprof.pipeline.profiler import Profiler  # noqa: E402
from tramprof.procfs.maps import read_maps  # noqa: E402
from tramprof.sampler.layout import Counter as BpfCounter  # noqa: E402
from tramprof.sampler.tables import CHUNK_BYTES, chunks_for  # noqa: E402
from tramprof.unwind.cfi import CfiError, compile_table  # noqa: E402

DEPTHS = (10, 32, 64)
CHAIN = ("main", "chain_a", "chain_b", "chain_c")


def build(out: Path) -> dict[str, Path]:
    made = {}
    for name, flags in (("deep_tables", ["-O2"]), ("deep_fp", ["-O2", "-fno-omit-frame-pointer"]),
                        ("chain_tables", ["-O2"])):
        source = REPO / ("benchmarks/deep.c" if name.startswith("deep") else
                         "tests/targets/chain.c")
        subprocess.run(["gcc", *flags, "-o", str(out / name), str(source)], check=True)
        made[name] = out / name
    return made


def start(exe: Path, *args: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([str(exe), *args], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


def per_sample_ns(exe: Path, frames: int, seconds: float) -> tuple[float, float]:
    """(ns per sample, share of samples with all frames) after tables are in."""
    proc = start(exe, "600", str(frames))
    profiler = Profiler(Config(pids=(proc.pid,), frequency=499, interval=0.5))
    profiler.start()
    try:
        for _ in range(60):  # until the stacks are whole (tables loaded, if any)
            profiler.wait(0.5)
            stacks = profiler.collect()
            total = sum(s.count for s in stacks)
            if total and sum(s.count for s in stacks if len(s.frames) >= frames) / total > 0.9:
                break
        before = profiler.sampler.run_time() or (0, 0)
        recorded0 = profiler.sampler.counters()[BpfCounter.RECORDED]
        full = total = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            profiler.wait(0.5)
            for s in profiler.collect():
                total += s.count
                full += s.count if len(s.frames) >= frames else 0
        after = profiler.sampler.run_time() or (0, 0)
        recorded = profiler.sampler.counters()[BpfCounter.RECORDED] - recorded0
    finally:
        profiler.close()
        proc.kill()
        proc.wait()
    # Runs for other processes are cheap exits (pid filter): all run time is
    # charged to the target's recorded samples, an upper bound per sample.
    return (after[0] - before[0]) / max(1, recorded), full / max(1, total)


def host_objects() -> dict[tuple[int, int], str]:
    objects: dict[tuple[int, int], str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            maps = read_maps(int(entry))
        except Exception:
            continue
        for m in maps:
            if m.is_exec and m.path.startswith("/") and not m.is_deleted:
                objects.setdefault((m.dev_major << 32 | m.dev_minor, m.inode),
                                   f"/proc/{entry}/root{m.path}")
    return objects


def host_tables() -> None:
    objects = host_objects()
    rows = table_bytes = tabled = fp = refused = 0
    began = time.process_time()
    for path in objects.values():
        try:
            with open(path, "rb") as f:
                table = compile_table(f)
        except (OSError, CfiError):
            refused += 1
            continue
        if table.frame_pointers:
            fp += 1
            continue
        tabled += 1
        rows += table.row_count
        table_bytes += chunks_for(table.row_count) * CHUNK_BYTES
    cpu = time.process_time() - began
    print(f"host: {len(objects)} executable objects mapped; {tabled} need tables "
          f"({rows:,} rows, {table_bytes / 2**20:.1f} MiB in chunks, "
          f"{rows * 8 / 2**20:.1f} MiB of rows), {fp} keep frame pointers, {refused} unusable")
    print(f"build: {cpu:.1f} s CPU, {rows / max(cpu, 1e-9):,.0f} rows/s")


def chain_share(stacks: Counter[tuple[str, ...]]) -> float:
    total = sum(stacks.values())
    good = sum(c for s, c in stacks.items() if tuple(s[-4:]) == CHAIN)
    return good / max(1, total)


def versus_perf(exe: Path, seconds: float) -> None:
    proc = start(exe, "600")
    try:
        # tramprof: tables warm first (as a running daemon has them), then measure.
        profiler = Profiler(Config(pids=(proc.pid,), frequency=499, interval=0.5))
        profiler.start()
        try:
            for _ in range(60):
                profiler.wait(0.5)
                stacks = Counter({s.frames: s.count for s in profiler.collect()})
                if stacks and chain_share(stacks) > 0.9:
                    break
            cpu0 = resource.getrusage(resource.RUSAGE_SELF)
            measured: Counter[tuple[str, ...]] = Counter()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                profiler.wait(0.5)
                for s in profiler.collect():
                    measured[s.frames] += s.count
            cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        finally:
            profiler.close()
        ours_cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
        folded = sum(len(";".join(s)) + 8 for s in measured)
        print(f"tramprof: {chain_share(measured):.1%} exact main;chain_a;chain_b;chain_c, "
              f"{ours_cpu:.2f} s CPU of the daemon's process (steady state, tables loaded), "
              f"{folded:,} bytes of folded stacks for {seconds:.0f} s")
        if shutil.which("perf") is None:
            print("perf: not installed (linux-perf)")
            return
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "perf.data"
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run(["perf", "record", "-q", "-F", "499", "--call-graph", "dwarf",
                            "-p", str(proc.pid), "-o", str(data), "--", "sleep", str(seconds)],
                           check=True, stderr=subprocess.DEVNULL)
            recorded = resource.getrusage(resource.RUSAGE_CHILDREN)
            script = subprocess.run(["perf", "script", "-i", str(data), "-F", "ip,sym"],
                                    capture_output=True, text=True, check=True).stdout
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            stacks: Counter[tuple[str, ...]] = Counter()
            for block in script.strip().split("\n\n"):
                names = [line.split()[1] for line in block.splitlines() if len(line.split()) > 1]
                stacks[tuple(reversed(names))] += 1
            rec_cpu = (recorded.ru_utime + recorded.ru_stime) - (before.ru_utime + before.ru_stime)
            post_cpu = (after.ru_utime + after.ru_stime) - (recorded.ru_utime + recorded.ru_stime)
            print(f"perf --call-graph dwarf: {chain_share(stacks):.1%} exact, {rec_cpu:.2f} s CPU "
                  f"recording + {post_cpu:.2f} s CPU in perf script, "
                  f"{data.stat().st_size:,} bytes written for {seconds:.0f} s")
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_tables: needs root (loads BPF programs)")
    with tempfile.TemporaryDirectory() as tmp:
        exes = build(Path(tmp))
        print(f"BPF run time per sample at 499 Hz ({args.seconds:.0f} s each, alternating):")
        for depth in DEPTHS:
            results = {}
            for name in ("deep_fp", "deep_tables", "deep_fp", "deep_tables"):
                ns, whole = per_sample_ns(exes[name], depth, args.seconds)
                results.setdefault(name, []).append((ns, whole))
            fp = min(r[0] for r in results["deep_fp"])
            tables = min(r[0] for r in results["deep_tables"])
            print(f"  {depth:3d} frames: FP walk {fp / 1000:.2f} µs "
                  f"({results['deep_fp'][-1][1]:.0%} whole), tables {tables / 1000:.2f} µs "
                  f"({results['deep_tables'][-1][1]:.0%} whole), ratio {tables / fp:.2f}")
        host_tables()
        versus_perf(exes["chain_tables"], args.seconds)


if __name__ == "__main__":
    main()
