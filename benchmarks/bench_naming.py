"""What naming one drained stack costs the daemon once its process's caches
know every address (the steady state of a busy node), or every address but
the leaf's pc, which the names other processes found give (a busy node's
processes mostly sample a leaf pc they never sampled): by the compiled
whole-stack pass, by the compiled passes a frame, and in Python alone, side
by side.

A ``python3`` process (asleep) gives the native frames: ``--pool`` addresses
with a function name in its mapped executable files, named once so that they
are cached. Stub and trampoline frames are made up in an anonymous range
(the process has no runtime; their names are put in the image's JIT cache as
the runtime's perf map would name them). ``--stacks`` distinct samples per
drain, as the busy node's mix: Python stacks under the runtime (``--native``
native frames, every third a stub's return address, and one trampoline frame
per stub) and native stacks of 60 frames, each with 3 kernel frames. Every
sample is named through ``StackNamer.name``, the daemon's path; each drain
has a new stack cache, so no stack is found again whole.

Reported: CPU per stack (``time.process_time``, least of ``--rounds`` rounds,
every way in each round) for the whole naming, for the two per-frame passes
alone (``user_addresses``, ``ProcessImage.name_frames_cached``), and the
ratio whole-stack pass / passes a frame.

    .venv/bin/python benchmarks/bench_naming.py [--stacks 1000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import has_function_name, new_image, sleepers
from tramprof import speedups
from tramprof.model import FrameSource, RawSample
from tramprof.pipeline import naming
from tramprof.pipeline.naming import StackNamer
from tramprof.symbols.images import ProcessImage, ProcessRegistry
from tramprof.unwind import merge
from tramprof.unwind.arenas import Arenas

ARENA = 0x7E00_0000_0000  # stubs: 64-byte slots in one 256 KiB arena
KERNEL = {0xFFFF_FFFF_8100_0000 + 0x10 * i: f"kernel_{i}" for i in range(8)}


def named_addresses(image: ProcessImage, count: int, rng: random.Random) -> list[int]:
    """Addresses in the process's executable files whose code has a name."""
    assert image.symbolizer is not None
    spans = [(m.start, m.end) for m in image.symbolizer.mappings
             if m.is_exec and not m.is_anonymous and not m.is_special]
    out: list[int] = []
    while len(out) < count:
        start, end = rng.choice(spans)
        addr = rng.randrange(start, end)
        name, _source = image.lookup(addr)  # cached from now on
        if has_function_name(name):
            out.append(addr)
    return out


def make_samples(pool: list[int], stacks: int, native: int, rng: random.Random,
                 pid: int) -> list[RawSample]:
    samples = []
    for index in range(stacks):
        python = index % 5 < 3
        depth = native if python else 60
        ips, sps, tramps = [], [], []
        sp = 0x7FFF_0000_0000
        for frame in range(depth):
            sp += 0x60
            if python and frame % 3 == 1:
                slot = ARENA + 64 * rng.randrange(4096)
                ips.append(slot + 0x11)  # a return address inside the stub
                tramps.append((slot, sp + 0x10))
            else:
                ips.append(rng.choice(pool) + (1 if frame else 0))
            sps.append(sp)
        samples.append(RawSample(
            tgid=pid, start_boottime_ns=1, exec_id=1, comm="worker", user_ips=tuple(ips),
            user_sps=tuple(sps), user_flags=0, kernel_ips=tuple(rng.sample(list(KERNEL), 3)),
            trampoline_frames=tuple(tramps), kernel_error=0, count=1,
            user_stack_id=(index + 1, rng.getrandbits(64))))
    return samples


class OneImage:
    """The registry's ``image`` for the one process."""

    def __init__(self, image: ProcessImage) -> None:
        self.found = image

    def image(self, tgid: int, start_boottime_ns: int, exec_id: int,
              fallback_name: str) -> tuple[str, ProcessImage | None]:
        return "worker", self.found


@contextmanager
def whole_stack(on: bool) -> Iterator[None]:
    """Off: the namer names every stack by the passes a frame (the compiled
    whole-stack pass declines every sample)."""
    saved = naming.cached_frames
    if not on:
        naming.cached_frames = lambda *_args: None  # type: ignore[assignment]
    try:
        yield
    finally:
        naming.cached_frames = saved


