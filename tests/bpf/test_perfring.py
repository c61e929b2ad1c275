"""The perf ring reader against the kernel's own rings: records in order and
whole (also those that wrap around the ring's end), lost records counted,
and a ring whose head claims more than it holds skipped, not trusted."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time

import pytest
from tramprof import speedups
from tramprof.sampler import perfring
from tramprof.sampler.compiler import LoadRequest, compile_and_load
from tramprof.sampler.loaded import online_cpus
from tramprof.sampler.perfring import PerfRing, close_rings, open_rings

from tests.conftest import requires_root

pytestmark = requires_root

PERF_EVENT = 7  # BPF_PROG_TYPE_PERF_EVENT
PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CPU_CLOCK = 1, 0

# Records of 28 bytes: with the raw size word 32, with the header 40, so a
# one-page ring (4,096 bytes) has records that wrap around its end.
WRITER = r"""
struct rec { u32 seq; u32 check[6]; };
BPF_PERF_OUTPUT(out);
/* Per CPU: each CPU's records are numbered 0, 1, 2... in its own ring. */
BPF_PERCPU_ARRAY(next_seq, u32, 1);
BPF_PERCPU_ARRAY(sent, u64, 2);  /* [0] written, [1] refused: the ring was full */

int writer(void *ctx) {
    u32 zero = 0, one = 1;
    u32 *seq = next_seq.lookup(&zero);
    if (!seq)
        return 0;
    struct rec r = {};
    r.seq = *seq;
    *seq += 1;
    #pragma unroll
    for (int i = 0; i < 6; i++)
        r.check[i] = r.seq * 7 + i;
    int err = out.perf_submit(ctx, &r, sizeof(r));
    u64 *count = sent.lookup(err ? &one : &zero);
    if (count)
        *count += 1;
    return 0;
}
"""
RECORD = struct.Struct("=7I")


@pytest.fixture
def writer():
    compiled = compile_and_load(LoadRequest(WRITER, [], [("writer", PERF_EVENT)], []))
    yield compiled.program
    compiled.program.cleanup()


def _seqs(records: list[bytes]) -> list[int]:
    """Each record's number, after checking that it is whole: its check
    words derive from its number, and the kernel's padding is zeros."""
    seqs = []
    for record in records:
        assert len(record) == 28, len(record)
        seq, *check = RECORD.unpack(record)
        assert check == [seq * 7 + i for i in range(6)], (seq, check)
        seqs.append(seq)
    return seqs


def _sampling(writer) -> tuple[list[PerfRing], dict[int, list[int]]]:
    """One-page rings on every CPU, written to by the program at 999 Hz,
    and an empty list of record numbers for each."""
    rings = open_rings(writer[b"out"], 1)
    try:
        writer.attach_perf_event(ev_type=PERF_TYPE_SOFTWARE, ev_config=PERF_COUNT_SW_CPU_CLOCK,
                                 fn_name=b"writer", sample_freq=999)
    except BaseException:
        close_rings(writer[b"out"], rings)
        raise
    return rings, {ring.cpu: [] for ring in rings}


def _read_all(rings: list[PerfRing], by_cpu: dict[int, list[int]]) -> int:
    """Read every ring once: each record's number goes to its CPU's list;
    returns the records told lost."""
    lost = 0
    for ring in rings:
        records, dropped = ring.read()
        by_cpu[ring.cpu] += _seqs(records)
        lost += dropped
    return lost


def _stopped(writer, rings: list[PerfRing], by_cpu: dict[int, list[int]]
             ) -> tuple[int, int, int]:
    """Stop the program, read what is left: the records told lost in it,
    and the program's counts of records written and refused."""
    writer.detach_perf_event(PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CPU_CLOCK)
    lost = _read_all(rings, by_cpu)
    return (lost, *_sent(writer))


def _sent(program) -> tuple[int, int]:
    sent = program[b"sent"]
    return sum(sent.getvalue(sent.Key(0))), sum(sent.getvalue(sent.Key(1)))


