"""/metrics latency, response size and process RSS at 1k and 10k series,
plain, gzipped, and as Prometheus asks (OpenMetrics, gzipped).

Each size runs in its own process (so RSS is that size's alone): a series
tracker fed with synthetic stacks until it holds the wanted number of series,
served by the daemon's HTTP server on loopback, scraped 30 times each way
(``SCRAPES``, in turn). At 10k series it also times gzip alone at levels 1, 6 and 9 on
that exposition (the server's level is ``METRICS_GZIP_LEVEL``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry
from tramprof.export.collector import Consistent, ProfilerCollector
from tramprof.export.http import METRICS_GZIP_LEVEL, MetricsServer
from tramprof.export.series import SeriesConfig, SeriesTracker
from tramprof.model import Stack
from tramprof.pipeline.stats import ProfilerStats

# (name, request headers): plain text, gzipped text, and what Prometheus asks
# by default (OpenMetrics first, gzip).
SCRAPES = (
    ("plain", {}),
    ("gzip", {"Accept-Encoding": "gzip"}),
    ("om+gzip", {"Accept-Encoding": "gzip",
                 "Accept": "application/openmetrics-text;version=1.0.0;q=0.5,"
                           "application/openmetrics-text;version=0.0.1;q=0.4,"
                           "text/plain;version=0.0.4;q=0.3,*/*;q=0.2"}),
)


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
    times: dict[str, list[float]] = {kind: [] for kind, _headers in SCRAPES}
    sizes = {}
    for _ in range(30):
        for kind, headers in SCRAPES:
            request = urllib.request.Request(url, headers=headers)
            began = time.perf_counter()
            with urllib.request.urlopen(request) as r:
                sizes[kind] = len(r.read())
                assert (r.headers.get("Content-Encoding") == "gzip") == (kind != "plain")
            times[kind].append((time.perf_counter() - began) * 1000)
    server.close()
    status = Path("/proc/self/status").read_text().splitlines()
    rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024
    result = {"series": tracker.series_count(), "rss_mib": rss, "gzip_levels": {}}
    for kind, samples in times.items():
        samples.sort()
        result[kind] = {"median_ms": samples[len(samples) // 2],
                        "p95_ms": samples[int(len(samples) * 0.95)], "bytes": sizes[kind]}
    if series >= 10_000:
        body = generate_latest(registry)
        for level in (1, 6, 9):
            spent = []
            for _ in range(10):
                began = time.perf_counter()
                size = len(gzip.compress(body, compresslevel=level, mtime=0))
                spent.append((time.perf_counter() - began) * 1000)
            result["gzip_levels"][level] = {"ms": sorted(spent)[5], "bytes": size}
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    print(f"{'series':>8} {'encoding':>8} {'median ms':>10} {'p95 ms':>8} {'KiB':>7} "
          f"{'RSS MiB':>8}")
    levels = {}
    for series in (1000, 10000):
        out = subprocess.run([sys.executable, __file__, "--child", str(series)],
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out)
        for kind, _headers in SCRAPES:
            k = r[kind]
            print(f"{r['series']:>8} {kind:>8} {k['median_ms']:>10.1f} {k['p95_ms']:>8.1f} "
                  f"{k['bytes'] / 1024:>7.0f} {r['rss_mib']:>8.1f}")
        levels = r["gzip_levels"] or levels
    print(f"\ngzip alone on the 10k-series exposition (server level {METRICS_GZIP_LEVEL}):")
    for level, g in levels.items():
        print(f"  level {level}: {g['ms']:6.1f} ms  {g['bytes'] / 1024:6.0f} KiB")


if __name__ == "__main__":
    main()
