"""The unwind-table compiler, row by row against binutils' own reading of the
same call-frame information (``readelf --debug-dump=frames-interp``)."""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from tramprof.sampler import layout
from tramprof.unwind.cfi import CfiError, UnwindTable, compile_table

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("readelf") is None,
                                reason="needs gcc and readelf (binutils)")

LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")

SOURCE = r"""
#include <stdio.h>
#include <string.h>
#include <alloca.h>
__attribute__((noinline)) int vla(int n) {
    char *p = alloca(n); memset(p, n, n);
    int s = 0; for (int i = 0; i < n; i++) s += p[i]; return s;
}
__attribute__((noinline)) int leaf(int x) { return x * 3 + 1; }
__attribute__((noinline)) int saves(int x) {
    int a = leaf(x), b = leaf(a), c = leaf(b); return a + b + c + vla(x);
}
int main(int argc, char **argv) { printf("%d\n", saves(argc * 100)); return 0; }
"""

_FDE = re.compile(r"^\S+ \S+ \S+ FDE cie=(\S+) pc=([0-9a-f]+)\.\.([0-9a-f]+)")
_CIE = re.compile(r"^(\S+) \S+ \S+ CIE \"([^\"]*)\"")


def readelf_rows(path: Path) -> list[tuple[int, int, str, str, str, bool]]:
    """(pc, end, CFA, rbp, ra, signal frame) of every row binutils decodes."""
    # readelf exits 1 on objects whose separate debug file it cannot follow;
    # the frames it printed are complete.
    text = subprocess.run(["readelf", "--debug-dump=frames-interp", str(path)],
                          capture_output=True, text=True, check=False).stdout
    assert "FDE" in text
    rows: list[tuple[int, int, str, str, str, bool]] = []
    cie_rows: dict[str, tuple[str, str, str]] = {}
    cie_signal: dict[str, bool] = {}
    current: tuple[str, int, int] | None = None   # (cie, start, end) of an FDE
    cie: str | None = None
    columns: list[str] = []
    had_rows = False

    def close_fde() -> None:
        if current is not None and not had_rows and current[0] in cie_rows:
            cfa, rbp, ra = cie_rows[current[0]]
            rows.append((current[1], current[2], cfa, rbp, ra, cie_signal[current[0]]))

    for line in text.splitlines():
        if m := _CIE.match(line):
            close_fde()
            current, cie, had_rows = None, m.group(1), False
            cie_signal[cie] = "S" in m.group(2)
            continue
        if m := _FDE.match(line):
            close_fde()
            current = (m.group(1), int(m.group(2), 16), int(m.group(3), 16))
            cie, had_rows = None, False
            continue
        if line.startswith("   LOC"):
            columns = line.split()
            continue
        parts = line.split()
        if parts and len(parts) == len(columns) and re.fullmatch(r"[0-9a-f]{16}", parts[0]):
            values = dict(zip(columns, parts, strict=True))
            row = (values["CFA"], values.get("rbp", "u"), values["ra"])
            if cie is not None:
                cie_rows.setdefault(cie, row)
            elif current is not None:
                had_rows = True
                rows.append((int(parts[0], 16), current[2], *row,
                             cie_signal.get(current[0], False)))
    close_fde()
    return rows


def expected(cfa: str, rbp: str, ra: str, signal: bool) -> tuple[int, ...] | None:
    """The row tramprof must produce for one readelf row (None: any stop)."""
    if ra == "u":
        return (layout.CFA_END,)
    if cfa == "exp":
        return (layout.CFA_SIGNAL,) if signal else (layout.CFA_PLT,)
    if ra != "c-8":
        return None
    reg, offset = re.fullmatch(r"(rsp|rbp)\+(\d+)", cfa).groups()  # type: ignore[union-attr]
    kind = layout.CFA_RSP if reg == "rsp" else layout.CFA_RBP
    saved = int(rbp[1:]) if rbp.startswith("c") else 0
    return (kind, int(offset), saved)


