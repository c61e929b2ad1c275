"""The compiled passes of naming a stack (tramprof._speedups) against the
Python code they stand for: the same lookup addresses and the same cached
answers for random stacks, odd ones included (values a lying process could
put there), and no reference kept past a call; and the perf ring's ordered
accesses, at the places perfring gives them."""

from __future__ import annotations

import mmap
import struct
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tramprof import speedups
from tramprof.model import NATIVE_GAP, FrameSource, MappedFile, RawSample
from tramprof.pipeline import frames
from tramprof.pipeline.naming import CountingNamer
from tramprof.sampler import layout, perfring
from tramprof.symbols.images import ProcessImage
from tramprof.unwind import merge, tables
from tramprof.unwind.arenas import Arenas

from .compiled import _speedups, needs_speedups
from .traced import traced_bytes

U64 = (1 << 64) - 1
BASE = 0x7F00_0000_0000
# Stub arenas at fixed places, so that drawn addresses fall in and out of them.
ARENAS = Arenas([(BASE + 0x10000, BASE + 0x20000), (BASE + 0x40000, BASE + 0x41000)])

address = st.one_of(
    st.integers(BASE, BASE + 0x50000),  # in and around the arenas
    st.sampled_from([0, 1, BASE + 0x10000, BASE + 0x10001, BASE + 0x20000, BASE + 0x20001,
                     BASE + 0x41000, U64, U64 - 1]),
    st.integers(0, U64),
)
stack_address = st.one_of(st.integers(0x7FFF_0000, 0x7FFF_0400), st.sampled_from([0, U64]))
flag_bits = st.lists(st.sampled_from([layout.TABLE_STOP, layout.USTACK_FAULT,
                                      layout.PYTHON_PAUSED, layout.USTACK_TRUNCATED, 0]),
                     max_size=3).map(lambda bits: sum(set(bits)))


@st.composite
def samples(draw: st.DrawFn) -> RawSample:
    """A sample whose native and trampoline frames are mostly in stack order
    (as the walkers give them), sometimes not (a lying process)."""
    ips = draw(st.lists(address, max_size=24))
    sps = draw(st.lists(stack_address, min_size=len(ips), max_size=len(ips)))
    pairs = draw(st.lists(st.tuples(address, stack_address), max_size=12))
    if draw(st.booleans()):
        sps.sort()
        pairs.sort(key=lambda pair: pair[1])
    return RawSample(tgid=1, start_boottime_ns=1, exec_id=1, comm="t", user_ips=tuple(ips),
                     user_sps=tuple(sps), user_flags=draw(flag_bits), kernel_ips=(),
                     trampoline_frames=tuple(pairs), kernel_error=0, count=1)


def test_the_compiled_passes_are_built() -> None:
    """``make setup`` builds them; without them every stack is named in
    Python (the same names, ~10x the time a frame)."""
    assert _speedups is not None, "tramprof._speedups is missing: make setup builds it " \
                                  "(needs gcc and python3-dev)"


@needs_speedups
@settings(max_examples=1500, deadline=None)
@given(sample=samples(), stubs=st.sampled_from([ARENAS, Arenas(), None]))
def test_merged_addresses_are_python_s(sample: RawSample, stubs: Arenas | None) -> None:
    assert merge.user_addresses(sample, stubs) == merge.merged_user_addresses(sample, stubs)


@needs_speedups
def test_merge_takes_the_ordinary_case_and_leaves_the_odd_one() -> None:
    """A Python stack under trampolines is merged in C; a caller's return
    address of 0, a value that is not a u64 or more trampoline frames than
    any drain gives are left to Python (None)."""
    ips, sps = (BASE + 0x500, BASE + 0x10041, BASE + 0x601), (0x100, 0x110, 0x120)
    tramps = ((BASE + 0x10040, 0x118),)
    starts, ends = ARENAS.search_lists
    assert _speedups.merge_trampolines(ips, sps, tramps, starts, ends, False, NATIVE_GAP) == \
        [BASE + 0x500, BASE + 0x10040, BASE + 0x600]
    # The walk stopped: the marker goes above the last native frame.
    assert _speedups.merge_trampolines(ips, sps, ((BASE + 0x10040, 0x128),), starts, ends,
                                       True, NATIVE_GAP) == \
        [BASE + 0x500, BASE + 0x600, NATIVE_GAP, BASE + 0x10040]
    # Native frames keep the walker's order; a trampoline frame goes before
    # the first native frame above it.
    assert _speedups.merge_trampolines(ips, (0x130, 0x110, 0x120), tramps, starts, ends,
                                       False, NATIVE_GAP) == \
        [BASE + 0x10040, BASE + 0x500, BASE + 0x600]
    # Without trampoline frames they come as they are.
    assert _speedups.merge_trampolines(ips, (0x130, 0x110, 0x120), (), [], [], False,
                                       NATIVE_GAP) == [BASE + 0x500, BASE + 0x10040, BASE + 0x600]
    many = tuple((BASE + 0x10000 + 64 * i, i) for i in range(1100))
    assert _speedups.merge_trampolines(ips, sps, many, starts, ends, False,
                                       NATIVE_GAP) is None
    assert _speedups.merge_trampolines((1, 0), (1, 2), tramps, starts, ends, False,
                                       NATIVE_GAP) is None
    assert _speedups.merge_trampolines((1, -1), (1, 2), tramps, starts, ends, False,
                                       NATIVE_GAP) is None
    assert _speedups.merge_trampolines((1,), (1,), ((1, 2, 3),), starts, ends, False,
                                       NATIVE_GAP) is None


