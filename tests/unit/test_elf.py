"""ElfSymbols / ElfCache against real binaries compiled at test time.

Expected addresses come from binutils (nm, readelf), never from the code
under test, so the parser is checked against an independent reader.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import struct
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tramprof.model import SymbolizationError
from tramprof.symbols.elf import (
    MAX_REMEMBERED_SPANS,
    ElfCache,
    ElfError,
    ElfSymbols,
    LoadSegment,
    read_build_id,
)

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ["-O2", "-fno-omit-frame-pointer"]

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("gcc", "nm", "readelf", "strip")),
    reason="needs gcc and binutils (nm, readelf, strip) to build test binaries",
)


def _run(*cmd: str | Path) -> str:
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True).stdout


def _nm_funcs(path: Path, dynamic: bool = False) -> dict[str, tuple[int, int]]:
    """name -> (address, size) of the defined function symbols, per readelf.

    (Named after nm, whose letters cannot tell a weak function from weak data.)
    """
    out: dict[str, tuple[int, int]] = {}
    for line in _run("readelf", "-W", "--dyn-syms" if dynamic else "--syms", path).splitlines():
        parts = line.split()
        if len(parts) == 8 and parts[3] in ("FUNC", "IFUNC") and parts[6] != "UND":
            out[parts[7].split("@")[0]] = (int(parts[1], 16), int(parts[2], 0))
    return out


def _readelf_build_id(path: Path) -> str | None:
    for line in _run("readelf", "-n", path).splitlines():
        if "Build ID:" in line:
            return line.split("Build ID:")[1].strip()
    return None


def _readelf_loads(path: Path) -> list[tuple[int, int, int]]:
    """(offset, vaddr, filesz) of each PT_LOAD, from readelf."""
    loads = []
    for line in _run("readelf", "-lW", path).splitlines():
        parts = line.split()
        if parts and parts[0] == "LOAD":
            loads.append((int(parts[1], 16), int(parts[2], 16), int(parts[4], 16)))
    return loads


@pytest.fixture(scope="module")
def bins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("elfbins")
    target, shlib = CSRC / "target.c", CSRC / "shlib.c"
    b = {
        "pie": d / "target_pie",
        "nopie": d / "target_nopie",
        "lib": d / "libtramprof_unit.so",
        "nobuildid": d / "target_nobuildid",
        "fs32": d / "fs32",
    }
    _run("gcc", *CFLAGS, "-fPIE", "-pie", "-o", b["pie"], target)
    _run("gcc", *CFLAGS, "-fno-pie", "-no-pie", "-o", b["nopie"], target)
    _run("gcc", *CFLAGS, "-shared", "-fPIC", "-o", b["lib"], shlib)
    _run("gcc", *CFLAGS, "-Wl,--build-id=none", "-o", b["nobuildid"], target)
    _run(
        "gcc", "-m32", "-O2", "-nostdlib", "-static", "-fno-pie", "-no-pie",
        "-o", b["fs32"], CSRC / "freestanding32.c",
    )  # fmt: skip
    for name in ("pie", "lib", "fs32"):
        b[f"{name}_stripped"] = d / f"{b[name].name}.stripped"
        _run("strip", "-o", b[f"{name}_stripped"], b[name])
    return b


@pytest.mark.parametrize("which", ["pie", "nopie", "lib", "fs32"])
def test_every_nm_function_resolves_to_itself_or_an_alias(
    bins: dict[str, Path], which: str
) -> None:
    path = bins[which]
    elf = ElfSymbols.from_path(path)
    funcs = _nm_funcs(path)
    by_addr: dict[int, set[str]] = {}
    for name, (addr, _size) in funcs.items():
        by_addr.setdefault(addr, set()).add(name)
    assert funcs
    for name, (addr, size) in funcs.items():
        assert elf.resolve_vaddr(addr) in by_addr[addr], name
        if size:
            assert elf.resolve_vaddr(addr + size - 1) in by_addr[addr], name


@pytest.mark.parametrize("which", ["pie", "nopie"])
def test_executable_known_functions(bins: dict[str, Path], which: str) -> None:
    elf = ElfSymbols.from_path(bins[which])
    funcs = _nm_funcs(bins[which])
    for name in ("tramprof_unit_leaf", "tramprof_unit_static", "main"):
        addr, size = funcs[name]
        assert elf.resolve_vaddr(addr) == name
        assert elf.resolve_vaddr(addr + size // 2) == name
    assert elf.elf_class == 64
    assert elf.elf_type == ("ET_DYN" if which == "pie" else "ET_EXEC")


def test_shared_library_symbol_kinds(bins: dict[str, Path]) -> None:
    elf = ElfSymbols.from_path(bins["lib"])
    funcs = _nm_funcs(bins["lib"])
    assert elf.resolve_vaddr(funcs["tramprof_lib_func"][0]) == "tramprof_lib_func"
    # File-local symbols exist only in .symtab.
    assert elf.resolve_vaddr(funcs["tramprof_lib_local"][0] + 1) == "tramprof_lib_local"
    # Strong global beats its weak alias at the same address.
    strong, size = funcs["tramprof_lib_strong"]
    assert funcs["tramprof_lib_weak_alias"][0] == strong
    assert elf.resolve_vaddr(strong + size - 1) == "tramprof_lib_strong"
    # A zero-size symbol extends up to the next symbol.
    nosize, nosize_size = funcs["tramprof_lib_nosize"]
    assert nosize_size == 0
    assert elf.resolve_vaddr(nosize) == "tramprof_lib_nosize"
    assert elf.resolve_vaddr(nosize + 8) == "tramprof_lib_nosize"  # the final `ret`


def test_gap_after_sized_symbol_is_unresolved(bins: dict[str, Path]) -> None:
    elf = ElfSymbols.from_path(bins["lib"])
    funcs = _nm_funcs(bins["lib"])
    addr, size = funcs["tramprof_lib_func"]
    starts = sorted(a for a, _ in funcs.values())
    nxt = min(a for a in starts if a > addr)
    assert addr + size < nxt, "compiler left no padding; test precondition"
    assert elf.resolve_vaddr(addr + size) is None
    assert elf.resolve_vaddr(0) is None
    assert elf.resolve_vaddr(2**63) is None


def test_stripped_shared_library_keeps_dynsym(bins: dict[str, Path]) -> None:
    elf = ElfSymbols.from_path(bins["lib_stripped"])
    funcs = _nm_funcs(bins["lib"])
    assert elf.resolve_vaddr(funcs["tramprof_lib_func"][0]) == "tramprof_lib_func"
    assert elf.resolve_vaddr(funcs["tramprof_lib_strong"][0]) == "tramprof_lib_strong"
    # The local function is gone with .symtab. Like perf, the zero-size symbol
    # before it now extends over it, up to the next symbol.
    assert funcs["tramprof_lib_nosize"][0] < funcs["tramprof_lib_local"][0]
    assert elf.resolve_vaddr(funcs["tramprof_lib_local"][0] + 1) == "tramprof_lib_nosize"


def test_stripped_executable_has_empty_table(bins: dict[str, Path]) -> None:
    elf = ElfSymbols.from_path(bins["pie_stripped"])
    assert len(elf) == 0
    assert elf.resolve_vaddr(_nm_funcs(bins["pie"])["main"][0]) is None
    assert elf.build_id == _readelf_build_id(bins["pie"])


def test_32bit_elf(bins: dict[str, Path]) -> None:
    elf = ElfSymbols.from_path(bins["fs32"])
    assert elf.elf_class == 32
    assert elf.machine == "EM_386"
    addr, size = _nm_funcs(bins["fs32"])["tramprof_fs32_func"]
    assert elf.resolve_vaddr(addr + size - 1) == "tramprof_fs32_func"


def test_elf_with_no_symbols_at_all(bins: dict[str, Path]) -> None:
    # Static, stripped: neither .symtab nor .dynsym.
    elf = ElfSymbols.from_path(bins["fs32_stripped"])
    assert len(elf) == 0
    assert elf.resolve_vaddr(_nm_funcs(bins["fs32"])["tramprof_fs32_func"][0]) is None
    assert elf.segments
    assert elf.build_id == _readelf_build_id(bins["fs32"])


@pytest.mark.parametrize("which", ["pie", "nopie", "lib", "fs32", "nobuildid"])
def test_build_id_matches_readelf(bins: dict[str, Path], which: str) -> None:
    expected = _readelf_build_id(bins[which])
    assert ElfSymbols.from_path(bins[which]).build_id == expected
    with open(bins[which], "rb") as f:
        assert read_build_id(f) == expected
    assert (expected is None) == (which == "nobuildid")


@pytest.mark.parametrize("which", ["pie", "nopie", "lib", "fs32"])
def test_file_offset_to_vaddr_matches_program_headers(bins: dict[str, Path], which: str) -> None:
    elf = ElfSymbols.from_path(bins[which])
    loads = _readelf_loads(bins[which])
    assert [(s.offset, s.vaddr, s.filesz) for s in elf.segments] == loads
    for name, (vaddr, _size) in _nm_funcs(bins[which]).items():
        seg = next(s for s in loads if s[1] <= vaddr < s[1] + s[2])
        file_offset = vaddr - seg[1] + seg[0]
        assert elf.file_offset_to_vaddr(file_offset) == vaddr, name
    end = max(off + size for off, _, size in loads)
    assert elf.file_offset_to_vaddr(end + 0x10000) is None


@pytest.mark.parametrize("which", ["pie", "nopie", "lib", "fs32"])
def test_executable_span_agrees_with_file_offset_to_vaddr(bins: dict[str, Path],
                                                          which: str) -> None:
    """Every offset of the span maps as ``file_offset_to_vaddr`` maps it;
    the bytes just outside it do not belong to it."""
    elf = ElfSymbols.from_path(bins[which])
    (offset, vaddr, filesz), = [
        (s.offset, s.vaddr, s.filesz) for s in elf.segments if s.executable]
    for inside in (offset, offset + filesz // 2, offset + filesz - 1):
        first, end, bias = elf.executable_span(inside) or (0, 0, 0)
        assert (first, end, bias) == (offset, offset + filesz, vaddr - offset)
        for at in range(first, end, max(1, (end - first) // 997)):
            assert elf.file_offset_to_vaddr(at) == at + bias
    assert elf.executable_span(offset + filesz) is None
    assert elf.executable_span(max(0, offset - 1)) is None or offset == 0


def test_executable_span_needs_one_executable_segment_alone() -> None:
    """Two executable segments sharing file bytes (old layouts): which one
    an offset maps through depends on the offset, so there is no span."""
    def elf(*segments: LoadSegment) -> ElfSymbols:
        return ElfSymbols(build_id=None, elf_class=64, elf_type="ET_DYN", machine="EM_X86_64",
                          segments=segments, starts=array("Q"), names=[])

    text = LoadSegment(offset=0x1000, vaddr=0x401000, filesz=0x800, memsz=0x800, flags=5)
    data = LoadSegment(offset=0x1600, vaddr=0x602600, filesz=0x400, memsz=0x400, flags=6)
    assert elf(text, data).executable_span(0x1700) == (0x1000, 0x1800, 0x400000)
    more_text = LoadSegment(offset=0x1700, vaddr=0x801700, filesz=0x400, memsz=0x400, flags=5)
    assert elf(text, more_text).executable_span(0x1100) is None
    assert elf(text, more_text).executable_span(0x1a00) is None
    assert elf(data).executable_span(0x1700) is None
    empty = LoadSegment(offset=0x1000, vaddr=0x401000, filesz=0, memsz=0x800, flags=5)
    assert elf(empty).executable_span(0x1000) is None


def test_executable_span_asked_again_answers_as_the_first_time(bins: dict[str, Path]) -> None:
    """Every process mapping an object asks for its span: answered from
    memory after the first time, the same as worked out afresh, for more
    offsets than are remembered and in any order."""
    elf = ElfSymbols.from_path(bins["pie"])
    (offset, filesz), = [(s.offset, s.filesz) for s in elf.segments if s.executable]
    asked = [offset + filesz * i // 40 for i in range(40)] + [0, offset + filesz, 1 << 40]
    fresh = [ElfSymbols.from_path(bins["pie"]).executable_span(at) for at in asked]
    rng = random.Random(3)
    for _ in range(3):
        order = list(range(len(asked)))
        rng.shuffle(order)
        assert [elf.executable_span(asked[i]) for i in order] == [fresh[i] for i in order]
    assert fresh.count(None) == (2 if offset == 0 else 3)
    assert len(elf._spans) == MAX_REMEMBERED_SPANS


def test_from_bytes_equals_from_path(bins: dict[str, Path]) -> None:
    a = ElfSymbols.from_path(bins["lib"])
    b = ElfSymbols.from_bytes(bins["lib"].read_bytes())
    assert (a.build_id, a.segments, len(a)) == (b.build_id, b.segments, len(b))
    for addr, _ in _nm_funcs(bins["lib"]).values():
        assert a.resolve_vaddr(addr) == b.resolve_vaddr(addr)


def _own_vdso() -> tuple[int, bytes]:
    libc = ctypes.CDLL(None)
    libc.getauxval.restype = ctypes.c_ulong
    libc.getauxval.argtypes = [ctypes.c_ulong]
    base = int(libc.getauxval(33))  # AT_SYSINFO_EHDR
    if not base:
        pytest.skip("this process has no vdso")
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith("[vdso]"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            assert start == base
            return base, ctypes.string_at(base, end - start)
    pytest.skip("no [vdso] line in /proc/self/maps")


def test_vdso_image_from_memory(tmp_path: Path) -> None:
    _base, image = _own_vdso()
    dump = tmp_path / "vdso.so"
    dump.write_bytes(image)
    expected = _nm_funcs(dump, dynamic=True)
    elf = ElfSymbols.from_bytes(image)
    addr, size = expected["__vdso_clock_gettime"]
    # Strong __vdso_clock_gettime wins over its weak clock_gettime alias.
    assert elf.resolve_vaddr(addr) == "__vdso_clock_gettime"
    assert elf.resolve_vaddr(addr + size - 1) == "__vdso_clock_gettime"
    assert elf.build_id == _readelf_build_id(dump)


# -- malformed input ---------------------------------------------------------


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "empty"
    p.write_bytes(b"")
    with pytest.raises(ElfError) as exc:
        ElfSymbols.from_path(p)
    assert exc.value.reason == "not_elf"
    assert isinstance(exc.value, SymbolizationError)


def test_non_elf_file(tmp_path: Path) -> None:
    p = tmp_path / "script.sh"
    p.write_text("#!/bin/sh\necho hello\n")
    with pytest.raises(ElfError, match="not an ELF") as exc:
        ElfSymbols.from_path(p)
    assert exc.value.reason == "not_elf"
    with pytest.raises(ElfError):
        ElfSymbols.from_bytes(b"\x7fEL")


@pytest.mark.parametrize("keep", [16, 64, 200, 0.5, 0.95])
def test_truncated_elf(bins: dict[str, Path], tmp_path: Path, keep: float) -> None:
    data = bins["lib"].read_bytes()
    n = int(keep) if keep >= 1 else int(len(data) * keep)
    p = tmp_path / "truncated.so"
    p.write_bytes(data[:n])
    with pytest.raises(ElfError) as exc:
        ElfSymbols.from_path(p)
    assert exc.value.reason == "malformed_elf"


def test_missing_file_is_oserror_not_elferror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ElfSymbols.from_path(tmp_path / "nope")


@pytest.fixture(scope="module")
def lib_image(bins: dict[str, Path]) -> bytes:
    return bins["lib"].read_bytes()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_corrupted_elf_never_escapes_as_other_exception(
    lib_image: bytes, data: st.DataObject
) -> None:
    image = bytearray(lib_image)
    # Corrupt the parts the parser reads: ELF header, program/section headers, tables.
    shoff = int.from_bytes(image[0x28:0x30], "little")
    regions = [(4, 64), (64, 64 + 56 * 13), (shoff, len(image))]
    for _ in range(data.draw(st.integers(1, 8))):
        lo, hi = data.draw(st.sampled_from(regions))
        pos = data.draw(st.integers(lo, hi - 1))
        image[pos] = data.draw(st.integers(0, 255))
    try:
        elf = ElfSymbols.from_bytes(bytes(image))
    except ElfError:
        return
    elf.resolve_vaddr(0x1150)
    elf.file_offset_to_vaddr(0x1150)
    elf.executable_span(0x1150)


# -- cache -------------------------------------------------------------------


def test_cache_hits_by_stat_identity(bins: dict[str, Path]) -> None:
    cache = ElfCache(max_entries=4)
    a = cache.get_path(bins["lib"])
    b = cache.get_path(bins["lib"])
    assert a is b
    assert (cache.misses, cache.hits) == (1, 1)


def test_held_files_are_one_descriptor_per_file(bins: dict[str, Path]) -> None:
    """Every process mapping a library holds it open until it is parsed: the
    cache keeps one descriptor per file for all of them, closed with its last
    holder, and none once the file is parsed."""
    cache = ElfCache()
    first, second = open(bins["lib"], "rb"), open(bins["lib"], "rb")  # noqa: SIM115
    assert cache.hold(first) is first
    assert cache.hold(second) is first and second.closed
    symbols = cache.get_file(first)
    third = open(bins["lib"], "rb")  # noqa: SIM115
    assert cache.hold(third) is symbols and third.closed
    assert not first.closed  # the holders let go of it; it is closed with the last
    other = open(bins["pie"], "rb")  # noqa: SIM115
    assert cache.hold(other) is other
    fd = other.fileno()
    del other
    assert not os.path.exists(f"/proc/self/fd/{fd}") or \
        os.readlink(f"/proc/self/fd/{fd}") != str(bins["pie"])
    again = open(bins["pie"], "rb")  # noqa: SIM115
    assert cache.hold(again) is again  # the last holder went: nothing shared any more
    again.close()


def test_cache_shares_by_build_id_across_copies(bins: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "copy.so"
    shutil.copy(bins["lib"], copy)
    cache = ElfCache()
    assert cache.get_path(bins["lib"]) is cache.get_path(copy)
    assert cache.misses == 1
    assert len(cache) == 1


def test_cache_without_build_id_keys_on_file_identity(
    bins: dict[str, Path], tmp_path: Path
) -> None:
    p = tmp_path / "nobid"
    shutil.copy(bins["nobuildid"], p)
    cache = ElfCache()
    first = cache.get_path(p)
    assert cache.get_path(p) is first
    os.utime(p, ns=(1, 1))  # a rebuilt file would change mtime
    assert cache.get_path(p) is not first
    assert cache.misses == 2


def test_cache_is_bounded_lru(bins: dict[str, Path]) -> None:
    cache = ElfCache(max_entries=2)
    lib = cache.get_path(bins["lib"])
    cache.get_path(bins["pie"])
    cache.get_path(bins["lib"])  # lib is now most recently used
    cache.get_path(bins["nopie"])  # evicts pie
    assert len(cache) == 2
    assert cache.get_path(bins["lib"]) is lib
    misses = cache.misses
    cache.get_path(bins["pie"])
    assert cache.misses == misses + 1
    with pytest.raises(ValueError):
        ElfCache(max_entries=0)


def test_cache_remembers_failures(tmp_path: Path) -> None:
    p = tmp_path / "junk"
    p.write_bytes(b"\x7fELF" + b"\xff" * 60)
    cache = ElfCache()
    for _ in range(2):
        with pytest.raises(ElfError):
            cache.get_path(p)
    assert (cache.misses, cache.hits) == (1, 1)


def test_cache_images_by_content(bins: dict[str, Path]) -> None:
    cache = ElfCache()
    data = bins["lib"].read_bytes()
    assert cache.get_image(data) is cache.get_image(bytes(data))
    assert cache.misses == 1


# --- files made to cost memory: they are the process's to choose --------------


def _elf64_header(shoff: int, shnum: int, phnum: int = 0) -> bytes:
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    return ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 56, phnum, 64,
                               shnum, 0)


def test_a_sparse_file_with_a_million_section_headers_is_refused_and_remembered(tmp_path):
    import tramprof.symbols.elf as elf_module

    bomb = tmp_path / "bomb.so"
    shoff = 4096
    with open(bomb, "wb") as f:
        f.write(_elf64_header(shoff, shnum=0))  # extended numbering: count in section 0
        f.seek(shoff)
        f.write(struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 1_000_000, 0, 0, 0, 0))
        f.truncate(shoff + 64 * 1_000_000)  # sparse: 64 MB of headers, nothing on disk
    cache = ElfCache()
    with open(bomb, "rb") as f, pytest.raises(ElfError, match="1000000 section headers"):
        cache.get_file(f)
    parses = []
    real_parse = elf_module._parse
    elf_module._parse = lambda f: parses.append(1) or real_parse(f)
    try:
        with open(bomb, "rb") as f, pytest.raises(ElfError, match="section headers"):
            cache.get_file(f)  # the failure is cached: not parsed again
    finally:
        elf_module._parse = real_parse
    assert parses == []


def test_a_symbol_table_claiming_gigabytes_is_refused(tmp_path, monkeypatch):
    import tramprof.symbols.elf as elf_module

    monkeypatch.setattr(elf_module, "MAX_SYMBOL_TABLE_BYTES", 1024)
    source = tmp_path / "big.c"
    source.write_text("".join(f"int f{i}(void) {{ return {i}; }}\n" for i in range(200)))
    lib = tmp_path / "big.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    with pytest.raises(ElfError, match="at most 1024 are read"):
        ElfCache().get_path(lib)


def test_memory_exhausted_while_parsing_is_a_cached_failure(tmp_path, monkeypatch):
    import tramprof.symbols.elf as elf_module

    calls = []

    def exhausted(f):
        calls.append(1)
        raise MemoryError

    monkeypatch.setattr(elf_module, "_parse", exhausted)
    cache = ElfCache()
    for _ in range(3):
        with pytest.raises(ElfError, match="exhausted memory"):
            cache.get_path(sys.executable)
    assert calls == [1]
