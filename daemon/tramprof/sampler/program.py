"""Loads the stack-sampling BPF program, attaches it to every CPU, and owns it:
frequency, target pids, counters, run time, new-process events, drains.

bcc compiles and loads the program in a short-lived child process
(``sampler.compiler``), so that clang and LLVM never occupy the daemon's
memory; the daemon holds the maps and programs by descriptor
(``sampler.loaded``) and attaches the perf events itself.

Counting happens in the kernel; each drain moves only unique stacks and their
counts to user space (``sampler.drain``). Two buffers alternate so a drain
never races the programs still writing: the daemon flips the active buffer,
waits for programs that started before the flip to finish, then reads and
deletes the idle buffer's entries. Per-process unwinding state is written
through ``sampler.maps``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib.resources
import logging
import os
import struct
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tramprof.config import DEFAULT_STUB_PAGES, check_setting
from tramprof.model import RawSample
from tramprof.sampler import layout as bpf_layout
from tramprof.sampler.btf import VMLINUX_BTF, BtfError, KernelBtf
from tramprof.sampler.chunkmaker import ChunkMaker
from tramprof.sampler.compiler import CompileError, LoadRequest, compile_and_load
from tramprof.sampler.cpus import CpuWatch
from tramprof.sampler.drain import drain_buffer
from tramprof.sampler.image import ImageError, load_image
from tramprof.sampler.layout import Counter
from tramprof.sampler.loaded import LoadedProgram
from tramprof.sampler.maps import ProcessMaps
from tramprof.sampler.perfring import PerfRing, close_rings, open_rings
from tramprof.sampler.programcache import ProgramCache, cache_key
from tramprof.sampler.tables import CHUNK_BYTES, UnwindTableMaps

log = logging.getLogger(__name__)

# A BPF program runs for tens of microseconds at most; after this long every
# program that read the old buffer number has finished.
DRAIN_GRACE_SECONDS = 0.005

# Pages of each CPU's new-process ring: 64 KiB, ~1,600 records of 40 bytes.
NEW_PROCESS_PAGES = 16
# struct tp_process_seen (layout.ProcessSeen): tgid, pad, start time, exec id.
_PROCESS_SEEN = struct.Struct("=I4xQQ")
if _PROCESS_SEEN.size != ctypes.sizeof(bpf_layout.ProcessSeen):
    raise ImportError("the new-process record's struct layout and layout.ProcessSeen disagree")

# _IOW('$', 4, __u64): a new sample period, or frequency for frequency-mode events.
_PERF_EVENT_IOC_PERIOD = 0x40082404

# enum bpf_prog_type, enum perf_type_id, enum perf_hw_id / perf_sw_ids.
_PROG_TYPE_PERF_EVENT = 7
_PERF_TYPE_HARDWARE, _PERF_TYPE_SOFTWARE = 0, 1
_PERF_COUNT_HW_CPU_CYCLES, _PERF_COUNT_SW_CPU_CLOCK = 0, 0

# The sampling program, and the walkers it tail-calls from slot 0 of their
# program arrays (each also tail-calls itself, one slice of its work per run):
# the stack scan, the unwind-table walk.
_SAMPLING_PROGRAM = "on_sample"
_TAIL_PROGRAMS = (("scan_programs", "scan_step"), ("table_programs", "table_step_run"))
# Maps of maps and the map whose shape their entries have (BPF_ARRAY_OF_MAPS).
_INNER_MAPS = (("unwind_chunks", "unwind_chunk"),)

# Kernel fields the program reads, by -D name; offsets come from BTF.
_BTF_FIELDS = {
    "TASK_GROUP_LEADER": "task_struct.group_leader",
    "TASK_START_BOOTTIME": "task_struct.start_boottime",
    "TASK_SELF_EXEC_ID": "task_struct.self_exec_id",
    "TASK_FLAGS": "task_struct.flags",
    "TASK_FSBASE": "task_struct.thread.fsbase",
    "PT_REGS_IP": "pt_regs.ip",
    "PT_REGS_SP": "pt_regs.sp",
    "PT_REGS_BP": "pt_regs.bp",
}


class SamplerError(RuntimeError):
    """The BPF program could not be built, loaded or attached."""


@dataclass(frozen=True)
class SamplerConfig:
    frequency: int = 99
    event: str = "auto"
    max_keys: int = 16384
    max_user_stacks: int = 16384
    max_kernel_stacks: int = 8192
    max_targets: int = 4096
    scan_bytes: int = 65536  # stack window of "scan" mode, from sp upward
    max_stub_pages_per_process: int = DEFAULT_STUB_PAGES
    unwind_table_bytes: int = 64 << 20  # 0: no unwind tables
    program_cache_dir: str = ""  # compiled program images kept here; "": compile every time

    def __post_init__(self) -> None:
        # The settings' own rules (a ConfigError is a ValueError).
        check_setting("frequency", self.frequency)
        check_setting("event", self.event)
        check_setting("scan_window_bytes", self.scan_bytes)
        check_setting("max_stub_pages_per_process", self.max_stub_pages_per_process)
        check_setting("unwind_table_bytes", self.unwind_table_bytes)

    @property
    def unwind_chunk_slots(self) -> int:
        """Slots for row chunks: four times what the budget fills, so freed
        runs of slots are reused without compaction (an empty slot is a
        null pointer)."""
        return max(64, 4 * self.unwind_table_bytes // CHUNK_BYTES)


def bpf_source_dir() -> str:
    return str(importlib.resources.files("tramprof.bpf"))


def build_cflags(config: SamplerConfig, btf_path: str = VMLINUX_BTF) -> list[str]:
    """Compiler flags: include path, map sizes, kernel field offsets from BTF."""
    flags = [
        f"-I{bpf_source_dir()}",
        f"-DTP_MAX_KEYS={config.max_keys}",
        f"-DTP_MAX_USTACKS={config.max_user_stacks}",
        f"-DTP_MAX_KSTACKS={config.max_kernel_stacks}",
        f"-DTP_MAX_TARGETS={config.max_targets}",
        f"-DTP_SCAN_BYTES={config.scan_bytes}",
        f"-DTP_MAX_UNWIND_CHUNKS={config.unwind_chunk_slots}",
    ]
    with KernelBtf(btf_path) as btf:
        for macro, path in _BTF_FIELDS.items():
            field = btf.field(path)
            flags.append(f"-DTP_OFF_{macro}={field.offset}")
            if macro == "TASK_SELF_EXEC_ID":
                flags.append(f"-DTP_SIZE_{macro}={field.size}")
    return flags


def program_source() -> str:
    return (importlib.resources.files("tramprof.bpf") / "profile.bpf.c").read_text()


@contextlib.contextmanager
def _captured_stderr() -> Iterator[list[str]]:
    """Capture what bcc's runtime prints on fd 2 (perf event attachment) so
    errors can quote it."""
    captured: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            captured.append(tmp.read().decode(errors="replace"))


def _load_hint(log_text: str) -> str:
    if "No module named 'bcc'" in log_text:
        return "bcc is missing: install python3-bpfcc (`make setup`)"
    if "linux/" in log_text and "file not found" in log_text:
        return ("kernel headers are missing: run `make setup` (installs linux-headers and links "
                "them under /lib/modules/$(uname -r)/build)")
    if "Permission denied" in log_text or "Operation not permitted" in log_text:
        return "loading BPF needs root or CAP_BPF + CAP_PERFMON"
    if "invalid" in log_text or ("R" in log_text and "!read_ok" in log_text):
        return ("the kernel's verifier rejected the program; the log above says at which "
                "instruction — report it together with `uname -r`")
    return "see the compiler / verifier output above"


class Sampler:
    """The loaded BPF sampler. Not thread-safe: one owner drains it."""

    def __init__(self, config: SamplerConfig, btf_path: str = VMLINUX_BTF) -> None:
        self.config = config
        self._btf_path = btf_path
        self._bpf: Any = None
        self._active = 0
        self._filter: list[int] | None = None
        # The new-process rings, one a CPU, and their descriptors (asked for
        # at every wake of the loop), from when they are opened until closed.
        self._new_process_rings: list[PerfRing] = []
        self._event_fds: tuple[int, ...] = ()
        self.new_process_events_lost = 0
        self._stats_fd: int | None = None
        self._event: tuple[int, int] | None = None
        self.event_name = ""
        self._maps: ProcessMaps | None = None
        self._tables: UnwindTableMaps | None = None
        self._chunk_maker: ChunkMaker | None = None
        self._loaded_from = ""
        self._cached = False
        self._cpu_watch = CpuWatch()

    @property
    def loaded_from(self) -> str:
        """Where the program came from: "cache", "compiler" or "" (not loaded)."""
        return self._loaded_from

    @property
    def cached(self) -> bool:
        """The loaded program's image is in the program cache (it came from
        there, or was stored there after compiling)."""
        return self._cached

    def load(self) -> None:
        """Compile and load the program without attaching it (nothing is
        sampled yet); ``start`` does it when it was not done before. The
        compiler child's memory adds to this process's: call it while this
        process is small."""
        if self._bpf is not None:
            return
        try:
            cflags = build_cflags(self.config, self._btf_path)
        except BtfError as exc:
            raise SamplerError(f"cannot read kernel BTF: {exc}") from exc
        self._bpf = self._load(cflags, self.config.program_cache_dir, self._btf_path)

    def start(self, pids: Iterable[int] | None = None) -> None:
        """Compile and load (unless ``load`` did), then attach; with
        ``pids``, only those processes are sampled from the first tick on."""
        self.load()
        if pids is not None:
            self.set_targets(pids)
        self._write_config()
        self._maps = ProcessMaps(self._bpf, self.config.max_stub_pages_per_process)
        if self.config.unwind_table_bytes:
            # Chunks are created as objects show up, after CAP_BPF is dropped.
            self._chunk_maker = ChunkMaker()
        self._tables = UnwindTableMaps(
            self._bpf, self.config.unwind_chunk_slots,
            self._chunk_maker.create if self._chunk_maker is not None else None)
        self._open_new_process_events()
        self._attach()
        self._enable_run_time_stats()

    def _load(self, cflags: list[str], cache_dir: str, btf_path: str) -> LoadedProgram:
        """The program loaded from its cached image, or else compiled and
        loaded by the compiler child (and its image cached), tail calls in
        place."""
        request = LoadRequest(
            text=program_source(), cflags=cflags,
            programs=[(name, _PROG_TYPE_PERF_EVENT)
                      for name in (_SAMPLING_PROGRAM, *(p for _a, p in _TAIL_PROGRAMS))],
            tail_calls=_TAIL_PROGRAMS, inner_maps=_INNER_MAPS)
        cache = ProgramCache(cache_dir) if cache_dir else None
        key = cache_key(request, btf_path) if cache else ""
        if cache and (image := cache.load(key)) is not None:
            started = time.monotonic()
            try:
                program = load_image(image)
            except (OSError, ImageError) as exc:
                log.warning("the cached program %s did not load (%s); compiling it",
                            key[:12], exc)
            else:
                log.info("BPF program loaded from the cache (%s) in %.2f s", key[:12],
                         time.monotonic() - started)
                self._loaded_from = "cache"
                self._cached = True
                return program
        started = time.monotonic()
        try:
            compiled = compile_and_load(request, image=cache is not None)
        except CompileError as exc:
            if exc.stage == "load" and exc.program:
                detail = "\n".join(exc.output.strip().splitlines()[-20:])
                raise SamplerError(f"BPF program {exc.program} failed to load: {exc}\n"
                                   f"{detail}") from exc
            tail = "\n".join(exc.output.strip().splitlines()[-40:])
            raise SamplerError(f"BPF program failed to load: {exc}\n{tail}\n"
                               f"hint: {_load_hint(exc.output)}") from exc
        if compiled.output.strip():
            log.debug("bcc compiler output:\n%s", compiled.output)
        log.info("BPF program compiled and loaded in %.2f s", time.monotonic() - started)
        self._loaded_from = "compiler"
        if cache is not None:
            if compiled.image is None:
                log.warning("the compiled program cannot be cached: %s", compiled.image_problem)
            elif cache.store(key, compiled.image):
                log.info("compiled program kept in %s for the next start", cache.directory)
                self._cached = True
        return compiled.program

    def _open_new_process_events(self) -> None:
        self._new_process_rings = open_rings(self._bpf[b"new_processes"], NEW_PROCESS_PAGES)
        self._event_fds = tuple(ring.fd for ring in self._new_process_rings)

    def event_fds(self) -> list[int]:
        """File descriptors that become readable when new processes were seen
        (none before ``start`` and after ``close``)."""
        return list(self._event_fds)

    def new_processes(self) -> list[tuple[int, int, int]]:
        """(tgid, start_boottime_ns, exec_id) of images sampled for the first time."""
        seen: list[tuple[int, int, int]] = []
        for ring in self._new_process_rings:
            records, lost = ring.read()
            self.new_process_events_lost += lost
            seen.extend(_PROCESS_SEEN.unpack_from(record) for record in records
                        if len(record) >= _PROCESS_SEEN.size)
        return seen

    def _attach(self) -> None:
        candidates = {
            "cycles": (_PERF_TYPE_HARDWARE, _PERF_COUNT_HW_CPU_CYCLES),
            "cpu-clock": (_PERF_TYPE_SOFTWARE, _PERF_COUNT_SW_CPU_CLOCK),
        }
        order = ["cycles", "cpu-clock"] if self.config.event == "auto" else [self.config.event]
        errors = []
        for name in order:
            ev_type, ev_config = candidates[name]
            with _captured_stderr() as out:
                try:
                    self._bpf.attach_perf_event(ev_type=ev_type, ev_config=ev_config,
                                                fn_name=_SAMPLING_PROGRAM.encode(),
                                                sample_freq=self.config.frequency)
                except Exception as exc:
                    failure: Exception | None = exc
                else:
                    failure = None
            if failure is not None:
                detail = (out[0].strip() if out else "") or str(failure)
                errors.append(f"{name}: {detail}")
                log.debug("perf event %s unavailable: %s", name, detail)
                continue
            self.event_name = name
            self._event = (ev_type, ev_config)
            log.info("sampling on %s at %d Hz on every CPU", name, self.config.frequency)
            return
        raise SamplerError("cannot attach to any perf event: " + "; ".join(errors))

    def set_frequency(self, frequency: int) -> None:
        """Change the rate of the open perf events in place.

        PERF_EVENT_IOC_PERIOD on descriptors we hold needs no capability, so
        this works after the daemon dropped CAP_PERFMON (re-opening the events
        would not), and the program, its maps and the counts stay as they are.
        cpu-clock turned the frequency into a fixed period (ns) when the event
        was opened, so it takes a period; frequency-mode events take Hz.
        """
        if frequency == self.config.frequency:
            return
        if self._event is not None:
            value = 1_000_000_000 // frequency if self.event_name == "cpu-clock" else frequency
            arg = struct.pack("=Q", value)
            try:
                for fd in self._bpf.open_perf_events[self._event].values():
                    fcntl.ioctl(fd, _PERF_EVENT_IOC_PERIOD, arg)
            except OSError as exc:
                raise SamplerError(f"cannot change the sampling frequency to {frequency} Hz: "
                                   f"{exc.strerror} (kernel.perf_event_max_sample_rate?)"
                                   ) from exc
        self.config = replace(self.config, frequency=frequency)

    def _write_config(self) -> None:
        cfg = bpf_layout.Config(active_buffer=self._active,
                                filter_pids=1 if self._filter is not None else 0)
        table = self._bpf.get_table(b"config", keytype=ctypes.c_int, leaftype=bpf_layout.Config)
        table[ctypes.c_int(0)] = cfg

    def set_targets(self, pids: Iterable[int] | None) -> None:
        """Sample only these processes (None: all). Takes effect without reloading."""
        targets = self._bpf[b"target_pids"]
        wanted = None if pids is None else sorted(set(pids))
        if wanted is not None and len(wanted) > self.config.max_targets:
            raise SamplerError(f"{len(wanted)} target pids exceed max_targets "
                               f"({self.config.max_targets})")
        for key in list(targets.keys()):
            if wanted is None or key.value not in wanted:
                del targets[key]
        for pid in wanted or ():
            targets[targets.Key(pid)] = targets.Leaf(1)
        self._filter = wanted
        self._write_config()

    def _enable_run_time_stats(self) -> None:
        """Ask the kernel to account the program's run time while we hold the fd."""
        from tramprof.sampler.btf import libbpf

        lib = libbpf()
        lib.bpf_enable_stats.restype = ctypes.c_int
        lib.bpf_enable_stats.argtypes = [ctypes.c_int]
        fd = lib.bpf_enable_stats(0)  # BPF_STATS_RUN_TIME
        if fd < 0:
            log.info("BPF run-time statistics unavailable (errno %d)", -fd)
            return
        self._stats_fd = fd

    def run_time(self) -> tuple[int, int] | None:
        """(nanoseconds, runs) of the sampling program, from the kernel's fdinfo.
        The kernel counts while anyone asks it to: this daemon (with
        CAP_SYS_ADMIN) or the host (sysctl kernel.bpf_stats_enabled=1)."""
        if self._bpf is None:
            return None
        try:
            fd = self._bpf.funcs[_SAMPLING_PROGRAM.encode()].fd
            with open(f"/proc/self/fdinfo/{fd}") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            ns, runs = int(fields["run_time_ns"]), int(fields["run_cnt"])
        except (OSError, KeyError, ValueError):
            return None
        if self._stats_fd is None and runs == 0:
            return None  # nobody has the statistics on
        return ns, runs

    def unsampled_cpus(self) -> list[int]:
        """Online CPUs the sampling events do not sample: they came online
        after ``start``, or went offline and back since (``sampler.cpus``).
        A CPU back online is seen at the second asking after it at the
        latest."""
        if self._event is None:
            return []
        return self._cpu_watch.check(self._bpf.open_perf_events.get(self._event, {}))

    def counters(self) -> dict[Counter, int]:
        """Cumulative BPF-side counters, summed over CPUs."""
        table = self._bpf[b"counters"]
        return {c: int(sum(table.getvalue(table.Key(c.value)))) for c in Counter}

    def drain(self) -> list[RawSample]:
        """Swap buffers and return what the idle one collected, emptying it."""
        old = self._active
        self._active = 1 - old
        self._write_config()
        time.sleep(DRAIN_GRACE_SECONDS)
        return drain_buffer(self._bpf, old)

    @property
    def maps(self) -> ProcessMaps:
        """The writer of per-process unwinding state (valid after ``start``)."""
        if self._maps is None:
            raise SamplerError("the sampler is not started")
        return self._maps

    @property
    def tables(self) -> UnwindTableMaps:
        """The writer of unwind tables (valid after ``start``)."""
        if self._tables is None:
            raise SamplerError("the sampler is not started")
        return self._tables

    # The unwinding modes' map writer (unwind.mode.MapWriter): they exist
    # before the program is loaded, the maps only after.
    def install(self, tgid: int, walker: bytes, record: ctypes.Structure,
                arenas: Iterable[tuple[int, int]]) -> None:
        self.maps.install(tgid, walker, record, arenas)
        self._write_config()  # the programs' memos of absent entries are void

    def remove(self, tgid: int, walker: bytes) -> None:
        self.maps.remove(tgid, walker)

    def take_stale_chains(self) -> set[int]:
        return self.maps.take_stale_chains()

    # The table mode's writer (unwind.tables.TableWriter).
    def load_rows(self, rows: bytes) -> int:
        return self.tables.load(rows)

    def unload_rows(self, first_row: int) -> None:
        self.tables.unload(first_row)

    def set_unwind_process(self, tgid: int,
                           mappings: Sequence[bpf_layout.UnwindMapping]) -> None:
        self.tables.set_process(tgid, mappings)
        self._write_config()  # the programs' memos of absent entries are void

    def remove_unwind_process(self, tgid: int) -> None:
        self.tables.remove_process(tgid)

    def close(self) -> None:
        """Detach every perf event and unload the program and its maps."""
        if self._stats_fd is not None:
            os.close(self._stats_fd)
            self._stats_fd = None
        self._event_fds = ()
        if self._new_process_rings:
            close_rings(self._bpf[b"new_processes"] if self._bpf is not None else None,
                        self._new_process_rings)
            self._new_process_rings = []
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf = None
            self._maps = None
            self._tables = None
        if self._chunk_maker is not None:
            self._chunk_maker.close()
            self._chunk_maker = None

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
