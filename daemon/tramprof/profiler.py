"""The profiling pipeline shared by ``run`` and ``record``: sample, drain,
symbolize, count. Owns the sampler, kernel symbols and per-process state."""

from __future__ import annotations

import contextlib
import logging
import select
import time
from collections import Counter

from tramprof.bpf_layout import Counter as BpfCounter
from tramprof.chain import ChainProcesses
from tramprof.config import Config
from tramprof.process_state import ProcessRegistry
from tramprof.processes import open_event_source
from tramprof.sampler import RawSample, Sampler
from tramprof.scan import ScanProcesses
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
        self.chains = ChainProcesses(self.sampler)
        self.scans = ScanProcesses(self.sampler, proc_root=config.proc_root)

    def start(self) -> None:
        # Parse kallsyms now (~0.5 s of CPU), before sampling starts: new
        # processes must be looked at within milliseconds of their first sample.
        if not self.kernel.available:
            log.warning("kernel frames stay unnamed: %s", self.kernel.unavailable_reason)
        self.sampler.start(self.config.pids or None)

    def event_fds(self) -> list[int]:
        """Descriptors to wait on: lifecycle events and newly sampled processes."""
        fds = self.sampler.event_fds()
        fd = self.events.fileno()
        if fd is not None:
            fds.append(fd)
        return fds

    def wait(self, timeout: float) -> None:
        """Sleep until ``timeout`` passes or a process event arrives, then handle
        events: a process sampled for the first time must be looked at while it
        still runs, which may be only milliseconds."""
        with contextlib.suppress(InterruptedError):
            select.select(self.event_fds(), [], [], max(0.0, timeout))
        self.poll_process_events()

    def poll_process_events(self) -> None:
        """Warm newly sampled processes, queue lifecycle events (applied after
        the next drain)."""
        for tgid, start, exec_id in self.sampler.new_processes():
            try:
                image = self.registry.warm(tgid, start, exec_id)
                if image is not None and image.symbolizer is not None:
                    self.chains.consider(tgid, image.symbolizer.mappings)
                    if tgid not in self.chains:
                        self.scans.consider(tgid, image.symbolizer.mappings)
            except Exception:
                log.exception("cannot prepare symbols of pid %d", tgid)
        events = self.events.read_events()
        for event in events:
            self.stats.process_events[event.kind] += 1
        self.stats.process_events["overrun"] = self.events.overruns
        if self.events.take_resync_request():
            self.registry.resync()
        self._refresh_modes()
        self.registry.defer(events)

    def _refresh_modes(self) -> None:
        live = {identity.pid for identity in self.registry.identities()}
        self.chains.refresh(live)
        # A process that activated our runtime is walked by chain, not scanned.
        self.scans.refresh(live, skip=[pid for pid in live if pid in self.chains])

    def unwinding_mode(self, pid: int) -> str:
        return self.scans.mode(pid) or self.chains.mode(pid)

    def collect(self) -> list[Stack]:
        """Drain the kernel buffers and return this interval's named stacks."""
        began = time.monotonic()
        samples = self.sampler.drain()
        # Newest image first: it is the one /proc shows now (see process_state).
        samples.sort(key=lambda s: (s.tgid, s.start_boottime_ns, -s.exec_id))
        stacks = []
        for sample in samples:
            try:
                stacks.append(self._symbolize(sample))
            except Exception:
                # A bug in one stack must not stop the daemon; count it, keep the rest.
                self.stats.symbolization_failures["internal_error"] += sample.count
                log.exception("cannot symbolize a sample of pid %d", sample.tgid)
        self.poll_process_events()
        self.registry.apply_pending()
        # A process whose main thread exits first sends no process-level exit
        # event; a /proc check after every drain catches it.
        self.registry.resync()
        self._refresh_modes()
        for stack in stacks:
            self.stats.samples_by_process[stack.process] += stack.count
        self.stats.bpf_counters = self.sampler.counters()
        run_time = self.sampler.run_time()
        if run_time is not None:
            self.stats.bpf_run_time_ns, self.stats.bpf_run_count = run_time
        self.stats.new_process_events_lost = self.sampler.new_process_events_lost
        self.stats.processes = len(self.registry)
        self.stats.scan_refusals = Counter(self.scans.refusals)
        self.stats.drains += 1
        self.stats.last_drain_seconds = time.monotonic() - began
        jit = self.registry.jit_totals()
        self.stats.jit_counters, self.stats.jit_entries, self.stats.jit_files = \
            jit.counters, jit.entries, jit.files
        for reason, count in self.registry.symbolization_stats.snapshot().items():
            self.stats.symbolization_failures[reason] = count
        return stacks

    def _symbolize(self, sample: RawSample) -> Stack:
        user = None
        process = sample.comm
        if sample.user_frames:
            process, image = self.registry.image(sample.tgid, sample.start_boottime_ns,
                                                 sample.exec_id, sample.comm)
            user = image.resolve if image else None
        frames = stack_frames(sample, user, self.kernel.resolve,
                              self.stats.symbolization_failures,
                              self.chains.get(sample.tgid) or self.scans.get(sample.tgid))
        return Stack(pid=sample.tgid, process=process, comm=sample.comm, frames=frames,
                     count=sample.count)

    def bpf_counters(self) -> dict[BpfCounter, int]:
        return self.sampler.counters()

    def close(self) -> None:
        self.sampler.close()
        self.events.close()


def aggregate_folded(stacks: list[Stack]) -> Counter[tuple[str, ...]]:
    folded: Counter[tuple[str, ...]] = Counter()
    for stack in stacks:
        folded[stack.folded_key()] += stack.count
    return folded
