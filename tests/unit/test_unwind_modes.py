"""Every unwinding mode driven through the protocol and the registry, against
a recording map writer (no root, no BPF); and the real map writer against
fake BPF tables (all-or-nothing installs, pages shared between walkers)."""

from __future__ import annotations

import ctypes
import itertools
import os
import struct
from dataclasses import replace
from pathlib import Path

import pytest
from tramprof.sampler import layout
from tramprof.sampler.maps import MapFull, ProcessMaps
from tramprof.unwind import chain as chain_module
from tramprof.unwind.arenas import Arenas
from tramprof.unwind.chain import ChainMode
from tramprof.unwind.descriptor import (
    DUTY_ALWAYS,
    EXTENSION_RE,
    Changes,
    Descriptor,
    DescriptorError,
    DutyState,
    is_runtime_extension,
)
from tramprof.unwind.mode import (
    FP,
    NEWCOMER_LIMIT,
    NEWCOMER_SECONDS,
    DryRunMaps,
    Newcomers,
    UnwindModes,
)
from tramprof.unwind.scan import ScanMode

PID = 4242
ARENA = 0x10000000  # below 16 TiB: the fixture's sparse "mem" file holds it
STUB = bytes.fromhex("f30f1efa4883ec08ffd14883c408c3")  # CPython 3.13 -X perf stub
STRIDE = 16


class RecordingMaps:
    """A map writer that remembers what is installed, per (tgid, walker)."""

    def __init__(self) -> None:
        self.state: dict[tuple[int, bytes], tuple[ctypes.Structure, set[tuple[int, int]]]] = {}
        self.calls: list[tuple[str, int, bytes]] = []
        self.stale: set[int] = set()  # what the chain walker would report

    def install(self, tgid, walker, record, arenas) -> None:
        self.calls.append(("install", tgid, walker))
        _old, held = self.state.get((tgid, walker), (None, set()))
        self.state[(tgid, walker)] = (record, held | set(arenas))

    def remove(self, tgid, walker) -> None:
        self.calls.append(("remove", tgid, walker))
        self.state.pop((tgid, walker), None)

    def take_stale_chains(self) -> set[int]:
        stale, self.stale = self.stale, set()
        return stale


# --- a fixture /proc with one process running CPython -X perf stubs ----------


