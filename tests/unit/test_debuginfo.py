"""Separate debug files: found where gdb and perf look, verified, cached, and
refused when hostile.

The objects are built here with g++ -g and split the way distributions do
(``objcopy --only-keep-debug``, ``strip``, ``objcopy --add-gnu-debuglink``).
Expected names come from readelf on the unstripped build, demangled names
from c++filt: never from the code under test.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
from tramprof.symbols.debuginfo import MAX_DEBUG_FILE_BYTES, DebugInfo
from tramprof.symbols.demangle import Demangler
from tramprof.symbols.elf import DebugLink, ElfSymbols
from tramprof.symbols.images import evict_to_budget

CSRC = Path(__file__).parent / "csrc"
APP = "/opt/app/cxx"

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("g++", "objcopy", "strip", "readelf", "c++filt")),
    reason="needs g++ and binutils (objcopy, strip, readelf, c++filt) to build test objects",
)


def _run(*cmd: str | Path, stdin: str | None = None) -> str:
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True,
                          input=stdin).stdout


def _functions(path: Path) -> dict[int, set[str]]:
    """ELF vaddr -> names of the defined functions there, per readelf."""
    out: dict[int, set[str]] = {}
    for line in _run("readelf", "-W", "--syms", path).splitlines():
        parts = line.split()
        if len(parts) == 8 and parts[3] == "FUNC" and parts[6] != "UND" and int(parts[1], 16):
            out.setdefault(int(parts[1], 16), set()).add(parts[7].split("@")[0])
    return out


@dataclass(frozen=True)
class Build:
    full: Path  # with .symtab and DWARF
    stripped: Path  # .symtab gone, .gnu_debuglink added
    debug: Path  # objcopy --only-keep-debug

    @property
    def obj(self) -> ElfSymbols:
        return ElfSymbols.from_path(self.stripped)


def _split(out: Path, name: str, *ldflags: str) -> Build:
    full, debug, stripped = out / f"{name}_full", out / f"{name}.debug", out / name
    _run("g++", "-O2", "-g", "-fno-omit-frame-pointer", *ldflags, "-o", full,
         CSRC / "cxx_target.cc")
    _run("objcopy", "--only-keep-debug", full, debug)
    _run("strip", "--strip-all", "-o", stripped, full)
    _run("objcopy", f"--add-gnu-debuglink={debug}", stripped)
    return Build(full, stripped, debug)


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Build]:
    out = tmp_path_factory.mktemp("debuginfo")
    return {
        "bid": _split(out, "cxx"),
        "nobid": _split(out, "cxx_nobid", "-Wl,--build-id=none"),
        # The same program built another way: another build id, a foreign debug file.
        "other": _split(out, "cxx_other", "-O1"),
    }


def _place(root: Path, rel: str, src: Path) -> Path:
    dst = root / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return dst


def _build_id_path(obj: ElfSymbols) -> str:
    assert obj.build_id
    return f"usr/lib/debug/.build-id/{obj.build_id[:2]}/{obj.build_id[2:]}.debug"


def _assert_names_every_function(table_symbols: ElfSymbols, build: Build) -> None:
    functions = _functions(build.full)
    assert len(functions) >= 15
    for vaddr, names in functions.items():
        assert table_symbols.resolve_vaddr(vaddr) in names, (hex(vaddr), names)


def test_object_records_its_debuglink_and_that_it_is_stripped(builds: dict[str, Build]) -> None:
    build = builds["bid"]
    obj = build.obj
    assert not obj.has_symtab and ElfSymbols.from_path(build.full).has_symtab
    assert obj.debuglink == DebugLink("cxx.debug", zlib.crc32(build.debug.read_bytes()))
    assert obj.build_id == ElfSymbols.from_path(build.debug).build_id


def test_build_id_path_names_every_function(builds: dict[str, Build], tmp_path: Path) -> None:
    build = builds["bid"]
    obj = build.obj
    _place(tmp_path, _build_id_path(obj), build.debug)
    lookup = DebugInfo(host_root=str(tmp_path)).find(obj, APP)
    assert lookup.refused == () and lookup.table is not None
    assert lookup.table.location == str(tmp_path / _build_id_path(obj))
    symbols = lookup.table.symbols()
    assert symbols is not None
    _assert_names_every_function(symbols, build)
    # What the stripped object alone cannot name: the anonymous-namespace function.
    (hidden,) = [v for v, n in _functions(build.full).items()
                 if "_ZN12_GLOBAL__N_113hidden_helperEi" in n]
    assert obj.resolve_vaddr(hidden) is None


@pytest.mark.parametrize("place", ["opt/app/{}", "opt/app/.debug/{}",
                                   "usr/lib/debug/opt/app/{}"])
def test_debuglink_places_with_crc(builds: dict[str, Build], tmp_path: Path,
                                   place: str) -> None:
    build = builds["nobid"]
    obj = build.obj
    assert obj.build_id is None and obj.debuglink is not None
    where = _place(tmp_path, place.format(obj.debuglink.name), build.debug)
    lookup = DebugInfo(host_root=str(tmp_path)).find(obj, APP)
    assert lookup.table is not None and lookup.table.location == str(where)
    symbols = lookup.table.symbols()
    assert symbols is not None
    _assert_names_every_function(symbols, build)


def test_process_root_before_host(builds: dict[str, Build], tmp_path: Path) -> None:
    build = builds["bid"]
    obj = build.obj
    host, container = tmp_path / "host", tmp_path / "container"
    _place(host, _build_id_path(obj), build.debug)
    info = DebugInfo(host_root=str(host))
    inside = _place(container, f"opt/app/{build.debug.name}", build.debug)
    found = info.find(obj, APP, str(container)).table
    assert found is not None and found.location == str(inside)
    # Another root without a debug file of its own falls back to the host's.
    (tmp_path / "bare").mkdir()
    from_host = info.find(obj, APP, str(tmp_path / "bare")).table
    assert from_host is not None and from_host.location.startswith(str(host))
    assert from_host is not found  # a container's file never names another root's frames


def test_loaded_once_per_build_id(builds: dict[str, Build], tmp_path: Path) -> None:
    build = builds["bid"]
    _place(tmp_path, _build_id_path(build.obj), build.debug)
    info = DebugInfo(host_root=str(tmp_path))
    first = info.find(build.obj, APP).table
    second = info.find(ElfSymbols.from_path(build.stripped), "/elsewhere/copy").table
    assert first is not None and first is second and info.loads == 1


def test_demangled_names_match_cxxfilt(builds: dict[str, Build], tmp_path: Path) -> None:
    build = builds["bid"]
    _place(tmp_path, _build_id_path(build.obj), build.debug)
    table = DebugInfo(host_root=str(tmp_path)).find(build.obj, APP).table
    assert table is not None
    symbols = table.symbols()
    assert symbols is not None
    mangled = sorted({symbols.resolve_vaddr(v) or "" for v in _functions(build.full)}
                     - {""})
    mangled = [n for n in mangled if n.startswith("_Z")]
    assert len(mangled) >= 6
    expected = _run("c++filt", stdin="\n".join(mangled) + "\n").splitlines()
    demangler = Demangler()
    try:
        assert [demangler.demangle(n) for n in mangled] == expected
    finally:
        demangler.close()
    assert "tramprof_unit::detail::Accumulator<long, 3>::add(std::vector<long, " \
           "std::allocator<long> > const&) const [clone .isra.0]" in expected
    assert "(anonymous namespace)::hidden_helper(int)" in expected


# -- hostile debug files -----------------------------------------------------


def _with_debuglink(src: Path, dst: Path, name: bytes, crc: int) -> ElfSymbols:
    """A copy of the stripped ``src`` whose .gnu_debuglink says ``name``."""
    bare = dst.with_suffix(".bare")
    _run("objcopy", "--remove-section=.gnu_debuglink", src, bare)
    data = name + b"\0"
    data += b"\0" * (-len(data) % 4) + struct.pack("<I", crc)
    section = dst.with_suffix(".link")
    section.write_bytes(data)
    _run("objcopy", f"--add-section=.gnu_debuglink={section}", bare, dst)
    return ElfSymbols.from_path(dst)


def test_debuglink_pointing_outside_is_refused(builds: dict[str, Build], tmp_path: Path) -> None:
    build = builds["nobid"]
    crc = zlib.crc32(build.debug.read_bytes())
    obj = _with_debuglink(build.stripped, tmp_path / "evil", b"../../etc/shadow", crc)
    assert obj.debuglink == DebugLink("../../etc/shadow", crc)
    root = tmp_path / "root"
    _place(root, "etc/shadow", build.debug)  # would be a perfect match if followed
    lookup = DebugInfo(host_root=str(root)).find(obj, APP)
    assert lookup.table is None and lookup.refused == ("outside",)


def test_fifo_is_refused_without_blocking_and_the_next_place_is_used(
        builds: dict[str, Build], tmp_path: Path) -> None:
    build = builds["bid"]
    obj = build.obj
    fifo = tmp_path / _build_id_path(obj)
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    good = _place(tmp_path, f"opt/app/{build.debug.name}", build.debug)
    lookup = DebugInfo(host_root=str(tmp_path)).find(obj, APP)
    assert lookup.refused == ("not_regular",)
    assert lookup.table is not None and lookup.table.location == str(good)


def test_huge_file_is_refused_unread(builds: dict[str, Build], tmp_path: Path) -> None:
    build = builds["bid"]
    huge = _place(tmp_path, _build_id_path(build.obj), build.debug)
    with open(huge, "r+b") as f:
        f.truncate(MAX_DEBUG_FILE_BYTES + 1)  # sparse: costs nothing to make
    lookup = DebugInfo(host_root=str(tmp_path)).find(build.obj, APP)
    assert lookup.table is None and lookup.refused == ("too_large",)


def test_crc_mismatch_is_refused(builds: dict[str, Build], tmp_path: Path) -> None:
    build = builds["nobid"]
    obj = build.obj
    assert obj.debuglink is not None
    tampered = _place(tmp_path, f"opt/app/{obj.debuglink.name}", build.debug)
    with open(tampered, "ab") as f:
        f.write(b"\0")  # still a valid ELF file, another CRC
    lookup = DebugInfo(host_root=str(tmp_path)).find(obj, APP)
    assert lookup.table is None and lookup.refused == ("crc_mismatch",)


def test_debug_file_of_another_build_is_refused(builds: dict[str, Build], tmp_path: Path) -> None:
    build, other = builds["bid"], builds["other"]
    assert other.obj.build_id != build.obj.build_id
    _place(tmp_path, _build_id_path(build.obj), other.debug)
    # The debuglink place holds it too: the build ids differ before any CRC is read.
    _place(tmp_path, f"opt/app/{build.debug.name}", other.debug)
    lookup = DebugInfo(host_root=str(tmp_path)).find(build.obj, APP)
    assert lookup.table is None
    assert lookup.refused == ("build_id_mismatch", "build_id_mismatch")


def test_symlinks_below_the_root_are_not_followed(builds: dict[str, Build],
                                                  tmp_path: Path) -> None:
    build = builds["bid"]
    obj = build.obj
    real = _place(tmp_path, "elsewhere/real.debug", build.debug)
    link = tmp_path / _build_id_path(obj)
    link.parent.mkdir(parents=True)
    link.symlink_to(real)
    (tmp_path / "opt").mkdir()
    (tmp_path / "opt" / "app").symlink_to(real.parent, target_is_directory=True)
    shutil.copyfile(build.debug, real.parent / build.debug.name)
    lookup = DebugInfo(host_root=str(tmp_path)).find(obj, APP)
    # build-id link, then opt/app/ and opt/app/.debug/ through the linked directory
    assert lookup.table is None and lookup.refused == ("symlink",) * 3


def test_not_elf_is_refused(builds: dict[str, Build], tmp_path: Path) -> None:
    build = builds["bid"]
    (tmp_path / _build_id_path(build.obj)).parent.mkdir(parents=True)
    (tmp_path / _build_id_path(build.obj)).write_bytes(b"#!/bin/sh\n" * 10)
    lookup = DebugInfo(host_root=str(tmp_path)).find(build.obj, APP)
    assert lookup.table is None and lookup.refused == ("not_elf",)


# -- caching and the memory budget ---------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_not_found_is_retried_after_a_while(builds: dict[str, Build], tmp_path: Path) -> None:
    build, clock = builds["bid"], Clock()
    info = DebugInfo(host_root=str(tmp_path), retry_after=600, clock=clock)
    assert info.find(build.obj, APP).table is None
    _place(tmp_path, _build_id_path(build.obj), build.debug)  # a -dbg package installed
    assert info.find(build.obj, APP).table is None
    clock.now += 601
    assert info.find(build.obj, APP).table is not None


def test_budget_evicts_a_table_and_it_comes_back_after_the_backoff(
        builds: dict[str, Build], tmp_path: Path) -> None:
    build, clock = builds["bid"], Clock()
    _place(tmp_path, _build_id_path(build.obj), build.debug)
    info = DebugInfo(host_root=str(tmp_path), evicted_backoff=600, clock=clock)
    table = info.find(build.obj, APP).table
    assert table is not None and table.symbols() is not None
    size = table.memory_bytes()
    full = ElfSymbols.from_path(build.debug)
    assert size == full.memory_bytes() and size > 16 * len(full)
    assert info.tables() == [table]
    total, evicted = evict_to_budget(info.tables(), budget=size - 1)
    assert (total, evicted) == (0, 1) and table.memory_bytes() == 0
    assert table.symbols() is None and info.loads == 1  # not re-read during the backoff
    clock.now += 601
    assert table.symbols() is not None and info.loads == 2
