"""Table mode's decisions without BPF: which objects get tables, sharing,
the per-process mapping lists, the memory budget (real processes, a
recording writer)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
from tramprof.model import FrameSource, MappedFile
from tramprof.procfs.maps import Mapping, read_maps
from tramprof.sampler import layout
from tramprof.sampler.tables import CHUNK_BYTES, PROC_BYTES, TablesFull, chunks_for
from tramprof.unwind.cfi import compile_table
from tramprof.unwind.tables import TableMode, TableObject


class RecordingWriter:
    """Keeps what the mode would put in the BPF maps."""

    def __init__(self, slots: int = 1 << 16) -> None:
        self.loaded: dict[int, bytes] = {}
        self.processes: dict[int, list[tuple[int, int, int, int, int]]] = {}
        self.loads = 0
        self.unloads = 0
        self._next = 0
        self._slots = slots

    def load_rows(self, rows: bytes) -> int:
        need = chunks_for(len(rows) // 8)
        if self._next + need > self._slots:
            raise TablesFull("test")
        first = self._next * layout.UNWIND_CHUNK_ROWS
        self._next += need
        self.loaded[first] = rows
        self.loads += 1
        return first

    def unload_rows(self, first_row: int) -> None:
        del self.loaded[first_row]
        self.unloads += 1

    def set_unwind_process(self, tgid: int,
                           mappings: Sequence[layout.UnwindMapping]) -> None:
        self.processes[tgid] = [(m.start, m.end, m.bias, m.first_row, m.nr_rows)
                                for m in mappings]

    def remove_unwind_process(self, tgid: int) -> None:
        self.processes.pop(tgid, None)


def libc(mappings: list[Mapping]) -> Mapping:
    return next(m for m in mappings if m.is_exec and m.basename.startswith("libc.so"))


def code_in(*mappings: Mapping) -> tuple[FrameSource, ...]:
    """A stack's frames, leaf first, one in each of ``mappings``, located as
    the profiler names them (``ProcessImage.locate``)."""
    return tuple(FrameSource(m.start + 0x100 + i, MappedFile(m.display_path, m.start, m.end,
                                                              m.offset))
                 for i, m in enumerate(mappings))


def settle(mode: TableMode, live: set[int]) -> None:
    mode.refresh(live)
    mode.wait_for_builds(120)
    mode.refresh(live)


def table_libc(mode: TableMode, pids: list[int]) -> dict[int, list[Mapping]]:
    """Each process sampled in libc, the table built and installed."""
    maps = {pid: read_maps(pid) for pid in pids}
    for pid in pids:
        mode.consider(pid, maps[pid])
        mode.note_code(pid, code_in(libc(maps[pid])))
    settle(mode, set(pids))
    return maps


def test_one_table_per_object_shared_by_processes(sleepers: list[int]) -> None:
    writer = RecordingWriter()
    mode = TableMode(writer, 64 << 20)
    try:
        maps = table_libc(mode, sleepers)
    finally:
        mode.close()
    assert writer.loads == 1
    [(first, rows)] = writer.loaded.items()
    with open(libc(maps[sleepers[0]]).path, "rb") as f:
        assert rows == compile_table(f).rows
    for pid in sleepers:
        m = libc(maps[pid])
        [(start, end, bias, first_row, nr)] = writer.processes[pid]
        assert (start, end, first_row, nr) == (m.start, m.end, first, len(rows) // 8)
        # pc - bias is the ELF address: the mapping's file offset, through
        # libc's executable segment.
        assert m.start - bias == m.offset - next(
            o for o in mode.objects() if o.state == "loaded").segments[0][0] + next(
            o for o in mode.objects() if o.state == "loaded").segments[0][1]
        assert mode.unwinds(pid) and pid in mode.unwound()
    assert mode.stats.objects_loaded == 1
    assert mode.stats.table_bytes == chunks_for(len(rows) // 8) * CHUNK_BYTES + 2 * PROC_BYTES


def test_unsampled_objects_get_no_table(sleepers: list[int]) -> None:
    writer = RecordingWriter()
    mode = TableMode(writer, 64 << 20)
    try:
        pid = sleepers[0]
        mode.consider(pid, read_maps(pid))
        settle(mode, {pid})
    finally:
        mode.close()
    assert writer.loads == 0 and not writer.processes and not mode.unwinds(pid)


def test_frame_pointer_objects_are_left_to_the_fp_walk(tmp_path: Path) -> None:
    source = Path(__file__).resolve().parent.parent / "targets" / "chain.c"
    exe = tmp_path / "chain_fp"
    subprocess.run(["gcc", "-O2", "-fno-omit-frame-pointer", "-o", str(exe), str(source)],
                   check=True)
    proc = subprocess.Popen([str(exe), "30"], stdout=subprocess.PIPE)
    writer = RecordingWriter()
    mode = TableMode(writer, 64 << 20)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        maps = read_maps(proc.pid)
        main = next(m for m in maps if m.is_exec and m.path == str(exe))
        mode.consider(proc.pid, maps)
        mode.note_code(proc.pid, code_in(main))
        settle(mode, {proc.pid})
        report = mode.report(proc.pid)
    finally:
        mode.close()
        proc.kill()
        proc.wait()
    assert writer.loads == 0
    assert [o.state for o in mode.objects()] == ["frame_pointers"]
    assert report is not None and "keeps frame pointers" in report.detail
    assert mode.stats.builds["frame_pointers"] == 1


def test_budget_evicts_the_least_recently_sampled(sleepers: list[int]) -> None:
    pid = sleepers[0]
    maps = read_maps(pid)
    objects = [m for m in maps if m.is_exec and m.path.startswith("/")]
    assert len(objects) >= 3  # sleep, libc, ld.so
    sizes = {}
    for m in objects:
        with open(m.path, "rb") as f:
            sizes[m.path] = chunks_for(compile_table(f).row_count) * CHUNK_BYTES
    # Room for the largest one and the process list, not for all of them.
    budget = max(sizes.values()) + PROC_BYTES
    writer = RecordingWriter()
    mode = TableMode(writer, budget)
    try:
        mode.consider(pid, maps)
        for m in sorted(objects, key=lambda m: sizes[m.path]):
            mode.note_code(pid, code_in(m))
            settle(mode, {pid})
    finally:
        mode.close()
    assert mode.stats.table_bytes <= budget
    assert mode.stats.evictions >= 1
    assert writer.unloads == mode.stats.evictions
    # What stays loaded is what was sampled last: the largest object.
    [loaded] = [o for o in mode.objects() if o.state == "loaded"]
    assert chunks_for(loaded.rows) * CHUNK_BYTES == max(sizes.values())
    assert all(o.state in ("loaded", "evicted") for o in mode.objects())


def test_an_evicted_table_comes_back_when_sampled_after_the_back_off(sleepers: list[int]
                                                                      ) -> None:
    pid = sleepers[0]
    maps = read_maps(pid)
    first, second = libc(maps), next(m for m in maps if m.is_exec and "ld-linux" in m.path)
    writer = RecordingWriter()
    mode = TableMode(writer, 1)  # replaced below: room for one table at a time
    clock = [1000.0]
    mode._now = lambda: clock[0]  # type: ignore[method-assign]
    try:
        mode.consider(pid, maps)
        sizes = []
        for m in (first, second):
            with open(m.path, "rb") as f:
                sizes.append(chunks_for(compile_table(f).row_count) * CHUNK_BYTES)
        mode.budget_bytes = max(sizes) + PROC_BYTES
        mode.note_code(pid, code_in(first))
        settle(mode, {pid})
        clock[0] += 1
        mode.note_code(pid, code_in(second))
        settle(mode, {pid})
        states = {o.name: o.state for o in mode.objects()}
        assert sorted(states.values()) == ["evicted", "loaded"], states
        clock[0] += 10  # within the back-off: stays out
        mode.note_code(pid, code_in(first))
        settle(mode, {pid})
        assert writer.loads == 2
        clock[0] += 61
        mode.note_code(pid, code_in(first))
        settle(mode, {pid})
    finally:
        mode.close()
    assert writer.loads == 3 and mode.stats.evictions == 2
    assert {o.name: o.state for o in mode.objects()}[first.basename] == "loaded"


def test_exited_processes_are_forgotten(sleepers: list[int]) -> None:
    writer = RecordingWriter()
    mode = TableMode(writer, 64 << 20)
    try:
        pid = sleepers[0]
        maps = read_maps(pid)
        mode.consider(pid, maps)
        mode.note_code(pid, code_in(libc(maps)))
        settle(mode, {pid})
        assert pid in writer.processes
        mode.refresh(set())
    finally:
        mode.close()
    assert pid not in writer.processes and not mode.unwinds(pid) and pid not in mode.unwound()


def test_a_refresh_reworks_a_process_only_when_its_tables_change(
        sleepers: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every live process is refreshed each second; its mapping list is
    worked out again only after a load or an eviction, or when it wanted a
    new object, and then includes the new table."""
    looked_at: list[str] = []
    bias = TableObject.bias
    monkeypatch.setattr(TableObject, "bias",
                        lambda obj, m: looked_at.append(obj.name) or bias(obj, m))
    writer = RecordingWriter()
    mode = TableMode(writer, 64 << 20)
    try:
        maps = table_libc(mode, sleepers)
        assert all(len(writer.processes[pid]) == 1 for pid in sleepers)
        looked_at.clear()
        for _ in range(3):
            mode.refresh(set(sleepers))
        assert looked_at == []
        first = sleepers[0]
        loader = next(m for m in maps[first] if m.is_exec and "ld-linux" in m.path)
        mode.note_code(first, code_in(loader))
        settle(mode, set(sleepers))
        assert [len(writer.processes[pid]) for pid in sleepers] == [2, 1]
        looked_at.clear()
        mode.refresh(set(sleepers))
        assert looked_at == []
    finally:
        mode.close()


def test_every_object_a_stack_passes_through_is_wanted(sleepers: list[int]) -> None:
    """Frames that go back and forth between objects (libc, ld.so, libc, the
    program) and memory outside them make each of them wanted, once."""
    writer = RecordingWriter()
    mode = TableMode(writer, 64 << 20)
    pid = sleepers[0]
    maps = read_maps(pid)
    exec_files = [m for m in maps if m.is_exec and not m.is_anonymous and not m.is_special]
    c_library = libc(maps)
    loader = next(m for m in exec_files if m.basename.startswith("ld-linux"))
    program = next(m for m in exec_files if m.basename == "sleep")
    outside = next(m for m in maps if not m.is_exec)  # a gap for the table mode
    path = (c_library, outside, c_library, loader, outside, loader, c_library, program)
    mode.consider(pid, maps)
    mode.note_code(pid, (None, *code_in(*path), None))  # markers have no place
    settle(mode, {pid})
    tabled = {start for start, _end, _bias, _first, rows in writer.processes[pid] if rows}
    assert tabled == {c_library.start, loader.start, program.start}
