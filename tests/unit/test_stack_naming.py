"""Naming a drain's samples, and finding the stacks of the last drains again
(pipeline.naming, pipeline.stackcache): the same frames and counters as
naming every stack afresh, never an answer the image's caches would not give."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from tramprof.model import RawSample
from tramprof.pipeline.naming import StackNamer
from tramprof.pipeline.stackcache import StackCache
from tramprof.symbols.elf import ElfCache
from tramprof.symbols.images import ProcessImage
from tramprof.symbols.usersyms import ProcessSymbolizer, SymbolizationStats
from tramprof.unwind.arenas import Arenas

from tests.unit.test_jit_symbols import jit_image

KERNEL = {0xFFFF_FFFF_8100_0010: "do_syscall_64", 0xFFFF_FFFF_8100_0020: "entry_SYSCALL_64"}
PID = 40


class Images:
    """One process image, as the registry gives it."""

    def __init__(self, image: ProcessImage | None) -> None:
        self.found = image
        self.asked = 0

    def image(self, tgid: int, start_boottime_ns: int, exec_id: int,
              fallback_name: str) -> tuple[str, ProcessImage | None]:
        self.asked += 1
        return "app", self.found


def sample(*ips: int, stack_id: tuple[int, int] = (11, 12), kernel=(), count: int = 1,
           tramp: tuple[tuple[int, int], ...] = (), flags: int = 0) -> RawSample:
    """Leaf first: the leaf's address is looked up as it is, callers' one byte back."""
    return RawSample(tgid=PID, start_boottime_ns=5, exec_id=1, comm="worker",
                     user_ips=ips, user_sps=tuple(0x7FFF_0000 + 0x100 * i for i in range(len(ips))),
                     user_flags=flags, kernel_ips=tuple(kernel),
                     trampoline_frames=tramp, kernel_error=0, count=count,
                     user_stack_id=stack_id)


def drain(namer: StackNamer, samples: list[RawSample]) -> list[tuple[str, ...]]:
    frames = [namer.name(s).frames for s in samples]
    namer.end_drain()
    return frames


def namer_for(image: ProcessImage | None, stubs: Arenas | None = None,
              cache: StackCache | None = None) -> tuple[StackNamer, Counter[str], Images]:
    failures: Counter[str] = Counter()
    images = Images(image)
    return (StackNamer(images, lambda pid: stubs, KERNEL.get, failures, cache),
            failures, images)


def test_a_stack_of_the_last_drain_is_found_again_with_its_frames_and_counters(tmp_path):
    """Named once, then found whole in the next drains: the frames of naming
    it afresh, and the counters (JIT lookups, kernel frames without a symbol)
    that naming it afresh counts."""
    image, jit, _path, _clock = jit_image(tmp_path, PID, "7000 10 first\n7010 10 second\n")
    fresh_image, fresh_jit, _p, _c = jit_image(tmp_path / "fresh", PID,
                                               "7000 10 first\n7010 10 second\n")
    namer, failures, images = namer_for(image)
    fresh, fresh_failures, _ = namer_for(fresh_image, cache=StackCache(max_stacks=0))
    one = sample(0x7008, 0x7019, kernel=(0xFFFF_FFFF_8100_0010, 0xFFFF_FFFF_8100_0021,
                                         0xDEAD))
    expected = ("second", "first", "[unknown kernel]", "entry_SYSCALL_64", "do_syscall_64")
    for _ in range(4):
        assert drain(namer, [one, dataclasses.replace(one, comm="other", count=3)]) == \
            [expected, expected]
        assert drain(fresh, [one, dataclasses.replace(one, comm="other", count=3)]) == \
            [expected, expected]
    # Named past the image's caches twice (the first lookup reads the perf
    # map, the second caches its answer: symbols.images), not kept; named
    # from the caches once, kept; found ever after.
    assert (namer.cache.named, namer.cache.reused) == (3, 5)
    assert (fresh.cache.named, fresh.cache.reused) == (8, 0)
    assert failures == fresh_failures == Counter(kernel_no_symbol=8)
    assert (jit.lookups, jit.resolved) == (fresh_jit.lookups, fresh_jit.resolved) == (16, 16)
    assert images.asked == 4  # once per drain, not per sample


def test_a_stack_with_a_frame_looked_up_past_the_caches_is_named_again_every_drain(tmp_path):
    """A miss is looked up again (that lookup is what reads the perf map
    again): a stack with one is never reused, and gets the name once it exists."""
    image, _jit, path, clock = jit_image(tmp_path, PID, "7000 10 first\n")
    namer, _failures, _ = namer_for(image)
    one = sample(0x8008, 0x7009, stack_id=(21, 22))
    for _ in range(2):
        assert drain(namer, [one]) == [("first", "[anon]")]
    with path.open("a") as f:
        f.write("8000 10 created_later\n")
    clock.now += 1.5
    assert drain(namer, [one]) == [("first", "created_later")]
    assert namer.cache.reused == 0


def test_jit_code_recreated_at_the_same_addresses_is_named_anew(tmp_path):
    """When the JIT files are read again the image's caches are void, and so
    are the stacks named with them: the next drain has the new names."""
    image, _jit, path, clock = jit_image(tmp_path, PID, "7000 10 first\n7010 10 second\n")
    namer, _failures, _ = namer_for(image)
    known = sample(0x7008, 0x7019)
    other = sample(0x8008, stack_id=(31, 32))
    for _ in range(4):
        assert drain(namer, [known]) == [("second", "first")]
    assert namer.cache.reused == 1  # named past the caches twice, from them once, found
    with path.open("a") as f:
        f.write("7000 10 recreated\n8000 10 later\n")
    clock.now += 1.5
    # The miss re-reads the perf map; the known stack, sorted after it, is
    # named with the new names in the same drain.
    assert drain(namer, [other, known]) == [("later",), ("second", "recreated")]
    assert drain(namer, [known]) == [("second", "recreated")]


def test_jit_code_added_elsewhere_keeps_the_stacks_named_before(tmp_path):
    """A node process appends perf map lines all the time: entries away from
    a stack's frames leave it found whole, in the drain that read them too;
    one over a frame names it anew."""
    image, _jit, path, clock = jit_image(tmp_path, PID, "7000 10 first\n7010 10 second\n")
    namer, _failures, _ = namer_for(image)
    known = sample(0x7008, 0x7019)
    for _ in range(4):
        assert drain(namer, [known]) == [("second", "first")]
    assert namer.cache.reused == 1
    with path.open("a") as f:
        f.write("8000 10 later\n")
    clock.now += 1.5
    assert drain(namer, [sample(0x8008, stack_id=(31, 32)), known]) == \
        [("later",), ("second", "first")]
    assert namer.cache.reused == 2  # found whole
    with path.open("a") as f:
        f.write("7010 10 recreated\n")
    clock.now += 1.5
    assert drain(namer, [sample(0x8108, stack_id=(41, 42)), known]) == \
        [("[anon]",), ("recreated", "first")]
    assert drain(namer, [known]) == [("recreated", "first")]
    assert namer.cache.reused == 2


def test_stubs_that_moved_name_the_stack_anew(tmp_path):
    """The merge drops native frames inside the stub arenas: when the arenas
    change, so may the frames, and the stacks named before are not reused."""
    image, _jit, _path, _clock = jit_image(tmp_path, PID, "7000 10 first\n7010 10 second\n")
    failures: Counter[str] = Counter()
    stubs = {"now": None}
    namer = StackNamer(Images(image), lambda pid: stubs["now"], KERNEL.get, failures)
    one = sample(0x7008, 0x7019)
    for _ in range(4):
        assert drain(namer, [one]) == [("second", "first")]
    stubs["now"] = Arenas([(0x7000, 0x7010)])
    # 0x7008 is a stub's own frame now (no trampoline frame names it).
    assert drain(namer, [dataclasses.replace(one, trampoline_frames=((0x7010, 0x7FFF_0050),))]) \
        == [("second", "second")]
    assert namer.cache.reused == 1


def test_a_stack_without_the_kernels_identity_or_image_is_always_named(tmp_path):
    image, _jit, _path, _clock = jit_image(tmp_path, PID, "7000 10 first\n")
    namer, _failures, _ = namer_for(image)
    anonymous = sample(0x7008, stack_id=(0, 0))
    for _ in range(3):
        assert drain(namer, [anonymous]) == [("first",)]
    gone, _f, _i = namer_for(None)
    for _ in range(3):
        assert drain(gone, [sample(0x7008)]) == [("[process exited]",)]
    assert (namer.cache.reused, gone.cache.reused) == (0, 0)


def test_stacks_not_sampled_for_a_whole_drain_are_forgotten_and_the_cache_is_bounded(tmp_path):
    image, _jit, _path, _clock = jit_image(tmp_path, PID, "7000 10 first\n7010 10 second\n")
    cache = StackCache(max_stacks=2)
    namer, _failures, _ = namer_for(image, cache=cache)
    stacks = [sample(0x7008, 0x7019, stack_id=(i, i)) for i in range(1, 5)]
    drain(namer, [stacks[0]])  # warms the image's caches
    drain(namer, [stacks[0]])
    drain(namer, stacks)  # keeps the first two only
    assert len(cache) == 0  # (counted per drain)
    assert cache.named == 6
    drain(namer, [stacks[0], stacks[2]])  # the third was not kept
    assert cache.reused == 1
    drain(namer, [stacks[1]])  # the second was not sampled in the drain before
    assert cache.reused == 1
    drain(namer, [])
    drain(namer, [stacks[0]])  # nor the first
    assert cache.reused == 1


def test_a_drain_reports_the_newest_image_each_process_was_named_with(tmp_path):
    """Samples from before and after an exec, in the drain's order (newest
    image first): the unwinding modes are shown the image after the exec."""
    before, *_ = jit_image(tmp_path / "before", PID, "7000 10 old\n")
    after, *_ = jit_image(tmp_path / "after", PID, "7000 10 new\n")

    class TwoImages:
        def image(self, tgid: int, start_boottime_ns: int, exec_id: int,
                  fallback_name: str) -> tuple[str, ProcessImage | None]:
            return "app", after if exec_id == 2 else before

    namer = StackNamer(TwoImages(), lambda pid: None, KERNEL.get, Counter())
    samples = [dataclasses.replace(sample(0x7004), exec_id=2),
               dataclasses.replace(sample(0x7004), exec_id=1)]
    assert [namer.name(s).frames for s in samples] == [("new",), ("old",)]
    assert namer.end_drain() == [((PID, 5, 2), after)]
    assert namer.end_drain() == []


@pytest.mark.parametrize("maps", [None, ""], ids=["gone", "exiting"])
def test_a_process_gone_before_its_maps_were_read_is_one_marker(tmp_path, maps):
    """Seen alive, then gone before its maps could be read (a short-lived
    process), or exiting: its memory released, its maps empty while it is
    not a zombie yet. Its user frames are one "[process exited]" marker,
    counted once per drain, not a column of "[unknown]" frames; kernel
    frames are still named."""
    (tmp_path / str(PID)).mkdir()  # no maps file: the process is gone
    if maps is not None:
        (tmp_path / str(PID) / "maps").write_text(maps)
        (tmp_path / str(PID) / "stat").write_text(f"{PID} (shortjob) R 1 1 1 0 -1\n")
    stats = SymbolizationStats()
    image = ProcessImage(ProcessSymbolizer(PID, ElfCache(), stats, proc_root=str(tmp_path)))
    namer, failures, _ = namer_for(image)
    kernel = (0xFFFF_FFFF_8100_0010,)
    assert drain(namer, [sample(0x7008, 0x7019, kernel=kernel),
                         sample(0x7108, stack_id=(13, 14), kernel=kernel)]) == \
        [("[process exited]", "do_syscall_64")] * 2
    assert failures == Counter({"process_exited": 1})
    assert stats.snapshot() == {}
