"""/metrics latency and process RSS at 1k and 10k series.

Each size runs in its own process (so RSS is that size's alone): a series
tracker fed with synthetic stacks until it holds the wanted number of series,
served by the daemon's HTTP server on loopback, scraped 30 times.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client.registry import CollectorRegistry
from tramprof.export.collector import Consistent, ProfilerCollector
from tramprof.export.http import MetricsServer
from tramprof.export.series import SeriesConfig, SeriesTracker
from tramprof.model import Stack
from tramprof.pipeline.stats import ProfilerStats


def synthetic_stacks(series: int) -> list[Stack]:
    """Processes with 20 stacks each, every stack ending in its own function:
    each stack adds one stack series and two function series (self, total)."""
    stacks = []
    per_process = 20
    for p in range(series // (3 * per_process) + 1):
        for i in range(per_process):
            frames = ("_start", "main", f"module_{p}::handler", f"service::step_{i}",
                      f"leaf_function_{p}_{i}")
            stacks.append(Stack(1000 + p, f"proc{p}", f"proc{p}", frames, 10 + i))
    return stacks


def child(series: int) -> None:
    tracker = SeriesTracker(SeriesConfig(max_series=series, top_stacks=20,
                                         top_functions=50))
    tracker.add(synthetic_stacks(series), now=time.monotonic())
    registry = CollectorRegistry()
    registry.register(Consistent([ProfilerCollector(ProfilerStats), tracker],
                                 threading.Lock()))
    server = MetricsServer("127.0.0.1:0", registry, lambda: (True, "ok"))
    server.start()
    url = f"http://127.0.0.1:{server.address[1]}/metrics"
    times = []
    size = 0
    for _ in range(30):
        began = time.perf_counter()
        with urllib.request.urlopen(url) as r:
            size = len(r.read())
        times.append((time.perf_counter() - began) * 1000)
    server.close()
    status = Path("/proc/self/status").read_text().splitlines()
    rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024
    times.sort()
    print(json.dumps({"series": tracker.series_count(), "median_ms": times[len(times) // 2],
                      "p95_ms": times[int(len(times) * 0.95)], "bytes": size,
                      "rss_mib": rss}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    print(f"{'series':>8} {'median ms':>10} {'p95 ms':>8} {'KiB':>7} {'RSS MiB':>8}")
    for series in (1000, 10000):
        out = subprocess.run([sys.executable, __file__, "--child", str(series)],
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out)
        print(f"{r['series']:>8} {r['median_ms']:>10.1f} {r['p95_ms']:>8.1f} "
              f"{r['bytes'] / 1024:>7.0f} {r['rss_mib']:>8.1f}")


if __name__ == "__main__":
    main()
