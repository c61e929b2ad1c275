"""The BPF programs' per-CPU memo of map lookups never outlives a change the
daemon makes (root): target_pids changes and walker entries added after the
programs found none take effect at once, before any drain."""

from __future__ import annotations

import time

from tramprof.sampler.layout import ChainProc, UnwindMapping
from tramprof.sampler.layout import Counter as C
from tramprof.sampler.program import Sampler, SamplerConfig

from tests.conftest import requires_root

pytestmark = requires_root

# Far outside any mapping: the chain walker's first read of a chain head fails.
UNMAPPED_TLS_OFFSET = 1 << 45


def _samples_by_pid(samples: list) -> dict[int, int]:
    counts: dict[int, int] = {}
    for s in samples:
        counts[s.tgid] = counts.get(s.tgid, 0) + s.count
    return counts


def test_target_switch_applies_before_the_next_drain(targets, start_target):
    """A switch of target_pids with no drain after it: the other process is
    recorded from then on, within the same buffer."""
    first = start_target(str(targets / "chain"), "20")
    second = start_target(str(targets / "chain"), "20")
    with Sampler(SamplerConfig(frequency=499)) as sampler:
        sampler.set_targets([first.pid])
        sampler.drain()  # holds samples of every process from before the filter
        time.sleep(1)  # the programs have memoized both processes by now
        sampler.set_targets([second.pid])
        time.sleep(1)
        counts = _samples_by_pid(sampler.drain())
    assert set(counts) == {first.pid, second.pid}
    assert counts[first.pid] > 150 and counts[second.pid] > 150


def test_walker_entries_added_later_are_used_at_once(targets, start_target):
    """Entries added to chain_procs and unwind_procs for a process the
    programs already sampled (and found none for) are walked by the next
    samples: here they are bogus, so every sample stops on them, counted."""
    target = start_target(str(targets / "chain"), "20")
    with Sampler(SamplerConfig(frequency=499)) as sampler:
        sampler.set_targets([target.pid])
        time.sleep(1)
        before = sampler.counters()
        sampler.install(target.pid, b"chain_procs",
                        ChainProc(tls_offset=UNMAPPED_TLS_OFFSET, stub_stride=64,
                                  record_self=8), [])
        # Rows that were never loaded: the table walk stops at its first step.
        sampler.set_unwind_process(target.pid, [UnwindMapping(start=0x1000, end=1 << 47,
                                                              bias=0, first_row=0, nr_rows=1)])
        time.sleep(1)
        after = sampler.counters()
    assert before[C.RECORDED] > 150
    assert before[C.CHAIN_INVALID] == 0 and before[C.TABLE_STOP_NONE] == 0
    recorded = after[C.RECORDED] - before[C.RECORDED]
    assert recorded > 150
    # Every sample after the installs went through both walkers; a few taken
    # while the installs ran may not have.
    assert after[C.CHAIN_INVALID] >= recorded - 10
    assert after[C.TABLE_STOP_NONE] >= recorded - 10
