"""What following young Python interpreters costs the daemon (root).

A Python interpreter that no unwinding mode took at its first sample has its
maps looked at again in its first seconds (``pipeline.young``): the first
look reads them, later ones read ``/proc/PID/stat`` and the maps again only
if the address space changed size. This measures that cost where it is
largest: a node starting ``--rate`` Python interpreters a second, each
living ``--life`` seconds and mapping new memory every 0.25 s (so its size
changes between looks: every look reads the maps).

Two kinds of interpreters, in separate passes:

* ``plain``: Debian's ``python3`` without any runtime: never taken by a
  mode, so every look is paid and finds nothing (the worst case);
* ``runtime``: the same under our trampoline runtime (``TRAMPROF_TRAMPOLINES=1``),
  taken at the first look that sees it loaded.

Each kind runs with the looks on and with them off (``MAX_FOLLOWED`` 0: no
interpreter followed, the daemon before them), the four passes side by side
in each of ``--rounds`` rounds, one profiler in this process at a time
(``--frequency`` on all CPUs, a drain every ``--interval`` s as shipped).
Reported: the profiler's main-thread CPU (% of one core, all its stages:
what the looks add shows in ``process_events``), the interpreters started,
and the extra CPU per interpreter (looks on minus off, over the
interpreters started).

    .venv/bin/python benchmarks/bench_young.py [--rate 20] [--life 2.5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import install_trampolines, median  # noqa: E402
from tramprof.config import Config  # noqa: E402
from tramprof.pipeline import young  # noqa: E402
from tramprof.pipeline.profiler import Profiler  # noqa: E402

#: Started by the spawner: busy for a moment (so that it is sampled), then
#: maps 4 MiB more every 0.25 s until its life is over.
WORKER = """
import sys, time
began = time.monotonic()
while time.monotonic() - began < 0.02:
    pass
blocks = []
while time.monotonic() - began < float(sys.argv[1]):
    blocks.append(bytearray(4 << 20))
    time.sleep(0.25)
"""

#: Starts ``rate`` workers a second at a steady pace until stdin closes,
#: reaping them as they end; prints how many it started. The perf maps the
#: runtime leaves are removed 15 s after their process ended (after the
#: drain that reads them): thousands of them would fill /tmp, and a later
#: process given one of their pids would find one there.
SPAWNER = """
import os, subprocess, sys, threading, time
rate, life, worker = float(sys.argv[1]), sys.argv[2], sys.argv[3]
started, children, ended, stopping = 0, [], [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stopping.set()), daemon=True).start()

def remove_files(older_than):
    while ended and ended[0][1] <= older_than:
        pid, _ = ended.pop(0)
        for path in (f"/tmp/perf-{pid}.map", f"/tmp/jit-{pid}.dump"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

next_at = time.monotonic()
while not stopping.is_set():
    children.append(subprocess.Popen([sys.executable, worker, life]))
    started += 1
    for child in [c for c in children if c.poll() is not None]:
        ended.append((child.pid, time.monotonic()))
        children.remove(child)
    remove_files(time.monotonic() - 15)
    next_at += 1 / rate
    stopping.wait(max(0.0, next_at - time.monotonic()))
for child in children:
    child.wait()
    ended.append((child.pid, time.monotonic()))
remove_files(float("inf"))
print(started, flush=True)
"""


def run_pass(args: argparse.Namespace, work: Path, env: dict[str, str], looks: bool,
             ) -> tuple[float, int, dict[str, float]]:
    """(main-thread CPU % of one core, interpreters started, CPU by stage
    in ms) over one window of ``args.seconds``."""
    young.MAX_FOLLOWED = 512 if looks else 0
    profiler = Profiler(Config(frequency=args.frequency, interval=args.interval))
    profiler.start()
    spawner = subprocess.Popen(
        ["/usr/bin/python3", str(work / "spawner.py"), str(args.rate), str(args.life),
         str(work / "worker.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=env)
    try:
        began = time.monotonic()
        next_drain = began + args.interval
        window: tuple[float, dict[str, float]] | None = None
        while (now := time.monotonic()) < began + args.warmup + args.seconds:
            if window is None and now >= began + args.warmup:
                window = (now, dict(profiler.stats.main_thread_cpu_seconds))
            profiler.wait(min(next_drain - now, 1.0))
            if time.monotonic() >= next_drain:
                profiler.collect()
                next_drain += args.interval
        assert window is not None
        ended, stages = time.monotonic(), profiler.stats.main_thread_cpu_seconds
    finally:
        assert spawner.stdin is not None
        spawner.stdin.close()
        started_total = int(spawner.stdout.read() or 0) if spawner.stdout else 0
        spawner.wait(timeout=60)
        profiler.close()
    by_stage = {stage: (stages[stage] - window[1][stage]) * 1e3 for stage in stages}
    seconds = ended - window[0]
    # Interpreters started in the window: the spawner's pace is steady.
    started = round(started_total * args.seconds / (args.warmup + args.seconds))
    return sum(by_stage.values()) / 1e3 / seconds * 100, started, by_stage


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=20.0,
                        help="Python interpreters started per second")
    parser.add_argument("--life", type=float, default=2.5, help="seconds each lives")
    parser.add_argument("--seconds", type=float, default=40.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--frequency", type=int, default=99)
    parser.add_argument("--interval", type=float, default=10.0)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (loads BPF programs)", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="tramprof-bench-young-"))
    (work / "worker.py").write_text(WORKER)
    (work / "spawner.py").write_text(SPAWNER)
    runtime_env = install_trampolines()
    plain_env = {k: v for k, v in runtime_env.items() if k != "TRAMPROF_TRAMPOLINES"}
    kinds = {"plain": plain_env, "runtime": runtime_env}
    results: dict[tuple[str, bool], list[tuple[float, int, dict[str, float]]]] = {}
    for round_ in range(args.rounds):
        for kind, env in kinds.items():
            for looks in (True, False):
                result = run_pass(args, work, env, looks)
                results.setdefault((kind, looks), []).append(result)
                print(f"round {round_ + 1} {kind:7} looks {'on ' if looks else 'off'}: "
                      f"{result[0]:.2f}% of a core, {result[1]} interpreters, stages ms "
                      + ", ".join(f"{k} {v:.0f}" for k, v in result[2].items()), flush=True)
    print(f"\n{args.rate:g} interpreters/s living {args.life:g} s, {args.frequency} Hz, "
          f"drain every {args.interval:g} s; medians of {args.rounds} rounds:")
    print(f"{'kind':8} {'looks on %':>11} {'looks off %':>12} {'extra per interpreter':>22}")
    for kind in kinds:
        on, off = results[(kind, True)], results[(kind, False)]
        on_cpu, off_cpu = median([r[0] for r in on]), median([r[0] for r in off])
        interpreters = median([r[1] for r in on])
        extra_us = (on_cpu - off_cpu) / 100 * args.seconds / max(1, interpreters) * 1e6
        print(f"{kind:8} {on_cpu:11.2f} {off_cpu:12.2f} {extra_us:19.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
