"""Every metric family tramprof exports, declared once.

The README's metric table is generated from this list (``tramprof metrics``
prints it), so code and documentation cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from tramprof.symbols.images import CACHED_ADDRESS_BYTES


@dataclass(frozen=True)
class Family:
    name: str  # without the _total suffix for counters, as prometheus-client wants
    kind: str  # "counter" or "gauge"
    labels: tuple[str, ...]
    help: str

    @property
    def exposed_name(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


SAMPLES = Family(
    "tramprof_samples", "counter", ("process",),
    "CPU samples recorded, per process name; at most max_process_series names get a "
    "series, the samples of the others are counted in process=\"[other]\".")
PERF_EVENTS = Family(
    "tramprof_perf_events", "counter", ("outcome",),
    "Sampling ticks seen by the BPF program, by outcome: recorded, idle (no process on "
    "the CPU), filtered (not a target), lost (see tramprof_lost_samples_total).")
LOST_SAMPLES = Family(
    "tramprof_lost_samples", "counter", ("reason",),
    "Samples dropped before they were counted, by reason: counts_map_full, "
    "user_stacks_map_full, user_stack_collision.")
KERNEL_STACKS_LOST = Family(
    "tramprof_kernel_stacks_lost", "counter", ("reason",),
    "Samples whose kernel stack was lost (the sample is kept without it), by reason: "
    "collision (stack map bucket taken, -EEXIST: the map is too small) or error.")
TRUNCATED_STACKS = Family(
    "tramprof_truncated_stacks", "counter", (),
    "User stacks cut at the depth limit.")
UNWIND_FAULTS = Family(
    "tramprof_user_unwind_faults", "counter", (),
    "User stack walks that stopped at an unreadable or invalid frame pointer; normal for "
    "code built without frame pointers.")
KERNEL_THREAD_SAMPLES = Family(
    "tramprof_kernel_thread_samples", "counter", (),
    "Samples taken in kernel threads (kernel stack only).")
SYMBOLIZATION_FAILURES = Family(
    "tramprof_symbolization_failures", "counter", ("reason",),
    "Frames that could not be named, by reason; they are shown as module+0xoffset or a "
    "bracketed marker instead. Also, once per lookup, separate debug files refused "
    "(debug_file_<reason>: symlink, not_regular, permission, io_error, outside, too_large, "
    "build_id_mismatch, crc_mismatch, not_elf, malformed_elf), and, once per name, names left "
    "mangled (demangle_too_long, demangle_timeout, demangle_unavailable).")
PROCESSES = Family(
    "tramprof_processes", "gauge", (),
    "Processes with symbolization state held by the daemon.")
PROCESS_EVENTS = Family(
    "tramprof_process_events", "counter", ("kind",),
    "Process lifecycle events received (fork, exec, exit), and overruns: times the "
    "kernel dropped events because the daemon read too slowly (state is then re-checked "
    "against /proc).")
NEW_PROCESS_EVENTS_LOST = Family(
    "tramprof_new_process_events_lost", "counter", (),
    "First-sample notifications lost in the perf buffer; those processes are symbolized "
    "at the next drain instead, if they still run.")
CPUS_UNSAMPLED = Family(
    "tramprof_cpus_unsampled", "gauge", (),
    "Online CPUs the daemon does not sample: they came online after it started, or went "
    "offline and came back since (the kernel ends a CPU's perf events when it goes offline, "
    "and opening new ones needs CAP_PERFMON, which the running daemon has given up). "
    "Restart the daemon to sample them; the log names them.")
NEW_PROCESSES = Family(
    "tramprof_new_processes", "counter", ("result",),
    "Process images sampled for the first time, by result: warmed (their maps read and "
    "their files opened while they ran) or exited (gone before that, as short-lived "
    "processes may be within milliseconds of their first sample: their user frames are "
    "one marker frame instead of names).")
SCHEDULER_SLICE = Family(
    "tramprof_scheduler_slice_seconds", "gauge", (),
    "Scheduler slice the daemon's main loop runs with, as the kernel reports it (set by "
    "scheduler_slice: a short one lets the loop read a newly sampled process at once, before "
    "a short-lived one exits); 0 when the kernel reports none (before Linux 6.12).")
DRAINS = Family(
    "tramprof_drains", "counter", (),
    "Times the in-kernel sample buffers were drained.")
DRAIN_SECONDS = Family(
    "tramprof_drain_duration_seconds", "gauge", (),
    "Wall time of the last drain, symbolization included.")
DRAIN_CPU_SECONDS = Family(
    "tramprof_drain_cpu_seconds", "gauge", (),
    "CPU time of the last drain (its thread's), symbolization included: the wall time "
    "less what the drain waited for a CPU.")
MAIN_THREAD_CPU_SECONDS = Family(
    "tramprof_main_thread_cpu_seconds", "counter", ("stage",),
    "CPU time of the daemon's main thread by stage: drain (reading the kernel buffers, "
    "naming the stacks, the checks of processes and unwinding modes after each drain, "
    "the scheduler slice's switches around it), heap (the garbage collector's and "
    "allocator's step after each drain), aggregate (these figures, metric series and the "
    "windows kept for /profile), process_events (between drains: newly sampled processes "
    "read while they run, lifecycle events, unwinding mode refreshes, the loop's own "
    "steps). Their sum is the main thread's CPU; process_cpu_seconds_total less it is the "
    "other threads' (HTTP requests among them). As of the last drain.")
BPF_RUN_SECONDS = Family(
    "tramprof_bpf_run_time_seconds", "counter", (),
    "CPU time spent in the sampling BPF program (kernel BPF statistics).")
BPF_RUNS = Family(
    "tramprof_bpf_runs", "counter", (),
    "Runs of the sampling BPF program (kernel BPF statistics).")

JIT_FILES = Family(
    "tramprof_jit_files", "gauge", ("kind",),
    "Perf map (kind=perf_map) and jitdump files in use for live processes.")
JIT_ENTRIES = Family(
    "tramprof_jit_entries", "gauge", ("kind",),
    "Symbols held from perf map and jitdump files of live processes.")
JIT_FILES_REFUSED = Family(
    "tramprof_jit_files_refused", "counter", ("kind", "reason"),
    "Attempts to open a perf map or jitdump that were refused, by reason: missing, symlink, "
    "not_regular, hardlink, foreign_owner, permission, io_error, stale (left by an earlier "
    "process with the same pid).")
JIT_RECORDS_DROPPED = Family(
    "tramprof_jit_records_dropped", "counter", ("kind", "reason"),
    "Perf map lines or jitdump records skipped, by reason (malformed, long_lines, "
    "dropped_entries over the entry cap, bad_records, corrupt, ...).")
JIT_BYTES_READ = Family(
    "tramprof_jit_bytes_read", "counter", ("kind",),
    "Bytes read from perf map and jitdump files (incremental: appended bytes only).")

STACK_SAMPLES = Family(
    "tramprof_stack_samples", "counter", ("process", "stack"),
    "CPU samples per folded stack (frames root first, joined by ';'), per process group, "
    "plus the grouping labels (exe, container_id, pod_uid, pid) that are configured. Only "
    "the hottest stacks of a group get a series of their own; the others are counted in "
    "stack=\"[other]\", so a group's series add up to its samples. A label over the byte "
    "cap keeps its leaf end and starts with '…;'.")
FUNCTION_SAMPLES = Family(
    "tramprof_function_samples", "counter", ("process", "function", "kind"),
    "CPU samples per function and process group, plus the configured grouping labels: "
    "kind=\"self\" counts samples whose leaf frame is the function, kind=\"total\" samples "
    "with the function anywhere on the stack (once per sample, however deep it recurses). "
    "Only the functions of a group with the most total samples get series; the self "
    "samples of the others are counted in function=\"[other]\" (kind=\"self\" only).")
DROPPED_SERIES = Family(
    "tramprof_dropped_series", "counter", ("family", "reason"),
    "Stacks and functions that were folded into [other] instead of getting a series, counted "
    "once per drain in which they occurred, by family and reason: top_k (their process group "
    "had its maximum number of series) or budget (the global series budget was used up); "
    "and labels shortened to the byte cap (label_too_long; they keep a series).")
SERIES = Family(
    "tramprof_series", "gauge", ("family",),
    "Live series of the stack and function families, [other] included; together they stay "
    "within the configured series budget.")

SYMBOL_MEMORY = Family(
    "tramprof_symbol_memory_bytes", "gauge", (),
    "Estimated memory held by the perf map and jitdump indexes of all processes and by the "
    "symbol tables of separate debug files; kept within symbol_memory_bytes by evicting the "
    "least recently sampled indexes and tables.")
PROFILE_STORE_BYTES = Family(
    "tramprof_profile_store_bytes", "gauge", (),
    "Estimated memory held by the drained windows kept for /profile; kept within "
    "profile_store_bytes by dropping the oldest windows.")
PROFILE_STORE_SECONDS = Family(
    "tramprof_profile_store_seconds", "gauge", (),
    "Seconds of samples the windows kept for /profile cover: profile_retention, or fewer "
    "when profile_store_bytes is reached first (very many distinct stacks).")
ADDRESS_CACHE = Family(
    "tramprof_address_cache_entries", "gauge", (),
    "Addresses whose frame names and places are cached, all processes together; kept within "
    f"address_cache_bytes (~{CACHED_ADDRESS_BYTES} bytes an address) by emptying the caches of "
    "the least recently sampled processes.")
ADDRESS_CACHE_EVICTIONS = Family(
    "tramprof_address_cache_evictions", "counter", (),
    "Processes whose address caches were emptied to keep all within their bound; their "
    "addresses are looked up again (~5 us each) as they are sampled.")
STACKS_NAMED = Family(
    "tramprof_stacks_named", "counter", ("how",),
    "Distinct stacks of the drains by how they were named: reused (the same raw stack of "
    "the same process, named in one of the last two drains, found again whole) or named "
    "(frame by frame).")
HEAP_FULL_COLLECTIONS = Family(
    "tramprof_heap_full_collections", "counter", (),
    "Collections of the daemon's whole heap by Python's cyclic garbage collector (the "
    "rest of the time it sees only what was made since the last drain): every 5 minutes "
    "while they find garbage, then less and less often, up to hourly. Each holds the "
    "interpreter lock: drains and scrapes wait for it. As of the last drain.")
HEAP_FULL_COLLECTION_SECONDS = Family(
    "tramprof_heap_full_collection_seconds", "counter", (),
    "Seconds spent in those collections (tramprof_heap_full_collections_total).")
SYMBOL_EVICTIONS = Family(
    "tramprof_symbol_evictions", "counter", (),
    "Perf map / jitdump indexes and debug file tables dropped to stay within "
    "symbol_memory_bytes; that process's JIT frames stay unnamed (that object's frames keep "
    "only its exported names) for ten minutes.")
UNWIND_SAMPLES = Family(
    "tramprof_unwind_samples", "counter", ("mode",),
    "User stacks by unwinding mode: chain (through the trampoline runtime's frame "
    "chain), scan (return addresses of known stubs, e.g. CPython -X perf, found in the "
    "stack) or fp (frame pointers only); eh_frame counts the stacks whose native frames "
    "used unwind tables, which may also be counted under chain or scan.")
PYTHON_FRAMES_TRUNCATED = Family(
    "tramprof_python_stacks_truncated", "counter", (),
    "Samples with more trampoline (Python) frames than the chain walk keeps; the root "
    "side is cut (the stack scan's equivalent is tramprof_scan_overflows_total).")
CHAIN_INVALID = Family(
    "tramprof_chain_walks_stopped", "counter", (),
    "Trampoline chain walks that stopped at a record failing validation (a torn read of "
    "a running thread, or a stack-switching library); the frames before it are kept.")
SCAN_STALE = Family(
    "tramprof_scan_stale_words", "counter", (),
    "Stub return addresses the stack scan found but did not take as Python frames: the "
    "stub's caller had left no return address into the interpreter next to them, so they "
    "are stale copies in live C frames, not running functions.")

SCAN_WINDOWS_EXHAUSTED = Family(
    "tramprof_scan_windows_exhausted", "counter", (),
    "Stack scans that used up their window (scan_window_bytes) while the stack went on: "
    "Python frames nearer the root may be missing. Raise the window if this grows.")

SCAN_REFUSALS = Family(
    "tramprof_scan_layouts_refused", "counter", ("reason",),
    "Stub pools whose layout scan mode would not trust, by reason (no_call, "
    "ambiguous_call, stub_size, no_stride, stride, stride_mismatch, arena_size, "
    "arena_alignment, stub_alignment, arena_bytes, layout); those processes stay in fp "
    "mode. The scan rows of tramprof_unwind_refusals_total.")
SCAN_OVERFLOWS = Family(
    "tramprof_scan_overflows", "counter", (),
    "Stack scans that found more stub return addresses than a sample keeps: Python "
    "frames were lost and the stack is marked truncated.")
UNWIND_REFUSALS = Family(
    "tramprof_unwind_refusals", "counter", ("mode", "reason"),
    "Processes an unwinding mode refused or could not follow, by mode and reason: chain "
    "descriptor_unreadable, unsupported_runtime or map_full (more stub pages than "
    "max_stub_pages_per_process); scan the stub layout reasons of "
    "tramprof_scan_layouts_refused_total, map_full, arena_overlap, or perf_map_<refusal> "
    "(a FIFO, symlink or foreign file at its perf map path). They are unwound by frame "
    "pointers.")
UNWIND_TABLE_BYTES = Family(
    "tramprof_unwind_table_bytes", "gauge", (),
    "Kernel memory held by unwind tables (row chunks and per-process mapping lists) for "
    "native code without frame pointers; kept within unwind_table_bytes by evicting the "
    "least recently sampled objects.")
UNWIND_TABLE_OBJECTS = Family(
    "tramprof_unwind_table_objects", "gauge", (),
    "ELF objects (executables and libraries, shared by every process mapping them) whose "
    "unwind table is loaded.")
UNWIND_TABLE_ROWS = Family(
    "tramprof_unwind_table_rows", "gauge", (),
    "Unwind rows loaded, over all objects (8 bytes each, in 4,096-row chunks).")
UNWIND_TABLE_EVICTIONS = Family(
    "tramprof_unwind_table_evictions", "counter", (),
    "Unwind tables unloaded to make room for another within unwind_table_bytes; the "
    "object is walked by frame pointers until it is sampled again a minute later.")
UNWIND_TABLE_BUILDS = Family(
    "tramprof_unwind_table_builds", "counter", ("result",),
    "Objects whose call-frame information was compiled, by result: loaded, "
    "frame_pointers (the object keeps frame pointers; no table needed), no_usable_cfi, "
    "malformed_object, budget or map_error.")
UNWIND_TABLE_BUILD_SECONDS = Family(
    "tramprof_unwind_table_build_seconds", "counter", (),
    "Time spent compiling call-frame information into unwind rows (wall time of "
    "the compiler child processes, off the drain path).")
UNWIND_TABLE_STOPS = Family(
    "tramprof_unwind_table_stops", "counter", ("reason",),
    "Table walks that stopped before the outermost frame, by reason: no_unwind_info (no "
    "FDE covers the address) or unsupported_rule (a DWARF rule the BPF walker cannot "
    "follow). The stack ends with the [native frames not unwound] marker there.")
PROCESS_ERRORS = Family(
    "tramprof_process_errors", "counter", ("stage",),
    "Failures while handling one process (reading its maps, binaries, memory or JIT "
    "files, or installing its unwinding state), by stage. The process is left alone for "
    "a minute; the daemon and every other process carry on.")

INJECTIONS = Family(
    "tramprof_injections", "counter", ("result",),
    "Automatic injections of trampolines into running CPythons (inject_* settings), by "
    "result: ok, a refusal (not_cpython, unsupported_version, remote_debug_disabled, "
    "ptrace_denied, self, already_active, gone), timeout, failed or skipped (queue full).")
BUILD_INFO = Family(
    "tramprof_build_info", "gauge", ("version", "python_version", "bcc_version", "naming"),
    "Always 1: the labels say which tramprof runs, on which Python and bcc (bcc_version "
    "empty when not installed), and whether it names stacks with its compiled part "
    "(naming=\"compiled\") or in Python alone (\"python\": the same names, ~2.5x the CPU).")

PYTHON_DUTY_CYCLE = Family(
    "tramprof_python_duty_cycle", "gauge", ("process",),
    "Share of time the trampoline runtime's hook is on in the processes of this name that "
    "run it (mean over them; 1 = always on), set by python_overhead_budget. Samples taken "
    "while it is off carry [python frames paused] instead of Python names.")
PYTHON_OVERHEAD = Family(
    "tramprof_python_overhead_ratio", "gauge", ("process",),
    "Estimated share of those processes' time spent in trampolines at their duty cycle "
    "(mean over them): Python calls through the hook per second, times the extra cost of "
    "one call that each runtime measures while it runs.")
PYTHON_DUTY_WRITES_FAILED = Family(
    "tramprof_python_duty_writes_failed", "counter", (),
    "Writes of a duty cycle (python_overhead_budget) into a trampoline runtime that the "
    "running process refused: the daemon lacks the right to ptrace it (CAP_SYS_PTRACE, "
    "Yama's ptrace_scope 3, a seccomp or LSM rule). Those processes stay always on, "
    "whatever the budget; the log names them.")
ALL: tuple[Family, ...] = (
    SAMPLES, PERF_EVENTS, LOST_SAMPLES, KERNEL_STACKS_LOST, TRUNCATED_STACKS, UNWIND_FAULTS,
    KERNEL_THREAD_SAMPLES, SYMBOLIZATION_FAILURES, PROCESSES, PROCESS_EVENTS, NEW_PROCESSES,
    SCHEDULER_SLICE, NEW_PROCESS_EVENTS_LOST, CPUS_UNSAMPLED, DRAINS, DRAIN_SECONDS,
    DRAIN_CPU_SECONDS, MAIN_THREAD_CPU_SECONDS,
    BPF_RUN_SECONDS, BPF_RUNS, JIT_FILES, JIT_ENTRIES, JIT_FILES_REFUSED,
    JIT_RECORDS_DROPPED, JIT_BYTES_READ, UNWIND_SAMPLES, PYTHON_FRAMES_TRUNCATED,
    CHAIN_INVALID, SCAN_STALE, SCAN_WINDOWS_EXHAUSTED, SCAN_OVERFLOWS, SCAN_REFUSALS,
    UNWIND_REFUSALS, UNWIND_TABLE_BYTES, UNWIND_TABLE_OBJECTS, UNWIND_TABLE_ROWS,
    UNWIND_TABLE_EVICTIONS, UNWIND_TABLE_BUILDS, UNWIND_TABLE_BUILD_SECONDS, UNWIND_TABLE_STOPS,
    PYTHON_DUTY_CYCLE, PYTHON_OVERHEAD, PYTHON_DUTY_WRITES_FAILED, PROCESS_ERRORS, INJECTIONS,
    SYMBOL_MEMORY, SYMBOL_EVICTIONS, ADDRESS_CACHE, ADDRESS_CACHE_EVICTIONS, STACKS_NAMED,
    HEAP_FULL_COLLECTIONS, HEAP_FULL_COLLECTION_SECONDS, PROFILE_STORE_BYTES,
    PROFILE_STORE_SECONDS, STACK_SAMPLES, FUNCTION_SAMPLES, DROPPED_SERIES, SERIES, BUILD_INFO,
)


def markdown_table() -> str:
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for f in ALL:
        labels = ", ".join(f.labels) or "—"
        rows.append(f"| `{f.exposed_name}` | {f.kind} | {labels} | {f.help} |")
    return "\n".join(rows)