@contextmanager
def compiled(on: bool) -> Iterator[None]:
    saved = speedups.compiled
    if not on:
        speedups.compiled = None  # type: ignore[assignment]
    try:
        yield
    finally:
        speedups.compiled = saved


def per_stack(run: Callable[[], object], stacks: int) -> float:
    began = time.process_time()
    run()
    return (time.process_time() - began) / stacks


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stacks", type=int, default=1000, help="distinct stacks per drain")
    parser.add_argument("--native", type=int, default=120,
                        help="native frames of a Python stack")
    parser.add_argument("--pool", type=int, default=2000, help="distinct native addresses")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if speedups.compiled is None:
        print("tramprof._speedups is not built (make setup builds it: gcc, python3-dev)")
        return 1
    rng = random.Random(1)
    with sleepers(1) as procs:
        image = new_image(ProcessRegistry(), procs[0].pid)
        pool = named_addresses(image, args.pool, rng)
        samples = make_samples(pool, args.stacks, args.native, rng, procs[0].pid)
        stubs = Arenas([(ARENA, ARENA + 64 * 4096)])
        image.naming_state()  # the JIT cache's key is current: filled, it stays
        for slot in range(4096):
            image.jit_found[ARENA + 64 * slot] = (f"py::f{slot}:app.py",
                                                  FrameSource(ARENA + 64 * slot))
        lookups = [merge.user_addresses(s, stubs) for s in samples]
        for addresses in lookups:  # every address cached
            image.name_frames_cached(addresses)
        leaves = {s.user_ips[0] for s in samples}  # a leaf's pc is its ip
        # Named by the whole-stack pass, by the passes a frame (compiled), and
        # in Python alone.
        modes = {"whole": (True, True), "a pass a frame": (True, False),
                 "python": (False, False)}
        best: dict[tuple[str, str], float] = {}

        def keep(key: tuple[str, str], value: float) -> None:
            best[key] = min(best.get(key, float("inf")), value)

        def drain(namer: StackNamer) -> None:
            [namer.name(s) for s in samples]
            namer.end_drain()

        for _ in range(args.rounds):
            for label, (on, whole) in modes.items():
                with compiled(on), whole_stack(whole):
                    if label != "a pass a frame":
                        keep((label, "merge"), per_stack(
                            lambda: [merge.user_addresses(s, stubs) for s in samples],
                            args.stacks))
                        keep((label, "caches"), per_stack(
                            lambda: [image.name_frames_cached(a) for a in lookups],
                            args.stacks))
                    namer = StackNamer(OneImage(image), lambda _pid: stubs, KERNEL.get,
                                       Counter())
                    keep((label, "cached"), per_stack(partial(drain, namer), args.stacks))
                    # Leaves named by other processes only (a busy node's
                    # processes mostly sample a leaf pc they never did).
                    for leaf in leaves:
                        image.found.pop(leaf, None)
                    namer = StackNamer(OneImage(image), lambda _pid: stubs, KERNEL.get,
                                       Counter())
                    keep((label, "leaves"), per_stack(partial(drain, namer), args.stacks))
        # The same stacks every way.
        named = {}
        for label, (on, whole) in modes.items():
            with compiled(on), whole_stack(whole):
                for leaf in leaves:
                    image.found.pop(leaf, None)
                namer = StackNamer(OneImage(image), lambda _pid: stubs, KERNEL.get, Counter())
                named[label] = [namer.name(s) for s in samples]
        assert named["whole"] == named["a pass a frame"] == named["python"], \
            "the compiled passes named a stack otherwise"
    frames = sum(len(a) for a in lookups) / len(lookups)
    print(f"{args.stacks} distinct stacks per drain ({frames:.0f} lookup frames each on "
          f"average, 3 in 5 Python under trampolines); CPU per stack, least of "
          f"{args.rounds} rounds:")
    print(f"  {'':34} {'whole':>9} {'a frame':>9} {'python':>9}  whole / a frame")
    for part, what in (("merge", "user_addresses"), ("caches", "name_frames_cached"),
                       ("cached", "StackNamer.name, all cached"),
                       ("leaves", "StackNamer.name, leaf shared")):
        row = [best.get((label, part)) for label in modes]
        cells = " ".join("        -" if t is None else f"{t * 1e6:7.2f}us" for t in row)
        ratio = f"{row[0] / row[1]:6.2f}" if row[1] is not None else ""
        print(f"  {what:34} {cells}  {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
