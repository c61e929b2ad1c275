"""tramprof_trampolines on every available interpreter (host 3.11 + Debian roots).

All C code runs in child interpreters (see conftest.check)."""

from __future__ import annotations

import json
import os
import re
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from tramprof.unwind import descriptor as trampoline_descriptor

from .conftest import Interp, check, read_perf_map

# The out-of-process reader is the profiler's (tramprof.unwind.descriptor).
desc = trampoline_descriptor

ON = {"TRAMPROF_TRAMPOLINES": "1"}
FIRST_ROUNDS, FIRST_MAX = 7, 21  # cost rounds at the first activation: ABI.md section 8
# Stub bytes, arch_prctl and fs-base chain walks are x86-64 specifics.
pytestmark = pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 only")

# The x86-64 stub as documented in trampolines/ABI.md, TLS displacement zeroed.
STUB_TEMPLATE = bytes.fromhex(
    "f30f1efa" "55" "4889e5" "4883ec10" "64488b0425" "00000000" "488945f0"
    "488d05e0ffffff" "488945f8" "488d45f0" "6448890425" "00000000" "ffd1"
    "488b4df0" "6448890c25" "00000000" "c9" "c3")
TLS_PATCHES = (17, 45, 60)


def run_json(interp: Interp, *args: str, env: dict[str, str] | None = None) -> dict:
    out = check(interp.run(*args, env=env), f"{interp.name} {' '.join(args)}")
    return json.loads(out.strip().splitlines()[-1])


def test_semantics_unchanged(interp: Interp) -> None:
    """Call counts, profile/trace events, generator, coroutine, async generator,
    exception, recursion and contextlib behaviour are identical with and
    without the runtime."""
    script = interp.script("semantics.py")
    plain = run_json(interp, script)
    traced = run_json(interp, script, env=ON)
    assert plain["active"] is None
    assert traced["active"] is True
    assert traced["results"]["counts"]["fib"] == 3193 + 177  # fib(16) and fib(10)
    for key in plain["results"]:
        assert traced["results"][key] == plain["results"][key], key
    assert traced["results"] == plain["results"]


def test_cost_rounds_leave_signals_and_profilers_alone(interp: Interp) -> None:
    """The runtime keeps measuring its cost per call while the program runs
    (one round a second, as a pending call): an exception a signal handler
    raises meanwhile still reaches the program, and a profile function never
    sees the measurement's calls (no rounds run while one is set)."""
    out = run_json(interp, interp.script("calibration.py"), env=ON)
    at_start, running, with_signals, profiled = out["rounds"]
    assert at_start + out["dropped_at_start"] <= FIRST_MAX, out  # at the first activation
    assert at_start >= FIRST_ROUNDS or at_start + out["dropped_at_start"] == FIRST_MAX, out
    assert running - at_start >= 2, out  # ~one a second for 3.5 s
    assert out["raised"] > 200 and out["caught"] == out["raised"], out
    assert profiled == with_signals, out
    assert out["profiled_names"] == ["fib"], out


def first_activation_kept_its_promise(cost_ps: int, kept: int, dropped: int) -> bool:
    """The first activation runs rounds until seven are kept and their mean
    is positive, dropping those that moved to another CPU, up to 21 in all;
    only a start that ran all 21 may leave the cost unknown (0)."""
    tried = kept + dropped
    return tried <= FIRST_MAX and (tried == FIRST_MAX or (cost_ps > 0 and kept >= FIRST_ROUNDS))


