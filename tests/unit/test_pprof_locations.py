"""Where frames' code is, from the pipeline to pprof: located frames (sources
parallel to the folded frames), a real process image's mappings and build
ids, and the pprof Mapping / Location / Function tables built from them."""

from __future__ import annotations

import ctypes
import gc
import gzip
import os
import random
import subprocess
import time
import tracemalloc
from collections import Counter

from tramprof.export.formats.folded import folded_line
from tramprof.export.formats.pprof import ProfileMessage, encode_pprof, python_name
from tramprof.model import (
    KERNEL_LOST,
    NATIVE_GAP,
    TRUNCATED,
    FrameSource,
    MappedFile,
    Profile,
    RawSample,
    Stack,
    merge,
)
from tramprof.pipeline.frames import KERNEL_MAPPING, located_frames, stack_frames
from tramprof.procfs.identity import read_stat
from tramprof.procfs.maps import read_maps
from tramprof.sampler import layout as bpf_layout
from tramprof.symbols.elf import ElfCache, read_build_id
from tramprof.symbols.images import CACHED_ADDRESS_BYTES, ProcessImage, ProcessRegistry
from tramprof.symbols.usersyms import ProcessSymbolizer
from tramprof.unwind.arenas import Arenas

USER = {0x1000: "leaf", 0x1fff: "mid", 0x2fff: "root", 0x9000: "py::outer:/app/a.py",
        0x9050: "py::inner:/app/a.py"}
KERNEL = {0xffff0010: "vfs_read", 0xffff001f: "ksys_read"}
LIB = MappedFile("/usr/lib/libx.so", 0x1000, 0x3000, 0x1000, "ab12")


def sample(**kw) -> RawSample:
    base = dict(tgid=1, start_boottime_ns=0, exec_id=0, comm="t",
                user_frames=((0x1000, 0x10), (0x2000, 0x20), (0x3000, 0x30)),
                user_flags=0, kernel_ips=(0xffff0010, 0xffff0020), kernel_error=0,
                trampoline_frames=(), count=3)
    base.update(kw)
    # Written as (ip, stack address) pairs, leaf first.
    frames = base.pop("user_frames")
    base["user_ips"] = tuple(ip for ip, _sp in frames)
    base["user_sps"] = tuple(sp for _ip, sp in frames)
    return RawSample(**base)


def locate(addr: int) -> FrameSource:
    return FrameSource(addr, None if addr >= 0x9000 else LIB)


def test_sources_run_parallel_to_the_folded_frames():
    failures: Counter[str] = Counter()
    frames, sources = located_frames(sample(), USER.__getitem__, locate, KERNEL.get, failures)
    assert frames == stack_frames(sample(), USER.__getitem__, KERNEL.get, Counter())
    assert frames == ("root", "mid", "leaf", "ksys_read", "vfs_read")
    # Callers at their return address minus one, as they were named.
    assert sources == (FrameSource(0x2fff, LIB), FrameSource(0x1fff, LIB),
                       FrameSource(0x1000, LIB), FrameSource(0xffff001f, KERNEL_MAPPING),
                       FrameSource(0xffff0010, KERNEL_MAPPING))


def test_markers_have_no_source():
    failures: Counter[str] = Counter()
    s = sample(user_frames=((0x1000, 0x100), (0x9033, 0x1f0)),
               trampoline_frames=((0x9050, 0x200), (0x9000, 0x400)),
               user_flags=bpf_layout.USTACK_FAULT | bpf_layout.CHAIN_TRUNCATED,
               kernel_ips=(), kernel_error=-17)
    frames, sources = located_frames(s, USER.__getitem__, locate, KERNEL.get, failures,
                                     Arenas([(0x9000, 0xA000)]))
    assert frames == (TRUNCATED, "py::outer:/app/a.py", "py::inner:/app/a.py", NATIVE_GAP,
                      "leaf", KERNEL_LOST)
    assert sources == (None, FrameSource(0x9000), FrameSource(0x9050), None,
                       FrameSource(0x1000, LIB), None)
    _, gone = located_frames(s, None, None, KERNEL.get, failures)
    assert gone == (None, None, None)  # truncated, [process exited], [kernel stack lost]


