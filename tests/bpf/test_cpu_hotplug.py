"""A CPU taken offline and brought back loses its sampling events for good
(the kernel ends them): the sampler reports that CPU, and only that one
(root; takes one CPU offline for a moment)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from tramprof.sampler.loaded import online_cpus
from tramprof.sampler.program import Sampler, SamplerConfig

from tests.conftest import requires_root

pytestmark = requires_root

SPIN = "while True: pass"


def online_file(cpu: int) -> str:
    return f"/sys/devices/system/cpu/cpu{cpu}/online"


def set_online(cpu: int, online: bool) -> None:
    with open(online_file(cpu), "w") as f:
        f.write("1" if online else "0")


@pytest.fixture
def spare_cpu() -> Iterator[int]:
    """The highest online CPU but the first, if it can go offline; back
    online afterwards whatever happens."""
    candidates = [cpu for cpu in online_cpus()
                  if cpu > 0 and os.access(online_file(cpu), os.W_OK)]
    if not candidates:
        pytest.skip("no CPU here can be taken offline (one CPU, or a read-only "
                    "/sys/devices/system/cpu)")
    cpu = candidates[-1]
    try:
        yield cpu
    finally:
        if cpu not in online_cpus():
            set_online(cpu, True)


def spinner(cpu: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", SPIN])
    os.sched_setaffinity(proc.pid, {cpu})
    return proc


def by_pid(samples: list) -> Counter[int]:
    counts: Counter[int] = Counter()
    for sample in samples:
        counts[sample.tgid] += sample.count
    return counts


def test_a_cpu_offline_and_back_is_reported_and_the_others_are_not(spare_cpu: int) -> None:
    moved, stays = spinner(spare_cpu), spinner(0)
    try:
        with Sampler(SamplerConfig(frequency=499)) as sampler:
            sampler.set_targets([moved.pid, stays.pid])
            sampler.drain()
            assert sampler.unsampled_cpus() == []
            time.sleep(1)
            assert sampler.unsampled_cpus() == []  # busy, and counting
            before = by_pid(sampler.drain())
            try:
                set_online(spare_cpu, False)
            except OSError as exc:
                pytest.skip(f"CPU {spare_cpu} cannot go offline: {exc}")
            time.sleep(0.2)
            assert sampler.unsampled_cpus() == []  # offline: not missed
            set_online(spare_cpu, True)
            os.sched_setaffinity(moved.pid, {spare_cpu})  # offlining unpinned it
            sampler.drain()
            time.sleep(1)
            first = sampler.unsampled_cpus()  # no count of it to compare yet
            time.sleep(0.5)
            second = sampler.unsampled_cpus()
            after = by_pid(sampler.drain())
    finally:
        for proc in (moved, stays):
            proc.kill()
            proc.wait()
    # Both sampled at ~499 Hz before; after, nothing from the CPU that came
    # back (the kernel's side of what is reported), the other CPU as before.
    assert before[moved.pid] > 300 and before[stays.pid] > 300, before
    assert after[moved.pid] == 0 and after[stays.pid] > 450, after
    assert first in ([], [spare_cpu]) and second == [spare_cpu]