@needs_speedups
def test_cache_passes_take_ints_and_markers_only() -> None:
    """Anything else is left to Python (its lookups could run Python code)."""
    found = {1: ("f", None)}
    assert _speedups.cached_answers([1, NATIVE_GAP, 7], found, {7: ("g", None)}) == \
        ([("f", None), None, ("g", None)], 1, 1)
    assert _speedups.cached_answers([1, 1.0], found, {}) is None
    assert _speedups.split_pairs([("f", None), ("g", 1)]) == (["f", "g"], [None, 1])
    assert _speedups.split_pairs([("f", None), ("g",)]) is None


@needs_speedups
def test_the_shared_pass_takes_its_segments_and_leaves_the_rest() -> None:
    """Misses in a segment whose place has a name are answered and cached;
    markers, answered frames, addresses outside the segments or without a
    name are left; a full cache takes nothing; odd arguments answer none."""
    names = {("obj", 0x1010): "f", ("obj", 0x1020): "g"}
    los, his = [BASE + 0x1000, BASE + 0x9000], [BASE + 0x2000, BASE + 0x9100]
    entries = [("obj", 0x1000 - BASE - 0x1000, "lib"), ("other", 0, "lib2")]
    stack = [BASE + 0x1010, NATIVE_GAP, BASE + 0x1020, BASE + 0x1030, BASE + 0x2010, 5]
    answers: list[object] = [None, None, ("h", None), None, None, None]
    found: dict[int, object] = {}
    assert _speedups.shared_answers(stack, answers, los, his, entries, names, found, 10,
                                    FrameSource) == 1
    first = ("f", FrameSource(BASE + 0x1010, "lib"))  # type: ignore[arg-type]
    assert answers == [first, None, ("h", None), None, None, None]
    assert found == {BASE + 0x1010: first}
    answers[0] = None
    assert _speedups.shared_answers(stack, answers, los, his, entries, names, found, 1,
                                    FrameSource) == 0  # full: Python empties it
    for odd in ([*los[:1], 1.5], [BASE], [BASE + 0x1000, -1]):
        assert _speedups.shared_answers(stack, answers, odd, his, entries, names, found, 10,
                                        FrameSource) is None
    for odd_entries in ([("obj", 1), entries[1]], [("obj", 1.0, "lib"), entries[1]],
                        [(b"obj", 1, "lib"), entries[1]]):
        assert _speedups.shared_answers(stack, answers, los, his, odd_entries, names, found,
                                        10, FrameSource) is None
    assert _speedups.shared_answers([*stack[:5], 5.0], answers, los, his, entries, names,
                                    found, 10, FrameSource) is None
    assert answers[0] is None


answer = st.tuples(st.sampled_from(["f", "g", "[anon]"]),
                   st.builds(FrameSource, st.integers(0, 1 << 20)))


@needs_speedups
@settings(max_examples=500, deadline=None)
@given(found=st.dictionaries(st.integers(0, 64), answer, max_size=40),
       jit_found=st.dictionaries(st.integers(0, 64), answer, max_size=40),
       addresses=st.lists(st.one_of(st.integers(0, 80), st.sampled_from([NATIVE_GAP, "[x]"])),
                          max_size=40))
