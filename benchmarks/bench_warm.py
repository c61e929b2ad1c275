"""What warming a newly sampled process costs the daemon, and how much of it
is the /proc reads themselves: the most that doing the rest in C could save
(root: ``map_files`` needs it).

A process sampled for the first time is warmed at once, while it still runs
(``ProcessRegistry.warm``: its stat, exe link, cgroup and maps read, its
mapped objects looked up by identity). On a busy node that is several a
second, each after the daemon slept, so each runs with cold caches.

``--processes`` processes of one program (``/usr/bin/python3``, asleep) are
started, and one is warmed first, uncounted, so that its objects are parsed
and held as on a node running the program already. Then, alternating process
by process so that both see the same conditions, either:

* ``warm``: the daemon's path, ``ProcessRegistry.warm``;
* ``reads``: the system calls that warm makes and nothing else (the same
  files read as the daemon reads them, one ``stat`` through ``map_files`` per
  executable file mapped), with the least Python around them.

in two conditions: ``cold``, ``--pause`` seconds asleep before each process
with ``--thrash`` processes next to it walking a list far larger than the
caches (the busy node's case); ``hot``, back to back (the same neighbours).

Reported: CPU per process (``time.thread_time_ns``, median and 90th
percentile) of each, and the share of the warm that the reads are.

    sudo .venv/bin/python benchmarks/bench_warm.py [--processes 200] [--pause 0.1]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import median, percentile, sleepers
from tramprof.procfs.identity import read_proc_file, read_stat
from tramprof.symbols.images import ProcessRegistry

# A mapping line's range, permissions and path (``/proc/PID/maps``).
_MAPPING = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+ +(/.*)$", re.M)
_THRASH = ("import random\nx = [random.random() for _ in range(2_000_000)]\n"
           "while True:\n    x.sort()\n    random.shuffle(x)\n")


def reads_only(pid: int) -> None:
    """The system calls of a warm, without the work around them (the files
    read by the daemon's own reader)."""
    proc = f"/proc/{pid}"
    os.readlink(f"{proc}/exe")
    read_proc_file(pid, "cgroup")
    read_proc_file(pid, "stat")
    seen = set()
    for start, end, perms, path in _MAPPING.findall(read_proc_file(pid, "maps")):
        if b"x" in perms and path not in seen:
            seen.add(path)
            os.stat(f"{proc}/map_files/{int(start, 16):x}-{int(end, 16):x}")


@contextmanager
def neighbours(count: int) -> Iterator[None]:
    """``count`` processes that keep evicting what the caches hold."""
    procs = [subprocess.Popen([sys.executable, "-c", _THRASH]) for _ in range(count)]
    try:
        time.sleep(1.0)  # their lists made
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def measure(pids: list[int], pause: float) -> dict[str, list[int]]:
    """CPU ns per process of each way, alternating process by process."""
    ticks_ns = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    starts = {pid: read_stat(pid).start_ticks * ticks_ns for pid in pids}
    registry = ProcessRegistry()
    first, *rest = pids
    registry.warm(first, starts[first], 1)  # the program's objects parsed, uncounted
    ways: dict[str, Callable[[int], object]] = {
        "warm": lambda pid: registry.warm(pid, starts[pid], 1),
        "reads": reads_only,
    }
    names = list(ways)
    spent: dict[str, list[int]] = {name: [] for name in names}
    for index, pid in enumerate(rest):
        name = names[index % len(names)]
        if pause:
            time.sleep(pause)
        began = time.thread_time_ns()
        ways[name](pid)
        spent[name].append(time.thread_time_ns() - began)
    return spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=200)
    parser.add_argument("--pause", type=float, default=0.1,
                        help="seconds asleep before each process in the cold condition")
    parser.add_argument("--thrash", type=int, default=2,
                        help="cache-thrashing neighbours (one per CPU of a busy node)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_warm: needs root (map_files)", file=sys.stderr)
        return 1
    rows = []
    with neighbours(args.thrash), sleepers(args.processes) as procs:
        pids = [proc.pid for proc in procs]
        half = len(pids) // 2
        for condition, group, pause in (("cold", pids[:half], args.pause),
                                        ("hot", pids[half:], 0.0)):
            spent = measure(group, pause)
            warm, reads = spent["warm"], spent["reads"]
            rows.append((condition, median(warm) / 1e3, percentile(warm, 0.9) / 1e3,
                         median(reads) / 1e3, percentile(reads, 0.9) / 1e3,
                         median(reads) / median(warm), len(warm) + len(reads)))
    print(f"{'':6s} {'warm us p50':>12s} {'p90':>6s} {'reads us p50':>13s} {'p90':>6s} "
          f"{'reads/warm':>11s} {'processes':>10s}")
    for condition, warm50, warm90, reads50, reads90, share, count in rows:
        print(f"{condition:6s} {warm50:12.0f} {warm90:6.0f} {reads50:13.0f} {reads90:6.0f} "
              f"{share:11.2f} {count:10d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
