"""The Python overhead budget (root; Debian's system python3 under the
runtime): the daemon duty-cycles the runtime's hook so that the workload
loses about the budget and no more, samples taken while the hook is off carry
the marker and never a Python name, and the Python-level profile stays the
workload's own.

Throughput is work per CPU second, of the workload under the runtime against
the same workload without it running at the same time (the CPUs are shared:
wall time, or a reference taken at another time, would measure the
neighbours too). The two are pinned to one CPU each and swap CPUs every
SWAP_SECONDS, the loss being the median of the losses of the phase's
segments (SEGMENT_SECONDS): left to migrate, two identical workloads
differed by up to 6.5% over 15 s here; pinned, by at most 0.4%. Swapped
only between 10 s segments, one CPU running slower for a while (a virtual
CPU shares its host; no steal time is reported here) made segments of one
phase differ by up to 0.16 and the baseline below range 0.97-1.13; swapped
every quarter second, by at most 0.065 over nine runs.

The comparison is paired: before the profiler starts and after the last
segment, the target runs with the runtime deactivated next to the reference
(BASELINE_SECONDS), and its losses are taken against the mean of those two
ratios. A phase whose two baselines disagree by more than BASELINE_SPREAD
is run again (a CI run once measured 0.64 before an always-on phase whose
neighbours measured 1.0, and that phase's loss came out 0.20 against their
0.31). The baselines are in the failure report.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from tramprof.config import Config
from tramprof.model import PYTHON_PAUSED, Stack
from tramprof.pipeline.profiler import Profiler
from tramprof.procfs.memory import write_memory
from tramprof.unwind.chain import ChainMode
from tramprof.unwind.descriptor import DUTY_ALWAYS, DUTY_PPM_OFFSET, read_duty
from tramprof.unwind.duty import on_share

from .conftest import Interp

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: loads BPF programs"),
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 stubs only"),
]

ON = {"TRAMPROF_TRAMPOLINES": "1"}
#: The loss is the median of the losses of segments this long. Measured
#: over a whole phase, with CPUs swapped only between segments, one run gave
#: 0.164 at budget 0.05 (hook on 13% of the time; other runs 0.04-0.08) and
#: another 0.163 at budget 0.25 (hook on 93%, always-on loss 0.289).
SEGMENT_SECONDS = 10.0
#: The target's own speed against the reference's, measured this long with
#: the runtime's hook off and no profiler.
BASELINE_SECONDS = 10.0
#: How far the baselines before and after a phase may differ (0.97-1.13
#: here, swapped every SWAP_SECONDS); a phase is run at most PHASE_RUNS times.
BASELINE_SPREAD = 0.1
PHASE_RUNS = 3
#: A budgeted phase's own always-on segment, and the wait before it for the
#: runtime's thread to put the hook back on (it looks once per 1 s window).
OWN_ALWAYS_SECONDS = 10.0
OWN_ALWAYS_SETTLE = 1.5
#: The two workloads swap CPUs this often.
SWAP_SECONDS = 0.25
#: The estimated overhead against the loss measured, lowest and highest
#: seen: 0.60-1.25 over six processes here (CPUs swapped every SWAP_SECONDS),
#: 0.71-0.98 over four more once the runtime measured at random intervals;
#: one CI run had 1.47 when it measured once a second, a cadence locked to
#: the swaps (here every round ran on one CPU for 15 s at a time, and such
#: stretches differed by up to 1.5x). A copy of a function costs up to 1.4x
#: another: this range is the estimate's, not the loss's, precision.
ESTIMATE_RANGE = (0.6, 1.5)
#: How far a phase's loss may sit from its process's always-on loss times
#: the share of time the hook was on: between processes, three always-on
#: phases of one run lost 0.296-0.308 here, and a CI run 0.361 and 0.249 (hook
#: on 96%); the segments of one phase are within 0.01 of their median.
PHASE_SPREAD = 0.05
#: How far a phase's baseline may sit from the always-on phase's, relative:
#: 0.97-1.13 here. A CI run had one phase at 0.58 against 1.01 and 1.06 (its
#: own two agreeing), and its loss off by 0.07: the host ran the workloads
#: differently then, and such a phase is measured again.
BASELINE_DRIFT = 0.25
LEAVES = ("a_rec", "b_rec", "c_rec")
#: The depths each leaf recursion is run at per round, as shares.py's
#: work_loop runs them: identical functions, so their time goes as their calls.
ROUND = {"a_rec": (16, 16, 15), "b_rec": (16, 15), "c_rec": (16,)}
#: How far a leaf's share of the samples may sit from its share of the calls.
#: Always on, 0.004-0.013 here (three runs) and 0.031 in one CI run (a_rec
#: 0.531 for 0.500): the hook is a quarter of the time then, and its cost per
#: call differs by where a function's code and stub land (up to 1.4x). At
#: budget 0.05, 0.002-0.005 here and 0.010 in that run. (Compared with each
#: other, as this test first did, the two phases of that run were 0.034 apart.)
SHARE_SPREAD = 0.04
#: Every Python function of the workload, outermost first.
KNOWN = ("<module>", "work_loop", *LEAVES)


@dataclass
class Phase:
    loss: float                  # 1 - throughput under the runtime / without it (median)
    baseline: float = 1.0        # target / reference throughput, runtime off (mean)
    baselines: tuple[float, float] = (1.0, 1.0)  # ... before and after the segments
    discarded: list[tuple[float, float]] = field(default_factory=list)  # runs' baselines
    losses: list[float] = field(default_factory=list)  # per segment
    cpu_share: float = 0.0       # of one CPU, the smaller of the two workloads'
    own_always: float | None = None  # loss of its own process always on (budgeted phases)
    samples: int = 0
    paused: int = 0              # samples with the marker
    named_in_paused: int = 0     # ... that also had a Python name (must be 0)
    wrong: list[tuple[str, ...]] = field(default_factory=list)  # impossible chains
    leaves: Counter[str] = field(default_factory=Counter)
    duty: tuple[float, float] | None = None   # exported (duty cycle, overhead)
    # For a failure's message: the first stacks with no Python name that were
    # not paused, and the profiler's failure counters after the phase.
    unnamed: list[tuple[str, ...]] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)


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


class Swapper(threading.Thread):
    """Pins the two workloads to one CPU each and swaps them every
    SWAP_SECONDS, so that a CPU running slower for a while (a virtual CPU
    shares its host) slows both alike."""

    def __init__(self, first: Workload, second: Workload, cpus: list[int]) -> None:
        super().__init__(daemon=True)
        self.pair, self.cpus = (first, second), cpus
        self.stopping = threading.Event()

    def run(self) -> None:
        turn = 0
        while True:
            for index, workload in enumerate(self.pair):
                with contextlib.suppress(OSError):  # a workload that ended
                    workload.pin(self.cpus[(turn + index) % 2])
            turn += 1
            if self.stopping.wait(SWAP_SECONDS):
                return

    def __enter__(self) -> Swapper:
        if len(self.cpus) >= 2:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        if self.is_alive():
            self.join()


def measured_phase(interp: Interp, budget: float, seconds: int) -> Phase:
    """``run_phase`` until its baselines agree (at most PHASE_RUNS runs)."""
    discarded: list[tuple[float, float]] = []
    while True:
        phase = run_phase(interp, budget, seconds)
        before, after = phase.baselines
        if abs(before - after) <= BASELINE_SPREAD or len(discarded) + 1 >= PHASE_RUNS:
            phase.discarded = discarded
            return phase
        discarded.append(phase.baselines)


def _baseline(target: Workload, reference: Workload) -> float:
    """The target's throughput against the reference's, runtime off."""
    target.command("off")
    reference.mark()
    target.mark()
    time.sleep(BASELINE_SECONDS)
    target.mark()
    reference.mark()
    return target.rate(-2) / reference.rate(-2)


def _descriptor_address(profiler: Profiler, pid: int) -> int:
    """Where the profiler found ``pid``'s runtime descriptor."""
    for mode in profiler.unwinders.modes:
        if isinstance(mode, ChainMode) and (proc := mode.duty.get(pid)) is not None:
            return proc.address
    raise AssertionError(f"the profiler does not duty-cycle pid {pid}")