def test_cached_answers_are_python_s(found: dict[int, tuple[str, FrameSource]],
                                     jit_found: dict[int, tuple[str, FrameSource]],
                                     addresses: list[int | str]) -> None:
    image = ProcessImage(symbolizer=None, found=dict(found), jit_found=dict(jit_found))
    assert _speedups.cached_answers(addresses, image.found, image.jit_found) == \
        image._cached_answers(addresses)
    # The whole naming: a list goes through C, a tuple through Python.
    assert image.name_frames_cached(addresses) == image.name_frames_cached(tuple(addresses))


KERNEL_NAMES = {0xFFFF_FFFF_8100_0000 + 0x10 * i: f"kernel_{i}" for i in range(4)}
kernel_address = st.sampled_from([*KERNEL_NAMES, *(a + 1 for a in KERNEL_NAMES),
                                  0xFFFF_FFFF_8000_0000])


@needs_speedups
@settings(max_examples=1500, deadline=None)
@given(sample=samples(), stubs=st.sampled_from([ARENAS, Arenas(), None]),
       kernel_ips=st.lists(kernel_address, max_size=4), kernel_error=st.sampled_from([0, -14]),
       no_user=st.booleans(), where=st.data())
def test_a_stack_named_from_the_caches_is_named_as_in_python(
        sample: RawSample, stubs: Arenas | None, kernel_ips: list[int], kernel_error: int,
        no_user: bool, where: st.DataObject) -> None:
    """The whole-stack pass gives ``named_frames``'s frames and places, and
    the JIT cache's hits, when the caches hold every user frame; the lookup
    addresses when one is missing; nothing for samples it does not take."""
    flags = sample.user_flags | (layout.USTACK_NO_USER if no_user else 0)
    sample = replace(sample, user_flags=flags, kernel_ips=tuple(kernel_ips),
                     kernel_error=kernel_error)
    addresses = merge.merged_user_addresses(sample, stubs)
    image = ProcessImage(symbolizer=None)
    for addr in addresses:  # each cached in one cache or the other, or not at all
        if isinstance(addr, int):
            cache = where.draw(st.sampled_from([image.found, image.jit_found, None]))
            if cache is not None:
                cache[addr] = (f"f{addr:x}", FrameSource(addr))
    failures: Counter[str] = Counter()
    kernel_frames = frames.kernel_part(sample, KERNEL_NAMES.get, failures)
    expected_failures = Counter(failures)
    cached = frames.cached_frames(sample, image.caches(), stubs, kernel_frames)
    namer = CountingNamer(image)
    saved, speedups.compiled = speedups.compiled, None  # type: ignore[assignment]
    try:
        failures.clear()
        expected = frames.named_frames(sample, namer, KERNEL_NAMES.get, failures, stubs)
    finally:
        speedups.compiled = saved
    assert failures == expected_failures  # the kernel part is counted once either way
    arguments = merge.merge_arguments(sample, stubs)
    if no_user or arguments is None or \
            _speedups.merge_trampolines(*arguments[:6], NATIVE_GAP) is None:
        assert cached is None  # paused, no user stack, or odd: named in Python
    elif namer.jit_hits is None:  # a frame was missing from both caches
        assert cached == addresses
    else:
        assert cached == (*expected, namer.jit_hits, 0)


@needs_speedups
def test_the_whole_stack_pass_leaves_odd_answers_and_markers() -> None:
    """An answer that is not a (name, place) pair, or a gap marker that is
    not a plain str, is left to Python (None)."""
    ips, sps = (BASE + 0x500, BASE + 0x601), (0x100, 0x110)
    common = (ips, sps, (), [], [], False, True)
    good = {BASE + 0x500: ("f", None), BASE + 0x600: ("g", None)}
    assert _speedups.cached_stack(*common, NATIVE_GAP, good, {}, None, ("[t]",), ("k",),
                                  (None,)) == \
        (("[t]", NATIVE_GAP, "g", "f", "k"), (None, None, None, None, None), 0, 0)
    assert _speedups.cached_stack(*common, NATIVE_GAP, {}, good, None, (), (), ()) == \
        ((NATIVE_GAP, "g", "f"), (None, None, None), 2, 0)
    assert _speedups.cached_stack(*common, NATIVE_GAP, {BASE + 0x500: ("f",)}, good, None,
                                  (), (), ()) is None

    class Marker(str):
        pass

    assert _speedups.cached_stack(*common, Marker(NATIVE_GAP), good, {}, None, (), (),
                                  ()) is None
    assert _speedups.cached_stack(*common, NATIVE_GAP, good, {}, None, (), ("k",), ()) is None
    for odd_shared in ((), ([], [], [], {}, 1), ([], [], [], {}, "1", FrameSource), [1]):
        assert _speedups.cached_stack(*common, NATIVE_GAP, good, {}, odd_shared, (), (),
                                      ()) is None