@pytest.mark.parametrize("part", ["compiled", "python"])
def test_records_come_whole_and_in_order_across_the_ring_end(writer, part, monkeypatch):
    """Read as they come from one-page rings at 999 Hz on every CPU for a
    second: every record written arrives exactly once, whole, in its CPU's
    order, ten times and more what a ring holds; with the compiled part's
    ordered accesses and with plain ones."""
    if part == "python":
        monkeypatch.setattr(speedups, "compiled", None)
    elif speedups.compiled is None:
        pytest.skip("the compiled part was not built")
    rings, by_cpu = _sampling(writer)
    lost = 0
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            lost += _read_all(rings, by_cpu)
            time.sleep(0.005)
        last_lost, written, refused = _stopped(writer, rings, by_cpu)
        lost += last_lost
    finally:
        close_rings(writer[b"out"], rings)
    assert sorted(by_cpu) == online_cpus()
    for cpu, seqs in by_cpu.items():
        assert seqs == list(range(len(seqs))), cpu  # all, in order, none twice
    received = sum(len(seqs) for seqs in by_cpu.values())
    assert received == written and refused == lost == 0
    assert received > 10 * 4096 // 40  # the rings went round many times


def test_records_that_did_not_fit_are_counted_as_lost(writer):
    """Rings left unread fill up: the records refused then are reported as
    lost at the next record there is room for, exactly, and the ones kept
    arrive in order. (Every CPU is kept busy: an idle CPU takes no samples,
    so it would tell its losses only later.)"""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in online_cpus()]
    rings, by_cpu = _sampling(writer)
    lost = 0
    try:
        time.sleep(0.5)  # ~500 records a CPU for ~100 places
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # room again: the losses are told
            lost += _read_all(rings, by_cpu)
            written, refused = _sent(writer)
            if refused and lost == refused:
                break
            time.sleep(0.005)
        last_lost, written, refused = _stopped(writer, rings, by_cpu)
        lost += last_lost
    finally:
        close_rings(writer[b"out"], rings)
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    for cpu, seqs in by_cpu.items():
        assert seqs == sorted(set(seqs)) and seqs[0] == 0, cpu  # in order, none twice
    assert sum(len(seqs) for seqs in by_cpu.values()) == written
    assert refused > 100 and lost == refused


def test_a_head_past_what_the_ring_holds_is_skipped_and_counted():
    """A control page whose head claims records the ring does not hold (not
    something a kernel writes; only the control page is writable, the
    records are the kernel's): what is there is skipped, counted as
    malformed, and reading goes on from the head."""
    ring = PerfRing(online_cpus()[0], 1)
    view = memoryview(ring._map)
    try:
        for head in (64, 1 << 40):  # zeros where a record's header should be
            struct.pack_into("=Q", view, perfring.DATA_HEAD, head)
            malformed = ring.malformed
            assert ring.read() == ([], 0)
            assert ring.malformed == malformed + 1
            assert struct.unpack_from("=Q", view, perfring.DATA_TAIL)[0] == head
            assert ring.read() == ([], 0) and ring.malformed == malformed + 1
    finally:
        view.release()
        ring.close()
    assert ring.fd == -1


def test_rings_open_one_a_cpu_and_close_with_every_descriptor(writer):
    """One perf event a CPU, in the array at its CPU; closing takes each out
    of the array and leaves no descriptor or mapping behind."""
    before = set(os.listdir("/proc/self/fd"))
    rings = open_rings(writer[b"out"], 2)
    assert [ring.cpu for ring in rings] == online_cpus()
    assert {os.readlink(f"/proc/self/fd/{ring.fd}") for ring in rings} == {
        "anon_inode:[perf_event]"}
    table = writer[b"out"]
    with open("/proc/self/maps") as maps:
        assert maps.read().count("[perf_event]") == len(rings)
    close_rings(table, rings)
    assert not set(os.listdir("/proc/self/fd")) - before
    with open("/proc/self/maps") as maps:
        assert "[perf_event]" not in maps.read()
    for cpu in online_cpus():  # taken out of the array (which user space cannot read)
        with pytest.raises(KeyError):
            del table[table.Key(cpu)]
    with pytest.raises(ValueError):
        PerfRing(0, 3)
