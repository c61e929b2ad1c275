"""The ctypes mirrors match bpf/tramprof.h as a C compiler lays it out."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from tramprof.sampler import layout as bpf_layout
from tramprof.sampler.drain import decode_user_stack, decode_user_stack_key
from tramprof.sampler.program import bpf_source_dir, program_source

STRUCTS = {
    "tp_config": bpf_layout.Config,
    "tp_frame": bpf_layout.Frame,
    "tp_user_stack": bpf_layout.UserStack,
    "tp_native_stack": bpf_layout.NativeStack,
    "tp_sample_key": bpf_layout.SampleKey,
    "tp_process_seen": bpf_layout.ProcessSeen,
    "tp_chain_proc": bpf_layout.ChainProc,
    "tp_stub_page": bpf_layout.StubPage,
    "tp_scan_proc": bpf_layout.ScanProc,
    "tp_unwind_row": bpf_layout.UnwindRow,
    "tp_unwind_mapping": bpf_layout.UnwindMapping,
    "tp_unwind_proc": bpf_layout.UnwindProc,
}
# Header constant -> its mirror in sampler.layout.
CONSTANTS = {
    "TP_MAX_FRAMES": "MAX_FRAMES", "TP_COMM_LEN": "COMM_LEN", "TP_CNT_MAX": "COUNTER_COUNT",
    "TP_MAX_TRAMP": "MAX_TRAMP", "TP_USTACK_TRUNCATED": "USTACK_TRUNCATED",
    "TP_USTACK_FAULT": "USTACK_FAULT", "TP_USTACK_NO_USER": "USTACK_NO_USER",
    "TP_CHAIN_TRUNCATED": "CHAIN_TRUNCATED", "TP_CHAIN_INVALID": "CHAIN_INVALID",
    "TP_SCAN_TRUNCATED": "SCAN_TRUNCATED", "TP_SCAN_OVERFLOW": "SCAN_OVERFLOW",
    "TP_TABLE_STOP": "TABLE_STOP", "TP_USTACK_ROOT": "USTACK_ROOT",
    "TP_PYTHON_PAUSED": "PYTHON_PAUSED", "TP_USTACK_HASH_TRAMP": "USTACK_HASH_TRAMP",
    "TP_CFA_KIND_BITS": "CFA_KIND_BITS", "TP_CFA_KIND_MASK": "CFA_KIND_MASK",
    "TP_CFA_RSP": "CFA_RSP", "TP_CFA_RBP": "CFA_RBP", "TP_CFA_PLT": "CFA_PLT",
    "TP_CFA_SIGNAL": "CFA_SIGNAL", "TP_CFA_END": "CFA_END", "TP_CFA_NONE": "CFA_NONE",
    "TP_CFA_UNSUPPORTED": "CFA_UNSUPPORTED", "TP_UNWIND_CHUNK_ROWS": "UNWIND_CHUNK_ROWS",
    "TP_MAX_UNWIND_MAPPINGS": "MAX_UNWIND_MAPPINGS",
}
KEYS_IN_PROGRAM = {"tp_count_key": bpf_layout.CountKey, "tp_ustack_key": bpf_layout.UserStackKey}


def _c_layout(tmp_path, header_code: str, structs: dict[str, type]) -> dict[str, int]:
    lines = []
    for cname, mirror in structs.items():
        lines.append(f'printf("{cname} size %zu\\n", sizeof(struct {cname}));')
        for field, *_ in mirror._fields_:
            lines.append(f'printf("{cname}.{field} %zu\\n", offsetof(struct {cname}, {field}));')
    program = tmp_path / "layout.c"
    program.write_text(
        "#include <stdio.h>\n#include <stddef.h>\n#include <linux/types.h>\n"
        f"{header_code}\nint main(void) {{\n" + "\n".join(lines) + "\n"
        + "".join(f'printf("{c} %d\\n", {c});\n' for c in CONSTANTS) +
        "return 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run(["gcc", f"-I{bpf_source_dir()}", "-o", str(exe), str(program)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in (line.rsplit(" ", 1) for line in out.splitlines())}


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_shared_structs_match(tmp_path):
    # The map keys are defined in the program itself; lift their definitions.
    source = program_source()
    key_defs = "\n".join(re.search(rf"struct {name} \{{.*?\}};", source, re.S).group(0)
                         for name in KEYS_IN_PROGRAM)
    layout = _c_layout(tmp_path, '#include "tramprof.h"\n' + key_defs,
                       {**STRUCTS, **KEYS_IN_PROGRAM})
    for cname, mirror in {**STRUCTS, **KEYS_IN_PROGRAM}.items():
        assert layout[f"{cname} size"] == ctypes.sizeof(mirror), cname
        for field, *_ in mirror._fields_:
            assert layout[f"{cname}.{field}"] == getattr(mirror, field).offset, (cname, field)
    for constant, mirror in CONSTANTS.items():
        assert layout[constant] == getattr(bpf_layout, mirror), constant

def test_counter_enum_matches_header():
    header = Path(bpf_source_dir(), "tramprof.h").read_text()
    body = re.search(r"enum tp_counter \{(.*?)\};", header, re.S).group(1)
    names = re.findall(r"^\s*TP_CNT_([A-Z_]+)", body, re.M)
    names.remove("MAX")
    assert names == [c.name for c in bpf_layout.Counter]


def test_a_user_stack_is_decoded_from_its_bytes_as_its_fields_say():
    """The drain decodes stored stacks from raw bytes, not through ctypes:
    its offsets must be the structure's (the check hash too: it names the
    stack across drains), and counts past the arrays are cut."""
    stack = bpf_layout.UserStack(nr=3, flags=bpf_layout.USTACK_TRUNCATED, check=0xdead,
                                 nr_tramp=2)
    for i in range(3):
        stack.frames[i] = bpf_layout.Frame(0x1000 + i, 0x7000 + i)
    for i in range(2):
        stack.tramp[i] = bpf_layout.Frame(0x2000 + i, 0x8000 + i)
    assert decode_user_stack(memoryview(bytes(stack))) == (
        (0x1000, 0x1001, 0x1002), (0x7000, 0x7001, 0x7002),
        ((0x2000, 0x8000), (0x2001, 0x8001)),
        bpf_layout.USTACK_TRUNCATED, 0xdead)

    key = bpf_layout.UserStackKey(hash=0x1234_5678_9ABC_DEF0, buffer=1)
    assert decode_user_stack_key(bytes(key)) == (0x1234_5678_9ABC_DEF0, 1)

    stack.nr, stack.nr_tramp = 1000, 1000  # a count the arrays cannot hold
    ips, sps, tramp, _flags, _check = decode_user_stack(memoryview(bytes(stack)))
    assert (len(ips), len(sps), len(tramp)) == (bpf_layout.MAX_FRAMES, bpf_layout.MAX_FRAMES,
                                                bpf_layout.MAX_TRAMP)


def test_a_native_stack_is_a_user_stack_cut_before_its_trampoline_frames():
    """The program stores a stack without trampoline frames from the same
    scratch copy, by its first bytes: they must decode as the whole would."""
    assert ctypes.sizeof(bpf_layout.NativeStack) == bpf_layout.UserStack.tramp.offset
    stack = bpf_layout.UserStack(nr=2, flags=bpf_layout.USTACK_TRUNCATED, check=0xbeef)
    stack.frames[0] = bpf_layout.Frame(0x1000, 0x7000)
    stack.frames[1] = bpf_layout.Frame(0x1001, 0x7008)
    whole = bytes(stack)
    native = whole[:ctypes.sizeof(bpf_layout.NativeStack)]
    assert decode_user_stack(memoryview(native)) == decode_user_stack(memoryview(whole)) == (
        (0x1000, 0x1001), (0x7000, 0x7008), (), bpf_layout.USTACK_TRUNCATED, 0xbeef)
