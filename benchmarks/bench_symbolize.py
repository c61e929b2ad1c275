"""What naming a native frame costs the daemon when no cache of its own
process knows it yet, the case of every new process and of many processes of
one program (workers, short-lived runs of one tool).

Starts ``--processes`` processes of one program (``/usr/bin/python3``,
asleep), then names the same addresses in each of its mapped executable
files (``--frames`` file offsets picked at random over the code of each,
of which those in code with a function name are kept: a fallback name,
file+offset, is the process's own and never shared) through the daemon's
own path (``ProcessImage.name_frames``, a new image per process):

* ``cold``: the first process, nothing known yet (objects already parsed);
* ``shared, searched``: another process, its own caches empty, the names
  found already by the first (``ElfCache``'s shared names), looked up
  through ``lookup`` as before ``shared_lookup`` existed;
* ``shared, direct``: the same with ``shared_lookup``: no search of the
  object's segments, one addition (in Python: the compiled part off);
* ``shared, compiled``: the same through the compiled pass
  (``_speedups.shared_answers``), as the daemon names them when its
  compiled part is built;
* ``cached``: the same process again (its per-address cache).

Reported: CPU time per frame (``time.process_time``, least of ``--rounds``
rounds, the passes side by side in each round) and the ratios of the
shared passes.

    .venv/bin/python benchmarks/bench_symbolize.py [--processes 6] [--frames 4000]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import has_function_name, new_image, sleepers
from tramprof import speedups
from tramprof.symbols import usersyms
from tramprof.symbols.images import ProcessImage, ProcessRegistry


def addresses_of(image: ProcessImage, offsets: dict[str, list[int]]) -> list[int]:
    """The given file offsets of each mapped executable file, as addresses."""
    assert image.symbolizer is not None
    out = []
    for m in image.symbolizer.mappings:
        for offset in offsets.get(m.path, ()):
            if m.offset <= offset < m.offset + (m.end - m.start):
                out.append(m.start + offset - m.offset)
    return out


def per_frame(name: Callable[[list[int]], object], addresses: list[int]) -> float:
    """CPU seconds per frame to name ``addresses`` as stacks of 40 frames."""
    began = time.process_time()
    for at in range(0, len(addresses), 40):
        name(addresses[at:at + 40])
    return (time.process_time() - began) / len(addresses)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--frames", type=int, default=4000, help="per mapped file")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    rng = random.Random(1)
    passes = ("cold", "shared, searched", "shared, direct", "shared, compiled", "cached")
    if speedups.compiled is None:
        parser.error("the compiled part (tramprof._speedups) is not built")
    if args.processes < 4:
        parser.error("--processes: at least 4 (one cold, one for each shared pass)")
    compiled = speedups.compiled
    best = dict.fromkeys(passes, float("inf"))
    with sleepers(args.processes * args.rounds + 1) as procs:
        registry = ProcessRegistry()
        first = new_image(registry, procs[-1].pid)  # the others are named below
        assert first.symbolizer is not None
        offsets = {m.path: sorted(rng.randrange(m.offset, m.offset + m.end - m.start)
                                  for _ in range(args.frames))
                   for m in first.symbolizer.mappings
                   if m.is_exec and not m.is_anonymous and not m.is_special}
        # Parse every object once; keep the offsets whose code has a name
        # (a fallback name, file+offset, is the process's own and never
        # shared: stripped code costs the same in both shared passes).
        named_offsets: dict[str, list[int]] = {}
        for path, file_offsets in offsets.items():
            for offset in file_offsets:
                addr, = addresses_of(first, {path: [offset]})
                name, _source = first.lookup(addr)
                if has_function_name(name):
                    named_offsets.setdefault(path, []).append(offset)
        offsets = named_offsets
        real_shared_lookup = usersyms.ProcessSymbolizer.shared_lookup
        frames = 0
        for round_ in range(args.rounds):
            group = procs[round_ * args.processes:(round_ + 1) * args.processes]
            registry.elf_cache._names.clear()  # nothing named yet
            cold = new_image(registry, group[0].pid)
            addrs = addresses_of(cold, offsets)
            frames = len(addrs)
            best["cold"] = min(best["cold"], per_frame(cold.name_frames, addrs))
            for index, proc in enumerate(group[1:]):
                label = passes[1 + index % 3]
                if label == "shared, searched":
                    usersyms.ProcessSymbolizer.shared_lookup = (  # type: ignore[method-assign]
                        lambda self, addr: None)
                if label != "shared, compiled":
                    speedups.compiled = None  # type: ignore[assignment]
                try:
                    image = new_image(registry, proc.pid)
                    addrs = addresses_of(image, offsets)
                    best[label] = min(best[label], per_frame(image.name_frames, addrs))
                finally:
                    usersyms.ProcessSymbolizer.shared_lookup = (  # type: ignore[method-assign]
                        real_shared_lookup)
                    speedups.compiled = compiled
            best["cached"] = min(best["cached"], per_frame(image.name_frames, addrs))
    print(f"{args.processes} processes of /usr/bin/python3 per round, {frames} frames each "
          f"over {len(offsets)} files; CPU per frame, least of {args.rounds} rounds:")
    for label in passes:
        print(f"  {label:18} {best[label] * 1e6:7.2f} us")
    print(f"  shared: direct / searched = "
          f"{best['shared, direct'] / best['shared, searched']:.2f}, "
          f"compiled / direct = {best['shared, compiled'] / best['shared, direct']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
