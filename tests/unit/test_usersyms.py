"""ProcessSymbolizer against live processes and a synthetic /proc tree.

Live targets are compiled from tests/unit/csrc at test time; each prints the
addresses of known functions, so every assertion is on an exact name.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from tramprof import speedups
from tramprof.model import NATIVE_GAP, RawSample
from tramprof.pipeline import frames
from tramprof.procfs.identity import read_stat
from tramprof.procfs.maps import Mapping, memory_thread, process_exited, read_maps
from tramprof.sampler import layout
from tramprof.symbols import elf as elf_module
from tramprof.symbols import usersyms as usersyms_module
from tramprof.symbols.elf import ElfCache, ElfSymbols
from tramprof.symbols.horizon import SampleHorizon
from tramprof.symbols.images import ProcessImage
from tramprof.symbols.safeopen import open_mapping, open_process_mapping
from tramprof.symbols.usersyms import ProcessSymbolizer, SymbolizationStats, read_kernel_vdso

from .compiled import needs_speedups

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ["-O2", "-fno-omit-frame-pointer"]
BASE = 0x555555554000

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("gcc", "readelf", "strip")),
    reason="needs gcc and binutils (readelf, strip) to build test binaries",
)
needs_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="opening /proc/PID/map_files/* needs CAP_SYS_ADMIN (run as root)",
)


def _run(*cmd: str | Path) -> str:
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True).stdout


def _funcs(path: Path, dynamic: bool = False) -> dict[str, int]:
    """name -> ELF vaddr of defined functions, per readelf (independent of the code)."""
    out: dict[str, int] = {}
    for line in _run("readelf", "-W", "--dyn-syms" if dynamic else "--syms", path).splitlines():
        parts = line.split()
        if len(parts) == 8 and parts[3] in ("FUNC", "IFUNC") and parts[6] != "UND":
            out[parts[7].split("@")[0]] = int(parts[1], 16)
    return out


def _exec_load(path: Path) -> tuple[int, int, int]:
    """(offset, vaddr, filesz) of the executable PT_LOAD, per readelf."""
    for line in _run("readelf", "-lW", path).splitlines():
        parts = line.split()
        if parts and parts[0] == "LOAD" and "E" in parts[7:-1]:
            return int(parts[1], 16), int(parts[2], 16), int(parts[4], 16)
    raise AssertionError(f"no executable PT_LOAD in {path}")


@pytest.fixture(scope="module")
def bins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("userbins")
    b = {
        "pie": d / "target_pie",
        "nopie": d / "target_nopie",
        "lib": d / "libtramprof_unit.so",
        "dlopen": d / "dlopen_target",
        "pie_stripped": d / "target_stripped",
        "leader_exits": d / "leader_exits",
    }
    _run("gcc", *CFLAGS, "-fPIE", "-pie", "-o", b["pie"], CSRC / "target.c")
    _run("gcc", *CFLAGS, "-fno-pie", "-no-pie", "-o", b["nopie"], CSRC / "target.c")
    _run("gcc", *CFLAGS, "-shared", "-fPIC", "-o", b["lib"], CSRC / "shlib.c")
    _run("gcc", *CFLAGS, "-o", b["dlopen"], CSRC / "dlopen_target.c", "-ldl")
    _run("strip", "-o", b["pie_stripped"], b["pie"])
    _run("gcc", *CFLAGS, "-pthread", "-o", b["leader_exits"], CSRC / "leader_exits.c", "-ldl")
    return b


@contextmanager
def running(*argv: str | Path) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """Start a target, yield it with the addresses it printed, end it on exit."""
    proc = subprocess.Popen(
        [str(a) for a in argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"target {argv[0]} failed: {proc.stderr.read()}")
        yield proc, [int(x, 16) for x in line.split()]
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            proc.wait(timeout=5)
        proc.stdout.close()
        proc.stderr.close()


def _symbolizer(
    pid: int,
    proc_root: str = "/proc",
    anon_resolver: Callable[[Mapping, int], str | None] | None = None,
    maps_refresh_interval: float = 1.0,
    horizon: SampleHorizon | None = None,
) -> ProcessSymbolizer:
    return ProcessSymbolizer(
        pid,
        ElfCache(),
        SymbolizationStats(),
        proc_root=proc_root,
        anon_resolver=anon_resolver,
        maps_refresh_interval=maps_refresh_interval,
        horizon=horizon,
    )


# -- live processes ------------------------------------------------------------


@pytest.mark.parametrize("which", ["pie", "nopie"])
def test_live_executable_functions(bins: dict[str, Path], which: str) -> None:
    with running(bins[which]) as (proc, (leaf, static)):
        sym = _symbolizer(proc.pid)
        assert sym.resolve(leaf) == "tramprof_unit_leaf"
        assert sym.resolve(leaf + 4) == "tramprof_unit_leaf"
        assert sym.resolve(static) == "tramprof_unit_static"
        assert sym.stats.total() == 0
    if which == "nopie":
        assert leaf == _funcs(bins["nopie"])["tramprof_unit_leaf"]
    else:
        assert leaf != _funcs(bins["pie"])["tramprof_unit_leaf"]  # relocated


def test_live_stripped_gives_basename_plus_vaddr(bins: dict[str, Path]) -> None:
    vaddr = _funcs(bins["pie"])["tramprof_unit_leaf"]
    with running(bins["pie_stripped"]) as (proc, (leaf, _static)):
        sym = _symbolizer(proc.pid)
        # The ELF vaddr, as addr2line -e target_pie expects it.
        assert sym.resolve(leaf) == f"target_stripped+0x{vaddr:x}"
        assert sym.stats["no_symbol"] == 1


def test_shared_elf_cache_parses_once(bins: dict[str, Path]) -> None:
    cache, stats = ElfCache(), SymbolizationStats()
    with running(bins["pie"]) as (p1, (leaf1, _)), running(bins["pie"]) as (p2, (leaf2, _)):
        assert ProcessSymbolizer(p1.pid, cache, stats).resolve(leaf1) == "tramprof_unit_leaf"
        assert ProcessSymbolizer(p2.pid, cache, stats).resolve(leaf2) == "tramprof_unit_leaf"
    assert cache.misses == 1


def test_names_found_in_one_process_are_shared_with_the_next(
        bins: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A second process of the same program finds the names the first one
    found without looking in the symbol table; other addresses still look."""
    cache, stats = ElfCache(), SymbolizationStats()
    with running(bins["pie"]) as (p1, (leaf1, _)), \
            running(bins["pie"]) as (p2, (leaf2, static2)):
        assert ProcessSymbolizer(p1.pid, cache, stats).resolve(leaf1) == "tramprof_unit_leaf"

        def looked_up(self: ElfSymbols, vaddr: int) -> str | None:
            raise AssertionError("looked up in the symbol table")

        monkeypatch.setattr(ElfSymbols, "resolve_vaddr", looked_up)
        second = ProcessSymbolizer(p2.pid, cache, stats)
        assert second.resolve(leaf2) == "tramprof_unit_leaf"
        with pytest.raises(AssertionError, match="looked up"):
            second.resolve(static2)


