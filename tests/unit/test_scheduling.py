"""The main loop's scheduler slice (commands.scheduling), asked for by real
threads of this process and read back from the kernel."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest
from tramprof.commands.scheduling import LoopSlice, SliceOutcome, request_slice, thread_slice

T = TypeVar("T")


def in_thread(job: Callable[[], T]) -> T:
    """``job``'s result, run in a new thread (what it sets stays there)."""
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(job())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


DEFAULT_SLICE = in_thread(thread_slice)
needs_slices = pytest.mark.skipif(
    not DEFAULT_SLICE, reason="this kernel reports no scheduler slice (Linux 6.12 and later do)")


@needs_slices
def test_a_short_slice_is_taken_and_kept_to_the_calling_thread() -> None:
    def job() -> tuple[SliceOutcome, int | None, int | None, int]:
        outcome = request_slice(0.0001)
        child_thread = in_thread(thread_slice)
        pid = os.fork()
        if pid == 0:  # the child reports its slice in its exit status, in units of 0.1 ms
            os._exit(min(255, (thread_slice() or 0) // 100_000))
        _, status = os.waitpid(pid, 0)
        return outcome, thread_slice(), child_thread, os.waitstatus_to_exitcode(status)

    before = thread_slice()  # (tests that run a loop in this thread may have set it)
    outcome, mine, child_thread, child_process = in_thread(job)
    assert outcome == SliceOutcome(100_000, 100_000), outcome
    assert outcome.taken
    assert mine == 100_000
    # Threads and processes it starts get the kernel's default.
    assert child_thread == DEFAULT_SLICE
    assert child_process == min(255, DEFAULT_SLICE // 100_000)
    # The thread that started it is left as it was.
    assert thread_slice() == before


@needs_slices
def test_the_thread_keeps_its_nice_value_and_policy() -> None:
    def job() -> tuple[SliceOutcome, int, int]:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, 7)
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        outcome = request_slice(0.002)
        return outcome, os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid)

    outcome, nice, policy = in_thread(job)
    assert outcome == SliceOutcome(2_000_000, 2_000_000)
    assert nice == 7
    assert policy == os.SCHED_BATCH | os.SCHED_RESET_ON_FORK  # reported with the policy


@needs_slices
def test_zero_gives_the_kernels_default_back() -> None:
    def job() -> tuple[SliceOutcome, SliceOutcome]:
        return request_slice(0.0005), request_slice(0)

    short, back = in_thread(job)
    assert short.slice_ns == 500_000
    assert back == SliceOutcome(0, DEFAULT_SLICE), back


@needs_slices
def test_the_kernel_clamps_and_the_outcome_says_so() -> None:
    # Config refuses these; the kernel's own bounds are reported as they are.
    low = in_thread(lambda: request_slice(0.00001))
    assert low.slice_ns == 100_000 and low.taken, low
    high = in_thread(lambda: request_slice(1.0))
    assert high.slice_ns == 100_000_000 and high.taken, high


@needs_slices
def test_a_policy_set_from_outside_is_left_alone() -> None:
    def job() -> tuple[SliceOutcome, int, int | None]:
        tid = threading.get_native_id()
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return request_slice(0.0001), os.sched_getscheduler(tid), thread_slice()

    outcome, policy, now = in_thread(job)
    assert not outcome.taken
    assert "policy 5" in outcome.reason, outcome
    assert policy == os.SCHED_IDLE  # no reset-on-fork flag either
    assert now == outcome.slice_ns != 100_000


@needs_slices
def test_a_loop_drains_with_the_default_and_waits_with_its_own() -> None:
    def job() -> list[int | None]:
        loop = LoopSlice()
        loop.set(0.0003)
        seen = [thread_slice()]
        with loop.batch():
            seen.append(thread_slice())
        seen.append(thread_slice())
        with pytest.raises(RuntimeError), loop.batch():
            raise RuntimeError("a failed drain")
        seen.append(thread_slice())
        loop.release()  # the loop is over
        seen.append(thread_slice())
        loop.release()  # nothing more to give back
        loop.set(0)
        with loop.batch():
            seen.append(thread_slice())
        seen.append(thread_slice())
        return seen

    assert in_thread(job) == [300_000, DEFAULT_SLICE, 300_000, 300_000,
                              DEFAULT_SLICE, DEFAULT_SLICE, DEFAULT_SLICE]


def test_settings_outside_the_kernels_range_are_refused() -> None:
    from tramprof.config import Config, ConfigError

    assert Config(scheduler_slice=0).validated().scheduler_slice == 0
    assert Config(scheduler_slice=0.1).validated().scheduler_slice == 0.1
    for wrong in (0.00005, 0.2, -0.001):
        with pytest.raises(ConfigError, match="scheduler_slice"):
            Config(scheduler_slice=wrong).validated()
