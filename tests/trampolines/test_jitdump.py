"""jitdump mode (TRAMPROF_TRAMPOLINES_JITDUMP=1): /tmp/jit-<pid>.dump holds
an UNWINDING_INFO + CODE_LOAD pair per stub, consistent with the perf map,
and perf itself turns it into ELF objects whose CFI unwinds the stub."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import struct
import subprocess
from pathlib import Path

import pytest

from .conftest import Interp, check, read_perf_map
from .test_runtime import STUB_TEMPLATE, TLS_PATCHES

pytestmark = pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 only")
JIT_ENV = {"TRAMPROF_TRAMPOLINES": "1", "TRAMPROF_TRAMPOLINES_JITDUMP": "1"}


def parse_jitdump(path: Path) -> tuple[dict, list[tuple[int, dict]]]:
    data = path.read_bytes()
    magic, version, size, mach, _pad, pid, _ts, flags = struct.unpack_from("<6IQQ", data, 0)
    header = {"magic": magic, "version": version, "size": size, "mach": mach, "pid": pid,
              "flags": flags}
    records = []
    pos = size
    while pos + 16 <= len(data):
        rid, total, _ts = struct.unpack_from("<IIQ", data, pos)
        assert total >= 16 and pos + total <= len(data), f"bad record at {pos}"
        body = data[pos + 16:pos + total]
        if rid == 0:
            rpid, tid, vma, addr, csize, index = struct.unpack_from("<IIQQQQ", body)
            end = body.index(b"\0", 40)
            records.append((0, {"pid": rpid, "tid": tid, "vma": vma, "addr": addr,
                                "size": csize, "index": index,
                                "name": body[40:end].decode(),
                                "code": body[end + 1:end + 1 + csize]}))
        elif rid == 4:
            usize, hsize, msize = struct.unpack_from("<QQQ", body)
            records.append((4, {"size": usize, "hdr": hsize, "mapped": msize,
                                "data": body[24:24 + usize]}))
        else:
            records.append((rid, {}))
        pos += total
    assert pos == len(data), "trailing garbage"
    return header, records


def test_jitdump_matches_perf_map(interp: Interp) -> None:
    out = json.loads(check(interp.run(interp.script("jitdump_target.py"), env=JIT_ENV)))
    path = interp.host_path(out["jitdump"])
    assert out["jitdump"] == f"/tmp/jit-{out['pid']}.dump"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    header, records = parse_jitdump(path)
    assert header == {"magic": 0x4A695444, "version": 1, "size": 40, "mach": 62,
                      "pid": out["pid"], "flags": 0}
    kinds = [k for k, _r in records]
    assert kinds == [4, 0] * (len(kinds) // 2)
    loads = [r for k, r in records if k == 0]
    unwinds = [r for k, r in records if k == 4]
    entries = read_perf_map(interp.host_path(out["map"]))
    assert [(r["addr"], r["size"], r["name"]) for r in loads] == entries
    assert [r["index"] for r in loads] == list(range(len(loads)))
    assert out["leaf"] in {r["addr"] for r in loads}
    for r in loads:
        assert r["vma"] == r["addr"]
        assert r["pid"] == out["pid"]
        code = bytearray(r["code"])
        (tls,) = struct.unpack_from("<i", code, TLS_PATCHES[0])
        for offset in TLS_PATCHES:
            assert struct.unpack_from("<i", code, offset)[0] == tls
            code[offset:offset + 4] = b"\0\0\0\0"
        assert bytes(code) == STUB_TEMPLATE
    blob = unwinds[0]["data"]
    assert all(u["data"] == blob for u in unwinds)
    assert unwinds[0]["hdr"] == 20
    assert unwinds[0]["mapped"] == (len(blob) + 7) & ~7
    # .eh_frame_hdr: version 1, one FDE.
    hdr = blob[-20:]
    assert hdr[:4] == bytes([1, 0x1b, 0x03, 0x3b])
    assert struct.unpack_from("<I", hdr, 8)[0] == 1


def test_perf_inject_unwinds_stubs(host_interp: Interp, tmp_path: Path) -> None:
    """perf record -k 1 + perf inject --jit builds one ELF per stub from our
    records; binutils decodes its CFI as the stub's real frame layout."""
    if shutil.which("perf") is None or shutil.which("readelf") is None:
        pytest.skip("perf (linux-perf) and readelf (binutils) are needed")
    data = tmp_path / "perf.data"
    env = {**os.environ, **host_interp.env, **JIT_ENV, "HOME": str(tmp_path)}
    proc = subprocess.run(
        ["perf", "record", "-q", "-k", "1", "-e", "cpu-clock", "-F", "999", "-g", "-o",
         str(data), "--", host_interp.python, host_interp.script("jitdump_target.py"), "0.5"],
        env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and "perf_event_open" in proc.stderr:
        pytest.skip(f"perf cannot sample here: {proc.stderr.strip()[:200]}")
    out = json.loads(check(proc, "perf record").strip().splitlines()[-1])
    injected = tmp_path / "perf.jit.data"
    check(subprocess.run(["perf", "inject", "--jit", "-i", str(data), "-o", str(injected)],
                         env=env, capture_output=True, text=True, timeout=300), "perf inject")
    # perf inject writes jitted-<pid>-<n>.so beside the jitdump file.
    jitted = sorted(Path(out["jitdump"]).parent.glob(f"jitted-{out['pid']}-*.so"))
    try:
        _check_jitted(jitted, env, injected)
    finally:
        for path in jitted:
            path.unlink()


def _check_jitted(jitted: list[Path], env: dict[str, str], injected: Path) -> None:
    assert jitted, "perf inject produced no jitted objects"
    frames = check(subprocess.run(["readelf", "--debug-dump=frames-interp", str(jitted[0])],
                                  capture_output=True, text=True), "readelf")
    text = check(subprocess.run(["readelf", "-S", "-W", str(jitted[0])],
                                capture_output=True, text=True), "readelf")
    text_addr = int(re.search(r"\.text\s+PROGBITS\s+([0-9a-f]+)", text).group(1), 16)
    fde = re.search(r"FDE cie=\w+ pc=([0-9a-f]+)\.\.([0-9a-f]+)", frames)
    assert fde, frames
    assert (int(fde.group(1), 16), int(fde.group(2), 16)) == (text_addr, text_addr + 66)
    rows = re.findall(r"^([0-9a-f]{16}) (\S+)\s+(\S+)\s+(\S+)", frames, re.M)
    table = {int(loc, 16) - text_addr: (cfa, rbp, ra) for loc, cfa, rbp, ra in rows
             if int(loc, 16) >= text_addr}
    assert table == {0: ("rsp+8", "u", "c-8"), 5: ("rsp+16", "c-16", "c-8"),
                     8: ("rbp+16", "c-16", "c-8"), 65: ("rsp+8", "u", "c-8")}, frames
    # perf resolves samples in the stubs to our names.
    report = check(subprocess.run(["perf", "report", "-i", str(injected), "--stdio",
                                   "--no-children", "--sort", "sym", "-g", "none"],
                                  env=env, capture_output=True, text=True, timeout=300),
                   "perf report")
    assert "py::" in report
