"""Stack assembly (order, markers, return-address adjustment) and folded I/O."""

from __future__ import annotations

import io
from collections import Counter

from tramprof import bpf_layout
from tramprof.folded import parse_folded, write_folded
from tramprof.sampler import RawSample
from tramprof.unwind import KERNEL_LOST, PROCESS_EXITED, TRUNCATED, stack_frames

USER = {0x1000: "leaf", 0x1fff: "mid", 0x2fff: "root"}  # callers looked up at ret - 1
KERNEL = {0xffff0010: "vfs_read", 0xffff001f: "ksys_read"}


def sample(**kw) -> RawSample:
    base = dict(tgid=1, start_boottime_ns=0, exec_id=0, comm="t",
                user_frames=((0x1000, 0x10), (0x2000, 0x20), (0x3000, 0x30)),
                user_flags=0, kernel_ips=(0xffff0010, 0xffff0020), kernel_error=0, count=3)
    base.update(kw)
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