def _own_always_ratio(target: Workload, reference: Workload, address: int) -> float:
    """The target's throughput against the reference's with its hook put
    back always on (no profiler running), as its phase left it otherwise."""
    pid = target.proc.pid
    write_memory(pid, address + DUTY_PPM_OFFSET, struct.pack("<I", DUTY_ALWAYS))
    time.sleep(OWN_ALWAYS_SETTLE)
    before, before_at = read_duty(pid, address), time.monotonic()
    target.mark()
    reference.mark()
    time.sleep(OWN_ALWAYS_SECONDS)
    reference.mark()
    target.mark()
    after, after_at = read_duty(pid, address), time.monotonic()
    assert not after.paused and on_share(before, after, before_at, after_at) == 1.0, (
        "the hook was paused in the always-on segment", before, after)
    return target.rate(-2) / reference.rate(-2)


def run_phase(interp: Interp, budget: float, seconds: int) -> Phase:
    """The workload under the runtime and a profiler with ``budget``, next to
    the same workload without either, for ``seconds`` after a warm-up."""
    reference = Workload(interp, {})
    target = Workload(interp, ON)
    profiler = Profiler(Config(pids=(target.proc.pid,), frequency=499, interval=1.0,
                               python_overhead_budget=budget))
    cpus = sorted(os.sched_getaffinity(0))[:2]
    closed = False
    try:
        with Swapper(target, reference, cpus):
            before = _baseline(target, reference)
            phase = Phase(loss=0.0)
            target.command("on")
            profiler.start()
            drain_for(profiler, 4.0)  # the duty cycle settles within a few drains
            reference.mark()
            target.mark()

            def count(stacks: list[Stack]) -> None:
                for stack in stacks:
                    _count(phase, stack.frames, stack.count)

            ratios = []
            for _segment in range(round(seconds / SEGMENT_SECONDS)):
                drain_for(profiler, SEGMENT_SECONDS, count)
                target.mark()
                reference.mark()
                ratios.append(target.rate(-2) / reference.rate(-2))
            stats = profiler.stats  # of the segments
            address = _descriptor_address(profiler, target.proc.pid) if budget > 0 else 0
            # Sampling stopped, as it was before: the baseline after is taken
            # as the one before.
            profiler.close()
            closed = True
            own = _own_always_ratio(target, reference, address) if budget > 0 else None
            after = _baseline(target, reference)
        phase.baselines = (before, after)
        phase.baseline = (before + after) / 2
        losses = [1 - ratio / phase.baseline for ratio in ratios]
        phase.own_always = None if own is None else 1 - own / phase.baseline
        phase.failures = {**{k: v for k, v in stats.symbolization_failures.items() if v},
                          **{f"{kind}_{name}": v for (kind, name), v in stats.jit_counters.items()
                             if v}}
        exported = stats.python_duty  # one process: one group
        assert len(exported) <= 1, exported
        phase.duty = next(iter(exported.values()), None)
        phase.loss = statistics.median(losses)
        phase.losses = losses
        phase.cpu_share = min(target.cpu_share(), reference.cpu_share())
        return phase
    finally:
        if not closed:
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
    elif not names and len(phase.unnamed) < 3:
        phase.unnamed.append(frames)


