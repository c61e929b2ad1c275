"""sampler.cpus: which online CPUs are reported as not sampled, from the
events' counts and /proc/stat's busy time (the kernel side is
tests/bpf/test_cpu_hotplug.py)."""

from __future__ import annotations

import os

import pytest
from tramprof.sampler.cpus import CpuReading, CpuWatch, busy_ticks, unsampled
from tramprof.sampler.loaded import online_cpus

PROC_STAT = """\
cpu  900 10 300 50000 40 5 7 3 0 0
cpu0 500 10 200 25000 20 3 4 1 0 0
cpu1 400 0 100 25000 20 2 3 2 0 0
cpu12 1 2 3 4 5 6 7 8 9 10
cpux 1 2 3 4 5 6 7 8 9 10
cpu3 1 2
intr 12345 0 0
ctxt 999
"""


def test_busy_time_is_user_nice_system_irq_softirq_of_each_cpu() -> None:
    assert busy_ticks(PROC_STAT) == {0: 500 + 10 + 200 + 3 + 4, 1: 400 + 100 + 2 + 3,
                                     12: 1 + 2 + 3 + 6 + 7}


def test_proc_stat_lists_the_online_cpus_and_their_busy_time_grows() -> None:
    with open("/proc/stat") as f:
        before = busy_ticks(f.read())
    assert sorted(before) == online_cpus()
    deadline = os.times().elapsed + 0.3
    while os.times().elapsed < deadline:
        pass
    with open("/proc/stat") as f:
        after = busy_ticks(f.read())
    assert sum(after.values()) - sum(before.values()) >= 20  # 0.3 s at 100 ticks a second


@pytest.mark.parametrize(("before", "now", "expected"), [
    # The first check: only a CPU without an event.
    ({}, {0: CpuReading(10, 5), 1: CpuReading(None, 5)}, [1]),
    # Live events count on: nothing to report.
    ({0: CpuReading(10, 5), 1: CpuReading(20, 5)},
     {0: CpuReading(11, 9), 1: CpuReading(25, 9)}, []),
    # CPU 1 busy while its event counted nothing: its event is gone.
    ({0: CpuReading(10, 5), 1: CpuReading(20, 5)},
     {0: CpuReading(11, 9), 1: CpuReading(20, 9)}, [1]),
    # CPU 1 idle throughout: a stopped count says nothing, and nothing was missed.
    ({0: CpuReading(10, 5), 1: CpuReading(20, 5)},
     {0: CpuReading(11, 9), 1: CpuReading(20, 5)}, []),
    # CPU 2 came online since: no event on it.
    ({0: CpuReading(10, 5)}, {0: CpuReading(11, 9), 2: CpuReading(None, 1)}, [2]),
])
def test_unsampled_cpus(before, now, expected) -> None:
    assert unsampled(before, now) == expected


def test_an_offline_cpu_is_not_reported() -> None:
    before = {0: CpuReading(10, 5), 1: CpuReading(20, 5)}
    now = {0: CpuReading(11, 9)}
    assert unsampled(before, now) == []


def test_the_watch_reads_each_event_count_and_remembers_the_last(tmp_path) -> None:
    """Event descriptors stand in as pipes holding 8-byte counts; /proc/stat
    is a file (its CPUs are the online ones). CPU 1's count stops while it
    is busy: reported at the second check, as is CPU 2 (online, no event) at
    each; CPU 3 once offline is not."""
    stat = tmp_path / "stat"
    watch = CpuWatch(str(stat))
    pipes = {cpu: os.pipe() for cpu in (0, 1)}

    def check(counts: dict[int, int], busy: dict[int, int]) -> list[int]:
        for cpu, count in counts.items():
            os.write(pipes[cpu][1], count.to_bytes(8, "little"))
        stat.write_text("cpu  0 0 0 0 0 0 0 0 0 0\n" + "".join(
            f"cpu{cpu} {ticks} 0 0 100 0 0 0 0 0 0\n" for cpu, ticks in busy.items()))
        return watch.check({cpu: r for cpu, (r, _w) in pipes.items()})

    try:
        assert check({0: 100, 1: 200}, {0: 5, 1: 5, 2: 5}) == [2]
        assert check({0: 150, 1: 200}, {0: 9, 1: 9, 2: 9}) == [1, 2]
        assert check({0: 160, 1: 200}, {0: 12, 1: 9, 2: 9}) == [2]  # CPU 1 idle since
        assert check({0: 170, 1: 200}, {0: 15, 1: 9, 2: 9, 3: 1}) == [2, 3]
        assert check({0: 180, 1: 200}, {0: 18, 1: 9}) == []
    finally:
        for r, w in pipes.values():
            os.close(r)
            os.close(w)
