"""``tramprof record``: a one-shot profile written as folded stacks."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections import Counter
from types import FrameType

from tramprof.config import Config
from tramprof.folded import write_folded
from tramprof.profiler import Profiler, aggregate_folded
from tramprof.sampler import SamplerError


def record(config: Config, duration: float, fmt: str, output: str | None) -> int:
    profiler = Profiler(config)
    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        profiler.start()
    except SamplerError as exc:
        print(f"tramprof: {exc}", file=sys.stderr)
        return 1
    folded: Counter[tuple[str, ...]] = Counter()
    try:
        deadline = time.monotonic() + duration
        next_drain = time.monotonic() + config.interval
        while not stop:
            now = time.monotonic()
            if now >= deadline:
                break
            profiler.wait(min(0.5, deadline - now, next_drain - now))
            if time.monotonic() >= next_drain:
                folded.update(aggregate_folded(profiler.collect()))
                next_drain = time.monotonic() + config.interval
        folded.update(aggregate_folded(profiler.collect()))
    finally:
        profiler.close()
    if fmt != "folded":
        print(f"tramprof: unsupported format {fmt}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(output, "w")) if output else sys.stdout
        write_folded(folded, out)
    return 0
