"""The profiling pipeline shared by ``run``, ``record`` and ``doctor``: sample,
drain, unwind, symbolize, count. Owns the sampler, kernel symbols, the
per-process symbol state and the unwinding modes.

Everything done for one process after a drain runs inside a per-process
error boundary: whatever a process exposes (its maps, memory, JIT files) is
the attacker's to choose, so a failure is counted by stage, logged once with
the pid, and that process is left alone for a back-off period. The daemon
and every other process carry on.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import logging
import select
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Protocol

from tramprof.config import Config
from tramprof.inject.policy import AutoInjector
from tramprof.model import ProcessGone, Stack
from tramprof.pipeline.heap import HeapPolicy
from tramprof.pipeline.naming import ImageKey, StackNamer
from tramprof.pipeline.stats import ProcessSamples, ProfilerStats
from tramprof.pipeline.young import YoungInterpreters, is_interpreter
from tramprof.procfs.events import open_event_source
from tramprof.procfs.identity import read_stat
from tramprof.sampler.layout import Counter as BpfCounter
from tramprof.sampler.program import Sampler, SamplerConfig
from tramprof.symbols.images import ProcessImage, ProcessRegistry
from tramprof.symbols.kallsyms import KernelSymbols
from tramprof.symbols.perfmap import gc_paused
from tramprof.unwind.chain import ChainMode
from tramprof.unwind.descriptor import DUTY_ALWAYS
from tramprof.unwind.mode import FOLLOW_EVERY, FP, MapWriter, UnwindModes
from tramprof.unwind.scan import ScanMode
from tramprof.unwind.tables import TableMode, TableWriter

log = logging.getLogger(__name__)

# A process whose handling failed is left alone this long (seconds), so a
# process that fails every time costs one attempt per back-off, not per drain.
ERROR_BACKOFF_SECONDS = 60.0
# After every drain the unwinding modes are refreshed: every runtime's
# descriptor is read again (tens of ms of CPU for a hundred Python processes).
# Between drains they are refreshed at most once a second (as when the loop
# wakes on its one-second timeout alone), looking only at what may have
# changed (the runtimes whose chain met an arena not installed yet), and less
# often when that costs more than this share of the time until the next one:
# on a busy host process events wake the loop dozens of times a second.
# In between, each wake follows only the modes' newcomers (unwind.mode).
MODE_REFRESH_SECONDS = 1.0
MODE_REFRESH_SHARE = 0.05
# Held processes are checked against /proc after a drain at least this often
# (seconds), and after every drain that followed lost events. Exit events
# remove nearly all; the check catches the rest (a process whose main thread
# exited first sends no process-level exit event) at a stat read per held
# process, a tenth of a busy node's drain if done at every drain.
RESYNC_SECONDS = 30.0
# Which online CPUs are sampled is checked after a drain at most this often
# (seconds; sampler.cpus): reading each CPU's event count interrupts that
# CPU (~25 us a CPU here, so ~5 ms on a host of 192). A CPU back online is
# then reported within two checks.
CPU_CHECK_SECONDS = 60.0
# Lifecycle events are read once this often (seconds) between drains, and at
# every drain: they take effect after the next drain anyway. The kernel keeps
# thousands meanwhile (procfs.events: a receive buffer of up to 8 MiB), and
# an overflow is counted and answered by a /proc rescan. Read less often,
# each read finds more (a busy node sends 60 a second): every read after a
# sleep runs cache-cold, several times slower than the same code run again.
EVENTS_EVERY = 1.0


def sampler_config(config: Config) -> SamplerConfig:
    """The sampler's parameters from the daemon's settings."""
    return SamplerConfig(frequency=config.frequency, event=config.event,
                         max_keys=config.max_keys, max_user_stacks=config.max_user_stacks,
                         max_kernel_stacks=config.max_kernel_stacks,
                         scan_bytes=config.scan_window_bytes,
                         max_stub_pages_per_process=config.max_stub_pages_per_process,
                         unwind_table_bytes=config.unwind_table_bytes,
                         program_cache_dir=config.program_cache_dir,
                         max_targets=max(4096, len(config.pids)))


#: Process names with their own duty-cycle gauges (the first, alphabetically).
MAX_DUTY_SERIES = 200


class ModeWriter(MapWriter, TableWriter, Protocol):
    """What the modes write through: the sampler, or ``DryRunMaps``."""


def unwind_modes(maps: ModeWriter, proc_root: str = "/proc",
                 unwind_table_bytes: int = 0,
                 python_overhead_budget: float = 0.0) -> UnwindModes:
    """Every trampoline mode, in order of preference: our runtime's chain is
    exact and cheap, so it wins over scanning the same process's stack; and
    unwind tables under both for native code without frame pointers."""
    native = [TableMode(maps, unwind_table_bytes, proc_root)] if unwind_table_bytes else []
    return UnwindModes([ChainMode(maps, proc_root, python_overhead_budget),
                        ScanMode(maps, proc_root)], native)


class Sighting(enum.Enum):
    """What the unwinding modes must do with a process image (``ConsideredImages``)."""

    SEEN = "seen"          # shown with these maps already, or older than the image shown
    LOOK = "look"          # the process's first image shown, or its maps were re-read
    REPLACED = "replaced"  # newer than the image shown: forget that one, then look


class ConsideredImages:
    """The image of each process the unwinding modes last looked at, and its
    maps generation then. The modes follow a process's newest image only: an
    exec or a reused pid voids what they installed for the image before, and
    an older image still named in a drain (samples from before the exec) is
    not shown to them again."""

    def __init__(self) -> None:
        self._shown: dict[int, tuple[int, int, int]] = {}  # pid -> (start, exec id, generation)

    def sighting(self, key: ImageKey, generation: int) -> Sighting:
        """Note that the image ``key`` has maps ``generation`` now."""
        pid, start, exec_id = key
        shown = self._shown.get(pid)
        now = (start, exec_id, generation)
        if shown is None:
            self._shown[pid] = now
            return Sighting.LOOK
        if now[:2] < shown[:2] or now == shown:
            return Sighting.SEEN
        self._shown[pid] = now
        return Sighting.LOOK if now[:2] == shown[:2] else Sighting.REPLACED

    def forget(self, pid: int) -> None:
        """The modes dropped the process: its next image sighting is a LOOK."""
        self._shown.pop(pid, None)

    def forget_exited(self, live: set[int]) -> None:
        for pid in [p for p in self._shown if p not in live]:
            del self._shown[pid]


class ProcessErrors:
    """The per-process error boundary: counts by stage, one log line per
    process and stage, and a back-off during which the process is skipped."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 backoff: float = ERROR_BACKOFF_SECONDS) -> None:
        self.by_stage: Counter[str] = Counter()
        self._until: dict[int, float] = {}
        self._logged: set[tuple[int, str]] = set()
        self._clock = clock
        self._backoff = backoff

    def backing_off(self, pid: int) -> bool:
        until = self._until.get(pid)
        if until is None:
            return False
        if self._clock() >= until:
            del self._until[pid]
            return False
        return True

    def backing_off_among(self, pids: set[int]) -> set[int]:
        """Those of ``pids`` that are backing off (a look at the few that
        failed, not at every process)."""
        return {pid for pid in list(self._until) if pid in pids and self.backing_off(pid)}

    @contextlib.contextmanager
    def boundary(self, pid: int, stage: str, on_error: Callable[[], None] | None = None
                 ) -> Iterator[None]:
        try:
            yield
        except Exception:
            self.by_stage[stage] += 1
            self._until[pid] = self._clock() + self._backoff
            if (pid, stage) not in self._logged:
                self._logged.add((pid, stage))
                log.exception("pid %d: %s failed; leaving it alone for %.0f s",
                              pid, stage, self._backoff)
            if on_error is not None:
                with contextlib.suppress(Exception):
                    on_error()

    def forget_exited(self, live: set[int]) -> None:
        for pid in [p for p in self._until if p not in live]:
            del self._until[pid]
        self._logged = {(p, s) for p, s in self._logged if p in live}


