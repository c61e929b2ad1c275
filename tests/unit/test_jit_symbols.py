"""Where and when a process's perf map is trusted (fixture /proc trees)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tramprof.procfs.maps import Mapping
from tramprof.symbols.horizon import SampleHorizon
from tramprof.symbols.jit import MTIME_SLACK_NS, JitLimits, JitSymbols, boot_time_realtime_ns

ANON = Mapping(0x7000, 0x9000, "r-xp", 0, 0, 0, 0, "")


def fake_process(proc: Path, pid: int, nstgid: list[int], uid: int | None = None) -> Path:
    uid = os.geteuid() if uid is None else uid
    (proc / str(pid) / "root" / "tmp").mkdir(parents=True)
    (proc / str(pid) / "status").write_text(
        f"Name:\tapp\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t0\t0\t0\t0\n"
        f"NStgid:\t{' '.join(map(str, nstgid))}\n")
    return proc / str(pid) / "root" / "tmp"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_container_process_uses_its_own_tmp_and_namespace_pid(tmp_path):
    tmp = fake_process(tmp_path, 4242, [4242, 7])
    (tmp / "perf-4242.map").write_text("7000 10 host_pid_named_file\n")
    (tmp / "perf-7.map").write_text("7000 10 py::handler:/app/main.py\n")
    jit = JitSymbols(4242, proc_root=str(tmp_path))
    assert jit.resolve(ANON, 0x7008) == "py::handler:/app/main.py"
    assert jit.perf_map.path.endswith("/4242/root/tmp/perf-7.map")


def test_no_fallback_to_the_hosts_tmp(tmp_path):
    fake_process(tmp_path, 4242, [4242, 7])
    jit = JitSymbols(4242, proc_root=str(tmp_path))
    assert jit.resolve(ANON, 0x7008) is None
    [perf_map, jitdump] = jit.report()
    assert perf_map.refused == "missing" and not perf_map.used
    assert jitdump.refused == "missing"


def test_the_status_is_read_at_the_first_lookup_of_jit_code(tmp_path):
    """A process whose JIT code is never sampled costs no status read; one
    gone by its first lookup names nothing and is not read again."""
    (tmp_path / "4242" / "root" / "tmp").mkdir(parents=True)
    jit = JitSymbols(4242, proc_root=str(tmp_path))
    assert jit.sources() == () and jit.memory_bytes() == 0
    # Written after the reader was made: the namespace pid is the one it reads.
    tmp = fake_process(tmp_path, 4243, [4243, 9])
    (tmp / "perf-9.map").write_text("7000 10 inner_named\n")
    (tmp_path / "4243" / "status").rename(tmp_path / "4242" / "status")
    assert jit.resolve(ANON, 0x7008) is None  # /4242/root/tmp has no perf-9.map
    assert jit.perf_map.path.endswith("/4242/root/tmp/perf-9.map")
    assert [kind for kind, _reader in jit.sources()] == ["perf_map", "jitdump"]

    gone = JitSymbols(4244, proc_root=str(tmp_path))
    assert gone.resolve(ANON, 0x7008) is None and gone.unavailable
    (tmp_path / "4244" / "root" / "tmp").mkdir(parents=True)
    (tmp_path / "4242" / "status").rename(tmp_path / "4244" / "status")
    assert gone.resolve(ANON, 0x7008) is None and gone.sources() == ()
    assert gone.debug_info(0x7008) is None


def test_miss_rereads_at_most_once_per_interval(tmp_path):
    tmp = fake_process(tmp_path, 10, [10])
    path = tmp / "perf-10.map"
    path.write_text("7000 10 first\n")
    clock = Clock()
    jit = JitSymbols(10, proc_root=str(tmp_path), clock=clock,
                     limits=JitLimits(refresh_interval=1.0))
    assert jit.resolve(ANON, 0x7000) == "first"
    with path.open("a") as f:
        f.write("8000 10 created_later\n")
    assert jit.resolve(ANON, 0x8000) is None  # just read: no re-read yet
    clock.now += 1.5
    assert jit.resolve(ANON, 0x8000) == "created_later"
    assert (jit.lookups, jit.resolved) == (3, 2)


def test_miss_rereads_files_read_before_the_samples_were_taken(tmp_path):
    """A runtime switched on a moment after a read writes entries for the
    functions called since: a sample of one, named within the interval, is
    named from one re-read, and a read from after the samples waits for the
    interval again."""
    tmp = fake_process(tmp_path, 12, [12])
    path = tmp / "perf-12.map"
    path.write_text("7000 10 first\n")
    clock, horizon = Clock(), SampleHorizon()
    jit = JitSymbols(12, proc_root=str(tmp_path), clock=clock, horizon=horizon,
                     limits=JitLimits(refresh_interval=1.0))
    assert jit.resolve(ANON, 0x7000) == "first"
    with path.open("a") as f:
        f.write("8000 10 called_since\n")
    clock.now += 0.2
    horizon.taken_by = clock.now  # a sample ran it, then was drained
    clock.now += 0.1
    assert jit.resolve(ANON, 0x8000) == "called_since"
    with path.open("a") as f:
        f.write("9000 10 called_after_the_samples\n")
    assert jit.resolve(ANON, 0x9000) is None
    clock.now += 1.0
    assert jit.resolve(ANON, 0x9000) == "called_after_the_samples"


def refused_stale_map(proc: Path, pid: int, text: str) -> tuple[Path, JitSymbols, Clock]:
    """A perf map written by an earlier process with ``pid``, and the reader
    of the process started since, which has refused it as stale."""
    path = fake_process(proc, pid, [pid]) / f"perf-{pid}.map"
    path.write_text(text)
    started_ns = time.time_ns() - boot_time_realtime_ns()  # "now", in CLOCK_BOOTTIME
    old = (time.time_ns() - 10 * MTIME_SLACK_NS) / 1e9
    os.utime(path, (old, old))
    clock = Clock()
    jit = JitSymbols(pid, started_ns, proc_root=str(proc), clock=clock)
    assert jit.resolve(ANON, 0x7000) is None
    assert jit.report()[0].refused == "stale"
    return path, jit, clock


def test_stale_file_from_an_earlier_process_is_skipped(tmp_path):
    path, jit, clock = refused_stale_map(tmp_path, 11, "7000 100 stale_name\n")
    # The new process appends to the same file (CPython never truncates):
    # only its own lines count, the earlier process's prefix stays ignored.
    with path.open("a") as f:
        f.write("7040 10 fresh_name\n")
    clock.now += 5
    assert jit.resolve(ANON, 0x7040) == "fresh_name"
    assert jit.resolve(ANON, 0x7000) is None
    assert jit.perf_map.stats.refused["stale"] >= 1


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    """A directory on a disk file system (/var/tmp; /tmp may be a tmpfs,
    which never hands a freed inode number out again at once)."""
    path = Path(tempfile.mkdtemp(prefix="tramprof-test-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("fresh_lines", [1, 4])
def test_a_new_file_that_got_the_stale_files_inode_number_is_read_whole(disk_dir, fresh_lines):
    """A runtime that replaces a stale file (unlink, then an exclusive
    create, as the trampoline runtime does) makes a new file that ext4 gives
    the freed inode number: none of its lines are the earlier process's,
    whether it is shorter or longer than the stale one was."""
    path, jit, clock = refused_stale_map(
        disk_dir, 13, "".join(f"{0x9000 + 16 * i:x} 10 stale_{i}\n" for i in range(2)))
    stale_inode = path.stat().st_ino
    path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, "".join(f"{0x7000 + 16 * i:x} 10 fresh_{i}\n"
                         for i in range(fresh_lines)).encode())
    os.close(fd)
    if path.stat().st_ino != stale_inode:
        pytest.skip("this file system gave the new file another inode number")
    clock.now += 5
    assert [jit.resolve(ANON, 0x7000 + 16 * i) for i in range(fresh_lines)] == \
        [f"fresh_{i}" for i in range(fresh_lines)]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a file owned by another uid")
def test_file_owned_by_another_user_is_refused(tmp_path):
    tmp = fake_process(tmp_path, 12, [12], uid=1000)
    path = tmp / "perf-12.map"
    path.write_text("7000 10 planted\n")
    os.chown(path, 2000, 2000)
    jit = JitSymbols(12, proc_root=str(tmp_path))
    assert jit.resolve(ANON, 0x7000) is None
    assert jit.report()[0].refused == "foreign_owner"
    os.chown(path, 1000, 1000)  # the process's own uid: trusted
    jit = JitSymbols(12, proc_root=str(tmp_path))
    assert jit.resolve(ANON, 0x7000) == "planted"


def test_memory_budget_evicts_the_least_recently_sampled_index(tmp_path):
    from tramprof.symbols.images import JitTotals, ProcessImage, evict_to_budget

    clock = Clock()
    readers = []
    for pid in (21, 22, 23):
        tmp = fake_process(tmp_path, pid, [pid])
        (tmp / f"perf-{pid}.map").write_text(
            "".join(f"{0x7000 + i * 16:x} 10 py::f{i}:/srv/app/a_rather_long_module_name.py\n"
                    for i in range(200)))
        jit = JitSymbols(pid, proc_root=str(tmp_path), clock=clock,
                         limits=JitLimits(evicted_backoff=600))
        clock.now += 1
        assert jit.resolve(ANON, 0x7008) == "py::f0:/srv/app/a_rather_long_module_name.py"
        jit.note_use()  # what each drain does: lookups since the last one date the index
        readers.append(jit)
    sizes = [jit.memory_bytes() for jit in readers]
    assert all(size > 200 * 80 for size in sizes)
    clock.now += 1
    readers[0].resolve(ANON, 0x7008)  # pid 21 sampled again: now the newest
    total, evicted = evict_to_budget(readers, budget=sum(sizes) - 1)
    assert evicted == 1 and total == sizes[0] + sizes[2]
    assert readers[1].memory_bytes() == 0 and readers[1].evictions == 1
    # The evicted process's JIT frames stay unnamed during the back-off, without
    # re-reading the file at every miss; then the index is built again.
    assert readers[1].resolve(ANON, 0x7008) is None and readers[1].memory_bytes() == 0
    clock.now += 601
    assert readers[1].resolve(ANON, 0x7008) is not None
    # Counters of the dropped reader are kept: totals never go down.
    totals = JitTotals()
    totals.add_image(ProcessImage(symbolizer=None, jit=readers[1]), live=True)
    assert totals.counters[("perf_map", "lines_parsed")] == 400


def jit_image(tmp_path: Path, pid: int, perf_map: str, perms: str = "r-xp"):
    """A process image of a fake process with one anonymous mapping
    (executable unless ``perms`` say otherwise) and a perf map: (image, its
    JIT reader, perf map path, clock)."""
    from tramprof.symbols.elf import ElfCache
    from tramprof.symbols.images import ProcessImage
    from tramprof.symbols.usersyms import ProcessSymbolizer, SymbolizationStats

    tmp = fake_process(tmp_path, pid, [pid])
    (tmp_path / str(pid) / "maps").write_text(f"7000-9000 {perms} 00000000 00:00 0\n")
    path = tmp / f"perf-{pid}.map"
    path.write_text(perf_map)
    clock = Clock()
    jit = JitSymbols(pid, proc_root=str(tmp_path), clock=clock,
                     limits=JitLimits(refresh_interval=1.0))
    symbolizer = ProcessSymbolizer(pid, ElfCache(), SymbolizationStats(),
                                   proc_root=str(tmp_path), anon_resolver=jit.resolve)
    return ProcessImage(symbolizer, jit), jit, path, clock


def test_image_caches_jit_names_only_until_the_files_are_read_again(tmp_path):
    """A name found in anonymous memory is reused until the JIT files are read
    again: the same answer the lookup would give, at one dict lookup."""
    image, jit, path, clock = jit_image(tmp_path, 30, "7000 10 first\n")
    looked_up = []
    lookup = jit.perf_map.lookup
    jit.perf_map.lookup = lambda addr: looked_up.append(addr) or lookup(addr)  # type: ignore[method-assign]
    assert [image.resolve(0x7008) for _ in range(3)] == ["first"] * 3
    assert looked_up == [0x7008, 0x7008]  # read with the first lookup, cached after the second
    assert (jit.lookups, jit.resolved) == (3, 3)  # cached answers still date the index

    # A miss is not cached: counted, and looked up again once the file may have grown.
    assert image.resolve(0x8008) == "[anon]"
    with path.open("a") as f:
        f.write("8000 10 created_later\n7000 10 recreated\n")
    assert image.resolve(0x8008) == "[anon]"
    assert image.resolve(0x7008) == "first"  # the index is not read again on a hit...
    clock.now += 1.5
    assert image.resolve(0x8008) == "created_later"  # ...but on a miss, and then
    assert image.resolve(0x7008) == jit.perf_map.lookup(0x7008) == "recreated"


def test_image_keeps_jit_names_while_nothing_they_depend_on_changed(tmp_path):
    """A miss re-reads the JIT files once a second; a read that finds nothing
    new, and maps that changed only in data (a heap, a Python's memory
    arenas), keep the names found (a node process misses in every drain),
    and so do new entries elsewhere (it appends some all the time). An entry
    over a name found, or a change of the executable mappings, drops it."""
    image, jit, path, clock = jit_image(tmp_path, 33, "7000 10 first\n")
    assert image.symbolizer is not None
    symbolizer = image.symbolizer
    maps = tmp_path / "33" / "maps"
    looked_up = []
    lookup = jit.perf_map.lookup
    jit.perf_map.lookup = lambda addr: looked_up.append(addr) or lookup(addr)  # type: ignore[method-assign]

    def looked_up_again() -> bool:
        del looked_up[:]
        assert image.resolve(0x7008) == "first"
        return 0x7008 in looked_up

    assert image.resolve(0x7008) == "first" and looked_up_again()  # cached from here
    assert not looked_up_again()
    epoch = jit.epoch
    clock.now += 1.5
    assert image.resolve(0x8008) == "[anon]"  # the miss read the file again: nothing new
    assert jit.epoch == epoch and jit.last_results is not None
    assert not looked_up_again()

    maps.write_text("7000-9000 r-xp 00000000 00:00 0\n"
                    "a000-c000 rw-p 00000000 00:00 0\n")
    symbolizer.reload_maps()
    assert not looked_up_again()  # data mappings came: the code is where it was
    maps.write_text("7000-9000 r-xp 00000000 00:00 0\n"
                    "a000-c000 rw-p 00000000 00:00 0\n"
                    "d000-e000 r-xp 00000000 00:00 0\n")
    symbolizer.reload_maps()
    assert looked_up_again()  # new code: looked up once more, then cached
    assert not looked_up_again()
    maps.write_text("7000-9000 rw-p 00000000 00:00 0\n"
                    "a000-c000 rw-p 00000000 00:00 0\n"
                    "d000-e000 r-xp 00000000 00:00 0\n")
    symbolizer.reload_maps()
    assert looked_up_again()  # the code's pages made writable (V8 patching it)

    assert not looked_up_again()
    with path.open("a") as f:
        f.write("d000 10 created_later\n")
    clock.now += 1.5
    assert image.resolve(0xd008) == "created_later"  # the miss read again: a new entry
    assert jit.epoch == epoch and not jit.changes  # only 0xd000-0xd00f was forgotten
    assert not looked_up_again()  # a name found outside its range stays
    assert image.resolve(0xd008) == "created_later"  # cached from here

    with path.open("a") as f:
        f.write("7008 4 over_it\n")
    clock.now += 1.5
    assert image.resolve(0xd020) == "[anon]"  # the miss read again: an entry over 0x7008
    assert jit.epoch == epoch and not jit.changes  # only 0x7008-0x700b
    del looked_up[:]
    assert image.resolve(0x7008) == "over_it" and looked_up == [0x7008]
    assert image.resolve(0xd008) == "created_later" and looked_up == [0x7008]  # kept


def test_jit_code_the_maps_show_writable_is_named_from_the_perf_map(tmp_path):
    """A JIT writes code into writable pages and makes them executable later
    (V8 also flips them back to patch or move code), so maps read before show
    code the samples ran in as writable. What the perf map names there is the
    answer, cached as JIT code is; what it does not name stays not code."""
    from tramprof.model import FrameSource

    image, jit, _path, _clock = jit_image(tmp_path, 32, "7000 10 compiled\n", perms="rw-p")
    assert image.symbolizer is not None
    stats = image.symbolizer.stats
    looked_up = []
    lookup = jit.perf_map.lookup
    jit.perf_map.lookup = lambda addr: looked_up.append(addr) or lookup(addr)  # type: ignore[method-assign]
    assert image.name_frames([0x7008, 0x8008])[0] == ["compiled", "[unknown]"]
    # From the stack after the one that read the perf map, a named address is
    # cached (one object per address); the unnamed one is looked up each time.
    names, sources = image.name_frames([0x7008, 0x8008, 0x7008])
    assert names == ["compiled", "[unknown]", "compiled"]
    assert sources[0] is sources[2] and sources[0] == FrameSource(0x7008)
    assert sources[1] == FrameSource(0x8008)  # an address, in no mapping of code
    assert image.name_frames([0x7008])[0] == ["compiled"]
    assert looked_up == [0x7008, 0x8008, 0x7008, 0x8008]
    assert stats.snapshot() == {"not_executable": 2}


def test_image_names_a_whole_stack_as_one_lookup_at_a_time_would(tmp_path):
    """``name_frames`` answers from the caches in bulk and looks up the rest
    one by one: the names, locations and counters of ``resolve`` and
    ``locate``, and misses looked up again at every stack."""
    from tramprof.model import FrameSource

    image, jit, path, clock = jit_image(tmp_path, 31, "7000 10 first\n7010 10 second\n")
    assert image.symbolizer is not None
    stats = image.symbolizer.stats
    stack = [0x7008, "[marker]", 0x8008, 0x7018, 0x7008]
    names, sources = image.name_frames(stack)
    assert names == ["first", "[marker]", "[anon]", "second", "first"]
    assert sources == [FrameSource(0x7008), None, FrameSource(0x8008), FrameSource(0x7018),
                       FrameSource(0x7008)]
    assert image.name_frames(stack) == (names, sources)
    # One object per address, shared by every stack that has it (from the
    # stack after the one that read the perf map).
    _, again = image.name_frames(stack)
    assert all(a is b for a, b in zip(again, image.name_frames(stack)[1], strict=True))
    # Four stacks of four JIT frames: every one counts as a lookup (cached
    # ones date the index too); the miss is counted as unresolved each time.
    assert (jit.lookups, jit.resolved) == (16, 12)
    assert stats["anon_unresolved"] == 4

    with path.open("a") as f:
        f.write("8000 10 created_later\n7000 10 recreated\n")
    clock.now += 1.5
    # The miss reads the file again; the stack it is in keeps the names it
    # was begun with, the next one has the new ones.
    assert image.name_frames(stack)[0] == ["first", "[marker]", "created_later", "second",
                                           "first"]
    assert image.name_frames(stack)[0] == ["recreated", "[marker]", "created_later", "second",
                                           "recreated"]
