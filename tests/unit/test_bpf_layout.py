"""The ctypes mirrors match bpf/tramprof.h as a C compiler lays it out."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from tramprof.sampler import layout as bpf_layout
from tramprof.sampler.program import bpf_source_dir, program_source

STRUCTS = {
    "tp_config": bpf_layout.Config,
    "tp_frame": bpf_layout.Frame,
    "tp_user_stack": bpf_layout.UserStack,
    "tp_sample_key": bpf_layout.SampleKey,
    "tp_process_seen": bpf_layout.ProcessSeen,
    "tp_chain_proc": bpf_layout.ChainProc,
    "tp_stub_page": bpf_layout.StubPage,
    "tp_scan_proc": bpf_layout.ScanProc,
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
        f"{header_code}\nint main(void) {{\n" + "\n".join(lines) +
        '\nprintf("TP_MAX_FRAMES %d\\nTP_COMM_LEN %d\\nTP_CNT_MAX %d\\n",'
        " TP_MAX_FRAMES, TP_COMM_LEN, TP_CNT_MAX);\n"
        'printf("TP_MAX_TRAMP %d\\nTP_CHAIN_TRUNCATED %d\\nTP_CHAIN_INVALID %d\\n",'
        " TP_MAX_TRAMP, TP_CHAIN_TRUNCATED, TP_CHAIN_INVALID);\n"
        'printf("TP_SCAN_TRUNCATED %d\\nTP_SCAN_OVERFLOW %d\\n",'
        " TP_SCAN_TRUNCATED, TP_SCAN_OVERFLOW);"
        "\n"
        '\nprintf("TP_USTACK_TRUNCATED %d\\nTP_USTACK_FAULT %d\\nTP_USTACK_NO_USER %d\\n",'
        " TP_USTACK_TRUNCATED, TP_USTACK_FAULT, TP_USTACK_NO_USER);\nreturn 0;\n}\n")
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
    assert layout["TP_MAX_FRAMES"] == bpf_layout.MAX_FRAMES
    assert layout["TP_COMM_LEN"] == bpf_layout.COMM_LEN
    assert layout["TP_CNT_MAX"] == bpf_layout.COUNTER_COUNT
    assert layout["TP_USTACK_TRUNCATED"] == bpf_layout.USTACK_TRUNCATED
    assert layout["TP_USTACK_FAULT"] == bpf_layout.USTACK_FAULT
    assert layout["TP_USTACK_NO_USER"] == bpf_layout.USTACK_NO_USER
    assert layout["TP_MAX_TRAMP"] == bpf_layout.MAX_TRAMP
    assert layout["TP_CHAIN_TRUNCATED"] == bpf_layout.CHAIN_TRUNCATED
    assert layout["TP_CHAIN_INVALID"] == bpf_layout.CHAIN_INVALID
    assert layout["TP_SCAN_TRUNCATED"] == bpf_layout.SCAN_TRUNCATED
    assert layout["TP_SCAN_OVERFLOW"] == bpf_layout.SCAN_OVERFLOW


def test_counter_enum_matches_header():
    header = Path(bpf_source_dir(), "tramprof.h").read_text()
    body = re.search(r"enum tp_counter \{(.*?)\};", header, re.S).group(1)
    names = re.findall(r"^\s*TP_CNT_([A-Z_]+)", body, re.M)
    names.remove("MAX")
    assert names == [c.name for c in bpf_layout.Counter]
