"""Stack assembly (order, markers, return-address adjustment) and folded I/O."""

from __future__ import annotations

import io
from collections import Counter

from tramprof.export.formats.folded import parse_folded, write_folded
from tramprof.model import KERNEL_LOST, NATIVE_GAP, PROCESS_EXITED, TRUNCATED, RawSample
from tramprof.pipeline.frames import stack_frames
from tramprof.sampler import layout as bpf_layout
from tramprof.unwind.arenas import Arenas

USER = {0x1000: "leaf", 0x1fff: "mid", 0x2fff: "root"}  # callers looked up at ret - 1
KERNEL = {0xffff0010: "vfs_read", 0xffff001f: "ksys_read"}


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


def test_root_first_user_then_kernel():
    failures: Counter[str] = Counter()
    frames = stack_frames(sample(), USER.__getitem__, KERNEL.get, failures)
    assert frames == ("root", "mid", "leaf", "ksys_read", "vfs_read")
    assert not failures


def test_markers():
    failures: Counter[str] = Counter()
    truncated = sample(user_flags=bpf_layout.USTACK_TRUNCATED, kernel_ips=())
    assert stack_frames(truncated, USER.__getitem__, KERNEL.get, failures)[0] == TRUNCATED
    lost = sample(kernel_ips=(), kernel_error=-17)
    assert stack_frames(lost, USER.__getitem__, KERNEL.get, failures)[-1] == KERNEL_LOST
    gone = stack_frames(sample(kernel_ips=()), None, KERNEL.get, failures)
    assert gone == (PROCESS_EXITED,)
    kthread = sample(user_frames=(), user_flags=bpf_layout.USTACK_NO_USER)
    assert stack_frames(kthread, None, KERNEL.get, failures) == ("ksys_read", "vfs_read")
    unknown = stack_frames(sample(kernel_ips=(0xdead,), user_frames=(),
                                  user_flags=bpf_layout.USTACK_NO_USER), None, KERNEL.get,
                           failures)
    assert unknown == ("[unknown kernel]",) and failures["kernel_no_symbol"] == 1


def test_folded_round_trip_and_escaping():
    stacks = Counter({("a b", "x;y", "z\nw"): 5, ("c", "f"): 7})
    out = io.StringIO()
    write_folded(stacks, out)
    text = out.getvalue()
    assert text.splitlines()[0] == "c;f 7"
    assert parse_folded(text) == Counter({("a b", "x:y", "z w"): 5, ("c", "f"): 7})


def Stubs() -> Arenas:
    return Arenas([(0x9000, 0xA000)])


STUB_NAMES = {0x9000: "py::outer:a.py", 0x9050: "py::inner:a.py", 0x4000: "leaf_c",
              0x5fff: "interp_call", 0x9032: "py::inner:a.py"}


def test_chain_frames_interleave_by_stack_address():
    failures: Counter[str] = Counter()
    # FP walk: leaf in C (sp 0x100), its caller (ret 0x6000, frame 0x180), then a
    # return into a stub (hidden), then unreadable: the walk stopped.
    s = sample(user_frames=((0x4000, 0x100), (0x6000, 0x180), (0x9033, 0x1f0)),
               trampoline_frames=((0x9050, 0x200), (0x9000, 0x400)),
               user_flags=bpf_layout.USTACK_FAULT, kernel_ips=())
    frames = stack_frames(s, STUB_NAMES.__getitem__, KERNEL.get, failures, Stubs())
    assert frames == ("py::outer:a.py", "py::inner:a.py", NATIVE_GAP, "interp_call", "leaf_c")


def test_complete_native_walk_needs_no_gap_marker():
    failures: Counter[str] = Counter()
    s = sample(user_frames=((0x4000, 0x100), (0x6000, 0x180)),
               trampoline_frames=((0x9050, 0x200),), user_flags=0, kernel_ips=())
    frames = stack_frames(s, STUB_NAMES.__getitem__, KERNEL.get, failures, Stubs())
    assert frames == ("py::inner:a.py", "interp_call", "leaf_c")


def test_a_frameless_leaf_stays_the_leaf():
    """The table walk orders a caller by its return address's slot - 8: under
    a leaf function without a frame that is 8 bytes below the sampled sp.
    The native frames keep the walker's order (sorted, the caller would be
    named as the leaf); trampoline frames still go in by stack address."""
    failures: Counter[str] = Counter()
    s = sample(user_frames=((0x4000, 0x100), (0x6000, 0xF8)),
               trampoline_frames=((0x9050, 0x200),), user_flags=bpf_layout.TABLE_STOP,
               kernel_ips=())
    frames = stack_frames(s, STUB_NAMES.__getitem__, KERNEL.get, failures, Stubs())
    assert frames == ("py::inner:a.py", NATIVE_GAP, "interp_call", "leaf_c")


def test_only_frames_inside_an_arena_are_dropped_as_stub_frames():
    """Two arenas with native code between them: a return address in the gap,
    or one byte past an arena, is a native frame; the first and last byte of
    an arena are stub frames (their trampoline frames stand in)."""
    stubs = Arenas([(0x9000, 0xA000), (0xC000, 0xD000)])
    names = {0x9000: "py::a:a.py", 0xC000: "py::c:c.py", 0xB000: "gap_code",
             0xA000: "past_a", 0x4000: "leaf"}
    # Return addresses are looked up one byte back: 0x9001 -> 0x9000 (first
    # byte of an arena), 0xD000 -> 0xCFFF (its last), 0xA001 -> 0xA000 (past it).
    s = sample(user_frames=((0x4000, 0x100), (0x9001, 0x110), (0xB001, 0x120),
                            (0xA001, 0x130), (0xD000, 0x140)),
               trampoline_frames=((0x9000, 0x118), (0xC000, 0x148)), kernel_ips=())
    frames = stack_frames(s, names.__getitem__, KERNEL.get, Counter(), stubs)
    assert frames == ("py::c:c.py", "past_a", "gap_code", "py::a:a.py", "leaf")


def test_one_arena_drops_exactly_its_own_frames():
    """With one arena the merge tests its bounds alone: its first and last
    byte are stub frames, a byte either side of it native code."""
    stubs = Arenas([(0x9000, 0xA000)])
    names = {0x9000: "py::a:a.py", 0x8FFF: "before_a", 0xA000: "past_a", 0x4000: "leaf"}
    # Looked up one byte back: 0x9001 -> 0x9000, 0xA000 -> 0x9FFF (stub frames),
    # 0x9000 -> 0x8FFF, 0xA001 -> 0xA000 (native frames).
    s = sample(user_frames=((0x4000, 0x100), (0x9001, 0x110), (0x9000, 0x120),
                            (0xA000, 0x130), (0xA001, 0x140)),
               trampoline_frames=((0x9000, 0x118),), kernel_ips=())
    frames = stack_frames(s, names.__getitem__, KERNEL.get, Counter(), stubs)
    assert frames == ("past_a", "before_a", "py::a:a.py", "leaf")