def check_against_readelf(table: UnwindTable, path: Path) -> int:
    checked = 0
    for pc, _end, cfa, rbp, ra, signal in readelf_rows(path):
        found = table.lookup(pc)
        assert found is not None, hex(pc)
        _pc, kind, offset, saved = found
        want = expected(cfa, rbp, ra, signal)
        if want is None or (len(want) == 3 and (want[1] % 8 or want[2] % 8)):
            assert kind == layout.CFA_UNSUPPORTED, (hex(pc), cfa, rbp, ra)
        elif len(want) == 1:
            if want[0] == layout.CFA_PLT and kind == layout.CFA_UNSUPPORTED:
                continue  # a CFA expression other than the PLT's: stops, as it should
            assert kind == want[0], (hex(pc), cfa, ra, kind)
        else:
            assert (kind, offset, saved) == want, (hex(pc), cfa, rbp, ra)
        checked += 1
    return checked


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cfi")
    (out / "prog.c").write_text(SOURCE)
    subprocess.run(["gcc", "-O2", "-o", str(out / "prog"), str(out / "prog.c")], check=True)
    return out / "prog"


def test_rows_match_readelf_on_a_program_built_without_frame_pointers(program: Path) -> None:
    with program.open("rb") as f:
        table = compile_table(f)
    assert check_against_readelf(table, program) >= 15
    assert not table.frame_pointers
    kinds = {table.row(i)[1] for i in range(table.row_count)}
    # alloca makes GCC keep an rbp-based CFA; the PLT has its CFA expression;
    # _start's return address is undefined; gaps between functions have no rule.
    assert {layout.CFA_RSP, layout.CFA_RBP, layout.CFA_PLT, layout.CFA_END,
            layout.CFA_NONE} <= kinds


def test_rows_are_sorted_and_merged(program: Path) -> None:
    with program.open("rb") as f:
        table = compile_table(f)
    rows = [table.row(i) for i in range(table.row_count)]
    assert [r[0] for r in rows] == sorted({r[0] for r in rows})
    assert all(a[1:] != b[1:] for a, b in itertools.pairwise(rows))


def test_addresses_outside_every_fde_have_no_rule(program: Path) -> None:
    with program.open("rb") as f:
        table = compile_table(f)
    ends = sorted(end for _pc, end, *_ in readelf_rows(program))
    starts = {pc for pc, *_ in readelf_rows(program)}
    gaps = [end for end in ends if end not in starts]
    assert gaps
    for end in gaps:
        assert table.lookup(end)[1] == layout.CFA_NONE, hex(end)  # type: ignore[index]


def test_frame_pointer_builds_are_recognised(tmp_path: Path) -> None:
    (tmp_path / "p.c").write_text(SOURCE)
    subprocess.run(["gcc", "-O2", "-fno-omit-frame-pointer", "-o", str(tmp_path / "p"),
                    str(tmp_path / "p.c")], check=True)
    with (tmp_path / "p").open("rb") as f:
        table = compile_table(f)
    assert table.frame_pointers, table.fp_share


@pytest.mark.skipif(not LIBC.exists(), reason="no x86-64 glibc at /lib/x86_64-linux-gnu")
def test_rows_match_readelf_on_libc_including_the_signal_trampoline() -> None:
    with LIBC.open("rb") as f:
        table = compile_table(f)
    assert check_against_readelf(table, LIBC) > 10000
    signal = [pc for pc, _e, _c, _r, _ra, sig in readelf_rows(LIBC) if sig]
    assert signal, "glibc's __restore_rt has a signal-frame FDE"
    assert all(table.lookup(pc)[1] == layout.CFA_SIGNAL for pc in signal)  # type: ignore[index]


def test_not_elf_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x7fELF" + b"\xff" * 200)
    with bad.open("rb") as f, pytest.raises(CfiError):
        compile_table(f)