def test_every_start_publishes_a_cost_or_tries_every_round(interp: Interp, started: list) -> None:
    """A program that makes few Python calls gets no later rounds until it
    has made thousands, so its first activation must publish a cost if its
    rounds can show one. On 3.9 the hook costs ~7 ns a call, and seven
    rounds left no positive mean in about one start of twenty; 21 rounds
    still left none in one start of a hundred with both CPUs busy."""
    code = ("import os, sys, tramprof_trampolines as t\n"
            "t.activate()\n"
            "print(os.getpid(), t._debug_calibration_rounds(), t._debug_calibration_dropped(),"
            " flush=True)\n"
            "sys.stdin.read()\n")
    published = []
    for _ in range(20):
        proc = interp.popen("-c", code)
        started.append(proc)
        line = proc.stdout.readline().split()
        assert len(line) == 3, proc.stderr.read()
        pid, kept, dropped = (int(word) for word in line)
        duty = desc.read_descriptor(pid).duty
        assert duty is not None
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
        published.append((duty.call_cost_ps, kept, dropped))
    assert all(first_activation_kept_its_promise(*start) for start in published), published
    # A runtime that never found a cost would pass the above by trying every
    # round: one start in a hundred leaves it unknown, not one in four.
    assert sum(cost > 0 for cost, _, _ in published) >= 15, published


def test_chain_matches_python_stack(interp: Interp) -> None:
    """The per-thread chain equals the Python stack in every situation:
    nested, generator, deep recursion, after exceptions, coroutines, async
    generators, settrace/setprofile, 4 threads at once (head starts NULL)."""
    out = run_json(interp, interp.script("chain_probe.py"), env=ON)
    assert out["active"] is True
    names_by_address = {addr: name for addr, _size, name in
                        read_perf_map(interp.host_path(out["map"]))}
    labels = set()
    for probe in out["probes"]:
        labels.add(probe["label"])
        assert probe["first_is_debug_chain"], probe["label"]
        assert None not in probe["expected"], probe["label"]
        assert probe["chain"] == probe["expected"], probe["label"]
        assert [names_by_address.get(a) for a in probe["chain"]] == probe["names"], probe["label"]
    assert labels == {"nested", "generator", "deep", "after exceptions", "coroutine",
                      "async generator", "settrace", "end"}
    threads = {p["thread"] for p in out["probes"]}
    assert {"worker-0", "worker-1", "worker-2", "worker-3", "MainThread"} <= threads
    deep = [p for p in out["probes"] if p["label"] == "deep" and p["thread"] == "MainThread"]
    assert len(deep[0]["chain"]) > 300
    worker = next(p for p in out["probes"] if p["thread"] == "worker-0")
    assert worker["names"][-1].startswith("py::Thread._bootstrap:") or \
        worker["names"][-1].startswith("py::_bootstrap:")


def test_perf_map_content(interp: Interp, started: list) -> None:
    """Every executed function is in the map with qualname and filename, one
    line per stub, CPython's format, mode 0600, addresses inside the arenas."""
    proc = interp.popen(interp.script("blocker.py"), env=ON)
    started.append(proc)
    info = json.loads(proc.stdout.readline())
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    path = interp.perf_map(info["pid"])
    mode = os.stat(path).st_mode
    assert stat.S_IMODE(mode) == 0o600
    assert stat.S_ISREG(mode)
    entries = read_perf_map(path)
    d = desc.read_descriptor(info["pid"])
    addresses = [a for a, _s, _n in entries]
    assert len(set(addresses)) == len(addresses) == d.stub_count
    names = {n: a for a, _s, n in entries}
    script = interp.script("blocker.py")
    for fn in ("inner", "middle", "outer", "thread_inner", "thread_outer", "fs_base",
               "stack_names", "<module>"):
        assert f"py::{fn}:{script}" in names, fn
    for fn in ("inner", "middle", "outer"):
        assert names[f"py::{fn}:{script}"] == info["stubs"][fn]
    assert any(n.startswith("py::Thread.run:") or n.startswith("py::run:") for n in names)
    for address, size, _name in entries:
        assert size == d.stub_size
        start = d.arenas.slot_start(address, d.stub_stride)
        assert start == address, hex(address)