def _calls(depth: int) -> int:
    """Calls that ``rec(depth)`` makes, itself included."""
    shallower, calls = 1, 1          # depths 0 and 1: no recursion
    for _ in range(depth - 1):
        shallower, calls = calls, 1 + calls + shallower
    return calls


def call_shares() -> dict[str, float]:
    """Each leaf's share of the calls of one round of the workload."""
    calls = {leaf: sum(_calls(depth) for depth in ROUND[leaf]) for leaf in LEAVES}
    return {leaf: calls[leaf] / sum(calls.values()) for leaf in LEAVES}


def _shares(phase: Phase) -> dict[str, float]:
    total = sum(phase.leaves.values())
    assert total > 500, (f"{total} of {phase.samples} samples end in a workload function; "
                         f"stacks without Python names: {phase.unnamed}; "
                         f"profiler counters: {phase.failures}")
    return {leaf: phase.leaves[leaf] / total for leaf in LEAVES}


def test_budget_bounds_the_loss_and_keeps_the_profile(host_interp: Interp) -> None:
    durations = {0.0: 60, 0.25: 40, 0.05: 60}
    phases = {budget: measured_phase(host_interp, budget, seconds)
              for budget, seconds in durations.items()}

    def drifted() -> list[float]:
        reference = phases[0.0].baseline
        return [budget for budget, phase in phases.items()
                if abs(phase.baseline / reference - 1) > BASELINE_DRIFT]

    for budget in drifted():
        phases[budget] = measured_phase(host_interp, budget, durations[budget])
    always, quarter, twentieth = phases[0.0], phases[0.25], phases[0.05]
    report = "; ".join(f"budget {b}: loss {p.loss:.3f} (baselines {p.baselines[0]:.3f} and "
                       f"{p.baselines[1]:.3f}, runs discarded {p.discarded}, segments "
                       f"{', '.join(f'{x:.3f}' for x in p.losses)}), "
                       f"own always-on loss {p.own_always}, {p.paused}/{p.samples} paused, "
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
    if drifted():
        pytest.skip(f"the host ran the workloads differently from phase to phase, measured "
                    f"twice (baselines more than {BASELINE_DRIFT:.0%} apart): losses not "
                    f"comparable ({report})")
    # The workload is call-heavy: the always-on runtime costs it far more
    # than the smaller budgets (Debian's 3.11: 20-30%).
    assert always.loss > 0.12, report
    assert always.paused == 0, report
    # The mechanism: a phase loses its process's always-on loss times the
    # share of its CPU time the hook was on (its samples not paused),
    # whatever duty cycle the estimate chose.
    for phase in (quarter, twentieth):
        assert phase.own_always is not None and phase.own_always > 0.12, report
        hook_on = 1 - phase.paused / phase.samples
        assert abs(phase.loss - hook_on * phase.own_always) <= PHASE_SPREAD, report
    # The budget holds as far as the estimate of the overhead is right (it
    # rests on the cost per call the runtime measures, ABI.md section 8).
    # The estimate is within ESTIMATE_RANGE of the loss measured: at 0.25,
    # near the always-on loss, the hook may then stay on; at 0.05 the loss
    # stays a few points.
    low, high = ESTIMATE_RANGE
    assert quarter.own_always is not None and twentieth.own_always is not None
    assert quarter.loss <= min(quarter.own_always, 0.25 / low) + PHASE_SPREAD, report
    assert quarter.loss >= min(0.25, quarter.own_always) / high - 0.03, report
    assert twentieth.loss <= 0.05 / low + 0.03, report
    assert twentieth.loss < twentieth.own_always - 0.05, report
    # What the daemon exports: the duty cycle and the estimated overhead.
    assert twentieth.duty is not None and always.duty is not None, report
    # When the runtime measured its cost only at activation, one function
    # for both, the estimate was 0.48-1.9x the loss, and a run at budget 0.25
    # kept the hook always on.
    assert always.duty[0] == 1.0, report
    assert low * always.loss - 0.03 <= always.duty[1] <= high * always.loss + 0.03, report
    assert twentieth.duty[0] < 0.5 and abs(twentieth.duty[1] - 0.05) <= 0.01, report
    # Most samples at budget 0.05 are paused (marked).
    assert twentieth.paused > 0.4 * twentieth.samples, report
    # Per-function shares over a minute: the workload's own, always on and
    # duty-cycled alike.
    expected = call_shares()
    for which, phase in (("always on", always), ("budget 0.05", twentieth)):
        shares = _shares(phase)
        assert all(abs(shares[leaf] - expected[leaf]) <= SHARE_SPREAD for leaf in LEAVES), (
            which, shares, expected)
