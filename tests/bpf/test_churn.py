"""Per-process state follows the processes: created when sampled, dropped on exit."""

from __future__ import annotations

import os
import subprocess
import time
from itertools import pairwise

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
    """The churn's processes are all dropped once they exited. The profiler
    samples the whole host: a process of someone else (a service started by
    the set-up just before, say) whose main thread exits first sends no
    process-level exit event and is left to the periodic /proc check, so
    only the churn's own are asserted on (all stale ones are shown)."""
    profiler = Profiler(Config(frequency=499, interval=0.5))
    profiler.start()
    chain = str(targets / "chain")
    try:
        churn = subprocess.Popen(
            ["/bin/sh", "-c", f"for i in $(seq 500); do {chain} 0.01 >/dev/null; done"])
        began = read_start_ticks(churn.pid)
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
        stale = {i: profiler.registry.metadata(i.pid) for i in held
                 if not alive(i.pid, i.start_ticks)}
        churned = (chain, os.path.realpath("/bin/sh"))  # after and before the exec
        ours = [i for i, metadata in stale.items() if i.start_ticks >= began
                and metadata is not None and metadata.exe in churned]
        assert ours == [], f"state left of exited processes: {stale}"
        assert profiler.stats.process_events["exit"] >= 500
    finally:
        profiler.close()


def test_lifecycle_events_are_read_in_batches_between_drains_and_at_each_drain(targets):
    """Between drains the loop reads lifecycle events at most every
    EVENTS_AT_MOST_EVERY seconds, however often it wakes (a busy node wakes
    it for every newly sampled process); a drain reads them all, so none is
    applied later than before."""
    from tramprof.pipeline.profiler import EVENTS_AT_MOST_EVERY

    profiler = Profiler(Config(frequency=99, interval=10.0))
    profiler.start()
    try:
        reads = []
        read_events = profiler.events.read_events

        def counted() -> list:
            reads.append(time.monotonic())
            return read_events()

        profiler.events.read_events = counted  # type: ignore[method-assign]
        began = time.monotonic()
        wakes = 0
        while time.monotonic() - began < 1.0:
            profiler.wait(0.0)  # as if woken at once, again and again
            wakes += 1
        spent = time.monotonic() - began
        assert wakes > 50
        assert 2 <= len(reads) <= spent / EVENTS_AT_MOST_EVERY + 1
        gaps = [b - a for a, b in pairwise(reads)]
        assert min(gaps) >= EVENTS_AT_MOST_EVERY - 0.01  # both clocks read a moment apart

        exits = profiler.stats.process_events["exit"]
        subprocess.run([str(targets / "chain"), "0.01"], check=True, stdout=subprocess.DEVNULL)
        before = len(reads)
        profiler.collect()  # read at once, however recent the last read
        assert len(reads) == before + 1
        assert profiler.stats.process_events["exit"] >= exits + 1
    finally:
        profiler.close()