@pytest.mark.parametrize("which", ["pie", "nopie"])
def test_a_shared_name_is_found_without_a_search(
        bins: dict[str, Path], which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a process has looked up one address of a mapping, a name another
    process found elsewhere in it comes back from ``shared_lookup`` by one
    addition, with the same answer as ``lookup``; a name nobody found yet,
    an address past the segment's bytes and a re-read of the maps all say
    "ask lookup" (None)."""
    cache, stats = ElfCache(), SymbolizationStats()
    with running(bins[which]) as (p1, (leaf1, _)), \
            running(bins[which]) as (p2, (leaf2, static2)):
        first = ProcessSymbolizer(p1.pid, cache, stats)
        assert first.resolve(leaf1) == "tramprof_unit_leaf"
        second = ProcessSymbolizer(p2.pid, cache, stats)
        assert second.shared_lookup(leaf2) is None  # nothing looked up here yet
        assert second.resolve(static2 + 1) == "tramprof_unit_static"
        expected = second.lookup(leaf2)

        def searched(self: ElfSymbols, offset: int) -> int | None:
            raise AssertionError("searched the segments")

        monkeypatch.setattr(ElfSymbols, "file_offset_to_vaddr", searched)
        assert second.shared_lookup(leaf2) == expected
        assert expected[0] == "tramprof_unit_leaf"
        assert second.shared_lookup(leaf2 + 3) is None  # not found by anyone yet
        mapping = expected[1]
        assert mapping is not None
        offset, _vaddr, filesz = _exec_load(bins[which])
        past = mapping.start + (offset + filesz - mapping.offset)
        if past < mapping.end:  # the page's tail after the segment's bytes
            assert second.shared_lookup(past) is None
        second.reload_maps()
        assert second.shared_lookup(leaf2) is None
    assert stats.total() == 0


@needs_root
def test_a_warmed_process_names_from_others_before_its_first_lookup(
        bins: dict[str, Path]) -> None:
    """A process whose object another process parsed already answers the
    names found there from its preload on (a short-lived process is sampled
    once or twice: its first stack is the one that matters)."""
    cache, stats = ElfCache(), SymbolizationStats()
    with running(bins["pie"]) as (p1, (leaf1, _)), \
            running(bins["pie"]) as (p2, (leaf2, static2)):
        assert ProcessSymbolizer(p1.pid, cache, stats).resolve(leaf1) == "tramprof_unit_leaf"
        second = ProcessSymbolizer(p2.pid, cache, stats)
        second.preload()
        shared = second.shared_lookup(leaf2)
        assert shared is not None and shared == second.lookup(leaf2)
        assert shared[0] == "tramprof_unit_leaf"
        assert second.shared_lookup(static2 + 1) is None  # nobody named it yet
    assert stats.total() == 0


@contextmanager
def second_of_a_program(bins: dict[str, Path]) -> Iterator[
        tuple[tuple[subprocess.Popen[str], list[int]], Callable[[bool], ProcessImage]]]:
    """Two processes of one program, sharing one ELF cache, the first having
    named its leaf: the second (as ``running`` yields it) and a maker of its
    images (``warm``: with its static function looked up, a direct segment).
    No symbolization may fail meanwhile."""
    cache, stats = ElfCache(), SymbolizationStats()
    with running(bins["pie"]) as (p1, (leaf1, _)), running(bins["pie"]) as second:
        assert ProcessSymbolizer(p1.pid, cache, stats).resolve(leaf1) == "tramprof_unit_leaf"
        p2, (_leaf2, static2) = second

        def image(warm: bool = True) -> ProcessImage:
            made = ProcessImage(symbolizer=ProcessSymbolizer(p2.pid, cache, stats))
            if warm:
                assert made.lookup(static2 + 1)[0] == "tramprof_unit_static"
            return made

        yield second, image
    assert stats.total() == 0


@needs_speedups
def test_the_compiled_pass_names_from_other_processes_as_lookup_does(
        bins: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A stack of a second process, named through the compiled pass, gets
    the names the first process found without a search, with the places,
    cache entries and "looked up" answer that the Python lookups give the
    same stack; an address nobody named yet is searched once, then shared."""
    with second_of_a_program(bins) as (second, image):
        _, (leaf2, static2) = second
        compiled, python = image(), image()
        stack = [leaf2, NATIVE_GAP, leaf2, static2 + 1]
        searches: list[int] = []
        search = ElfSymbols.file_offset_to_vaddr

        def counted(self: ElfSymbols, offset: int) -> int | None:
            searches.append(offset)
            return search(self, offset)

        def asked(self: ProcessSymbolizer, addr: int) -> None:
            raise AssertionError("asked the symbolizer")

        monkeypatch.setattr(ElfSymbols, "file_offset_to_vaddr", counted)
        with monkeypatch.context() as patched:  # the compiled pass alone answers
            patched.setattr(ProcessSymbolizer, "shared_lookup", asked)
            patched.setattr(ProcessSymbolizer, "lookup", asked)
            names, sources, cached = compiled.name_frames_cached(stack)
        assert names == ["tramprof_unit_leaf", NATIVE_GAP, "tramprof_unit_leaf",
                         "tramprof_unit_static"]
        assert cached is None  # looked up past the image's own caches
        assert (names, sources, cached) == python.name_frames_cached(tuple(stack))
        assert compiled.found == python.found
        assert compiled.name_frames_cached(stack) == (names, sources, 0)  # now its own
        unnamed = [leaf2 + 3, leaf2]
        assert searches == []
        assert compiled.name_frames_cached(unnamed) == python.name_frames_cached(tuple(unnamed))
        assert len(searches) == 1  # leaf2 + 3 by the first image; the second finds its name

        # A new image's first stack: its first lookup makes the segment, and
        # the compiled pass names the rest of the stack from there.
        fresh = image(False)
        asked_for: list[int] = []
        shared_lookup = ProcessSymbolizer.shared_lookup

        def recorded(self: ProcessSymbolizer, addr: int) -> tuple[str, Mapping] | None:
            asked_for.append(addr)
            return shared_lookup(self, addr)

        monkeypatch.setattr(ProcessSymbolizer, "shared_lookup", recorded)
        stack = [static2 + 1, leaf2, NATIVE_GAP, leaf2 + 3]
        assert fresh.name_frames_cached(stack)[:2] == python.name_frames_cached(tuple(stack))[:2]
        assert asked_for == [static2 + 1]


@needs_speedups
def test_the_whole_stack_pass_names_from_other_processes_as_lookup_does(
        bins: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A sample of a second process, named by the compiled whole-stack pass,
    gets the names the first process found without asking the symbolizer:
    the frames, places and cache entries that the Python lookups give it,
    and it counts them as found past the image's own caches (then as its
    own); an address nobody named yet leaves the stack to the lookups."""
    with second_of_a_program(bins) as (second, image):
        p2, (leaf2, static2) = second
        whole, python = image(), image()
        # The caller's return address is one past its call; the table walk stopped.
        sample = RawSample(tgid=p2.pid, start_boottime_ns=1, exec_id=1, comm="pie",
                           user_ips=(leaf2, static2 + 2), user_sps=(0x100, 0x200),
                           user_flags=layout.TABLE_STOP, kernel_ips=(), trampoline_frames=(),
                           kernel_error=0, count=1)

        def asked(self: ProcessSymbolizer, addr: int) -> None:
            raise AssertionError("asked the symbolizer")

        with monkeypatch.context() as patched:  # the compiled pass alone answers
            patched.setattr(ProcessSymbolizer, "shared_lookup", asked)
            patched.setattr(ProcessSymbolizer, "lookup", asked)
            named = frames.cached_frames(sample, whole.caches(), None, ((), ()))
        with monkeypatch.context() as patched:
            patched.setattr(speedups, "compiled", None)
            expected = frames.named_frames(sample, python.name_frames, lambda _a: None,
                                           Counter())
        assert expected[0] == (NATIVE_GAP, "tramprof_unit_static", "tramprof_unit_leaf")
        assert named == (*expected, 0, 1)  # one frame from the names shared
        assert whole.found == python.found
        assert frames.cached_frames(sample, whole.caches(), None, ((), ())) == \
            (*expected, 0, 0)  # now its own
        unnamed = replace(sample, user_ips=(leaf2 + 3, static2 + 2))
        assert frames.cached_frames(unnamed, whole.caches(), None, ((), ())) == \
            [leaf2 + 3, static2 + 1, NATIVE_GAP]


@needs_root
def test_later_processes_of_a_program_are_warmed_without_opening_its_objects(
        bins: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The first process's objects are opened and held, or parsed; the next
    processes of the same program find them by the ``stat`` of their
    ``map_files`` links alone, and still name their frames after exiting."""
    cache, stats = ElfCache(), SymbolizationStats()
    with running(bins["pie"]) as (p1, (leaf1, _)), running(bins["pie"]) as (p2, (leaf2, _)), \
            running(bins["pie"]) as (p3, (leaf3, _)):
        first = ProcessSymbolizer(p1.pid, cache, stats)
        first.preload()
        opened: list[Mapping] = []
        real_open = usersyms_module.open_mapping

        def counting_open(proc: str, m: Mapping, *args: object, **kwargs: object) -> object:
            opened.append(m)
            return real_open(proc, m, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(usersyms_module, "open_mapping", counting_open)
        held = ProcessSymbolizer(p2.pid, cache, stats)  # while the first one's file is held
        held.preload()
        assert first.resolve(leaf1) == "tramprof_unit_leaf"
        parsed = ProcessSymbolizer(p3.pid, cache, stats)  # after it was parsed
        parsed.preload()
        for proc in (p2, p3):
            proc.kill()
            proc.wait()
        assert held.resolve(leaf2) == "tramprof_unit_leaf"
        assert parsed.resolve(leaf3) == "tramprof_unit_leaf"
    assert opened == [] and stats.total() == 0


def test_fallback_names_are_not_shared(bins: dict[str, Path], tmp_path: Path) -> None:
    """The same stripped program under two names: each process's frames say
    its own file name, and each is counted."""
    other = tmp_path / "other_name"
    shutil.copy(bins["pie_stripped"], other)
    cache, stats = ElfCache(), SymbolizationStats()
    vaddr = _funcs(bins["pie"])["tramprof_unit_leaf"]
    with running(bins["pie_stripped"]) as (p1, (leaf1, _)), running(other) as (p2, (leaf2, _)):
        assert ProcessSymbolizer(p1.pid, cache, stats).resolve(leaf1) == \
            f"target_stripped+0x{vaddr:x}"
        assert ProcessSymbolizer(p2.pid, cache, stats).resolve(leaf2) == f"other_name+0x{vaddr:x}"
    assert stats["no_symbol"] == 2


def test_shared_names_are_bounded(bins: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elf_module, "MAX_SHARED_NAMES", 4)
    cache = ElfCache()
    obj = cache.get_path(bins["pie"])
    for vaddr in range(5):
        cache.share_name(obj, vaddr, f"f{vaddr}")
    assert [cache.shared_name(obj, vaddr) for vaddr in range(5)] == [None] * 4 + ["f4"]
    outside = ElfSymbols.from_path(bins["pie"])  # not the cache's: nothing shared
    cache.share_name(outside, 1, "g")
    assert cache.shared_name(outside, 1) is None


def test_process_gone_before_first_resolve(bins: dict[str, Path]) -> None:
    with running(bins["pie"]) as (proc, (leaf, _)):
        sym = _symbolizer(proc.pid)
        proc.kill()
        proc.wait()
        assert sym.resolve(leaf) == "[unknown]"
        assert sym.mappings == []
        assert not sym.is_anonymous_exec(leaf)
    assert sym.stats.snapshot() == {"process_gone": 1}


def test_process_gone_after_maps_were_read(bins: dict[str, Path]) -> None:
    with running(bins["pie"]) as (proc, (leaf, _)):
        sym = _symbolizer(proc.pid)
        m = sym.mapping_for(leaf)
        assert m is not None and m.is_exec
        proc.kill()
        proc.wait()
        offset = leaf - m.start + m.offset
        assert sym.resolve(leaf) == f"target_pie+0x{offset:x}"
    assert sym.stats.snapshot() == {"process_gone": 1}


def test_a_process_whose_main_thread_exited_is_named_through_a_running_thread(
    bins: dict[str, Path],
) -> None:
    """The main thread's /proc entry shows no memory once it has exited (empty
    maps, no root), though the process runs on in its other threads: their
    entries show its maps and files. It is not a process that exited."""
    with running(bins["leader_exits"]) as (proc, (leaf,)):
        deadline = time.monotonic() + 10
        while not read_stat(proc.pid).leader_exited:
            assert time.monotonic() < deadline, "the main thread did not exit"
            time.sleep(0.01)
        assert Path(f"/proc/{proc.pid}/maps").read_text() == ""
        sym = _symbolizer(proc.pid)
        assert sym.resolve(leaf) == "tramprof_unit_worker_leaf"
        assert not sym.exited_unread()
        assert sym.stats.total() == 0
        assert process_exited(proc.pid) is False
        # Its files open through that thread's entry too (unwind tables).
        thread = memory_thread(proc.pid)
        assert thread is not None and thread != proc.pid
        exe = next(m for m in read_maps(thread, f"/proc/{proc.pid}/task")
                   if m.basename == "leader_exits" and m.is_exec)
        assert open_mapping(f"/proc/{proc.pid}", exe) is None
        opened = open_process_mapping("/proc", proc.pid, exe)
        assert opened is not None
        with opened:
            assert os.fstat(opened.fileno()).st_ino == exe.inode
    assert process_exited(proc.pid) is True


def test_a_process_whose_threads_exit_one_after_another_is_followed(
    bins: dict[str, Path],
) -> None:
    """The thread the symbolizer reads through exits, and a new one loads a
    library: its maps and the library are found through the new thread."""
    with running(bins["leader_exits"], bins["lib"]) as (proc, (leaf,)):
        assert proc.stdin is not None and proc.stdout is not None
        sym = _symbolizer(proc.pid, maps_refresh_interval=0.0)
        assert sym.resolve(leaf) == "tramprof_unit_worker_leaf"
        threads = [memory_thread(proc.pid)]
        for _ in range(3):
            proc.stdin.write("n")
            proc.stdin.flush()
            func = int(proc.stdout.readline(), 16)  # once the previous thread was joined
            threads.append(memory_thread(proc.pid))
            assert None not in threads and len(set(threads)) == len(threads), threads
            sym.reload_maps()
            assert sym.mapping_for(func) is not None
            assert sym.resolve(func) == "tramprof_lib_func"
        assert not sym.exited_unread()
        assert sym.stats.total() == 0


@needs_root
def test_dlopened_library_deleted_resolves_via_map_files(
    bins: dict[str, Path], tmp_path: Path
) -> None:
    lib = tmp_path / "libdeleted.so"
    shutil.copy(bins["lib"], lib)
    with running(bins["dlopen"], lib) as (proc, (func,)):
        lib.unlink()
        sym = _symbolizer(proc.pid)
        m = sym.mapping_for(func)
        assert m is not None and m.is_deleted
        assert sym.resolve(func) == "tramprof_lib_func"
        assert sym.stats.total() == 0


@needs_root
def test_dlopened_library_replaced_on_disk_uses_mapped_object(
    bins: dict[str, Path], tmp_path: Path
) -> None:
    lib = tmp_path / "libreplaced.so"
    shutil.copy(bins["lib"], lib)
    with running(bins["dlopen"], lib) as (proc, (func,)):
        # Same path, different file: the inode check must reject it.
        replacement = tmp_path / "other"
        shutil.copy(bins["nopie"], replacement)
        os.replace(replacement, lib)
        sym = _symbolizer(proc.pid)
        assert sym.resolve(func) == "tramprof_lib_func"


@needs_root
def test_memfd_library_in_own_process(bins: dict[str, Path]) -> None:
    fd = os.memfd_create("tramprof unit lib")
    try:
        os.write(fd, bins["lib"].read_bytes())
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
        addr = ctypes.cast(lib.tramprof_lib_func, ctypes.c_void_p).value
        assert addr is not None
        sym = _symbolizer(os.getpid())
        m = sym.mapping_for(addr)
        assert m is not None and m.is_memfd
        assert sym.resolve(addr) == "tramprof_lib_func"
    finally:
        os.close(fd)


def _own_vdso() -> tuple[int, bytes]:
    libc = ctypes.CDLL(None)
    libc.getauxval.restype = ctypes.c_ulong
    libc.getauxval.argtypes = [ctypes.c_ulong]
    base = int(libc.getauxval(33))  # AT_SYSINFO_EHDR
    if not base:
        pytest.skip("this process has no vdso")
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith("[vdso]"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            return base, ctypes.string_at(base, end - start)
    pytest.skip("no [vdso] line in /proc/self/maps")


def test_vdso_of_own_process(tmp_path: Path) -> None:
    base, image = _own_vdso()
    dump = tmp_path / "vdso.so"
    dump.write_bytes(image)
    vaddr = _funcs(dump, dynamic=True)["__vdso_clock_gettime"]
    seg_off, seg_vaddr, _ = _exec_load(dump)
    addr = base + vaddr - seg_vaddr + seg_off
    cache = ElfCache()
    sym = ProcessSymbolizer(os.getpid(), cache, SymbolizationStats())
    assert sym.resolve(addr) == "__vdso_clock_gettime"
    assert sym.resolve(addr + 1) == "__vdso_clock_gettime"
    assert sym.stats.total() == 0
    # Another symbolizer of the same vdso reuses the parsed image.
    misses = cache.misses
    assert ProcessSymbolizer(os.getpid(), cache).resolve(addr) == "__vdso_clock_gettime"
    assert cache.misses == misses


VDSO_BASE_PRINTER = (
    "import ctypes, sys\n"
    "libc = ctypes.CDLL(None)\n"
    "libc.getauxval.restype = ctypes.c_ulong\n"
    "libc.getauxval.argtypes = [ctypes.c_ulong]\n"
    "print(hex(libc.getauxval(33)), flush=True)\n"
    "sys.stdin.read()\n")


def test_vdso_frames_of_64_bit_processes_are_named_from_the_daemons_own_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel gives every 64-bit process the same vdso: it is read once,
    from the daemon's own memory, and no other process's memory is read for
    it (even after the process exited)."""
    _base, image = _own_vdso()
    dump = tmp_path / "vdso.so"
    dump.write_bytes(image)
    vaddr = _funcs(dump, dynamic=True)["__vdso_clock_gettime"]
    seg_off, seg_vaddr, _ = _exec_load(dump)
    cache = ElfCache()
    kernel_vdso = read_kernel_vdso(cache)
    assert kernel_vdso is not None and kernel_vdso.size == len(image)
    assert read_kernel_vdso(cache, str(tmp_path)) is None  # not a live /proc

    def no_memory_reads(*args: object) -> bytes:
        raise AssertionError("read another process's memory")

    monkeypatch.setattr(usersyms_module, "read_memory", no_memory_reads)
    with running("python3", "-c", VDSO_BASE_PRINTER) as (proc, (base,)):
        sym = ProcessSymbolizer(proc.pid, cache, kernel_vdso=kernel_vdso)
        sym.preload()
        vdso = next(m for m in sym.mappings if m.is_vdso)
        proc.kill()
        proc.wait()
        addr = base + vaddr - seg_vaddr + seg_off
        assert sym.resolve(addr) == "__vdso_clock_gettime"
        assert sym.stats.total() == 0
    # Only an image as large, and out of a 32-bit process's reach.
    assert kernel_vdso.serves(vdso)
    assert not kernel_vdso.serves(vdso._replace(end=vdso.start + 2 * vdso.size))
    assert not kernel_vdso.serves(vdso._replace(start=0xF7FC0000, end=0xF7FC0000 + vdso.size))


def test_anonymous_exec_memory_and_maps_refresh() -> None:
    sym_stale = _symbolizer(os.getpid(), maps_refresh_interval=3600.0)
    seen: list[tuple[Mapping, int]] = []

    def jit(m: Mapping, addr: int) -> str | None:
        seen.append((m, addr))
        return "jit:compiled_fn"

    sym = _symbolizer(os.getpid(), anon_resolver=jit, maps_refresh_interval=0.0)
    assert sym.mappings and sym_stale.mappings  # maps read before the region exists
    region = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    try:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(region)) + 16
        assert sym.is_anonymous_exec(addr)
        assert sym.resolve(addr) == "jit:compiled_fn"
        assert seen[0][1] == addr and seen[0][0].contains(addr)
        assert sym_stale.resolve(addr) == "[unknown]"  # not re-read within the interval
        assert sym_stale.stats["no_mapping"] == 1
        plain = _symbolizer(os.getpid())
        assert plain.resolve(addr) == "[anon]"
        assert plain.stats["anon_unresolved"] == 1
    finally:
        del seen[:]
        region.close()


def test_maps_read_before_the_samples_were_taken_are_read_again_at_a_miss() -> None:
    """Memory mapped after the maps were read, where a sample then ran, is
    found: a read from before the samples answers a miss with one re-read,
    whatever the interval, and a read from after them waits for it."""
    horizon = SampleHorizon()
    sym = _symbolizer(os.getpid(), anon_resolver=lambda _m, _a: "jit:made_since",
                      maps_refresh_interval=3600.0, horizon=horizon)
    assert sym.mappings  # read before the region exists
    region = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    try:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(region)) + 16
        horizon.taken_by = time.monotonic()  # a sample ran there; it was drained
        generation = sym.maps_generation
        assert sym.resolve(addr) == "jit:made_since"
        assert sym.maps_generation == generation + 1
        # Read since the samples were taken: a miss waits for the interval.
        never_mapped = 8
        assert sym.resolve(never_mapped) == "[unknown]"
        assert sym.maps_generation == generation + 1
    finally:
        region.close()


# -- synthetic /proc tree ------------------------------------------------------


@pytest.fixture
def fake_proc(bins: dict[str, Path], tmp_path: Path) -> tuple[str, int, dict[str, int]]:
    """A /proc/4242 whose root holds the PIE target at a path with spaces.

    Returns (proc_root, pid, addresses by name). There is no map_files and
    no mem, like a process whose private files we may not open.
    """
    pid = 4242
    proc = tmp_path / "proc" / str(pid)
    exe_path = "/opt/my app/target bin"
    exe = proc / "root" / exe_path.lstrip("/")
    exe.parent.mkdir(parents=True)
    shutil.copy(bins["pie"], exe)
    junk = proc / "root" / "junk.bin"
    junk.write_bytes(b"#!/bin/sh\n" * 100)
    fifo = proc / "root" / "pipe"
    os.mkfifo(fifo)
    (proc / "stat").write_text(f"{pid} (target bin) S 1 1 1 0 -1\n")

    seg_off, seg_vaddr, filesz = _exec_load(bins["pie"])
    start = BASE + (seg_vaddr & ~0xFFF)
    end = start + ((filesz + (seg_vaddr & 0xFFF) + 0xFFF) & ~0xFFF)
    ino = exe.stat().st_ino
    lines = [
        f"{start:x}-{end:x} r-xp {seg_off & ~0xFFF:08x} fe:00 {ino}  {exe_path}",
        f"{end:x}-{end + 0x1000:x} rw-p 00000000 00:00 0 ",
        f"600000000000-600000001000 r-xp 00000000 fe:00 {junk.stat().st_ino}  /junk.bin",
        f"600000001000-600000002000 r-xp 00000000 fe:00 {ino + 1}  /opt/my app/target bin",
        "600000003000-600000004000 rwxp 00000000 00:00 0  [anon:jit]",
        f"600000005000-600000006000 r-xp 00000000 fe:00 {fifo.stat().st_ino}  /pipe",
        "7ffd1b7d6000-7ffd1b7d8000 r-xp 00000000 00:00 0  [vdso]",
        "ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0  [vsyscall]",
    ]
    (proc / "maps").write_text("\n".join(lines) + "\n")
    addrs = {name: BASE + v for name, v in _funcs(bins["pie"]).items()}
    addrs["data"] = end + 8
    return str(tmp_path / "proc"), pid, addrs


def test_container_root_path_with_spaces(fake_proc: tuple[str, int, dict[str, int]]) -> None:
    root, pid, addrs = fake_proc
    sym = _symbolizer(pid, proc_root=root)
    assert sym.resolve(addrs["tramprof_unit_leaf"]) == "tramprof_unit_leaf"
    assert sym.resolve(addrs["main"] + 2) == "main"
    assert sym.stats.total() == 0


def test_fallbacks_are_printable_and_counted(fake_proc: tuple[str, int, dict[str, int]]) -> None:
    root, pid, addrs = fake_proc
    sym = _symbolizer(pid, proc_root=root)
    assert sym.resolve(0x600000000010) == "junk.bin+0x10"  # not ELF
    assert sym.resolve(0x600000001020) == "target bin+0x20"  # inode mismatch, no map_files
    assert sym.resolve(0x600000003000) == "[anon]"
    assert sym.resolve(0x7FFD1B7D6010) == "[vdso]+0x10"  # no /proc/PID/mem
    assert sym.resolve(0xFFFFFFFFFF600400) == "[vsyscall]"
    assert sym.resolve(addrs["data"]) == "[unknown]"  # not executable
    assert sym.resolve(0x10) == "[unknown]"
    assert sym.stats.snapshot() == {
        "not_elf": 1,
        "file_unreadable": 1,
        "anon_unresolved": 1,
        "vdso_unreadable": 1,
        "not_executable": 1,
        "no_mapping": 1,
    }
    assert sym.is_anonymous_exec(0x600000003000)
    assert not sym.is_anonymous_exec(addrs["main"])
    assert not sym.is_anonymous_exec(0x10)


def test_fifo_at_mapped_path_is_not_opened_for_reading(
    fake_proc: tuple[str, int, dict[str, int]],
) -> None:
    root, pid, _ = fake_proc
    sym = _symbolizer(pid, proc_root=root)
    assert sym.resolve(0x600000005010) == "pipe+0x10"  # and did not block
    assert sym.stats.snapshot() == {"file_unreadable": 1}


def test_anon_resolver_exception_degrades(fake_proc: tuple[str, int, dict[str, int]]) -> None:
    root, pid, _ = fake_proc

    def broken(m: Mapping, addr: int) -> str | None:
        raise RuntimeError("perf map parse failed")

    sym = _symbolizer(pid, proc_root=root, anon_resolver=broken)
    assert sym.resolve(0x600000003000) == "[anon]"
    assert sym.stats["anon_resolver_error"] == 1


def test_unreadable_maps(tmp_path: Path) -> None:
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "stat").write_text("9 (x) S 1\n")
    (tmp_path / "9" / "maps").write_text("garbage\n")
    sym = _symbolizer(9, proc_root=str(tmp_path))
    assert sym.resolve(0x1000) == "[unknown]"
    assert sym.stats.snapshot() == {"maps_unreadable": 1}


# -- stripped objects: separate debug files, demangling ----------------------------


@pytest.fixture(scope="module")
def split_cxx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A stripped C++ program next to its debug file (found by .gnu_debuglink),
    and a copy next to a debug file that fails the CRC."""
    if shutil.which("g++") is None or shutil.which("objcopy") is None:
        pytest.skip("needs g++ and objcopy to build a program with a separate debug file")
    d = tmp_path_factory.mktemp("splitbins")
    full = d / "cxx_full"
    _run("g++", *CFLAGS, "-g", "-o", full, CSRC / "cxx_target.cc")
    out = {"full": full}
    for variant in ("good", "bad"):
        (d / variant).mkdir()
        exe, debug = d / variant / "cxx", d / variant / "cxx.debug"
        _run("objcopy", "--only-keep-debug", full, debug)
        _run("strip", "--strip-all", "-o", exe, full)
        _run("objcopy", f"--add-gnu-debuglink={debug}", exe)
        out[variant] = exe
    with open(d / "bad" / "cxx.debug", "ab") as f:
        f.write(b"\0")
    return out


def _mangled_at(path: Path, vaddr: int) -> str:
    for line in _run("readelf", "-W", "--syms", path).splitlines():
        parts = line.split()
        if len(parts) == 8 and parts[3] == "FUNC" and int(parts[1], 16) == vaddr:
            return parts[7]
    raise AssertionError(f"no function at {vaddr:#x} in {path}")


def test_live_stripped_program_named_from_its_debug_file_and_demangled(
        split_cxx: dict[str, Path]) -> None:
    from tramprof.symbols.debuginfo import DebugInfo
    from tramprof.symbols.demangle import Demangler

    demangler = Demangler()
    try:
        with running(split_cxx["good"]) as (proc, addrs):
            sym = ProcessSymbolizer(proc.pid, ElfCache(), SymbolizationStats(),
                                    debug_info=DebugInfo(), demangler=demangler)
            names = [sym.resolve(a) for a in addrs]
            bare = _symbolizer(proc.pid)  # without the debug file: offsets only
            assert all(bare.resolve(a).startswith("cxx+0x") for a in addrs)
        seg_off, seg_vaddr, _ = _exec_load(split_cxx["full"])
        exe = next(m for m in sym.mappings if m.is_exec and m.path.endswith("/good/cxx"))
        mangled = [_mangled_at(split_cxx["full"], a - exe.start + exe.offset - seg_off + seg_vaddr)
                   for a in addrs]
        expected = _run("c++filt", *mangled).splitlines()
        assert names == expected
        assert names[1:] == ["(anonymous namespace)::hidden_helper(int)",
                             "tramprof_unit_c_static_like"]
        assert sym.stats.total() == 0
    finally:
        demangler.close()


def test_a_name_left_mangled_is_not_shared(split_cxx: dict[str, Path]) -> None:
    """A process whose demangler was unavailable keeps the mangled name; the
    next process demangles it for itself."""
    from tramprof.symbols.debuginfo import DebugInfo
    from tramprof.symbols.demangle import Demangler

    unavailable, working = Demangler(max_restarts=0), Demangler()
    cache = ElfCache()
    try:
        with running(split_cxx["good"]) as (proc, addrs):
            first = ProcessSymbolizer(proc.pid, cache, SymbolizationStats(),
                                      debug_info=DebugInfo(), demangler=unavailable)
            assert first.resolve(addrs[1]).startswith("_Z")
            second = ProcessSymbolizer(proc.pid, cache, SymbolizationStats(),
                                       debug_info=DebugInfo(), demangler=working)
            assert second.resolve(addrs[1]) == "(anonymous namespace)::hidden_helper(int)"
            assert first.resolve(addrs[2]) == "tramprof_unit_c_static_like"  # not mangled
    finally:
        unavailable.close()
        working.close()


def test_debug_file_failing_its_crc_is_refused_and_counted(split_cxx: dict[str, Path]) -> None:
    from tramprof.symbols.debuginfo import DebugInfo

    with running(split_cxx["bad"]) as (proc, (_describe, hidden, _c)):
        sym = ProcessSymbolizer(proc.pid, ElfCache(), SymbolizationStats(),
                                debug_info=DebugInfo())
        assert sym.resolve(hidden).startswith("cxx+0x")
        assert sym.resolve(hidden + 1).startswith("cxx+0x")
    assert sym.stats.snapshot() == {"debug_file_crc_mismatch": 1, "no_symbol": 2}


def test_image_forgets_names_by_address_when_a_file_mapping_goes(tmp_path: Path) -> None:
    """Names from files are cached by address until a file mapping goes
    away: a file unmapped and another mapped at the same address (dlclose
    and dlopen, or a hostile process) is named as the new file; an address
    in a mapping without code is never cached."""
    from tramprof.symbols.images import ProcessImage

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    paths = []
    for name in ("first_code", "second_code"):
        path = tmp_path / name
        path.write_bytes(b"\xeb\xfe" + bytes(4094))  # not ELF: named by file and offset
        paths.append(path)

    def map_at(path: Path, address: int | None, prot: int) -> int:
        fd = os.open(path, os.O_RDONLY)
        try:
            flags = mmap.MAP_PRIVATE | (0x10 if address else 0)  # MAP_FIXED
            at = libc.mmap(address, 4096, prot, flags, fd, 0)
        finally:
            os.close(fd)
        assert at not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        return at

    image = ProcessImage(ProcessSymbolizer(os.getpid(), ElfCache()))
    address = map_at(paths[0], None, mmap.PROT_READ)
    try:
        image.symbolizer.reload_maps()
        assert image.resolve(address + 8) == "[unknown]"  # no code here...
        map_at(paths[0], address, mmap.PROT_READ | mmap.PROT_EXEC)
        image.symbolizer.reload_maps()
        assert image.resolve(address + 8) == "first_code+0x8"  # ...until there is
        libc.munmap(address, 4096)
        map_at(paths[1], address, mmap.PROT_READ | mmap.PROT_EXEC)
        assert image.resolve(address + 8) == "first_code+0x8"  # maps not read again yet
        image.symbolizer.reload_maps()
        assert image.resolve(address + 8) == "second_code+0x8"
        # Mappings without code coming and going (data, the heap) keep the cache.
        generation = image.symbolizer.files_generation
        data = map_at(paths[0], None, mmap.PROT_READ)
        image.symbolizer.reload_maps()
        libc.munmap(data, 4096)
        image.symbolizer.reload_maps()
        assert image.symbolizer.files_generation == generation
    finally:
        libc.munmap(address, 4096)
