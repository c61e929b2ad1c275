"""Per-process state follows the processes: created when sampled, dropped on exit."""

from __future__ import annotations

import subprocess
import time

from tramprof.config import Config
from tramprof.pipeline.profiler import Profiler
from tramprof.procfs.identity import read_start_ticks

from tests.conftest import requires_root

pytestmark = requires_root


def alive(pid: int, start_ticks: int) -> bool:
    try:
        return read_start_ticks(pid) == start_ticks
    except Exception:
        return False


def test_state_of_500_exited_processes_is_dropped(targets):
    profiler = Profiler(Config(frequency=499, interval=0.5))
    profiler.start()
    try:
        churn = subprocess.Popen(
            ["/bin/sh", "-c", f"for i in $(seq 500); do {targets / 'chain'} 0.01 >/dev/null; done"])
        peak = 0
        while churn.poll() is None:
            next_drain = time.monotonic() + 0.5
            while time.monotonic() < next_drain:
                profiler.wait(next_drain - time.monotonic())
            peak = max(peak, len(profiler.registry))
            profiler.collect()
        assert churn.returncode == 0
        for _ in range(2):  # exits are applied after the drain that follows them
            time.sleep(0.2)
            profiler.collect()
        held = profiler.registry.identities()
        assert peak >= 10, "short-lived processes should get state while they run"
        stale = [i for i in held if not alive(i.pid, i.start_ticks)]
        assert stale == []
        assert profiler.stats.process_events["exit"] >= 500
    finally:
        profiler.close()
