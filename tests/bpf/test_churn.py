"""Per-process state follows the processes: created when sampled, dropped on exit."""

from __future__ import annotations

import os
import subprocess
import time
from itertools import pairwise

from bcc.utils import get_online_cpus
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
    """Between drains the loop reads lifecycle events once every
    EVENTS_EVERY seconds, however often it wakes (a busy node wakes it for
    every newly sampled process); a drain reads them all, so none is
    applied later than before."""
    from tramprof.pipeline.profiler import EVENTS_EVERY

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
        while time.monotonic() - began < 2.5 * EVENTS_EVERY:
            profiler.wait(0.0)  # as if woken at once, again and again
            wakes += 1
        spent = time.monotonic() - began
        assert wakes > 100
        assert 2 <= len(reads) <= spent / EVENTS_EVERY + 1
        gaps = [b - a for a, b in pairwise(reads)]
        assert min(gaps) >= EVENTS_EVERY - 0.01  # both clocks read a moment apart

        exits = profiler.stats.process_events["exit"]
        subprocess.run([str(targets / "chain"), "0.01"], check=True, stdout=subprocess.DEVNULL)
        before = len(reads)
        profiler.collect()  # read at once, however recent the last read
        assert len(reads) == before + 1
        assert profiler.stats.process_events["exit"] >= exits + 1
    finally:
        profiler.close()


def test_the_new_process_buffers_are_read_when_they_woke_the_loop(targets):
    """A wake for another reason (a timeout, the recorder's descriptor) does
    not read the new-process rings, which costs a cache-cold pass over them
    each time; a newly sampled process still wakes the loop
    and is warmed while it runs."""
    profiler = Profiler(Config(frequency=99, interval=10.0))
    profiler.start()
    reads: list[int] = []
    new_processes = profiler.sampler.new_processes

    def counted() -> list[tuple[int, int, int]]:
        found = new_processes()
        reads.append(len(found))
        return found

    profiler.sampler.new_processes = counted  # type: ignore[method-assign]
    always, writer = os.pipe()
    os.write(writer, b"x")  # readable throughout: every wait returns at once
    target = None
    try:
        for _ in range(300):
            profiler.wait(1.0, (always,))
        # Each record wakes the loop once: a read that finds none follows
        # only a read that found some (a record that came during the read
        # leaves the buffer readable once more).
        assert reads.count(0) <= len(reads) - reads.count(0) + 1, reads
        target = subprocess.Popen([str(targets / "chain"), "5"], stdout=subprocess.PIPE)
        assert target.stdout is not None and target.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 4
        while target.pid not in profiler.registry.pids() and time.monotonic() < deadline:
            profiler.wait(1.0, (always,))
        assert target.pid in profiler.registry.pids()
        assert target.poll() is None  # warmed while it ran
        assert profiler.stats.new_processes["warmed"] >= 1
    finally:
        if target is not None:
            target.kill()
            target.wait()
        os.close(always)
        os.close(writer)
        profiler.close()


def test_a_process_gone_before_it_was_warmed_is_counted(targets):
    """A process sampled, then gone before the loop looked at it (as a
    short-lived one may be within milliseconds), counts as exited: its
    samples cannot be named, and the figure says how often that happens."""
    profiler = Profiler(Config(frequency=99, interval=10.0))
    profiler.start()
    outcomes: dict[int, object] = {}
    warm = profiler.registry.warm

    def recorded(tgid: int, start: int, exec_id: int):  # type: ignore[no-untyped-def]
        image = warm(tgid, start, exec_id)
        outcomes[tgid] = image
        return image

    profiler.registry.warm = recorded  # type: ignore[method-assign]
    try:
        exited = profiler.stats.new_processes["exited"]
        target = subprocess.Popen([str(targets / "chain"), "0.3"], stdout=subprocess.DEVNULL)
        assert target.wait() == 0  # sampled ~30 times while the loop slept, now reaped
        deadline = time.monotonic() + 4
        while target.pid not in outcomes and time.monotonic() < deadline:
            profiler.wait(0.0)
        assert target.pid in outcomes, "the target's first sample was never announced"
        assert outcomes[target.pid] is None  # gone: nothing could be read
        assert profiler.stats.new_processes["exited"] >= exited + 1
    finally:
        profiler.close()


def test_the_loop_waits_on_the_open_new_process_buffers():
    """The descriptors the loop polls at every wake, kept from the buffers'
    opening: one perf event per CPU, exactly the rings', none before the
    start or after the close; each call's list is the caller's own."""
    profiler = Profiler(Config(frequency=99, interval=10.0))
    try:
        assert profiler.event_fds() == []
        profiler.start()
        fds = profiler.event_fds()
        assert sorted(fds) == sorted(ring.fd for ring in profiler.sampler._new_process_rings)
        assert len(fds) == len(get_online_cpus())
        assert {os.readlink(f"/proc/self/fd/{fd}") for fd in fds} == {"anon_inode:[perf_event]"}
        fds.append(-1)
        assert profiler.event_fds() == fds[:-1]
    finally:
        profiler.close()
    assert profiler.event_fds() == []