def test_kernel_sources_are_shared_objects():
    failures: Counter[str] = Counter()
    _, first = located_frames(sample(), USER.__getitem__, locate, KERNEL.get, failures)
    _, second = located_frames(sample(), USER.__getitem__, locate, KERNEL.get, failures)
    assert first[-1] is second[-1]


def test_a_real_process_image_locates_libc():
    """This process's libc: the mapping /proc/self/maps shows, the build id in
    the file, one object per address."""
    libc = ctypes.CDLL(None)
    address = ctypes.cast(libc.getpid, ctypes.c_void_p).value
    assert address is not None
    image = ProcessImage(symbolizer=ProcessSymbolizer(os.getpid(), ElfCache()))
    assert image.resolve(address) in ("getpid", "__getpid")  # aliases at one address
    source = image.locate(address)
    mapping = next(m for m in read_maps(os.getpid()) if m.start <= address < m.end)
    with open(mapping.path, "rb") as f:
        build_id = read_build_id(f)
    assert build_id
    assert source == FrameSource(address, MappedFile(mapping.path, mapping.start, mapping.end,
                                                     mapping.offset, build_id))
    assert image.locate(address) is source
    assert image.locate(address + 1).mapping is source.mapping
    # An address in no mapping at all.
    assert image.locate(8) is None


def test_a_real_process_image_names_a_stack_as_one_lookup_at_a_time_would():
    libc = ctypes.CDLL(None)
    stack = [ctypes.cast(f, ctypes.c_void_p).value for f in (libc.getpid, libc.qsort)]
    stack += [NATIVE_GAP, 8]  # a marker, an address in no mapping
    image = ProcessImage(symbolizer=ProcessSymbolizer(os.getpid(), ElfCache()))
    names, sources = image.name_frames(stack)
    one_by_one = ProcessImage(symbolizer=ProcessSymbolizer(os.getpid(), ElfCache()))
    assert names == [a if isinstance(a, str) else one_by_one.resolve(a) for a in stack]
    assert sources == [None if isinstance(a, str) else one_by_one.locate(a) for a in stack]
    assert names[1] == "qsort" and names[3] == "[unknown]" and sources[3] is None
    again_names, again_sources = image.name_frames(stack)
    assert again_names == names
    assert again_sources[0] is sources[0] and again_sources[1] is sources[1]


def decode(profile: Profile):
    message = ProfileMessage()
    message.ParseFromString(gzip.decompress(encode_pprof(profile)))
    return message


def test_python_names():
    assert python_name("py::fib:/app/x.py") == ("fib", "/app/x.py")
    assert python_name("py::Cls.<locals>.f:C:\\odd:name.py") == ("Cls.<locals>.f",
                                                                "C:\\odd:name.py")
    assert python_name("py::<module>:") == ("<module>", "")
    for other in ("main", "py::", "py::nofile", "py:::x.py", "[anon]"):
        assert python_name(other) is None, other


