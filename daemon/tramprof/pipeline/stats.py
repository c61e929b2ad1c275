"""A consistent snapshot of the profiler's numbers, handed to exporters."""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tramprof.sampler.layout import Counter as BpfCounter
from tramprof.unwind.tables import TableStats

#: Where samples of process names beyond the cap are counted.
OTHER_PROCESSES = "[other]"


class ProcessSamples:
    """Samples per process name, for ``tramprof_samples_total{process}``.

    Process names (thread names of the main thread) are the processes' to
    choose, so a process forking children with random names could otherwise
    grow the series without bound. At most ``max_names`` names get a series;
    samples of the names beyond are counted in ``[other]``. A name without
    samples for ``expiry`` seconds is forgotten, and its series with it.
    """

    def __init__(self, max_names: int = 1000, expiry: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_names = max_names
        self.expiry = expiry
        self._clock = clock
        self._counts: dict[str, int] = {}
        self._seen: dict[str, float] = {}
        self.folded = 0  # samples counted in [other] because of the cap

    def add(self, samples: Iterable[tuple[str, int]]) -> None:
        now = self._clock()
        for name in [n for n, seen in self._seen.items() if now - seen > self.expiry]:
            del self._seen[name]
            del self._counts[name]
        for name, count in samples:
            if name not in self._counts:
                named = len(self._counts) - (OTHER_PROCESSES in self._counts)
                if named >= self.max_names:
                    self.folded += count
                    name = OTHER_PROCESSES
                self._counts.setdefault(name, 0)
            self._counts[name] += count
            self._seen[name] = now

    def items(self) -> list[tuple[str, int]]:
        return sorted(self._counts.items())

    def __len__(self) -> int:
        return len(self._counts)


#: What the daemon's main thread does, in the order it does it each interval:
#: ``drain`` reads the kernel's buffers and names the stacks, then checks
#: processes and unwinding modes; ``heap`` is the collector's and the
#: allocator's step after it (``pipeline.heap``); ``aggregate`` publishes
#: the figures and adds the stacks to the metric series and the windows kept
#: for /profile; and ``process_events``, between drains, reads newly sampled
#: processes while they run, takes lifecycle events and refreshes the
#: unwinding modes. The loop's own steps count with the stage they surround
#: (``add_uncounted_cpu``): together, the stages are the thread's CPU.
MAIN_THREAD_STAGES = ("drain", "heap", "aggregate", "process_events")


@dataclass
class ProfilerStats:
    samples_by_process: ProcessSamples = field(default_factory=ProcessSamples)
    bpf_counters: dict[BpfCounter, int] = field(default_factory=dict)
    symbolization_failures: Counter[str] = field(default_factory=Counter)
    processes: int = 0
    process_events: Counter[str] = field(default_factory=Counter)
    new_process_events_lost: int = 0
    # Online CPUs with no live sampling event (sampler.cpus): restart to sample them.
    unsampled_cpus: list[int] = field(default_factory=list)
    # Newly sampled process images by result: "warmed" or "exited" (gone first).
    new_processes: Counter[str] = field(default_factory=Counter)
    # The main loop's scheduler slice as the kernel reports it (0: none).
    scheduler_slice_seconds: float = 0.0
    drains: int = 0
    last_drain_seconds: float = 0.0
    last_drain_cpu_seconds: float = 0.0  # the drain thread's CPU time in it
    bpf_run_time_ns: int | None = None
    bpf_run_count: int | None = None
    jit_counters: Counter[tuple[str, str]] = field(default_factory=Counter)
    jit_entries: Counter[str] = field(default_factory=Counter)
    jit_files: Counter[str] = field(default_factory=Counter)
    # Recorded user stacks by unwinding mode (the registry's names, then "fp").
    unwind_samples: dict[str, int] = field(default_factory=dict)
    # (mode, reason) -> processes a mode refused or failed.
    unwind_refusals: Counter[tuple[str, str]] = field(default_factory=Counter)
    # Estimated memory of the perf map / jitdump indexes, and how many were
    # dropped to stay within symbol_memory_bytes.
    symbol_memory_bytes: int = 0
    symbol_evictions: int = 0
    # Addresses whose names and places are cached, all processes together,
    # and how many processes' caches were emptied to stay within the bound.
    cached_addresses: int = 0
    address_cache_evictions: int = 0
    # Distinct drained stacks found again whole (pipeline.stackcache), and
    # named frame by frame.
    stacks_reused: int = 0
    stacks_named: int = 0
    # Collections of the whole heap, and their seconds (pipeline.heap).
    heap_full_collections: int = 0
    heap_full_collection_seconds: float = 0.0
    # CPU seconds of the main thread by stage (MAIN_THREAD_STAGES).
    main_thread_cpu_seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(MAIN_THREAD_STAGES, 0.0))
    # Failures inside the per-process error boundary, by stage.
    process_errors: Counter[str] = field(default_factory=Counter)
    # Automatic injections (inject_* settings) by result.
    injections: Counter[str] = field(default_factory=Counter)
    # Unwind tables for native code without frame pointers.
    unwind_tables: TableStats = field(default_factory=TableStats)
    # Processes under the trampoline runtime, by process name: (mean duty
    # cycle of the hook, mean estimated share of time spent in trampolines).
    python_duty: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Writes of a duty cycle that a running process refused (it stays always on).
    python_duty_writes_failed: int = 0

    def add_cpu(self, stage: str, seconds: float) -> None:
        """Count ``seconds`` of the main thread's CPU for ``stage``."""
        self.main_thread_cpu_seconds[stage] += seconds

    def cpu_mark(self) -> tuple[float, float]:
        """The calling thread's CPU time now, and the stages' total: for
        ``add_uncounted_cpu``."""
        return time.thread_time(), sum(self.main_thread_cpu_seconds.values())

    def add_uncounted_cpu(self, stage: str, mark: tuple[float, float]) -> None:
        """Count for ``stage`` the calling thread's CPU since ``mark`` that no
        stage counted (the loop's own steps around the stages, cache-cold
        after each sleep: ~50 us a wake, 0.1-0.2 ms for a drain's scheduler
        slice switches), so that the stages add up to the main thread's CPU."""
        thread_then, counted_then = mark
        uncounted = (time.thread_time() - thread_then) - (
            sum(self.main_thread_cpu_seconds.values()) - counted_then)
        if uncounted > 0:
            self.main_thread_cpu_seconds[stage] += uncounted

    def copy(self) -> ProfilerStats:
        return copy.deepcopy(self)
