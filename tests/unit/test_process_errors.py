"""The per-process error boundary: a failure is counted by stage and the
process is left alone for the back-off, the others are not."""

from __future__ import annotations

import pytest
from tramprof.pipeline.profiler import ProcessErrors


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fail(errors: ProcessErrors, pid: int, stage: str, undone: list[int]) -> None:
    with errors.boundary(pid, stage, lambda: undone.append(pid)):
        raise ValueError(f"pid {pid} lies")


def test_a_failure_backs_off_that_process_only(caplog: pytest.LogCaptureFixture) -> None:
    clock, undone = Clock(), []
    errors = ProcessErrors(clock, backoff=60.0)
    fail(errors, 7, "new_process", undone)
    fail(errors, 7, "new_process", undone)
    fail(errors, 9, "unwind_consider", undone)
    with errors.boundary(8, "new_process"):
        pass
    assert errors.by_stage == {"new_process": 2, "unwind_consider": 1}
    assert undone == [7, 7, 9]
    assert sum("pid 7" in r.getMessage() for r in caplog.records) == 1  # logged once
    assert errors.backing_off_among({7, 8, 9, 10}) == {7, 9}
    assert errors.backing_off_among({8, 9}) == {9}
    assert not errors.backing_off(8)

    clock.now += 60.0
    assert errors.backing_off_among({7, 8, 9}) == set()
    assert not errors.backing_off(7)


def test_exited_processes_are_forgotten() -> None:
    clock, undone = Clock(), []
    errors = ProcessErrors(clock, backoff=60.0)
    fail(errors, 7, "new_process", undone)
    fail(errors, 9, "new_process", undone)
    errors.forget_exited({9})
    assert errors.backing_off_among({7, 9}) == {9}