def test_pprof_tables_from_sources():
    kernel = FrameSource(0xffffffff81000010, KERNEL_MAPPING)
    jit = FrameSource(0x7000_0010, None, "/srv/app.js", 42)
    stacks = (
        Stack(10, "app", "worker", (TRUNCATED, "py::main:/app/a.py", "py::fib:/app/a.py",
                                    "leaf", "vfs_read"), 5,
              (None, FrameSource(0x9000), FrameSource(0x9050), FrameSource(0x1fff, LIB),
               kernel)),
        Stack(10, "app", "worker", ("py::main:/app/a.py", "py::fib:/app/a.py", "leaf"), 2,
              (FrameSource(0x9000), FrameSource(0x9050), FrameSource(0x2aaa, LIB))),
        Stack(11, "node", "node", ("LazyCompile:*f /srv/app.js:40",), 1, (jit,)),
        Stack(12, "old", "old", ("main",), 1),  # no sources: one address-less location
    )
    p = decode(Profile(stacks, 1, 2, 99, {10: {"container_id": "abc", "pod_uid": ""}}))
    s = list(p.string_table)
    assert [(s[m.filename], m.memory_start, m.memory_limit, m.file_offset, s[m.build_id],
             m.has_functions) for m in p.mapping] == [
        ("[kernel.kallsyms]", KERNEL_MAPPING.start, KERNEL_MAPPING.end, 0, "", True),
        ("/usr/lib/libx.so", 0x1000, 0x3000, 0x1000, "ab12", True)]
    functions = {f.id: (s[f.name], s[f.system_name], s[f.filename]) for f in p.function}
    mappings = {m.id: s[m.filename] for m in p.mapping}
    locations = {loc.id: (mappings.get(loc.mapping_id, ""), loc.address,
                          functions[loc.line[0].function_id], loc.line[0].line)
                 for loc in p.location}
    decoded = [[locations[i] for i in x.location_id] for x in p.sample]
    assert decoded[0] == [
        ("[kernel.kallsyms]", 0xffffffff81000010, ("vfs_read", "vfs_read", ""), 0),
        ("/usr/lib/libx.so", 0x1fff, ("leaf", "leaf", ""), 0),
        ("", 0x9050, ("fib", "py::fib:/app/a.py", "/app/a.py"), 0),
        ("", 0x9000, ("main", "py::main:/app/a.py", "/app/a.py"), 0),
        ("", 0, (TRUNCATED, TRUNCATED, ""), 0)]
    # Same Python frames, another native address: shared Python locations,
    # a second location of the same function.
    assert decoded[1] == [("/usr/lib/libx.so", 0x2aaa, ("leaf", "leaf", ""), 0),
                          *decoded[0][2:4]]
    assert p.sample[1].location_id[1:] == p.sample[0].location_id[2:4]
    assert decoded[2] == [("", 0x7000_0010, ("LazyCompile:*f /srv/app.js:40",
                                              "LazyCompile:*f /srv/app.js:40",
                                              "/srv/app.js"), 42)]
    assert decoded[3] == [("", 0, ("main", "main", ""), 0)]
    assert len(p.function) == 7 and len(p.location) == 8
    labels = [{s[label.key]: s[label.str] or label.num for label in x.label} for x in p.sample]
    assert labels[0] == {"pid": 10, "comm": "worker", "process": "app", "container_id": "abc"}
    assert labels[2] == {"pid": 11, "comm": "node", "process": "node"}


def test_merge_keeps_addresses_apart_and_folded_output_alike():
    a = Stack(1, "p", "p", ("main", "leaf"), 2, (FrameSource(0x10, LIB), FrameSource(0x20, LIB)))
    same = Stack(1, "p", "p", ("main", "leaf"), 3, (FrameSource(0x10, LIB),
                                                    FrameSource(0x20, LIB)))
    other = Stack(1, "p", "p", ("main", "leaf"), 4, (FrameSource(0x10, LIB),
                                                     FrameSource(0x28, LIB)))
    assert a == Stack(1, "p", "p", ("main", "leaf"), 2)  # sources take no part in equality
    merged = merge([Profile((a,), 0, 10, 99, {1: {"container_id": "c"}}),
                    Profile((same, other), 10, 10, 99)], 99)
    assert sorted((s.sources[1].address, s.count) for s in merged.stacks) == [(0x20, 5),
                                                                              (0x28, 4)]
    assert merged.process_labels == {1: {"container_id": "c"}}
    assert merged.only_pids({2}).process_labels == {}
    # The folded form of the merged profile is what it was without sources.
    folded = Counter()
    for s in merged.stacks:
        folded[folded_line(s.comm, s.frames, 0)] += s.count
    assert folded == Counter({"p;main;leaf 0": 9})


