"""Prometheus collectors: fresh metric families from a stats snapshot per
scrape, the build info, and the daemon's registry that holds them."""

from __future__ import annotations

import importlib.metadata
import platform
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

import tramprof
from tramprof.export import families as fam
from tramprof.export.store import ProfileStore
from tramprof.pipeline.stats import ProfilerStats
from tramprof.sampler.layout import Counter as BpfCounter
from tramprof.speedups import naming_passes

_LOST = {
    "counts_map_full": BpfCounter.LOST_COUNTS_FULL,
    "user_stacks_map_full": BpfCounter.LOST_USTACKS_FULL,
    "user_stack_collision": BpfCounter.LOST_USTACK_COLLISION,
}
_KSTACK_LOST = {
    "collision": BpfCounter.KSTACK_COLLISION,
    "error": BpfCounter.KSTACK_ERROR,
}


def _family(f: fam.Family) -> CounterMetricFamily | GaugeMetricFamily:
    if f.kind == "counter":
        return CounterMetricFamily(f.name, f.help, labels=f.labels)
    return GaugeMetricFamily(f.name, f.help, labels=f.labels)


def _single(f: fam.Family, value: float) -> CounterMetricFamily | GaugeMetricFamily:
    """A family without labels and its one sample."""
    family = _family(f)
    family.add_metric([], value)
    return family