def fake_proc(tmp_path: Path, arenas: list[int], named: list[int], anon_maps: list[int],
              perf_map: str | None = None) -> Path:
    proc = tmp_path / "proc"
    d = proc / str(PID)
    root = tmp_path / "rootfs"
    (root / "tmp").mkdir(parents=True)
    d.mkdir(parents=True)
    os.symlink(root, d / "root")
    uid = os.getuid()
    (d / "status").write_text(f"Name:\tpython3\nTgid:\t{PID}\nNStgid:\t{PID}\n"
                              f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t0\t0\t0\t0\n")
    lines = [f"{start:x}-{start + 0x10000:x} r-xp 00000000 00:00 0 \n" for start in anon_maps]
    lines.append("7f0000000000-7f0000100000 r-xp 00000000 fe:00 77 /usr/lib/libpython3.13.so\n")
    (d / "maps").write_text("".join(lines))
    with open(d / "mem", "wb") as mem:
        for start in arenas:
            arena = bytearray(b"\xcc" * 0x10000)
            for at in range(0, len(arena) - len(STUB) + 1, STRIDE):
                arena[at:at + len(STUB)] = STUB
            mem.seek(start)
            mem.write(arena)
    if perf_map is None:
        perf_map = "".join(f"{a:x} {len(STUB):x} py::f{i}:/app/a.py\n" for i, a in enumerate(named))
    if perf_map != "FIFO":
        (root / "tmp" / f"perf-{PID}.map").write_text(perf_map)
    else:
        os.mkfifo(root / "tmp" / f"perf-{PID}.map")
    return proc


def mappings(proc: Path):
    from tramprof.procfs.maps import read_maps

    return read_maps(PID, str(proc))


def test_scan_mode_learns_installs_and_follows_new_arenas(tmp_path):
    proc = fake_proc(tmp_path, [ARENA, ARENA + 0x10000], [ARENA, ARENA + 0x20],
                     [ARENA, ARENA + 0x10000])
    maps = RecordingMaps()
    scan = ScanMode(maps, str(proc))
    scan.consider(PID, mappings(proc))
    assert scan.unwinds(PID) and scan.unwound() == {PID}
    record, arenas = maps.state[(PID, b"scan_procs")]
    assert isinstance(record, layout.ScanProc)
    assert (record.return_offset, record.stride_mask) == (10, STRIDE - 1)
    assert record.caller_offset == 16 and record.word_phase == 2  # sub $8: 16 bytes up, 16n+8
    assert (record.caller_min, record.caller_span) == (0x7f0000000000, 0x100000)
    assert arenas == {(ARENA, ARENA + 0x10000)}
    assert ARENA + 0x25 in scan.arenas(PID) and ARENA + 0x10000 not in scan.arenas(PID)

    # The process hands out a stub in its second arena: the next refresh adds it.
    with open(proc.parent / "rootfs" / "tmp" / f"perf-{PID}.map", "a") as f:
        f.write(f"{ARENA + 0x10010:x} {len(STUB):x} py::g:/app/b.py\n")
    scan.refresh({PID})
    _record, arenas = maps.state[(PID, b"scan_procs")]
    assert arenas >= {(ARENA, ARENA + 0x10000), (ARENA + 0x10000, ARENA + 0x20000)}
    assert ARENA + 0x10005 in scan.arenas(PID)
    assert scan.report(PID).mode == "scan"

    scan.refresh(set())  # the process exited
    assert (PID, b"scan_procs") not in maps.state and not scan.unwinds(PID)


def refused_scan(tmp_path: Path) -> tuple[Path, RecordingMaps, ScanMode]:
    """A process whose one arena has a patched stub copy, considered once."""
    proc = fake_proc(tmp_path, [ARENA], [ARENA, ARENA + 0x20], [ARENA])
    with open(proc / str(PID) / "mem", "r+b") as mem:
        mem.seek(ARENA + 0x400)
        mem.write(b"\x90" * 4)  # one copy patched
    maps = RecordingMaps()
    scan = ScanMode(maps, str(proc))
    scan.consider(PID, mappings(proc))
    return proc, maps, scan


def test_scan_mode_refuses_an_arena_whose_copies_differ(tmp_path):
    _proc, maps, scan = refused_scan(tmp_path)
    assert not scan.unwinds(PID) and not scan.unwound() and not maps.state
    assert scan.errors() == {"arena_bytes": 1}
    report = scan.report(PID)
    assert report.mode == FP and "arena_bytes" in report.detail and report.problem


def test_a_refusal_holds_until_the_process_is_forgotten(tmp_path):
    """New maps of a refused process are not verified again; an exec (the
    profiler forgets the old image) is: its arenas are new code."""
    proc, _maps, scan = refused_scan(tmp_path)
    scan.consider(PID, mappings(proc))  # its maps changed
    scan.refresh({PID})
    assert not scan.unwinds(PID) and scan.errors() == {"arena_bytes": 1}

    fake_proc(tmp_path / "exec", [ARENA], [ARENA, ARENA + 0x20], [ARENA])
    os.replace(tmp_path / "exec" / "proc" / str(PID) / "mem", proc / str(PID) / "mem")
    scan.forget(PID)
    scan.consider(PID, mappings(proc))
    assert scan.unwinds(PID) and scan.report(PID).mode == "scan"
    assert scan.errors() == {"arena_bytes": 1}


def test_scan_mode_refuses_a_fifo_at_the_perf_map_path_without_blocking(tmp_path):
    proc = fake_proc(tmp_path, [ARENA], [ARENA], [ARENA], perf_map="FIFO")
    maps = RecordingMaps()
    scan = ScanMode(maps, str(proc))
    scan.consider(PID, mappings(proc))  # would block forever on open() of the FIFO
    scan.refresh({PID})
    assert not scan.unwinds(PID) and not maps.calls


def descriptor(active: bool, arenas: list[tuple[int, int]], generation: int = 1,
               abi: int = 1) -> Descriptor:
    return Descriptor(
        pid=PID, address=0x1000, extension="/x/tramprof_trampolines/_runtime.so",
        abi_version=abi, arch=62, stub_size=16, stub_stride=32, stub_return_offset=12,
        state=1 if active else 0, tls_offset=-64, record_prev_offset=0, record_self_offset=8,
        record_fp_offset=16, writer_pid=PID, arenas_address=0x2000, arena_capacity=64,
        stub_count=3, generation=generation, runtime_version="0.1.0", python_version="3.11.2",
        arenas=Arenas(arenas))


def publish(monkeypatch, published: list[Descriptor]) -> list[int]:
    """The process's descriptor is ``published[-1]``; returns the pids whose
    whole descriptor was read."""
    reads: list[int] = []

    def read(pid, root, locator=None, mappings=None):
        reads.append(pid)
        return published[-1]

    monkeypatch.setattr(chain_module, "read_descriptor", read)
    monkeypatch.setattr(chain_module, "read_changes", lambda pid, known, root, memory: Changes(
        published[-1].generation, published[-1].duty))
    return reads


def watch_looks(monkeypatch, published: list[Descriptor]) -> list[int]:
    """As ``publish``; returns the pids whose descriptor was looked at (its
    generation read), in order."""
    publish(monkeypatch, published)
    looked: list[int] = []
    monkeypatch.setattr(chain_module, "read_changes", lambda pid, known, root, memory: (
        looked.append(pid), Changes(published[-1].generation, published[-1].duty))[1])
    return looked


@pytest.fixture
def runtime_mappings(tmp_path):
    proc = fake_proc(tmp_path, [ARENA], [ARENA], [ARENA])
    with open(proc / str(PID) / "maps", "a") as f:
        f.write("7f1000000000-7f1000010000 r-xp 00000000 fe:00 99 "
                "/venv/lib/python3.11/site-packages/tramprof_trampolines/_runtime.cpython-311"
                "-x86_64-linux-gnu.so\n")
    return proc


@pytest.mark.parametrize(("path", "expected"), [
    ("/venv/lib/python3.11/site-packages/tramprof_trampolines/_runtime.cpython-311"
     "-x86_64-linux-gnu.so", True),
    ("/usr/lib/python3/dist-packages/tramprof_trampolines/_runtime.abi3.so (deleted)", True),
    ("/opt/x/tramprof_trampolines/_runtime.cpython-311-x86_64-linux-gnu.so.bak", False),
    ("/opt/x/tramprof_trampolines/_runtime/evil.so", False),
    ("/opt/x/not_tramprof_trampolines/_runtimes.so", False),
    ("/usr/lib/x86_64-linux-gnu/libc.so.6", False),
    ("", False),
])
def test_the_runtime_extension_is_known_by_its_path(path, expected):
    assert is_runtime_extension(path) is expected
    assert is_runtime_extension(path) == bool(EXTENSION_RE.search(path))


def test_chain_mode_installs_once_active_and_grows_with_the_descriptor(runtime_mappings,
                                                                       monkeypatch):
    published = [descriptor(False, [])]
    publish(monkeypatch, published)
    maps = RecordingMaps()
    chain = ChainMode(maps, str(runtime_mappings))
    chain.consider(PID, mappings(runtime_mappings))
    assert not chain.unwinds(PID) and not chain.unwound() and not maps.state
    assert "not active" in chain.report(PID).detail

    published.append(descriptor(True, [(ARENA, ARENA + 0x10000)], generation=2))
    chain.refresh({PID})
    record, arenas = maps.state[(PID, b"chain_procs")]
    assert arenas == {(ARENA, ARENA + 0x10000)}
    assert (record.tls_offset, record.stub_stride, record.record_self) == (-64, 32, 8)
    assert chain.unwinds(PID) and chain.unwound() == {PID} and ARENA + 8 in chain.arenas(PID)

    published.append(descriptor(True, [(ARENA, ARENA + 0x10000), (ARENA + 0x20000,
                                                                   ARENA + 0x30000)], 3))
    chain.refresh({PID})
    assert maps.state[(PID, b"chain_procs")][1] == {(ARENA, ARENA + 0x10000),
                                                    (ARENA + 0x20000, ARENA + 0x30000)}
    chain.refresh(set())
    assert not maps.state


def test_chain_mode_reads_the_whole_descriptor_only_when_its_generation_moves(
        runtime_mappings, monkeypatch):
    duty = DutyState(duty_ppm=DUTY_ALWAYS, paused=False, hook_calls=10, off_ns=0,
                     paused_since_ns=0, call_cost_ps=20000)
    published = [replace(descriptor(True, [(ARENA, ARENA + 0x1000)], abi=2), duty=duty)]
    reads = publish(monkeypatch, published)
    chain = ChainMode(RecordingMaps(), str(runtime_mappings))
    seen: list[DutyState | None] = []
    monkeypatch.setattr(chain.duty, "update", lambda pid, state=None: seen.append(state))
    chain.consider(PID, mappings(runtime_mappings))
    assert seen == [duty]  # a runtime just found: its first duty step at once
    later = replace(duty, hook_calls=99)
    published.append(replace(published[-1], duty=later))  # same generation
    chain.refresh({PID})
    assert reads == [PID] and seen == [duty, later]
    published.append(replace(published[-1], generation=2, arenas=Arenas(
        [(ARENA, ARENA + 0x1000), (ARENA + 0x4000, ARENA + 0x5000)])))
    chain.refresh({PID})
    assert reads == [PID, PID] and ARENA + 0x4000 in chain.arenas(PID)


def test_between_drains_the_chain_mode_reads_only_what_the_walker_reported(
        runtime_mappings, monkeypatch):
    """After a drain (its samples not known) every runtime's descriptor is
    read; between drains only those whose chain met an arena not installed
    yet (the walker's report), and every one when an overhead budget is to
    be kept."""
    published = [descriptor(True, [(ARENA, ARENA + 0x1000)])]
    looked = watch_looks(monkeypatch, published)
    maps = RecordingMaps()
    chain = ChainMode(maps, str(runtime_mappings))
    chain.consider(PID, mappings(runtime_mappings))
    assert chain.unwinds(PID)
    published.append(descriptor(True, [(ARENA, ARENA + 0x1000), (ARENA + 0x8000, ARENA + 0x9000)],
                                generation=2))
    chain.refresh({PID}, full=False)
    assert looked == [] and ARENA + 0x8000 not in chain.arenas(PID)
    maps.stale = {PID, PID + 1}  # another process's report is not this mode's business
    chain.refresh({PID}, full=False)
    assert looked == [PID] and ARENA + 0x8000 in chain.arenas(PID)
    chain.refresh({PID}, full=False)
    assert looked == [PID]
    chain.refresh({PID})
    assert looked == [PID, PID]
    budgeted = ChainMode(maps, str(runtime_mappings), python_overhead_budget=0.05)
    budgeted.consider(PID, mappings(runtime_mappings))
    budgeted.refresh({PID}, full=False)
    assert looked == [PID] * 3


def test_after_a_drain_the_chain_mode_reads_the_sampled_the_reported_and_the_starting(
        runtime_mappings, monkeypatch):
    """After a drain whose samples are known, a runtime it had no samples of
    is not read: with nothing to walk, its new arenas wait until the walker
    meets one and reports it. The sampled, the reported and those not
    active yet are read; the exited are forgotten. After a resync (samples
    not known) every one is read."""
    published = [descriptor(False, [])]
    looked = watch_looks(monkeypatch, published)
    maps = RecordingMaps()
    chain = ChainMode(maps, str(runtime_mappings))
    quiet, sampled, reported, gone, starting = PID, PID + 1, PID + 2, PID + 3, PID + 4
    chain.consider(starting, mappings(runtime_mappings))
    published.append(descriptor(True, [(ARENA, ARENA + 0x1000)], generation=2))
    for pid in (quiet, sampled, reported, gone):
        chain.consider(pid, mappings(runtime_mappings))
    assert chain.unwound() == {quiet, sampled, reported, gone}
    grown = [(ARENA, ARENA + 0x1000), (ARENA + 0x8000, ARENA + 0x9000)]
    published.append(descriptor(True, grown, generation=3))
    maps.stale = {reported}
    live = {quiet, sampled, reported, starting}
    chain.refresh(live, full=True, sampled={sampled, gone, PID + 9})
    assert sorted(looked) == [sampled, reported, starting]
    for pid in (sampled, reported, starting):
        assert maps.state[(pid, b"chain_procs")][1] == set(grown)
    assert ARENA + 0x8000 not in chain.arenas(quiet)
    assert (gone, b"chain_procs") not in maps.state and chain.arenas(gone) is None
    assert chain.unwound() == live
    looked.clear()
    chain.refresh(live, full=True, sampled=set())
    assert looked == []
    chain.refresh(live)  # after a resync
    assert sorted(looked) == sorted(live)
    assert maps.state[(quiet, b"chain_procs")][1] == set(grown)


def test_chain_mode_counts_unreadable_and_unsupported_descriptors(runtime_mappings,
                                                                  monkeypatch):
    def unreadable(pid, root, locator=None, mappings=None):
        raise DescriptorError("cannot read mem")

    monkeypatch.setattr(chain_module, "read_descriptor", unreadable)
    chain = ChainMode(RecordingMaps(), str(runtime_mappings))
    chain.consider(PID, mappings(runtime_mappings))
    chain.refresh({PID})  # the same failure again is not counted twice
    assert chain.errors() == {"descriptor_unreadable": 1}
    assert chain.report(PID).problem

    monkeypatch.setattr(chain_module, "read_descriptor",
                        lambda pid, root, locator=None, mappings=None: descriptor(
                            True, [(ARENA, ARENA + 0x1000)], abi=9))
    chain.refresh({PID})
    assert chain.errors() == {"descriptor_unreadable": 1, "unsupported_runtime": 1}
    assert not chain.unwinds(PID)


def test_registry_prefers_chain_and_scan_lets_go(runtime_mappings, monkeypatch):
    """A -X perf process that activates our runtime moves from scan to chain."""
    published = [descriptor(False, [])]
    publish(monkeypatch, published)
    maps = RecordingMaps()
    modes = UnwindModes([ChainMode(maps, str(runtime_mappings)),
                         ScanMode(maps, str(runtime_mappings))])
    modes.consider(PID, mappings(runtime_mappings))
    assert modes.mode_of(PID) == "scan" and modes.names == ("chain", "scan", FP)
    published.append(descriptor(True, [(ARENA + 0x40000, ARENA + 0x50000)], generation=2))
    modes.refresh({PID})
    assert modes.mode_of(PID) == "chain"
    assert set(k for k in maps.state) == {(PID, b"chain_procs")}
    assert ARENA + 0x40000 in modes.arenas(PID) and ARENA not in modes.arenas(PID)
    assert modes.report(PID).mode == "chain"
    modes.forget(PID)
    assert modes.mode_of(PID) == FP and not maps.state
    assert modes.report(PID).mode == FP


def test_a_new_runtime_is_followed_between_refreshes_while_it_is_young(
        runtime_mappings, monkeypatch):
    """The .pth loads the runtime, then activates it, then the program's own
    code fills new arenas: each is taken up on the next wake of the loop
    after the walker reported it (not at the next full refresh), for the
    process's first seconds."""
    published = [descriptor(False, [])]
    reads: list[int] = []

    def read(pid, root, locator=None, mappings=None):
        reads.append(pid)
        return published[-1]

    publish(monkeypatch, published)
    monkeypatch.setattr(chain_module, "read_descriptor", read)
    clock = [1000.0]
    maps = RecordingMaps()
    chain = ChainMode(maps, str(runtime_mappings))
    chain._newcomers = Newcomers(now=lambda: clock[0])
    modes = UnwindModes([chain])
    modes.consider(PID, mappings(runtime_mappings))
    assert modes.mode_of(PID) == FP and modes.following()
    modes.follow(set())  # not (yet) a live process of the registry: not read
    assert reads == [PID]
    published.append(descriptor(True, [(ARENA, ARENA + 0x1000)], generation=2))
    modes.follow({PID})
    assert modes.mode_of(PID) == "chain" and maps.state[(PID, b"chain_procs")][1] == {
        (ARENA, ARENA + 0x1000)}
    published.append(descriptor(True, [(ARENA, ARENA + 0x1000), (ARENA + 0x8000, ARENA + 0x9000)],
                                generation=3))
    clock[0] += NEWCOMER_SECONDS - 0.1
    modes.follow({PID})  # active, and no report of its walker: nothing read
    assert reads == [PID] * 2
    maps.stale = {PID, PID + 1}
    modes.follow({PID})
    assert maps.state[(PID, b"chain_procs")][1] == {(ARENA, ARENA + 0x1000),
                                                     (ARENA + 0x8000, ARENA + 0x9000)}
    assert chain._stale == {PID + 1}  # kept for the next refresh
    clock[0] += 0.2  # no longer young: left to the full refresh
    maps.stale = {PID}
    modes.follow({PID})
    assert reads == [PID] * 3 and not modes.following()


def test_newcomers_leave_when_settled_or_old_and_at_most_a_limit_is_due():
    t0 = 100.0
    clock = [t0]
    newcomers = Newcomers(now=lambda: clock[0])
    last = NEWCOMER_LIMIT + 10
    for pid in range(1, last + 1):  # pid p taken at t0 + p ms
        clock[0] = t0 + pid * 0.001
        newcomers.add(pid)
    live = set(range(1, last + 1))
    # The newest first, at most the limit; the settled one leaves; one that is
    # not live is skipped.
    assert newcomers.due(live - {last}, candidates=live - {1}) == \
        list(range(last - 1, last - 1 - NEWCOMER_LIMIT, -1))
    newcomers.add(30)  # taken again: keeps its first time
    clock[0] = t0 + NEWCOMER_SECONDS + 0.0205  # pids 1..20 are too old now
    assert newcomers.due(live, candidates=live) == list(range(last, 20, -1))
    clock[0] += 1
    assert newcomers.due(live, candidates=live) == [] and not newcomers


def test_doctor_dry_run_installs_nothing(tmp_path):
    proc = fake_proc(tmp_path, [ARENA], [ARENA, ARENA + 0x20], [ARENA])
    modes = UnwindModes([ChainMode(DryRunMaps(), str(proc)), ScanMode(DryRunMaps(), str(proc))])
    modes.consider(PID, mappings(proc))
    report = modes.report(PID)
    assert report.mode == "scan" and "return offset 10, stride 16" in report.detail


# --- the real writer against fake BPF tables ---------------------------------


class FakeTable(dict):
    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def __setitem__(self, key, value) -> None:
        k = bytes(key)
        if k not in self and len(self) >= self.capacity:
            raise Exception("Could not update table: [Errno 7] Argument list too long")
        super().__setitem__(k, bytes(value))

    def __delitem__(self, key) -> None:
        super().__delitem__(bytes(key))


class FakeBpf:
    def __init__(self, pages: int) -> None:
        self.tables = {b"stub_pages": FakeTable(pages), b"chain_procs": FakeTable(64),
                       b"scan_procs": FakeTable(64)}

    def get_table(self, name, keytype=None, leaftype=None):
        return self.tables[name]


def pages_of(bpf: FakeBpf, tgid: int) -> set[int]:
    return {struct.unpack("<IIQ", k)[2] for k in bpf.tables[b"stub_pages"]
            if struct.unpack("<IIQ", k)[0] == tgid}


def test_writer_shares_pages_between_walkers_of_one_process():
    bpf = FakeBpf(pages=1000)
    writer = ProcessMaps(bpf)
    scan_rec = layout.ScanProc(stride_mask=15, return_offset=10)
    chain_rec = layout.ChainProc(tls_offset=-64, stub_stride=32, record_self=8)
    writer.install(7, b"scan_procs", scan_rec, [(0x10000, 0x12000)])
    writer.install(7, b"chain_procs", chain_rec, [(0x10000, 0x12000), (0x20000, 0x21000)])
    assert pages_of(bpf, 7) == {0x10000, 0x11000, 0x20000}
    writer.remove(7, b"scan_procs")  # the chain walker still needs the first arena
    assert pages_of(bpf, 7) == {0x10000, 0x11000, 0x20000}
    assert not bpf.tables[b"scan_procs"] and len(bpf.tables[b"chain_procs"]) == 1
    writer.remove(7, b"chain_procs")
    assert pages_of(bpf, 7) == set() and not bpf.tables[b"chain_procs"]


def test_writer_refuses_a_process_over_its_cap_and_rolls_back_a_full_map():
    bpf = FakeBpf(pages=10)
    writer = ProcessMaps(bpf, max_pages_per_process=8)
    record = layout.ChainProc(tls_offset=-64, stub_stride=32, record_self=8)
    # A lying descriptor claims a 1 GiB arena: refused before anything is written.
    with pytest.raises(MapFull, match="at most 8"):
        writer.install(1, b"chain_procs", record, [(0x10000, 0x10000 + (1 << 30))])
    assert not bpf.tables[b"stub_pages"] and not bpf.tables[b"chain_procs"]
    writer.install(2, b"chain_procs", record, [(0x10000, 0x16000)])  # 6 of 10 pages
    with pytest.raises(MapFull):  # 5 more do not fit: what was inserted is removed
        writer.install(3, b"chain_procs", record, [(0x40000, 0x45000)])
    assert pages_of(bpf, 3) == set() and len(bpf.tables[b"chain_procs"]) == 1
    assert pages_of(bpf, 2) == {0x10000 + i * 0x1000 for i in range(6)}
    assert writer.pages_held(3) == 0 and writer.pages_held(2) == 6


def test_scan_mode_backs_off_its_idle_looks_until_the_maps_change(tmp_path):
    """Each idle look (a perf map without Python entries) doubles the wait to
    the next, up to MAX_IDLE_LOOK_SECONDS; a change of the maps looks at once
    and starts again from IDLE_LOOK_SECONDS."""
    from tramprof.unwind.scan import IDLE_LOOK_SECONDS, MAX_IDLE_LOOK_SECONDS

    proc = fake_proc(tmp_path, [ARENA], [], [ARENA],
                     perf_map=f"{ARENA + 0x40:x} 20 LazyCompile:*main /app/a.js:1\n")
    scan = ScanMode(RecordingMaps(), str(proc))
    clock = [100.0]
    scan._now = lambda: clock[0]
    looks: list[float] = []
    update = scan._update
    scan._update = lambda pid: (looks.append(clock[0]), update(pid))[1]

    def refresh_every_second(seconds: int) -> list[float]:
        """The gaps between the looks over ``seconds`` of refreshes."""
        looks.clear()
        for _ in range(seconds):
            scan.refresh({PID})
            clock[0] += 1
        return [later - earlier for earlier, later in itertools.pairwise(looks)]

    scan.consider(PID, mappings(proc))  # the first look
    assert IDLE_LOOK_SECONDS == 10 and MAX_IDLE_LOOK_SECONDS == 160
    assert refresh_every_second(500) == [10, 20, 40, 80, 160, 160]
    scan.consider(PID, mappings(proc))  # its maps changed
    assert refresh_every_second(100) == [10, 20, 40]
    assert looks[0] == clock[0] - 100  # looked at the first refresh after the change


def test_scan_mode_looks_at_a_perf_map_without_python_entries_less_often(tmp_path):
    """node and the like write perf maps too: after its first look, such a
    process is looked at every IDLE_LOOK_SECONDS, not at every refresh, until
    a change of its maps brings it back at once."""
    from tramprof.unwind.scan import IDLE_LOOK_SECONDS

    proc = fake_proc(tmp_path, [ARENA], [], [ARENA],
                     perf_map=f"{ARENA + 0x40:x} 20 LazyCompile:*main /app/a.js:1\n")
    perf_map = proc.parent / "rootfs" / "tmp" / f"perf-{PID}.map"
    maps = RecordingMaps()
    scan = ScanMode(maps, str(proc))
    clock = [100.0]
    scan._now = lambda: clock[0]
    scan.consider(PID, mappings(proc))
    scan.refresh({PID})  # the first refresh looks again, then backs off
    assert not scan.unwinds(PID)
    with open(perf_map, "a") as f:
        f.write(f"{ARENA:x} {len(STUB):x} py::f:/app/a.py\n"
                f"{ARENA + 0x20:x} {len(STUB):x} py::g:/app/a.py\n")
    clock[0] += IDLE_LOOK_SECONDS - 1
    scan.refresh({PID})
    assert not scan.unwinds(PID)  # not looked at yet
    clock[0] += 1
    scan.refresh({PID})
    assert scan.unwinds(PID)

    # Another idle process; its maps change (an injection): the next refresh looks.
    scan.refresh(set())
    perf_map.write_text(f"{ARENA + 0x40:x} 20 LazyCompile:*main /app/a.js:1\n")
    scan.consider(PID, mappings(proc))
    scan.refresh({PID})
    with open(perf_map, "a") as f:
        f.write(f"{ARENA:x} {len(STUB):x} py::f:/app/a.py\n"
                f"{ARENA + 0x20:x} {len(STUB):x} py::g:/app/a.py\n")
    clock[0] += 1
    scan.refresh({PID})
    assert not scan.unwinds(PID)
    scan.consider(PID, mappings(proc))
    scan.refresh({PID})
    assert scan.unwinds(PID)