def test_the_executable_is_the_first_mapping():
    """pprof reports take the first mapping for the program (File: ...)."""
    libc = MappedFile("/usr/lib/x86_64-linux-gnu/libc.so.6", 0x7f00_0000, 0x7f10_0000, 0)
    libfoo = MappedFile("/opt/lib/libfoo-2.0.so.1.2", 0x7e00_0000, 0x7e10_0000, 0)
    exe = MappedFile("/usr/bin/app", 0x5500_0000, 0x5510_0000, 0x1000, "cd34")
    stack = Stack(1, "app", "app", ("main", "foo", "read", "vfs_read"), 1,
                  (FrameSource(0x5500_0100, exe), FrameSource(0x7e00_0100, libfoo),
                   FrameSource(0x7f00_0100, libc), FrameSource(0xffffffff81000000,
                                                               KERNEL_MAPPING)))
    p = decode(Profile((stack,), 0, 1, 99))
    s = list(p.string_table)
    # The others in the order they were met, leaf first.
    assert [s[m.filename] for m in p.mapping] == [
        "/usr/bin/app", "[kernel.kallsyms]", "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/opt/lib/libfoo-2.0.so.1.2"]
    by_id = {m.id: s[m.filename] for m in p.mapping}
    assert [by_id[loc.mapping_id] for loc in p.location] == [
        "[kernel.kallsyms]", "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/opt/lib/libfoo-2.0.so.1.2", "/usr/bin/app"]


def image_of(registry: ProcessRegistry, pid: int) -> ProcessImage:
    """The running image of ``pid``, as the registry gives it to a sample."""
    boot_ns = read_stat(pid).start_ticks * 10**9 // os.sysconf("SC_CLK_TCK")
    image = registry.image(pid, boot_ns, 1, "test")[1]
    assert image is not None
    return image


def test_address_caches_of_all_processes_stay_within_their_bound():
    """Past the bound, the caches of the least recently sampled processes are
    emptied, the rest kept; emptied ones name their stacks as before."""
    libc = ctypes.CDLL(None)
    stack = [ctypes.cast(f, ctypes.c_void_p).value for f in (libc.getpid, libc.qsort,
                                                             libc.getppid)]
    child = subprocess.Popen(["/bin/sleep", "60"])
    try:
        registry = ProcessRegistry()
        ours = image_of(registry, os.getpid())
        names = ours.name_frames(stack)[0]
        # The child's libc is mapped elsewhere: name its own libc's start
        # (once its loader has mapped it).
        deadline = time.monotonic() + 10
        while not (libcs := [m for m in read_maps(child.pid) if m.is_exec and "libc" in m.path]):
            assert time.monotonic() < deadline, "the child never mapped libc"
            time.sleep(0.01)
        child_libc = libcs[0]
        theirs = image_of(registry, child.pid)  # sampled after ours
        child_names = theirs.name_frames([child_libc.start + 16, child_libc.start + 32])[0]
        assert (ours.cached_addresses(), theirs.cached_addresses()) == (3, 2)
        assert registry.bound_address_caches(max_bytes=5 * CACHED_ADDRESS_BYTES) == 5
        assert registry.address_cache_evictions == 0
        # Past the bound: ours, sampled least recently, is emptied.
        assert registry.bound_address_caches(max_bytes=4 * CACHED_ADDRESS_BYTES) == 2
        assert (ours.cached_addresses(), theirs.cached_addresses()) == (0, 2)
        assert registry.address_cache_evictions == 1
        assert ours.name_frames(stack)[0] == names
        assert theirs.name_frames([child_libc.start + 16, child_libc.start + 32])[0] == \
            child_names
    finally:
        child.kill()
        child.wait()


def test_a_cached_address_costs_what_the_bound_counts():
    """address_cache_bytes is kept by counting addresses at
    CACHED_ADDRESS_BYTES each: measured on this process's own code, the
    caches' memory per address (the names themselves are shared, and were
    found before) is within 15% of it."""
    image = image_of(ProcessRegistry(), os.getpid())
    assert image.symbolizer is not None
    rng = random.Random(1)
    code = [m for m in image.symbolizer.mappings
            if m.is_exec and not m.is_anonymous and not m.is_special]
    addresses = list(dict.fromkeys(rng.randrange(m.start, m.end) for m in code
                                   for _ in range(20000 // len(code))))

    def name_all() -> None:
        for at in range(0, len(addresses), 40):  # stacks of 40 frames
            image.name_frames(addresses[at:at + 40])

    name_all()  # every name found and shared once
    image.forget_addresses()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        name_all()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    cached = image.cached_addresses()
    assert cached == len(addresses) > 15000
    assert 0.85 <= grown / cached / CACHED_ADDRESS_BYTES <= 1.15, \
        f"{grown / cached:.0f} bytes a cached address, counted as {CACHED_ADDRESS_BYTES}"
