"""The Python overhead budget (root; Debian's system python3 under the
runtime): the daemon duty-cycles the runtime's hook so that the workload
loses about the budget and no more, samples taken while the hook is off carry
the marker and never a Python name, and the Python-level profile stays that
of the always-on runtime.

Throughput is work per CPU second, of the workload under the runtime against
the same workload without it running at the same time (the CPUs are shared:
wall time, or a reference taken at another time, would measure the
neighbours too). The two are pinned to one CPU each and swap CPUs between
segments of the phase (SEGMENT_SECONDS), the loss being their median:
left to migrate, two identical workloads differed by up to 6.5% over 15 s
here; pinned, by at most 0.4%.

The comparison is paired: before the profiler starts, the target runs with
the runtime deactivated next to the reference (BASELINE_SECONDS on each
CPU), and its losses are taken against that ratio of the two. In CI runs,
whole phases came out 0.1-0.3 slower than their duty cycle and the runtime's
own measure of its cost give (0.372 with the hook off 80% of the time),
alike in every segment of the phase: a difference of the processes, not of
the CPUs or the moment. The baseline is in the failure report.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from tramprof.config import Config
from tramprof.model import PYTHON_PAUSED, Stack
from tramprof.pipeline.profiler import Profiler

from .conftest import Interp

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: loads BPF programs"),
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 stubs only"),
]

ON = {"TRAMPROF_TRAMPOLINES": "1"}
#: The loss is the median of the losses of segments this long, the two
#: workloads swapping CPUs between segments. Measured over a whole phase, one
#: run gave 0.164 at budget 0.05 (hook on 13% of the time; other runs
#: 0.04-0.08) and another 0.163 at budget 0.25 (hook on 93%, always-on loss
#: 0.289): a stretch of a phase can be far off, for reasons not measured here.
SEGMENT_SECONDS = 10.0
#: The target's own speed against the reference's, measured this long on
#: each CPU with the runtime's hook off and no profiler.
BASELINE_SECONDS = 5.0
LEAVES = ("a_rec", "b_rec", "c_rec")
#: Every Python function of the workload, outermost first.
KNOWN = ("<module>", "work_loop", *LEAVES)


@dataclass
class Phase:
    loss: float                  # 1 - throughput under the runtime / without it (median)
    baseline: float = 1.0        # target / reference throughput, runtime off
    losses: list[float] = field(default_factory=list)  # per segment
    cpu_share: float = 0.0       # of one CPU, the smaller of the two workloads'
    samples: int = 0
    paused: int = 0              # samples with the marker
    named_in_paused: int = 0     # ... that also had a Python name (must be 0)
    wrong: list[tuple[str, ...]] = field(default_factory=list)  # impossible chains
    leaves: Counter[str] = field(default_factory=Counter)
    duty: tuple[float, float] | None = None   # exported (duty cycle, overhead)


class Workload:
    """shares.py, answering marks with (CPU seconds, rounds done)."""

    def __init__(self, interp: Interp, env: dict[str, str]) -> None:
        self.proc = interp.popen(interp.script("shares.py"), env=env)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        line = self.stdout.readline()
        assert line.strip() == "ready", (line, self.proc.stderr.read() if self.proc.stderr
                                         else "")
        self.marks: list[tuple[float, int]] = []
        self.walls: list[float] = []

    def pin(self, cpu: int) -> None:
        """Every thread of the workload onto ``cpu``."""
        for task in os.listdir(f"/proc/{self.proc.pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(task), {cpu})

    def command(self, word: str) -> None:
        """``off`` or ``on``: the runtime deactivated or activated again."""
        self.stdin.write(word + "\n")
        self.stdin.flush()
        answer = self.stdout.readline()
        assert answer.strip() == "ok", (word, answer)

    def mark(self) -> None:
        self.stdin.write("mark\n")
        self.stdin.flush()
        cpu, done = self.stdout.readline().split()
        self.marks.append((float(cpu), int(done)))
        self.walls.append(time.monotonic())

    def cpu_share(self) -> float:
        """Share of one CPU the workload got between the first and last mark."""
        return (self.marks[-1][0] - self.marks[0][0]) / (self.walls[-1] - self.walls[0])

    def rate(self, since: int = 0) -> float:
        """Rounds per CPU second from mark ``since`` to the last."""
        (cpu0, done0), (cpu1, done1) = self.marks[since], self.marks[-1]
        return (done1 - done0) / (cpu1 - cpu0)

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.stdin.write("stop\n")
            self.stdin.flush()
        self.proc.wait(timeout=30)


def _python_names(frames: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f[4:].split(":", 1)[0] for f in frames if f.startswith("py::"))


def drain_for(profiler: Profiler, seconds: float,
              each: Callable[[list[Stack]], None] = lambda stacks: None) -> None:
    """Drain once a second for ``seconds``, as the daemon does (a wait
    returns early on process events)."""
    began = time.monotonic()
    for second in range(1, round(seconds) + 1):
        while (left := began + second - time.monotonic()) > 0:
            profiler.wait(left)
        each(profiler.collect())


def run_phase(interp: Interp, budget: float, seconds: int) -> Phase:
    """The workload under the runtime and a profiler with ``budget``, next to
    the same workload without either, for ``seconds`` after a warm-up."""
    reference = Workload(interp, {})
    target = Workload(interp, ON)
    profiler = Profiler(Config(pids=(target.proc.pid,), frequency=499, interval=1.0,
                               python_overhead_budget=budget))
    cpus = sorted(os.sched_getaffinity(0))[:2] if len(os.sched_getaffinity(0)) >= 2 else []

    def swap(segment: int) -> None:
        """Each workload gets each CPU in turn."""
        if cpus and segment:
            target.pin(cpus[segment % 2])
            reference.pin(cpus[1 - segment % 2])

    try:
        if cpus:
            target.pin(cpus[0])
            reference.pin(cpus[1])
        target.command("off")
        reference.mark()
        target.mark()
        ratios = []
        for segment in range(2 if cpus else 1):
            swap(segment)
            time.sleep(BASELINE_SECONDS)
            target.mark()
            reference.mark()
            ratios.append(target.rate(-2) / reference.rate(-2))
        phase = Phase(loss=0.0, baseline=statistics.geometric_mean(ratios))
        target.command("on")
        profiler.start()
        drain_for(profiler, 4.0)  # the duty cycle settles within a few drains
        reference.mark()
        target.mark()

        def count(stacks: list[Stack]) -> None:
            for stack in stacks:
                _count(phase, stack.frames, stack.count)

        losses = []
        for segment in range(round(seconds / SEGMENT_SECONDS)):
            swap(segment)
            drain_for(profiler, SEGMENT_SECONDS, count)
            target.mark()
            reference.mark()
            losses.append(1 - target.rate(-2) / reference.rate(-2) / phase.baseline)
        exported = profiler.stats.python_duty  # one process: one group
        assert len(exported) <= 1, exported
        phase.duty = next(iter(exported.values()), None)
        phase.loss = statistics.median(losses)
        phase.losses = losses
        phase.cpu_share = min(target.cpu_share(), reference.cpu_share())
        return phase
    finally:
        profiler.close()
        target.stop()
        reference.stop()


def _count(phase: Phase, frames: tuple[str, ...], count: int) -> None:
    phase.samples += count
    names = _python_names(frames)
    if PYTHON_PAUSED in frames:
        phase.paused += count
        if names:
            phase.named_in_paused += count
        return
    # Frames entered while the hook was off have no trampoline frame, so a
    # chain may miss outer functions; what it names must still be possible.
    # (The thread answering marks runs threading's own functions: names
    # outside the workload's are not judged.)
    order = [KNOWN.index(n) for n in names if n in KNOWN]
    leaf_calls = [n for n in names if n in LEAVES]
    if order != sorted(order) or len(set(leaf_calls)) > 1:
        phase.wrong.append(frames)
    if names and names[-1] in LEAVES:
        phase.leaves[names[-1]] += count


def _shares(phase: Phase) -> dict[str, float]:
    total = sum(phase.leaves.values())
    assert total > 500, phase
    return {leaf: phase.leaves[leaf] / total for leaf in LEAVES}


def test_budget_bounds_the_loss_and_keeps_the_profile(host_interp: Interp) -> None:
    phases = {budget: run_phase(host_interp, budget, seconds)
              for budget, seconds in ((0.0, 60), (0.25, 40), (0.05, 60))}
    always, quarter, twentieth = phases[0.0], phases[0.25], phases[0.05]
    report = "; ".join(f"budget {b}: loss {p.loss:.3f} (baseline {p.baseline:.3f}, segments "
                       f"{', '.join(f'{x:.3f}' for x in p.losses)}), "
                       f"{p.paused}/{p.samples} paused, "
                       f"exported {p.duty}, CPU share {p.cpu_share:.2f}"
                       for b, p in phases.items())
    # Whatever the load: a paused sample is never named, no chain is impossible.
    for phase in phases.values():
        assert phase.named_in_paused == 0, report
        assert phase.wrong == [], phase.wrong[:3]
    # Losses of a few points need the two workloads to run most of the time
    # (2 CPUs: one each). On an overloaded machine the cost per call drifts
    # from what the runtime calibrated and the comparison is noise.
    starved = min(p.cpu_share for p in phases.values())
    if starved < 0.5:
        pytest.skip(f"machine too busy to measure losses: a workload got {starved:.0%} "
                    f"of a CPU ({report})")
    # The workload is call-heavy: the always-on runtime costs it far more
    # than the smaller budgets (Debian's 3.11: 20-30%).
    assert always.loss > 0.12, report
    assert always.paused == 0, report
    # Losses follow the budget (noise on shared CPUs: a few points). At 0.25
    # the budget is near the always-on loss, which itself differs by several
    # points from one phase to the next (0.198 in one, 0.279 at budget 0.25
    # with the hook on 99% of the time in the next): bounded on each side.
    # Over 20 s one run measured 0.163 with the hook on 93% of the time (an
    # always-on loss of 0.289): this phase now lasts 40 s.
    assert quarter.loss <= 0.25 + 0.08, report
    assert quarter.loss >= min(0.25, always.loss) - 0.08, report
    # At 0.05 the loss is the duty cycle times the always-on cost, and the
    # duty cycle rests on the cost per call the runtime measures: 0.037 to
    # 0.113 over eight runs here (CPU shares of 0.7-0.9: shared CPUs).
    assert twentieth.loss <= 0.05 + 0.06, report
    assert twentieth.loss < always.loss - 0.05, report
    # What the daemon exports: the duty cycle and the estimated overhead.
    assert twentieth.duty is not None and always.duty is not None, report
    # The estimate rests on the cost per call the runtime measures (fib(12)
    # with and without the hook, the median of rounds taken while it runs;
    # ABI.md section 8): 0.347 for a loss of 0.344 and 0.314 for 0.293 here.
    # When it measured only at activation, one function for both, it was
    # 0.48-1.9x the loss, and a run at budget 0.25 kept the hook always on.
    assert always.duty[0] == 1.0, report
    assert 0.5 * always.loss <= always.duty[1] <= 2.0 * always.loss, report
    assert twentieth.duty[0] < 0.5 and abs(twentieth.duty[1] - 0.05) <= 0.01, report
    # Most samples at budget 0.05 are paused (marked).
    assert twentieth.paused > 0.4 * twentieth.samples, report
    # Per-function shares over a minute: within 3 points of always-on.
    on, cycled = _shares(always), _shares(twentieth)
    assert all(abs(on[leaf] - cycled[leaf]) <= 0.03 for leaf in LEAVES), (on, cycled)
