"""Workload slowdown caused by the daemon, and the daemon's own cost.

A fixed CPU-bound native workload runs pinned to one CPU, alternately with
no daemon, the daemon at 99 Hz and at 999 Hz (A/B/C order rotated every
round, so drift in the machine affects all modes alike). Reported: median
wall time per mode and slowdown against no daemon. Then the daemon runs at
99 Hz for a while next to a busy process: its CPU use (% of one core), peak
RSS, and the BPF program's run time per sample (kernel BPF statistics).
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import threading
import time
from pathlib import Path

from common import Daemon, build_workload, install_trampolines, median


def run_workload(argv: list[str], cpu: int, env: dict[str, str] | None = None) -> float:
    began = time.perf_counter()
    subprocess.run(["taskset", "-c", str(cpu), *argv], check=True, env=env)
    return time.perf_counter() - began


def slowdown(name: str, argv: list[str], rounds: int, modes: list[str],
             env: dict[str, str] | None = None) -> None:
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpu = (os.cpu_count() or 1) - 1
    run_workload(argv, cpu, env)  # warm caches, CPU frequency
    for r in range(rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for mode in order:
            daemon = None if mode == "none" else Daemon("--frequency", mode, "--interval", "10")
            try:
                times[mode].append(run_workload(argv, cpu, env))
            finally:
                if daemon:
                    daemon.stop()
    base = median(times["none"])
    print(f"workload: {name} pinned to CPU {cpu}, {rounds} rounds per mode")
    print(f"{'mode':>8} {'median s':>9} {'min s':>7} {'max s':>7} {'slowdown':>9}")
    for mode in modes:
        m = median(times[mode])
        print(f"{mode:>8} {m:9.3f} {min(times[mode]):7.3f} {max(times[mode]):7.3f} "
              f"{(m / base - 1) * 100:8.2f}%")


class Throughput:
    """A long-running workload that prints (time, rounds done) lines."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
        self.samples: list[tuple[float, int]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            t, done = line.split()
            self.samples.append((float(t), int(done)))

    def rate(self, seconds: float) -> float:
        """Rounds per second over the next ``seconds``."""
        time.sleep(0.3)
        first = self.samples[-1]
        time.sleep(seconds)
        last = self.samples[-1]
        return (last[1] - first[1]) / (last[0] - first[0])

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        Path(f"/tmp/perf-{self.proc.pid}.map").unlink(missing_ok=True)


def steady_python_slowdown(env: dict[str, str], rounds: int, window: float,
                           settle: float) -> None:
    """A Python process already running under the trampoline runtime: its
    throughput with no daemon, then with the daemon at 99 Hz once the daemon
    has seen it (start-up work excluded), alternating."""
    cpu = (os.cpu_count() or 1) - 1
    work = Throughput(["taskset", "-c", str(cpu), "/usr/bin/python3",
                       str(Path(__file__).with_name("pywork.py")), "stream"], env)
    rates: dict[str, list[float]] = {"none": [], "99": []}
    try:
        work.rate(2)  # warm up
        for _ in range(rounds):
            rates["none"].append(work.rate(window))
            daemon = Daemon("--frequency", "99", "--interval", "10")
            try:
                # The daemon looks at the process on its first sample, and
                # finishes its start-up (symbol preload, compiler memory
                # returned) meanwhile: steady state only.
                time.sleep(settle)
                rates["99"].append(work.rate(window))
            finally:
                daemon.stop()
    finally:
        work.stop()
    base = median(rates["none"])
    print(f"workload: Python under the trampoline runtime (chain mode), running throughout, "
          f"pinned to CPU {cpu}; {rounds} windows of {window:.0f} s per mode")
    print(f"{'mode':>8} {'rounds/s':>9} {'min':>7} {'max':>7} {'slowdown':>9}")
    for mode, values in rates.items():
        print(f"{mode:>8} {median(values):9.1f} {min(values):7.1f} {max(values):7.1f} "
              f"{(1 - median(values) / base) * 100:8.2f}%")
    # Each daemon window against the no-daemon window just before it: drift of
    # the machine over the run cancels out.
    paired = sorted((1 - on / off) * 100 for off, on in zip(rates["none"], rates["99"],
                                                             strict=True))
    print(f"paired slowdown (each 99 Hz window against the window before it): median "
          f"{median(paired):.2f}%, quartiles {paired[len(paired) // 4]:.2f}% .. "
          f"{paired[(3 * len(paired)) // 4]:.2f}%")
    none = rates["none"]
    spread = [abs(a - b) / base * 100 for a, b in itertools.pairwise(none)]
    if spread:
        print(f"window-to-window difference with no daemon: median {median(spread):.2f}%")


def daemon_cost(work: str, seconds: float, warmup: float = 15) -> None:
    busy = subprocess.Popen([work, "100000"])
    daemon = Daemon("--frequency", "99", "--interval", "10")
    try:
        start_cpu = daemon.cpu_seconds()
        time.sleep(warmup)  # first drain: kernel and ELF symbol tables are loaded once
        cpu0, t0 = daemon.cpu_seconds(), time.monotonic()
        time.sleep(seconds)
        cpu1, t1 = daemon.cpu_seconds(), time.monotonic()
        metrics = daemon.get("/metrics")
        rss = daemon.peak_rss_mib()
        steady_rss, anon_rss = daemon.rss_mib()
    finally:
        daemon.stop()
        busy.kill()
        busy.wait()
    values = {}
    for line in metrics.splitlines():
        if line.startswith(("tramprof_bpf_run_time_seconds_total", "tramprof_bpf_runs_total")):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    runs = values.get("tramprof_bpf_runs_total", 0)
    per_sample = values.get("tramprof_bpf_run_time_seconds_total", 0) / runs * 1e6 if runs else 0
    print(f"daemon at 99 Hz with one busy process, measured {seconds:.0f} s after a "
          f"{warmup:.0f} s warm-up:")
    print(f"  CPU: {(cpu1 - cpu0) / (t1 - t0) * 100:.2f}% of one core "
          f"(start-up incl. BPF compile: {start_cpu:.2f} s)")
    print(f"  RSS: {steady_rss:.1f} MiB now ({anon_rss:.1f} MiB anonymous), "
          f"peak {rss:.1f} MiB (during the BPF compile)")
    print(f"  BPF program: {per_sample:.2f} us per sample over {runs:.0f} runs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--millions", type=int, default=3000,
                        help="workload size (3000 ~ 3-4 s here)")
    parser.add_argument("--window", type=float, default=4,
                        help="seconds per measurement window of the Python workload")
    parser.add_argument("--settle", type=float, default=5,
                        help="seconds between the daemon's start and a Python window")
    parser.add_argument("--cost-seconds", type=float, default=60)
    parser.add_argument("--parts", default="native,python,cost",
                        help="comma-separated subset of: native, python, cost")
    args = parser.parse_args()
    parts = {p.strip() for p in args.parts.split(",")}
    work = build_workload()
    if "native" in parts:
        slowdown(f"native, {args.millions}M iterations", [work, str(args.millions)],
                 args.rounds, ["none", "99", "999"])
    if "python" in parts:
        steady_python_slowdown(install_trampolines(), args.rounds, args.window, args.settle)
    if "cost" in parts:
        daemon_cost(work, args.cost_seconds)


if __name__ == "__main__":
    main()