@needs_speedups
def test_the_whole_stack_pass_takes_names_other_processes_found() -> None:
    """Misses that the shared names answer are named and cached as
    ``shared_answers`` does, and counted; one they do not answer leaves the
    stack to the caller (the lookup addresses), keeping what was cached."""
    names = {("obj", 0x1010): "f", ("obj", 0x1020): "g"}
    shared = ([BASE + 0x1000], [BASE + 0x2000], [("obj", 0x1000 - BASE - 0x1000, "lib")],
              names, 10, FrameSource)
    ips, sps = (BASE + 0x1010, BASE + 0x1021, BASE + 0x5001), (0x100, 0x110, 0x120)
    found: dict[int, object] = {BASE + 0x5000: ("main", None)}
    named = _speedups.cached_stack(ips, sps, (), [], [], False, False, NATIVE_GAP, found, {},
                                   shared, (), (), ())
    f = ("f", FrameSource(BASE + 0x1010, "lib"))  # type: ignore[arg-type]
    g = ("g", FrameSource(BASE + 0x1020, "lib"))  # type: ignore[arg-type]
    assert named == (("main", "g", "f"), (None, g[1], f[1]), 0, 2)
    assert found == {BASE + 0x5000: ("main", None), BASE + 0x1010: f, BASE + 0x1020: g}
    found = {}
    ips = (BASE + 0x1010, BASE + 0x1031)  # no name at 0x1030
    assert _speedups.cached_stack(ips, sps[:2], (), [], [], False, False, NATIVE_GAP, found,
                                  {}, shared, (), (), ()) == [BASE + 0x1010, BASE + 0x1030]
    assert found == {BASE + 0x1010: f}
    # A full cache takes no more: the caller's lookups empty it.
    assert _speedups.cached_stack(ips[:1], sps[:1], (), [], [], False, False, NATIVE_GAP, {},
                                  {}, (*shared[:4], 0, FrameSource), (), (), ()) == \
        [BASE + 0x1010]


@needs_speedups
def test_no_reference_is_kept_past_a_call() -> None:
    """Ten thousand calls of each leave no objects behind (a leaked frame
    list would be ~50 MB here)."""
    ips = tuple(BASE + 0x1000 + 16 * i for i in range(120))
    sps = tuple(0x7FFF_0000 + 16 * i for i in range(120))
    tramps = tuple((BASE + 0x10000 + 64 * i, 0x7FFF_0000 + 48 * i + 8) for i in range(40))
    starts, ends = ARENAS.search_lists
    found = {BASE + 0x1000 + 16 * i - 1: ("f", FrameSource(i)) for i in range(60)}
    jit_found = {BASE + 0x10000 + 64 * i: ("py", FrameSource(i)) for i in range(20)}
    shared = {("obj", BASE + 0x1000 + 16 * i - 1): "s" for i in range(30)}
    mapped = [MappedFile(f"/lib{i}.so", BASE + i * 0x1000, BASE + (i + 1) * 0x1000, 0)
              for i in range(3)]
    places = tuple(FrameSource(BASE + i, mapped[i % 3]) for i in range(96))

    def calls() -> None:
        for _ in range(10_000):
            assert _speedups.mapping_starts(places) == {m.start for m in mapped}
            assert _speedups.mapping_starts((*places, "odd")) is None
            merged = _speedups.merge_trampolines(ips, sps, tramps, starts, ends, True,
                                                 NATIVE_GAP)
            assert merged is not None
            _speedups.cached_answers(merged, found, jit_found)
            answers: list[object] = [None] * len(merged)
            _speedups.shared_answers(merged, answers, [BASE], [BASE + 0x1000 + 16 * 30],
                                     [("obj", 0, "lib")], shared, {}, 1 << 20, FrameSource)
            _speedups.merge_trampolines(ips, (*sps[:-1], 0), tramps, starts, ends, True,
                                        NATIVE_GAP)
            _speedups.cached_stack(ips, sps, tramps, starts, ends, True, False, NATIVE_GAP,
                                   found, jit_found, None, ("[t]",), ("k",), (None,))
            hit = _speedups.cached_stack((BASE + 0x1000 + 15, *ips[2:50]), sps[1:50], (), [],
                                         [], False, False, NATIVE_GAP, found, {}, None,
                                         ("[t]",), ("k",), (None,))
            assert type(hit) is tuple
            # Each call finds the shared names anew (its own empty cache).
            assert type(_speedups.cached_stack(
                ips, sps, tramps, starts, ends, False, True, NATIVE_GAP, {}, jit_found,
                ([BASE], [BASE + 0x1000 + 16 * 30], [("obj", 0, "lib")], shared, 1 << 20,
                 FrameSource), (), (), ())) is list

    calls()
    _, grown = traced_bytes(calls)
    assert grown < 64 * 1024


