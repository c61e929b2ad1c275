#!/usr/bin/env python3
"""Benchmark the perf map reader.

Measures, on generated CPython-style maps:

* first load of a big map: ``refresh()`` alone and with the first lookup
  (which builds the address index), in lines per second;
* appending one line and refreshing, on a small and a big map, to show the
  cost depends on the appended bytes, not on the file size; plus the first
  lookup after it (which lays the new entry over the index);
* the occasional rebuild of the base index when enough appended entries have
  piled up (amortised over them);
* lookups per second on random addresses.

Run: ``.venv/bin/python benchmarks/bench_perfmap.py [--lines N]``
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from tramprof.symbols.perfmap import PerfMap

ARENA_ENTRIES = 4096  # CPython fills 64 KiB arenas of trampolines...
ARENA_TOP = 0x7F8000000000  # ...and mmap hands out arenas top-down.


def generate(path: Path, n: int, seed: int = 1) -> tuple[int, int]:
    """Write an ``n``-line map; return the [low, high) address span."""
    rng = random.Random(seed)
    lines = []
    low = high = 0
    for i in range(n):
        arena, slot = divmod(i, ARENA_ENTRIES)
        start = ARENA_TOP - (arena + 1) * 0x100000 + slot * 0x20 + rng.randrange(0, 4) * 8
        lines.append(b"%x 10 py::handler_%d:/srv/app/module_%d.py\n" % (start, i, i % 500))
        low = start if i == 0 else min(low, start)
        high = max(high, start + 0x10)
    path.write_bytes(b"".join(lines))
    return low, high


def first_load(path: Path, span: tuple[int, int]) -> tuple[PerfMap, float, float, int]:
    pm = PerfMap(str(path), os.geteuid())
    t0 = time.perf_counter()
    result = pm.refresh()
    t1 = time.perf_counter()
    pm.lookup(span[0])
    t2 = time.perf_counter()
    return pm, t1 - t0, t2 - t0, result.new_entries


def append_one(
    pm: PerfMap, path: Path, repeat: int, next_addr: int
) -> tuple[list[float], list[float], int]:
    refresh_us, lookup_us = [], []
    bytes_read = 0
    with open(path, "ab", buffering=0) as fh:
        for k in range(repeat):
            addr = next_addr + k * 0x20
            fh.write(b"%x 10 py::appended_%d:/srv/app/new.py\n" % (addr, k))
            t0 = time.perf_counter()
            r = pm.refresh()
            t1 = time.perf_counter()
            name = pm.lookup(addr)
            t2 = time.perf_counter()
            assert r.new_entries == 1 and name == f"py::appended_{k}:/srv/app/new.py"
            bytes_read = r.bytes_read
            refresh_us.append((t1 - t0) * 1e6)
            lookup_us.append((t2 - t1) * 1e6)
    return refresh_us, lookup_us, bytes_read


def base_rebuild(pm: PerfMap, path: Path, n_lines: int, next_addr: int) -> tuple[int, float]:
    """Append enough lines to overflow the overlay; time the merge into the base."""
    batch = max(4097, n_lines // 16 + 1)
    with open(path, "ab") as fh:
        fh.write(
            b"".join(
                b"%x 10 py::late_%d:/srv/app/late.py\n" % (next_addr + i * 0x20, i)
                for i in range(batch)
            )
        )
    pm.refresh()
    t0 = time.perf_counter()
    pm.lookup(next_addr)
    return batch, time.perf_counter() - t0


def fill_overlay(pm: PerfMap, path: Path, next_addr: int) -> int:
    """Append just fewer lines than trigger a base rebuild (the worst case
    for the per-append overlay merge)."""
    n = max(4096, (len(pm) + 1) // 16) - 500
    with open(path, "ab") as fh:
        fh.write(
            b"".join(
                b"%x 10 py::fill_%d:/srv/app/fill.py\n" % (next_addr + i * 0x20, i)
                for i in range(n)
            )
        )
    pm.refresh()
    pm.lookup(next_addr)
    return n


def lookups(
    pm: PerfMap, span: tuple[int, int], n: int, inside: bool = False
) -> tuple[float, float]:
    """Time ``n`` lookups of random addresses in the span, or inside entries."""
    rng = random.Random(2)
    if inside:
        symbols = pm.symbols()
        picks = [symbols[rng.randrange(len(symbols))] for _ in range(n)]
        addrs = [rng.randrange(start, end) for start, end, _ in picks]
    else:
        addrs = [rng.randrange(span[0], span[1]) for _ in range(n)]
    lookup = pm.lookup
    t0 = time.perf_counter()
    hits = 0
    for a in addrs:
        if lookup(a) is not None:
            hits += 1
    return n / (time.perf_counter() - t0), hits / n


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--lines", type=int, default=1_000_000, help="lines in the big map")
    ap.add_argument("--small", type=int, default=10_000, help="lines in the small map")
    ap.add_argument("--lookups", type=int, default=1_000_000, help="random lookups to time")
    ap.add_argument("--repeat", type=int, default=200, help="single-line appends to time")
    ap.add_argument("--dir", default=None, help="directory for the generated maps")
    args = ap.parse_args()

    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        results = {}
        for label, n in (("small", args.small), ("big", args.lines)):
            path = Path(d) / f"perf-{n}.map"
            span = generate(path, n)
            size = path.stat().st_size
            pm, t_refresh, t_total, entries = first_load(path, span)
            assert entries == n
            results[label] = (pm, path, span, n)
            if label == "big":
                rows.append((f"first load, {n:,} lines ({size / 1e6:.1f} MB)", ""))
                rows.append(
                    ("  refresh() only", f"{n / t_refresh:,.0f} lines/s ({t_refresh:.2f} s)")
                )
                rows.append(
                    ("  refresh() + index build", f"{n / t_total:,.0f} lines/s ({t_total:.2f} s)")
                )
        for label in ("small", "big"):
            pm, path, span, n = results[label]
            ref, look, nread = append_one(pm, path, args.repeat, span[1] + 0x1000)
            rows.append((f"append 1 line + refresh(), {n:,}-line map", ""))
            rows.append(
                (
                    "  refresh()",
                    f"median {statistics.median(ref):.0f} us, "
                    f"p95 {sorted(ref)[int(len(ref) * 0.95) - 1]:.0f} us "
                    f"({nread} bytes read)",
                )
            )
            rows.append(
                (
                    "  first lookup after it",
                    f"median {statistics.median(look):.0f} us, "
                    f"p95 {sorted(look)[int(len(look) * 0.95) - 1]:.0f} us",
                )
            )
        pm, path, span, n = results["big"]
        rate, hit = lookups(pm, span, args.lookups)
        rows.append((f"lookups, random addresses ({hit:.0%} hits)", f"{rate:,.0f} /s"))
        rate, hit = lookups(pm, span, args.lookups, inside=True)
        rows.append((f"lookups, addresses inside entries ({hit:.0%} hits)", f"{rate:,.0f} /s"))
        batch, t_merge = base_rebuild(pm, path, n, span[1] + 0x1000000)
        rows.append(
            (
                f"overlay merged into base ({batch:,} appended over {n:,})",
                f"{t_merge * 1e3:.0f} ms (= {t_merge / batch * 1e6:.1f} us per appended line)",
            )
        )
        rate, hit = lookups(pm, span, args.lookups)
        rows.append(("lookups after the merge", f"{rate:,.0f} /s"))
        overlay = fill_overlay(pm, path, span[1] + 0x4000000)
        ref, look, _ = append_one(pm, path, args.repeat, span[1] + 0x8000000)
        rows.append((f"append 1 line with {overlay:,} entries already in the overlay", ""))
        rows.append(("  refresh()", f"median {statistics.median(ref):.0f} us"))
        rows.append(("  first lookup after it", f"median {statistics.median(look):.0f} us"))
        rate, hit = lookups(pm, span, args.lookups)
        rows.append(("lookups with that overlay", f"{rate:,.0f} /s"))

    width = max(len(k) for k, _ in rows)
    print(f"{'measurement':<{width}}  result")
    print(f"{'-' * width}  {'-' * 40}")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
