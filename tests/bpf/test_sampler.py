"""The real BPF sampler on real processes (root)."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from tramprof.sampler.layout import MAX_FRAMES, USTACK_TRUNCATED
from tramprof.sampler.layout import Counter as C
from tramprof.sampler.program import Sampler, SamplerConfig, SamplerError

from tests.conftest import requires_root

pytestmark = requires_root


def _samples_by_pid(samples: list) -> Counter[int]:
    counts: Counter[int] = Counter()
    for s in samples:
        counts[s.tgid] += s.count
    return counts


def test_counts_every_sample_exactly_once(targets, start_target):
    """Everything the program recorded comes out of the drains, once."""
    target = start_target(str(targets / "chain"), "20")
    with Sampler(SamplerConfig(frequency=499)) as sampler:
        sampler.set_targets([target.pid])
        drained = 0
        for _ in range(4):
            time.sleep(0.5)
            drained += sum(s.count for s in sampler.drain())
        sampler.set_targets([])  # filter everything: no new recordings
        time.sleep(0.05)
        drained += sum(s.count for s in sampler.drain())
        drained += sum(s.count for s in sampler.drain())
        # Idle and filtered samples go on while the counters are read; every
        # sample bumps SAMPLES before its outcome, so reading SAMPLES before
        # and after the others brackets their sum exactly.
        first = sampler.counters()[C.SAMPLES]
        counters = sampler.counters()
        last = sampler.counters()[C.SAMPLES]
    assert counters[C.RECORDED] > 500
    assert drained == counters[C.RECORDED]
    lost = (counters[C.LOST_COUNTS_FULL] + counters[C.LOST_USTACKS_FULL]
            + counters[C.LOST_USTACK_COLLISION])
    accounted = counters[C.RECORDED] + counters[C.IDLE] + counters[C.FILTERED] + lost
    assert first <= accounted <= last


def test_pid_filter_changes_without_reload(targets, start_target):
    first = start_target(str(targets / "chain"), "20")
    second = start_target(str(targets / "chain"), "20")
    with Sampler(SamplerConfig(frequency=499)) as sampler:
        sampler.set_targets([first.pid])
        sampler.drain()  # holds samples of every process from before the filter
        time.sleep(1)
        before = _samples_by_pid(sampler.drain())
        sampler.set_targets([second.pid])
        sampler.drain()  # may hold samples from before the switch
        time.sleep(1)
        after = _samples_by_pid(sampler.drain())
    assert set(before) == {first.pid} and before[first.pid] > 150
    assert set(after) == {second.pid} and after[second.pid] > 150


def test_frames_carry_stack_addresses_in_call_order(targets, start_target):
    target = start_target(str(targets / "chain"), "20")
    with Sampler(SamplerConfig(frequency=499)) as sampler:
        sampler.set_targets([target.pid])
        time.sleep(1)
        samples = sampler.drain()
    assert samples
    for sample in samples:
        addresses = list(sample.user_sps)
        # The stack grows down: each caller's frame lies above its callee's.
        assert addresses == sorted(addresses)
        assert len(set(addresses)) == len(addresses)


def test_a_user_stack_has_the_same_identity_in_every_drain(targets, start_target):
    """The kernel's (hash, check) of a user stack names it across drains (the
    daemon finds stacks named before by it): one identity per distinct stack,
    the same in each drain, and none shared by two stacks."""
    target = start_target(str(targets / "chain"), "20")
    with Sampler(SamplerConfig(frequency=499)) as sampler:
        sampler.set_targets([target.pid])
        sampler.drain()
        drains = []
        for _ in range(3):
            time.sleep(0.7)
            drains.append({(s.user_ips, s.user_stack_id)
                           for s in sampler.drain() if s.tgid == target.pid})
    ids_by_stack: dict[tuple[int, ...], set[tuple[int, int]]] = {}
    for drained in drains:
        for ips, stack_id in drained:
            ids_by_stack.setdefault(ips, set()).add(stack_id)
    assert all(len(ids) == 1 for ids in ids_by_stack.values())
    assert len({next(iter(ids)) for ids in ids_by_stack.values()}) == len(ids_by_stack)
    assert (0, 0) not in {next(iter(ids)) for ids in ids_by_stack.values()}
    # The spinning chain's hot stacks come back in every drain, same identity.
    assert len(drains[0] & drains[1] & drains[2]) >= 1


def test_full_maps_are_counted_as_losses(targets, start_target):
    """With tiny maps, what does not fit is counted, never silently dropped."""
    target = start_target(str(targets / "recurse"), "20", "200")
    config = SamplerConfig(frequency=999, max_keys=64, max_user_stacks=64)
    with Sampler(config) as sampler:
        sampler.set_targets([target.pid])
        time.sleep(2)
        samples = sampler.drain()
        sampler.set_targets([])
        time.sleep(0.05)
        samples += sampler.drain()
        counters = sampler.counters()
    assert counters[C.LOST_USTACKS_FULL] + counters[C.LOST_COUNTS_FULL] > 0
    assert sum(s.count for s in samples) == counters[C.RECORDED]


def test_deep_stacks_are_cut_and_flagged(targets, start_target):
    """Recursion 200 deep exceeds the 127-frame walk: cut, flagged, counted."""
    target = start_target(str(targets / "recurse"), "20", "200")
    with Sampler(SamplerConfig(frequency=999)) as sampler:
        sampler.set_targets([target.pid])
        time.sleep(2)
        samples = sampler.drain()
        counters = sampler.counters()
    truncated = [s for s in samples if s.user_flags & USTACK_TRUNCATED]
    assert counters[C.USTACK_TRUNCATED] >= sum(s.count for s in truncated) > 0
    assert all(len(s.user_ips) == len(s.user_sps) == MAX_FRAMES for s in truncated)


def test_missing_btf_is_a_clear_error(tmp_path):
    bogus = tmp_path / "vmlinux"
    bogus.write_bytes(b"not btf")
    sampler = Sampler(SamplerConfig(), btf_path=str(bogus))
    with pytest.raises(SamplerError, match="BTF"):
        sampler.start()


def test_bad_frequency_is_rejected():
    with pytest.raises(ValueError, match="frequency"):
        SamplerConfig(frequency=0)