def test_descriptor_locator_parses_each_runtime_once(interp: Interp, started: list,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes of one runtime: its symbol table is parsed once, each
    descriptor is then read in place, and an address that no longer holds a
    descriptor is looked up afresh, giving what a fresh reader gives."""
    pids = []
    for _ in range(2):
        proc = interp.popen(interp.script("blocker.py"), env=ON)
        started.append(proc)
        pids.append(json.loads(proc.stdout.readline())["pid"])
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    parsed: list[str] = []
    real = desc._dynsym_value
    monkeypatch.setattr(desc, "_dynsym_value", lambda f, name: parsed.append(name) or real(f, name))
    maps_read: list[int] = []
    real_maps = desc.read_maps
    monkeypatch.setattr(desc, "read_maps", lambda pid, root: maps_read.append(pid) or
                        real_maps(pid, root))
    locator = desc.DescriptorLocator()
    for _ in range(3):
        for pid in pids:
            assert desc.read_descriptor(pid, locator=locator) == desc.read_descriptor(pid)
    fresh_reads = 3 * len(pids)  # the reads without a locator
    assert len(parsed) - fresh_reads == 1
    assert len(maps_read) - fresh_reads == len(pids)
    address, path = locator.known(pids[0])
    locator.remember(pids[0], (address + 8, path))  # no magic there
    assert desc.read_descriptor(pids[0], locator=locator).address == address
    assert locator.known(pids[0]) == (address, path)


def test_descriptor_from_another_process(interp: Interp, started: list) -> None:
    """read_descriptor() from this process sees a layout consistent with the
    perf map, /proc/PID/maps and the stub bytes; walking each blocked
    thread's chain from outside (fs base + tls_offset) gives its Python stack."""
    proc = interp.popen(interp.script("blocker.py"), env=ON)
    started.append(proc)
    info = json.loads(proc.stdout.readline())
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    pid = info["pid"]
    d = desc.read_descriptor(pid)
    assert (d.abi_version, d.arch, d.state, d.writer_pid) == (2, 62, 1, pid)
    assert (d.stub_size, d.stub_stride, d.stub_return_offset) == (66, 80, 51)
    assert (d.record_prev_offset, d.record_self_offset, d.record_fp_offset) == (0, 8, 16)
    assert d.python_version == info["python"]
    assert d.runtime_version.startswith("tramprof-trampolines ")
    assert -4096 < d.tls_offset < 0
    assert 1 <= len(d.arenas) <= d.arena_capacity
    # The small read that follows it gives the same generation and duty words.
    changes = desc.read_changes(pid, d)
    assert changes.generation == d.generation and changes.duty == desc.read_duty(pid, d.address)
    assert d.duty is not None
    assert first_activation_kept_its_promise(d.duty.call_cost_ps, *info["calibration"]), info

    # Arenas are anonymous r-x mappings; every stub holds the documented code.
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    for start, end in d.arenas:
        line = next(x for x in maps if x.startswith(f"{start:x}-{end:x} "))
        assert line.split()[1] == "r-xp"
        assert len(line.split()) == 5 or line.split()[5].startswith("[anon:")
    entries = read_perf_map(interp.perf_map(pid))
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for address, _size, _name in entries[:50] + entries[-50:]:
            mem.seek(address)
            code = bytearray(mem.read(d.stub_stride))
            for offset in TLS_PATCHES:
                (disp,) = struct.unpack_from("<i", code, offset)
                assert disp == d.tls_offset
                code[offset:offset + 4] = b"\0\0\0\0"
            assert bytes(code[:d.stub_size]) == STUB_TEMPLATE
            assert set(code[d.stub_size:]) == {0xCC}
            assert code[d.stub_return_offset - 2:d.stub_return_offset] == b"\xff\xd1"

    # The out-of-process chain walk, as the BPF unwinder does it.
    names = {a: n for a, _s, n in entries}
    for fs_key, names_key in (("main_fs", "main_names"), ("thread_fs", "thread_names")):
        chain = desc.read_chain(pid, d, info[fs_key])
        assert [names[stub] for _record, stub in chain] == info[names_key]
        records = [record for record, _stub in chain]
        assert records == sorted(records)  # outer frames higher on the stack
        # Each record's frame holds the return address into the hook, and
        # the frame pointer (record + fp offset) is the saved-rbp slot.
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            for record in records:
                mem.seek(record + d.record_fp_offset + 8)
                (ret,) = struct.unpack("<Q", mem.read(8))
                assert ret not in d.arenas  # returns into the C hook
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0, proc.stderr.read()


def test_fork_child_writes_own_map(interp: Interp) -> None:
    out = run_json(interp, interp.script("forker.py"))
    child = out["child"]
    assert out["status"] == 0
    parent_map = interp.host_path(out["parent_map"])
    child_map = interp.host_path(child["map"])
    assert child["map"] == f"/tmp/perf-{child['pid']}.map"
    assert child["descriptor_pid"] == child["pid"]
    assert child["active"] is True
    assert stat.S_IMODE(os.stat(child_map).st_mode) == 0o600
    inherited = parent_map.read_text()[:out["size_at_fork"]]
    child_text = child_map.read_text()
    assert child_text.startswith(inherited)
    child_entries = {n: a for a, _s, n in read_perf_map(child_map)}
    parent_entries = {n: a for a, _s, n in read_perf_map(parent_map)}
    script = interp.script("forker.py")
    assert child_entries[f"py::child_only:{script}"] == child["child_only"]
    assert child_entries[f"py::before_fork:{script}"] == child["before_fork"]
    assert f"py::child_only:{script}" not in parent_entries
    assert out["child_only_in_parent"] is None
    assert f"py::parent_after_fork:{script}" in parent_entries
    assert f"py::parent_after_fork:{script}" not in child_entries


def test_lifecycle(interp: Interp) -> None:
    out = run_json(interp, interp.script("lifecycle.py"))
    assert out["initial"] is False
    assert out["after_activate"] == [True, "stubs", True]
    assert out["after_deactivate"] == [False, None, True, True]
    assert out["reactivated"] == [True, True]
    assert "another mode" in out["mode_switch_error"]
    assert out["hook_only"] == [True, "hook-only", True, True]
    assert "mode must be one of" in out["bad_mode"]


def test_refuses_foreign_eval_frame(interp: Interp) -> None:
    """Another PEP 523 evaluator is never replaced."""
    so = interp.workdir + "/foreign_eval.so"
    check(interp.run("gcc", "-shared", "-fPIC", "-O2", "-o", so,
                     interp.script("foreign_eval.c"), python_args=False), "gcc")
    out = run_json(interp, interp.script("foreign_hook.py"), so)
    assert out["foreign_calls_before"] is True
    assert out["error"] and "another eval-frame function" in out["error"]
    assert out["still_foreign"] is True
    assert out["is_active"] is False
    assert out["work_stub"] is None


def test_refuses_builtin_perf_trampoline(interp: Interp) -> None:
    if interp.version < (3, 12):
        pytest.skip("CPython's perf trampoline exists from 3.12")
    code = ("import tramprof_trampolines as t\n"
            "try:\n    t.activate()\nexcept t.TrampolineError as e:\n    print(e)\n")
    out = check(interp.run("-X", "perf", "-c", code))
    assert "perf trampoline is active" in out
    # Through the .pth: a warning, and the program still runs.
    proc = interp.run("-X", "perf", "-c", "print('ran')", env=ON)
    check(proc)
    assert proc.stdout.strip() == "ran"
    assert "not activated" in proc.stderr


def test_pth_activation(interp: Interp) -> None:
    code = ("import sys, json; m = sys.modules.get('tramprof_trampolines'); "
            "print(json.dumps([m is not None, m is not None and m.is_active()]))")
    assert json.loads(check(interp.run("-c", code))) == [False, False]
    assert json.loads(check(interp.run("-c", code, env={"TRAMPROF_TRAMPOLINES": "0"}))) == \
        [False, False]
    assert json.loads(check(interp.run("-c", code, env=ON))) == [True, True]
    # Hook-only mode through the environment.
    mode = check(interp.run("-c", "import tramprof_trampolines as t; print(t.mode())",
                            env={**ON, "TRAMPROF_TRAMPOLINES_MODE": "hook-only"}))
    assert mode.strip() == "hook-only"


def test_cli_script_and_module(interp: Interp) -> None:
    script = interp.script("cli_target.py")
    proc = interp.run("-m", "tramprof_trampolines", script, "a", "--b")
    assert proc.returncode == 3, proc.stderr
    out = json.loads(proc.stdout)
    assert out == {"argv": [script, "a", "--b"], "name": "__main__", "active": True,
                   "path0": interp.scripts}
    proc = interp.run("-m", "tramprof_trampolines", "-m", "cli_target", "x", cwd=interp.scripts)
    assert proc.returncode == 3, proc.stderr
    out = json.loads(proc.stdout)
    assert out["argv"] == [script, "x"]
    assert out["name"] == "__main__"
    assert out["active"] is True
    proc = interp.run("-m", "tramprof_trampolines")
    assert proc.returncode == 2
    assert "usage" in proc.stderr


def test_descriptor_layout_matches_header(interp: Interp) -> None:
    """descriptor.py's struct layout equals the C struct as cffi sees it."""
    code = ("import json; from tramprof_trampolines._runtime import ffi\n"
            "t = 'struct tramprof_descriptor'\n"
            "print(json.dumps({'size': ffi.sizeof(t), 'offsets': "
            "{f: ffi.offsetof(t, f) for f, _ in ffi.typeof(t).fields}}))")
    out = json.loads(check(interp.run("-c", code)))
    assert out["size"] == desc.DESCRIPTOR_SIZE == 184
    # Offset of each field in the reader's struct format, in order.
    offsets = []
    pos = 0
    for count, char in re.findall(r"(\d*)([a-zA-Z])", desc._LAYOUT.format.lstrip("<")):
        n = int(count or 1)
        for _ in range(1 if char == "s" else n):
            offsets.append(pos)
            pos += n if char == "s" else struct.calcsize("<" + char)
    c_offsets = dict(out["offsets"])
    c_offsets["arenas_address"] = c_offsets.pop("arenas")
    assert [c_offsets[f] for f in (*desc.FIELDS, *desc.DUTY_FIELDS)] == offsets
    assert c_offsets["duty_ppm"] == desc.DUTY_PPM_OFFSET
    assert c_offsets["paused"] == desc.PAUSED_OFFSET


def test_descriptor_errors(tmp_path: Path) -> None:
    """A process without the runtime yields DescriptorError, not garbage."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        with pytest.raises(desc.DescriptorError, match="has not loaded"):
            desc.read_descriptor(proc.pid)
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait()
    with pytest.raises(desc.DescriptorError):
        desc.read_descriptor(2**22 + 12345)


SUBINTERPRETER = """
import json, sys
try:
    import _interpreters as interpreters
except ImportError:
    import _xxsubinterpreters as interpreters
import tramprof_trampolines as t
sub = interpreters.create()
interpreters.run_string(sub, '''
import sys
print("sub", "_tramprof_trampolines_boot" in sys.modules, "tramprof_trampolines" in sys.modules)
''')
interpreters.destroy(sub)
print("main", t.is_active())
"""


def test_subinterpreters_are_left_alone(interp: Interp) -> None:
    """Sub-interpreters run site (and our .pth) too: the runtime stays out of
    them silently, and the main interpreter keeps its hook."""
    if interp.version < (3, 12):
        pytest.skip("isolated sub-interpreters appear in 3.12")
    proc = interp.run("-c", SUBINTERPRETER, env=ON)
    out = check(proc).split("\n")
    assert "sub True False" in out
    assert "main True" in out
    assert "tramprof" not in proc.stderr
    assert "Traceback" not in proc.stderr