class ProfilerCollector(Collector):
    """Reads a ProfilerStats snapshot from ``source`` on every scrape."""

    def __init__(self, source: Callable[[], ProfilerStats]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        stats = self._source()
        bpf = stats.bpf_counters

        samples = _family(fam.SAMPLES)
        for process, count in stats.samples_by_process.items():
            samples.add_metric([process], count)
        yield samples

        lost_total = sum(bpf.get(c, 0) for c in _LOST.values())
        events = _family(fam.PERF_EVENTS)
        events.add_metric(["recorded"], bpf.get(BpfCounter.RECORDED, 0))
        events.add_metric(["idle"], bpf.get(BpfCounter.IDLE, 0))
        events.add_metric(["filtered"], bpf.get(BpfCounter.FILTERED, 0))
        events.add_metric(["lost"], lost_total)
        yield events

        lost = _family(fam.LOST_SAMPLES)
        for reason, counter in _LOST.items():
            lost.add_metric([reason], bpf.get(counter, 0))
        yield lost

        kernel_lost = _family(fam.KERNEL_STACKS_LOST)
        for reason, counter in _KSTACK_LOST.items():
            kernel_lost.add_metric([reason], bpf.get(counter, 0))
        yield kernel_lost

        for f, counter in ((fam.TRUNCATED_STACKS, BpfCounter.USTACK_TRUNCATED),
                           (fam.UNWIND_FAULTS, BpfCounter.USTACK_FAULT),
                           (fam.KERNEL_THREAD_SAMPLES, BpfCounter.KERNEL_THREAD)):
            family = _family(f)
            family.add_metric([], bpf.get(counter, 0))
            yield family

        failures = _family(fam.SYMBOLIZATION_FAILURES)
        for reason, count in sorted(stats.symbolization_failures.items()):
            failures.add_metric([reason], count)
        yield failures

        yield _single(fam.PROCESSES, stats.processes)

        proc_events = _family(fam.PROCESS_EVENTS)
        for kind, count in sorted(stats.process_events.items()):
            proc_events.add_metric([kind], count)
        yield proc_events

        yield _single(fam.NEW_PROCESS_EVENTS_LOST, stats.new_process_events_lost)
        yield _single(fam.CPUS_UNSAMPLED, len(stats.unsampled_cpus))

        new_processes = _family(fam.NEW_PROCESSES)
        for result in ("warmed", "exited"):
            new_processes.add_metric([result], stats.new_processes[result])
        yield new_processes
        yield _single(fam.SCHEDULER_SLICE, stats.scheduler_slice_seconds)

        yield _single(fam.DRAINS, stats.drains)
        yield _single(fam.DRAIN_SECONDS, stats.last_drain_seconds)
        yield _single(fam.DRAIN_CPU_SECONDS, stats.last_drain_cpu_seconds)
        main_thread = _family(fam.MAIN_THREAD_CPU_SECONDS)
        for stage, seconds in stats.main_thread_cpu_seconds.items():
            main_thread.add_metric([stage], seconds)
        yield main_thread

        yield from _jit_families(stats)

        modes = _family(fam.UNWIND_SAMPLES)
        for mode, count in stats.unwind_samples.items():
            modes.add_metric([mode], count)
        yield modes
        refusals = _family(fam.UNWIND_REFUSALS)
        scan_refusals = _family(fam.SCAN_REFUSALS)
        for (mode, reason), count in sorted(stats.unwind_refusals.items()):
            refusals.add_metric([mode, reason], count)
            if mode == "scan":  # the older, scan-only family
                scan_refusals.add_metric([reason], count)
        yield refusals
        yield scan_refusals
        yield _single(fam.SYMBOL_MEMORY, stats.symbol_memory_bytes)
        yield _single(fam.SYMBOL_EVICTIONS, stats.symbol_evictions)
        yield _single(fam.ADDRESS_CACHE, stats.cached_addresses)
        yield _single(fam.ADDRESS_CACHE_EVICTIONS, stats.address_cache_evictions)
        named = _family(fam.STACKS_NAMED)
        for how, count in (("reused", stats.stacks_reused), ("named", stats.stacks_named)):
            named.add_metric([how], count)
        yield named
        yield _single(fam.HEAP_FULL_COLLECTIONS, stats.heap_full_collections)
        yield _single(fam.HEAP_FULL_COLLECTION_SECONDS, stats.heap_full_collection_seconds)
        yield from _table_families(stats, bpf)
        yield from _duty_families(stats)
        process_errors = _family(fam.PROCESS_ERRORS)
        for stage, count in sorted(stats.process_errors.items()):
            process_errors.add_metric([stage], count)
        yield process_errors
        injections = _family(fam.INJECTIONS)
        for result, count in sorted(stats.injections.items()):
            injections.add_metric([result], count)
        yield injections
        for f, counter in ((fam.PYTHON_FRAMES_TRUNCATED, BpfCounter.CHAIN_TRUNCATED),
                           (fam.CHAIN_INVALID, BpfCounter.CHAIN_INVALID),
                           (fam.SCAN_STALE, BpfCounter.SCAN_STALE),
                           (fam.SCAN_WINDOWS_EXHAUSTED, BpfCounter.SCAN_TRUNCATED),
                           (fam.SCAN_OVERFLOWS, BpfCounter.SCAN_OVERFLOW)):
            family = _family(f)
            family.add_metric([], bpf.get(counter, 0))
            yield family

        if stats.bpf_run_time_ns is not None and stats.bpf_run_count is not None:
            yield _single(fam.BPF_RUN_SECONDS, stats.bpf_run_time_ns / 1e9)
            yield _single(fam.BPF_RUNS, stats.bpf_run_count)


JIT_KINDS = ("perf_map", "jitdump")


def _jit_families(stats: ProfilerStats) -> Iterator[Metric]:
    files, entries = _family(fam.JIT_FILES), _family(fam.JIT_ENTRIES)
    for kind in JIT_KINDS:
        files.add_metric([kind], stats.jit_files[kind])
        entries.add_metric([kind], stats.jit_entries[kind])
    yield files
    yield entries
    refused, dropped = _family(fam.JIT_FILES_REFUSED), _family(fam.JIT_RECORDS_DROPPED)
    read = _family(fam.JIT_BYTES_READ)
    for kind in JIT_KINDS:
        read.add_metric([kind], stats.jit_counters[(kind, "bytes_read")])
    for (kind, name), value in sorted(stats.jit_counters.items()):
        if name.startswith("refused_"):
            refused.add_metric([kind, name.removeprefix("refused_")], value)
        elif name in _JIT_DROP_COUNTERS:
            dropped.add_metric([kind, name], value)
    yield refused
    yield dropped
    yield read


# Reader counters that count skipped input (the others count work done).
_JIT_DROP_COUNTERS = frozenset((
    "malformed", "long_lines", "dropped_entries", "bad_records", "corrupt",
    "unknown_records", "debug_lines_dropped", "unwind_dropped",
))


class StoreCollector(Collector):
    """How much the windows kept for /profile hold: bytes and seconds."""

    def __init__(self, store: ProfileStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        held_bytes, held_seconds = self._store.held()
        yield _single(fam.PROFILE_STORE_BYTES, held_bytes)
        yield _single(fam.PROFILE_STORE_SECONDS, held_seconds)


class Consistent(Collector):
    """Collects several collectors under the lock their data source updates
    under, so one scrape never sees half of a drain (samples_total and the
    stack series always add up)."""

    def __init__(self, collectors: list[Collector], lock: threading.Lock) -> None:
        self._collectors = collectors
        self._lock = lock

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            metrics = [m for c in self._collectors for m in c.collect()]
        yield from metrics


def _installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def build_labels() -> dict[str, str]:
    """The labels of ``tramprof_build_info`` for this process."""
    return {"version": tramprof.__version__, "python_version": platform.python_version(),
            "bcc_version": _installed_version("bcc"), "naming": naming_passes()}


class BuildInfoCollector(Collector):
    """``tramprof_build_info{version, python_version, bcc_version, naming} 1``."""

    def __init__(self, labels: Mapping[str, str]) -> None:
        self._values = [labels[name] for name in fam.BUILD_INFO.labels]

    def collect(self) -> Iterator[Metric]:
        family = _family(fam.BUILD_INFO)
        family.add_metric(self._values, 1)
        yield family


def daemon_registry(consistent: Iterable[Collector], lock: threading.Lock,
                    proc_root: str = "/proc") -> CollectorRegistry:
    """What ``/metrics`` of the daemon serves: ``consistent`` collected under
    ``lock`` (the one a drain publishes under), the build info, and the
    standard ``process_*`` metrics of the daemon itself."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(Consistent(list(consistent), lock))
    registry.register(BuildInfoCollector(build_labels()))
    ProcessCollector(proc=proc_root, registry=registry)
    return registry


def _duty_families(stats: ProfilerStats) -> Iterator[Metric]:
    """Duty cycle and estimated overhead of the trampoline runtimes."""
    duty, overhead = _family(fam.PYTHON_DUTY_CYCLE), _family(fam.PYTHON_OVERHEAD)
    for process, (cycle, ratio) in stats.python_duty.items():
        duty.add_metric([process], cycle)
        overhead.add_metric([process], ratio)
    yield duty
    yield overhead
    yield _single(fam.PYTHON_DUTY_WRITES_FAILED, stats.python_duty_writes_failed)


def _table_families(stats: ProfilerStats, bpf: dict[BpfCounter, int]) -> Iterator[Metric]:
    """Unwind tables: memory, contents, builds and where walks stopped."""
    tables = stats.unwind_tables
    for family, value in ((fam.UNWIND_TABLE_BYTES, tables.table_bytes),
                          (fam.UNWIND_TABLE_OBJECTS, tables.objects_loaded),
                          (fam.UNWIND_TABLE_ROWS, tables.rows),
                          (fam.UNWIND_TABLE_EVICTIONS, tables.evictions),
                          (fam.UNWIND_TABLE_BUILD_SECONDS, tables.build_seconds)):
        metric = _family(family)
        metric.add_metric([], value)
        yield metric
    builds = _family(fam.UNWIND_TABLE_BUILDS)
    for result, count in sorted(tables.builds.items()):
        builds.add_metric([result], count)
    yield builds
    stops = _family(fam.UNWIND_TABLE_STOPS)
    stops.add_metric(["no_unwind_info"], bpf.get(BpfCounter.TABLE_STOP_NONE, 0))
    stops.add_metric(["unsupported_rule"], bpf.get(BpfCounter.TABLE_STOP_UNSUPPORTED, 0))
    yield stops
