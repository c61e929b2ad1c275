"""The profiling pipeline shared by ``run`` and ``record``: sample, drain,
symbolize, count. Owns the sampler, kernel symbols and per-process state."""

from __future__ import annotations

import logging
import time
from collections import Counter

from tramprof.bpf_layout import Counter as BpfCounter
from tramprof.config import Config
from tramprof.process_state import ProcessRegistry
from tramprof.processes import open_event_source
from tramprof.sampler import RawSample, Sampler
from tramprof.stats import ProfilerStats
from tramprof.symbols.kallsyms import KernelSymbols
from tramprof.unwind import Stack, stack_frames

log = logging.getLogger(__name__)


class Profiler:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.sampler = Sampler(config.sampler_config())
        self.kernel = KernelSymbols(f"{config.proc_root}/kallsyms")
        self.stats = ProfilerStats()
        self.registry = ProcessRegistry(proc_root=config.proc_root,
                                        failures=self.stats.symbolization_failures)
        self.events = open_event_source(log)

    def start(self) -> None:
        self.sampler.start()
        if self.config.pids:
            self.sampler.set_targets(self.config.pids)

    def event_fd(self) -> int | None:
        fileno = getattr(self.events, "fileno", None)
        return fileno() if fileno else None

    def poll_process_events(self) -> None:
        """Read pending lifecycle events; they are applied after the next drain."""
        events = self.events.read_events() if hasattr(self.events, "read_events") \
            else self.events.poll()
        for event in events:
            self.stats.process_events[event.kind] += 1
        overruns = getattr(self.events, "overruns", 0)
        if overruns > self.stats.process_events["overrun"]:
            self.stats.process_events["overrun"] = overruns
            self.registry.resync()
        self.registry.defer(events)

    def collect(self) -> list[Stack]:
        """Drain the kernel buffers and return this interval's named stacks."""
        began = time.monotonic()
        samples = self.sampler.drain()
        # Newest image first: it is the one /proc shows now (see process_state).
        samples.sort(key=lambda s: (s.tgid, s.start_boottime_ns, -s.exec_id))
        stacks = [self._symbolize(sample) for sample in samples]
        self.poll_process_events()
        self.registry.apply_pending()
        for stack in stacks:
            self.stats.samples_by_process[stack.process] += stack.count
        self.stats.bpf_counters = self.sampler.counters()
        self.stats.processes = len(self.registry)
        self.stats.drains += 1
        self.stats.last_drain_seconds = time.monotonic() - began
        for reason, count in self.registry.symbolization_stats.snapshot().items():
            self.stats.symbolization_failures[reason] = count
        return stacks

    def _symbolize(self, sample: RawSample) -> Stack:
        has_user = bool(sample.user_frames)
        if has_user:
            process, image = self.registry.image(sample.tgid, sample.start_boottime_ns,
                                                 sample.exec_id, sample.comm)
            user = image.resolve
        else:
            process, user = sample.comm, None
        frames = stack_frames(sample, user, self.kernel.resolve,
                              self.stats.symbolization_failures)
        return Stack(pid=sample.tgid, process=process, comm=sample.comm, frames=frames,
                     count=sample.count)

    def bpf_counters(self) -> dict[BpfCounter, int]:
        return self.sampler.counters()

    def close(self) -> None:
        self.sampler.close()
        close = getattr(self.events, "close", None)
        if close:
            close()


def aggregate_folded(stacks: list[Stack]) -> Counter[tuple[str, ...]]:
    folded: Counter[tuple[str, ...]] = Counter()
    for stack in stacks:
        folded[stack.folded_key()] += stack.count
    return folded