class Profiler:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.heap = HeapPolicy()  # first: the threads made below allocate from its arena
        self.sampler = Sampler(sampler_config(config))
        self.kernel = KernelSymbols(f"{config.proc_root}/kallsyms")
        self.stats = ProfilerStats(samples_by_process=ProcessSamples(
            config.max_process_series, config.series_expiry))
        self.registry = ProcessRegistry(proc_root=config.proc_root,
                                        failures=self.stats.symbolization_failures)
        self.events = open_event_source(log)
        self.unwinders = unwind_modes(self.sampler, config.proc_root, config.unwind_table_bytes,
                                      config.python_overhead_budget)
        self._process_names: dict[int, str] = {}  # pid -> process label, for the duty gauges
        self.errors = ProcessErrors()
        self.injector = AutoInjector(config)  # inject_* settings; off by default
        self._considered = ConsideredImages()
        self._young = YoungInterpreters()
        self.namer = StackNamer(self.registry, self.unwinders.arenas, self.kernel.resolve,
                                self.stats.symbolization_failures)
        self._next_mode_refresh = float("-inf")  # monotonic seconds
        self._next_resync = time.monotonic() + RESYNC_SECONDS
        self._next_cpu_check = float("-inf")  # at the first drain
        self._next_events_read = float("-inf")  # monotonic seconds

    def start(self) -> None:
        # Compile first, while this process is still small: the compiler
        # child's peak (~130 MB) adds to ours.
        self.sampler.load()
        # Parse kallsyms now (~0.5 s of CPU), before sampling starts: new
        # processes must be looked at within milliseconds of their first sample.
        if not self.kernel.available:
            log.warning("kernel frames stay unnamed: %s", self.kernel.unavailable_reason)
        self.sampler.start(self.config.pids or None)

    def event_fds(self) -> list[int]:
        """Descriptors to wait on: newly sampled processes. Lifecycle events
        take effect after the next drain anyway: they are read every
        ``EVENTS_EVERY`` s, not woken for (a host starting 20 processes a
        second sends 60 a second)."""
        return self.sampler.event_fds()

    def wait(self, timeout: float, wake_fds: Sequence[int] = ()) -> None:
        """Sleep until ``timeout`` passes (at most ``EVENTS_EVERY``), a newly
        sampled process shows up or one of ``wake_fds`` is readable, then
        handle events: a process sampled for the first time must be looked
        at while it still runs, which may be only milliseconds."""
        # CPU only: the time asleep in poll() counts for nothing.
        cpu_began = time.thread_time()
        try:
            # poll, not select: descriptors past 1023 (a busy host's held
            # files push them there) are fine.
            ready = select.poll()
            event_fds = self.event_fds()
            for fd in (*event_fds, *wake_fds):
                ready.register(fd, select.POLLIN)
            timeout = min(timeout, EVENTS_EVERY)
            if self.unwinders.following():
                timeout = min(timeout, FOLLOW_EVERY)
            young = self._young.seconds_to_next()
            if young is not None:
                # At most FOLLOW_EVERY apart: a Python program forking a
                # hundred children a second must not wake the loop for each.
                timeout = min(timeout, max(young, FOLLOW_EVERY))
            woken_by: set[int] | None = None  # None: not known (interrupted)
            with contextlib.suppress(InterruptedError):
                woken_by = {fd for fd, _events in ready.poll(max(0.0, timeout) * 1000)}
            # The new-process buffers are read only when they have records:
            # a read after a sleep costs ~80 us even when it finds none.
            self.poll_process_events(
                new_processes=woken_by is None or not woken_by.isdisjoint(event_fds))
        finally:
            self.stats.add_cpu("process_events", time.thread_time() - cpu_began)

    def poll_process_events(self, new_processes: bool = True) -> None:
        """Warm newly sampled processes (if ``new_processes``: their buffers
        have records), queue lifecycle events (applied after the next drain),
        refresh the unwinding modes when due and follow their newcomers in
        between."""
        now = time.monotonic()
        read_events = now >= self._next_events_read
        if read_events:
            self._next_events_read = now + EVENTS_EVERY
        resynced = self._handle_process_events(read_events, new_processes)
        if resynced or time.monotonic() >= self._next_mode_refresh:
            self._refresh_modes(full=resynced)
        elif self.unwinders.following():
            try:
                self.unwinders.follow(self.registry.pids())
            except Exception:
                self.errors.by_stage["unwind_refresh"] += 1
                log.exception("following the unwinding modes' newcomers failed")

    def _handle_process_events(self, read_events: bool = True,
                               new_processes: bool = True) -> bool:
        """Warm newly sampled processes (if ``new_processes``), queue
        lifecycle events (if ``read_events``); True if the processes were
        checked against /proc (some may be gone: refresh now)."""
        for tgid, start, exec_id in self.sampler.new_processes() if new_processes else ():
            if self.errors.backing_off(tgid):
                continue
            with self.errors.boundary(tgid, "new_process", partial(self._drop, tgid)):
                image = self.registry.warm(tgid, start, exec_id)
                warmed = image is not None and image.symbolizer is not None \
                    and not image.symbolizer.exited_unread()
                self.stats.new_processes["warmed" if warmed else "exited"] += 1
                if image is not None:
                    self._consider((tgid, start, exec_id), image)
                    self._follow_if_young_interpreter((tgid, start, exec_id), image)
            self.injector.offer(tgid, start, exec_id)
        self._look_again(self.injector.take_injected())
        self._look_at_young_interpreters()
        if not read_events:
            return False
        events = self.events.read_events()
        for event in events:
            self.stats.process_events[event.kind] += 1
        self.stats.process_events["overrun"] = self.events.overruns
        resynced = self.events.take_resync_request()
        if resynced:
            self.registry.resync()
        self.registry.defer(events)
        return resynced

    def _consider(self, key: ImageKey, image: ProcessImage) -> None:
        """Let the modes look at a process image whose maps they have not seen
        yet: first sampled, re-read since (it loaded a runtime, made arenas),
        or new (it replaced the image they saw)."""
        symbolizer = image.symbolizer
        if symbolizer is None:
            return
        mappings = symbolizer.mappings  # read now if they never were
        sighting = self._considered.sighting(key, symbolizer.maps_generation)
        if sighting is Sighting.SEEN:
            return
        pid = key[0]
        if sighting is Sighting.REPLACED:
            self.unwinders.forget(pid)
        self.unwinders.consider(pid, mappings)
        self._read_jit_now(image)

    def _read_jit_now(self, image: ProcessImage | None) -> None:
        """A process under a trampoline mode names its Python frames from its
        perf map: open it while the process runs (symbols.tailreader)."""
        if image is not None and image.jit is not None and image.symbolizer is not None \
                and self.unwinders.mode_of(image.symbolizer.pid) != FP:
            image.jit.read_now()

    def _look_at_young_interpreters(self) -> None:
        """The looks due (pipeline.young): the maps again if the process has
        written its perf map and its address space changed size since the
        last look that read them."""
        for key, last_vsize in self._young.take_due():
            pid = key[0]
            image: ProcessImage | None = None
            with self.errors.boundary(pid, "new_process", partial(self._drop, pid)):
                image = self.registry.warm(*key)
            if self.unwinders.mode_of(pid) != FP:  # taken since (followed to activation)
                self._young.forget(pid)  # nothing more to look for
                with self.errors.boundary(pid, "new_process", partial(self._drop, pid)):
                    self._read_jit_now(image)
                continue
            if image is None or image.jit is None or not image.jit.perf_map_written():
                continue  # gone, or no trampolines yet: nothing a mode would take
            try:
                vsize = read_stat(pid, self.config.proc_root).vsize
            except (OSError, ProcessGone, ValueError):
                self._young.forget(pid)  # gone
                continue
            if vsize != last_vsize:
                self._young.saw(key, vsize)
                self._look_again([key])

    def _follow_if_young_interpreter(self, key: ImageKey, image: ProcessImage) -> None:
        """A Python interpreter no trampoline mode took at its first sample
        may load a runtime in its next moments (pipeline.young)."""
        if self.unwinders.mode_of(key[0]) == FP and image.symbolizer is not None \
                and is_interpreter(image.symbolizer.mappings):
            self._young.add(key)

    def _look_again(self, images: list[tuple[int, int, int]]) -> None:
        """Injected processes now have stubs (or a runtime), young
        interpreters may have: re-read their maps so the unwinding modes see
        them."""
        for tgid, start, exec_id in images:
            with self.errors.boundary(tgid, "new_process", partial(self._drop, tgid)):
                image = self.registry.warm(tgid, start, exec_id)
                if image is not None and image.symbolizer is not None:
                    image.symbolizer.reload_maps()
                    self._consider((tgid, start, exec_id), image)

    def _drop(self, pid: int) -> None:
        """Roll back what the modes installed for a process that failed (or
        backs off after failing): once it is sampled again after the
        back-off, they are shown it afresh."""
        self.unwinders.forget(pid)
        self._considered.forget(pid)
        self._young.forget(pid)

    def _refresh_modes(self, full: bool, sampled: set[int] | None = None) -> None:
        """Refresh the unwinding modes: ``full`` after a drain (``sampled``:
        the processes it had samples of) or a resync, else each looks only at
        what may have changed (``UnwindMode.refresh``)."""
        began, cpu_began = time.monotonic(), time.thread_time()
        try:
            self._refresh_modes_now(full, sampled)
        finally:
            cost = time.thread_time() - cpu_began
            self._next_mode_refresh = began + max(MODE_REFRESH_SECONDS,
                                                  cost / MODE_REFRESH_SHARE)

    def _refresh_modes_now(self, full: bool, sampled: set[int] | None) -> None:
        live = self.registry.pids()
        self.errors.forget_exited(live)
        self._considered.forget_exited(live)
        self._young.forget_exited(live)
        healthy = live - self.errors.backing_off_among(live)
        for pid in live - healthy:
            self._drop(pid)
        try:
            self.unwinders.refresh(healthy, full, sampled)
        except Exception:
            # A mode's refresh is per process inside; what escapes is a bug of
            # the mode itself: count it, keep what is installed, try next time.
            self.errors.by_stage["unwind_refresh"] += 1
            log.exception("refreshing the unwinding modes failed")

    def collect(self) -> list[Stack]:
        """Drain the kernel buffers and return this interval's named stacks."""
        began, cpu_began = time.monotonic(), time.thread_time()
        # Collector paused throughout, the heap frozen at the end: what the
        # drain made is never walked by the collector (pipeline.heap).
        with gc_paused():
            samples = self.sampler.drain()
            # Every sample in hand was taken by now: maps and JIT files read
            # before may not name them yet (symbols.horizon).
            self.registry.horizon.taken_by = time.monotonic()
            # Newest image first: it is the one /proc shows now (see symbols.images).
            samples.sort(key=lambda s: (s.tgid, s.start_boottime_ns, -s.exec_id))
            sampled = {sample.tgid for sample in samples}
            stacks = []
            for sample in samples:
                try:
                    stack = self.namer.name(sample)
                    self.unwinders.note_code(sample.tgid, stack.sources)
                    stacks.append(stack)
                except Exception:
                    # A bug in one stack must not stop the daemon; count it, keep the rest.
                    self.stats.symbolization_failures["internal_error"] += sample.count
                    log.exception("cannot symbolize a sample of pid %d", sample.tgid)
            del samples
            for key, image in self.namer.end_drain():
                pid = key[0]
                if not self.errors.backing_off(pid):
                    with self.errors.boundary(pid, "unwind_consider",
                                              partial(self._drop, pid)):
                        self._consider(key, image)
            # The modes are refreshed below, once the pending events are applied.
            resynced = self._handle_process_events()
            self.registry.apply_pending()
            # A process whose main thread exits first sends no process-level exit
            # event; a /proc check now and then catches it.
            if resynced or time.monotonic() >= self._next_resync:
                self.registry.resync()
                self._next_resync = time.monotonic() + RESYNC_SECONDS
            self._refresh_modes(full=True, sampled=sampled)
            self._update_stats(stacks, began, cpu_began)
            heap_began = time.thread_time()
            self.stats.add_cpu("drain", heap_began - cpu_began)
            self.heap.after_drain()
            self.stats.add_cpu("heap", time.thread_time() - heap_began)
        # Outside the drain's own figures (last_drain_seconds), and published with them.
        self.stats.heap_full_collections = self.heap.full_collections
        self.stats.heap_full_collection_seconds = self.heap.full_collection_seconds
        return stacks

    def _update_stats(self, stacks: list[Stack], began: float, cpu_began: float) -> None:
        self.stats.samples_by_process.add((stack.process, stack.count) for stack in stacks)
        bpf = self.sampler.counters()
        self.stats.bpf_counters = bpf
        run_time = self.sampler.run_time()
        if run_time is not None:
            self.stats.bpf_run_time_ns, self.stats.bpf_run_count = run_time
        self.stats.new_process_events_lost = self.sampler.new_process_events_lost
        self._check_cpus()
        self.stats.processes = len(self.registry)
        self.stats.unwind_samples = self.unwind_samples(bpf)
        self.stats.unwind_refusals = self.unwinders.errors()
        self.stats.process_errors = Counter(self.errors.by_stage)
        self.stats.injections = self.injector.snapshot()
        for native in self.unwinders.native:
            if isinstance(native, TableMode):
                self.stats.unwind_tables = copy.deepcopy(native.stats)
        self.stats.python_duty = self._python_duty(stacks)
        self.stats.python_duty_writes_failed = sum(
            mode.duty.writes_failed for mode in self.unwinders.modes if isinstance(mode, ChainMode))
        self.stats.drains += 1
        self.stats.last_drain_seconds = time.monotonic() - began
        self.stats.last_drain_cpu_seconds = time.thread_time() - cpu_began
        self.stats.symbol_memory_bytes = self.registry.enforce_memory_budget(
            self.config.symbol_memory_bytes)
        self.stats.symbol_evictions = self.registry.jit_evictions
        self.stats.cached_addresses = self.registry.bound_address_caches(
            self.config.address_cache_bytes)
        self.stats.address_cache_evictions = self.registry.address_cache_evictions
        self.stats.stacks_reused = self.namer.cache.reused
        self.stats.stacks_named = self.namer.cache.named
        jit = self.registry.jit_totals()
        self.stats.jit_counters, self.stats.jit_entries, self.stats.jit_files = \
            jit.counters, jit.entries, jit.files
        for reason, count in self.registry.symbolization_stats.snapshot().items():
            self.stats.symbolization_failures[reason] = count

    def _check_cpus(self) -> None:
        """Publish the online CPUs not sampled when due; say so when they
        change."""
        if time.monotonic() < self._next_cpu_check:
            return
        self._next_cpu_check = time.monotonic() + CPU_CHECK_SECONDS
        try:
            cpus = self.sampler.unsampled_cpus()
        except OSError as exc:  # /proc/stat unreadable: keep the last word
            log.warning("cannot check which CPUs are sampled: %s", exc)
            return
        if cpus != self.stats.unsampled_cpus:
            if cpus:
                log.warning("not sampling online CPUs %s: they came online after the "
                            "start or went offline and back since; restart tramprof to "
                            "sample them", ",".join(map(str, cpus)))
            else:
                log.info("every online CPU is sampled")
        self.stats.unsampled_cpus = cpus

    def _python_duty(self, stacks: list[Stack]) -> dict[str, tuple[float, float]]:
        """Mean duty cycle and estimated overhead per process name."""
        for stack in stacks:
            self._process_names[stack.pid] = stack.process
        by_name: dict[str, list[tuple[float, float]]] = {}
        for mode in self.unwinders.modes:
            if not isinstance(mode, ChainMode):
                continue
            for pid in list(self._process_names):
                proc = mode.duty.get(pid)
                if proc is None:  # not under the runtime (or gone)
                    del self._process_names[pid]
                    continue
                overhead = mode.duty.estimated_overhead(pid)
                if overhead is not None:
                    by_name.setdefault(self._process_names[pid], []).append(
                        (proc.duty_ppm / DUTY_ALWAYS, overhead))
        return {name: (sum(d for d, _ in values) / len(values),
                       sum(o for _, o in values) / len(values))
                for name, values in sorted(by_name.items())[:MAX_DUTY_SERIES]}

    def unwind_samples(self, bpf: dict[BpfCounter, int]) -> dict[str, int]:
        """Recorded user stacks by the mode that unwound them; fp is the rest."""
        out = {mode.name: bpf.get(mode.sample_counter, 0) for mode in self.unwinders.modes}
        out[FP] = max(0, bpf.get(BpfCounter.RECORDED, 0) - sum(out.values())
                        - bpf.get(BpfCounter.KERNEL_THREAD, 0))
        # Native modes work under the trampoline modes: their samples overlap.
        out.update({mode.name: bpf.get(mode.sample_counter, 0)
                    for mode in self.unwinders.native})
        return out

    def bpf_counters(self) -> dict[BpfCounter, int]:
        return self.sampler.counters()

    def close(self) -> None:
        self.heap.close()
        self.injector.close()
        for native in self.unwinders.native:
            native.close()
        self.sampler.close()
        self.events.close()
