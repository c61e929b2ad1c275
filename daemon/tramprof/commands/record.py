"""``tramprof record``: a one-shot profile in any output format."""

from __future__ import annotations

import signal
import sys
import time
from types import FrameType

from tramprof.config import Config
from tramprof.export.formats import FORMATS
from tramprof.model import Profile, merge
from tramprof.pipeline.profiler import Profiler
from tramprof.sampler.program import SamplerError


def record(config: Config, duration: float, fmt: str, output: str | None) -> int:
    if fmt not in FORMATS:
        print(f"tramprof: unknown format {fmt}", file=sys.stderr)
        return 2
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
    windows: list[Profile] = []
    window_start = time.time_ns()

    def drain() -> None:
        nonlocal window_start
        stacks = profiler.collect()
        now = time.time_ns()
        windows.append(Profile(tuple(stacks), window_start, now - window_start,
                               config.frequency))
        window_start = now

    try:
        deadline = time.monotonic() + duration
        next_drain = time.monotonic() + config.interval
        while not stop and (left := deadline - time.monotonic()) > 0:
            profiler.wait(min(0.5, left, next_drain - time.monotonic()))
            if time.monotonic() >= next_drain:
                drain()
                next_drain = time.monotonic() + config.interval
        drain()
    finally:
        profiler.close()
    body = FORMATS[fmt].encode(merge(windows, config.frequency))
    if output:
        with open(output, "wb") as f:
            f.write(body)
    else:
        sys.stdout.buffer.write(body)
        sys.stdout.flush()
    return 0
