"""A consistent snapshot of the profiler's numbers, handed to exporters."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field

from tramprof.sampler.layout import Counter as BpfCounter


@dataclass
class ProfilerStats:
    samples_by_process: Counter[str] = field(default_factory=Counter)
    bpf_counters: dict[BpfCounter, int] = field(default_factory=dict)
    symbolization_failures: Counter[str] = field(default_factory=Counter)
    processes: int = 0
    process_events: Counter[str] = field(default_factory=Counter)
    new_process_events_lost: int = 0
    drains: int = 0
    last_drain_seconds: float = 0.0
    bpf_run_time_ns: int | None = None
    bpf_run_count: int | None = None
    jit_counters: Counter[tuple[str, str]] = field(default_factory=Counter)
    jit_entries: Counter[str] = field(default_factory=Counter)
    jit_files: Counter[str] = field(default_factory=Counter)
    # Recorded user stacks by unwinding mode (the registry's names, then "fp").
    unwind_samples: dict[str, int] = field(default_factory=dict)
    # (mode, reason) -> processes a mode refused or failed.
    unwind_refusals: Counter[tuple[str, str]] = field(default_factory=Counter)
    # Failures inside the per-process error boundary, by stage.
    process_errors: Counter[str] = field(default_factory=Counter)

    def copy(self) -> ProfilerStats:
        return copy.deepcopy(self)
