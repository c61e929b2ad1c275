"""``tramprof record``: a one-shot profile in any output format.

Like the daemon, it gives up what only loading and attaching needed as soon
as ``Profiler.start()`` returns: it keeps the runtime capabilities (reading
other processes' /proc files) and a root process switches to ``run_as``
(``nobody`` by default). The output file is opened before that, so it can be
anywhere the caller may write. If the drop fails, nothing is sampled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from types import FrameType

from tramprof.commands.privileges import DEFAULT_RUN_AS, PrivilegeError, drop_after_start
from tramprof.config import Config
from tramprof.export.formats import FORMATS
from tramprof.model import Profile, merge
from tramprof.pipeline.profiler import Profiler
from tramprof.sampler.program import SamplerError


def _open_output(path: str) -> tuple[int, bool]:
    """A descriptor for ``path`` and whether it was created now. An existing
    file is truncated only when the profile is written."""
    flags = os.O_WRONLY | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666), True
    except FileExistsError:
        return os.open(path, flags), False


def record(config: Config, duration: float, fmt: str, output: str | None,
           run_as: tuple[int, int] | None = DEFAULT_RUN_AS) -> int:
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
    out_fd, created = -1, False
    try:
        if output:
            out_fd, created = _open_output(output)
        drop_after_start(run_as)
    except (OSError, PrivilegeError) as exc:
        # Fail closed: no sampling, no reading of other processes' files
        # with more privileges than intended.
        profiler.close()
        if out_fd >= 0:
            os.close(out_fd)
            if created and output:
                with contextlib.suppress(OSError):
                    os.unlink(output)
        what = exc if isinstance(exc, PrivilegeError) else f"{output}: {exc.strerror}"
        print(f"tramprof: {what}", file=sys.stderr)
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
    if out_fd >= 0:
        with open(out_fd, "wb") as f:
            f.truncate(0)
            f.write(body)
    else:
        sys.stdout.buffer.write(body)
        sys.stdout.flush()
    return 0
