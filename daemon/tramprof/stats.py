"""A consistent snapshot of the profiler's numbers, handed to exporters."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tramprof.bpf_layout import Counter as BpfCounter


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
    scan_refusals: Counter[str] = field(default_factory=Counter)

    def copy(self) -> ProfilerStats:
        return ProfilerStats(
            samples_by_process=Counter(self.samples_by_process),
            bpf_counters=dict(self.bpf_counters),
            symbolization_failures=Counter(self.symbolization_failures),
            processes=self.processes,
            process_events=Counter(self.process_events),
            new_process_events_lost=self.new_process_events_lost,
            drains=self.drains,
            last_drain_seconds=self.last_drain_seconds,
            bpf_run_time_ns=self.bpf_run_time_ns,
            bpf_run_count=self.bpf_run_count,
            jit_counters=Counter(self.jit_counters),
            jit_entries=Counter(self.jit_entries),
            jit_files=Counter(self.jit_files),
            scan_refusals=Counter(self.scan_refusals),
        )