mapped_file = st.builds(MappedFile, st.sampled_from(["/a", "/b", "[vdso]"]),
                        st.integers(0, U64), st.integers(0, U64), st.integers(0, 1 << 40))
place = st.one_of(st.none(), st.builds(FrameSource, address, st.none()),
                  st.builds(FrameSource, address, mapped_file))


@needs_speedups
@settings(max_examples=1000, deadline=None)
@given(drawn=st.lists(place, max_size=120), runs=st.booleans(), as_list=st.booleans())
def test_the_mapping_starts_of_a_stack_are_python_s(drawn: list[FrameSource | None],
                                                    runs: bool, as_list: bool) -> None:
    """The compiled set of a stack's mapping starts is the set comprehension's,
    for places in runs of one mapping object (as a stack's frames are) or
    each with its own."""
    if runs:  # consecutive places share the mapping object, as named stacks do
        drawn = [p if p is None or i == 0 or drawn[i - 1] is None or drawn[i - 1].mapping is None
                 else p._replace(mapping=drawn[i - 1].mapping) for i, p in enumerate(drawn)]
    sources = drawn if as_list else tuple(drawn)
    expected = {s.mapping.start for s in drawn if s is not None and s.mapping is not None}
    assert _speedups.mapping_starts(sources) == expected
    assert tables.mapping_starts(sources) == expected


@needs_speedups
def test_the_mapping_starts_leave_odd_places_to_python() -> None:
    """A place or mapping of another kind makes the compiled pass decline (None)
    and the Python comprehension answer, or say what is wrong; an iterator is
    not consumed by the compiled pass."""
    lib = MappedFile("/lib.so", BASE, BASE + 0x1000, 0)

    class Start(int):
        pass

    odd_start = MappedFile("/odd.so", Start(7), 9, 0)
    assert _speedups.mapping_starts((FrameSource(1, odd_start),)) is None
    assert tables.mapping_starts((FrameSource(1, odd_start),)) == {7}
    assert _speedups.mapping_starts((FrameSource(1, lib), (2,))) is None
    assert _speedups.mapping_starts((FrameSource(1, (BASE,)),)) is None
    assert _speedups.mapping_starts("not places") is None
    assert _speedups.mapping_starts(()) == set()
    places = iter([FrameSource(1, lib), None])
    assert _speedups.mapping_starts(places) is None  # type: ignore[arg-type]
    assert tables.mapping_starts(places) == {BASE}
    try:
        tables.mapping_starts((FrameSource(1, lib), "odd"))  # type: ignore[arg-type]
    except AttributeError as err:
        assert "mapping" in str(err)
    else:
        raise AssertionError("an odd place was taken")


@needs_speedups
def test_the_ring_words_are_where_perfring_says() -> None:
    """The ordered accesses read and store the control page's words at the
    offsets the reader passes (perfring defines them once), and refuse a
    place outside the mapping or not 8-byte aligned."""
    page = mmap.mmap(-1, mmap.PAGESIZE * 2)
    struct.pack_into("=Q", page, perfring.DATA_HEAD, 0x1234_5678_9ABC)
    assert _speedups.ring_head(page, perfring.DATA_HEAD) == 0x1234_5678_9ABC
    _speedups.ring_tail(page, perfring.DATA_TAIL, 4096)
    assert struct.unpack_from("=Q", page, perfring.DATA_TAIL)[0] == 4096
    assert struct.unpack_from("=Q", page, perfring.DATA_HEAD)[0] == 0x1234_5678_9ABC
    for offset in (-8, perfring.DATA_HEAD + 1, mmap.PAGESIZE * 2 - 4):
        with pytest.raises(ValueError, match="not a perf ring"):
            _speedups.ring_head(page, offset)
        with pytest.raises(ValueError, match="not a perf ring"):
            _speedups.ring_tail(page, offset, 0)
    with pytest.raises(TypeError):
        _speedups.ring_head(bytes(mmap.PAGESIZE * 2), perfring.DATA_HEAD)  # not writable
    page.close()
