"""Native stacks without frame pointers: unwind tables compiled from
.eh_frame, walked in BPF (root; real programs built without frame pointers)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from tramprof.model import NATIVE_GAP

from tests.conftest import REPO, requires_root
from tests.tables import is_start, profile, rooted, share, top

pytestmark = requires_root

SOURCES = REPO / "tests" / "targets" / "unwind"
CHAIN = ["main", "chain_a", "chain_b", "chain_c"]

@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None or shutil.which("g++") is None:
        pytest.skip("gcc and g++ are needed to build the targets")
    out = tmp_path_factory.mktemp("unwind-targets")
    chain = str(REPO / "tests" / "targets" / "chain.c")

    def cc(*args: str) -> None:
        subprocess.run(["gcc", *args], check=True, cwd=out)

    cc("-O2", "-o", "chain_o2", chain)
    cc("-O2", "-fomit-frame-pointer", "-o", "chain_nofp", chain)
    subprocess.run(["g++", "-O2", "-o", "cxx_throw", str(SOURCES / "cxx_throw.cpp")],
                   check=True, cwd=out)
    cc("-O2", "-shared", "-fPIC", "-o", "libtpchain.so", str(SOURCES / "libtpchain.c"))
    cc("-O2", "-o", "solib", str(SOURCES / "solib_main.c"), "-L.", "-ltpchain",
       "-Wl,-rpath,$ORIGIN")
    cc("-O2", "-DDLOPEN_ONLY", "-o", "dlopen", str(SOURCES / "solib_main.c"), "-ldl")
    cc("-O2", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables",
       "-fomit-frame-pointer", "-c", "-o", "nocfi_leaf.o", str(SOURCES / "nocfi_leaf.c"))
    cc("-O2", "-o", "nocfi", str(SOURCES / "nocfi_main.c"), "nocfi_leaf.o")
    return out


@pytest.mark.parametrize("binary", ["chain_o2", "chain_nofp"])
def test_chain_without_frame_pointers_is_exact_to_the_root(built, start_target, binary):
    target = start_target(str(built / binary), "120")
    stacks, stats, mode = profile(target.pid, lambda s: rooted(s, CHAIN))
    assert sum(stacks.values()) > 300  # ~1,500 at 499 Hz on an idle CPU
    assert share(stacks, lambda s: rooted(s, CHAIN)) >= 0.95, top(stacks)
    loaded = {o.name for o in mode.objects() if o.state == "loaded"}
    assert {binary, "libc.so.6"} <= loaded
    tables = stats.unwind_tables
    assert tables.objects_loaded >= 2 and tables.rows > 1000
    assert tables.table_bytes >= tables.rows * 8
    assert stats.unwind_samples["eh_frame"] > 0


def test_cxx_exceptions_keep_exact_chains(built, start_target):
    target = start_target(str(built / "cxx_throw"), "120")

    def good(stack: tuple[str, ...]) -> bool:
        # Demangled C++ names carry their parameters: chain_a(double).
        frames = tuple(f.split("(", 1)[0] for f in stack)
        if "main" not in frames:
            return False
        at = frames.index("main")
        return (list(frames[at:at + 4]) == CHAIN and frames[0] == "_start"
                and all(is_start(f) for f in frames[:at]))

    stacks, _stats, _mode = profile(target.pid, good)
    assert share(stacks, good) >= 0.95, top(stacks)
    # Samples inside the C++ runtime's unwinder (libgcc_s, libstdc++) are
    # under chain_c, not cut off at them.
    deeper = share(stacks, lambda s: good(s) and any("_Unwind_" in f or "__cxa_" in f
                                                     for f in s))
    assert deeper > 0.01, top(stacks)


def test_chain_through_a_shared_library_without_frame_pointers(built, start_target):
    target = start_target(str(built / "solib"), "120")
    chain = ["main", "chain_a", "lib_b", "lib_c"]
    stacks, _stats, mode = profile(target.pid, lambda s: rooted(s, chain))
    assert share(stacks, lambda s: rooted(s, chain)) >= 0.95, top(stacks)
    assert "libtpchain.so" in {o.name for o in mode.objects() if o.state == "loaded"}


def test_library_loaded_with_dlopen_after_start(built, start_target):
    target = start_target(str(built / "dlopen"), "120")
    target.go()  # now it loads libtpchain.so
    chain = ["main", "chain_a", "lib_b", "lib_c"]
    stacks, _stats, _mode = profile(target.pid, lambda s: rooted(s, chain))
    assert share(stacks, lambda s: rooted(s, chain)) >= 0.95, top(stacks)


def test_code_without_unwind_information_stops_with_the_marker(built, start_target):
    """chain_c has no CFI: the stack is chain_c under one marker, nothing invented."""
    target = start_target(str(built / "nocfi"), "120")
    stopped = (NATIVE_GAP, "chain_c")
    stacks, stats, _mode = profile(target.pid, lambda s: s == stopped)
    assert share(stacks, lambda s: s == stopped) >= 0.95, top(stacks)
    assert not any("chain_b" in s for s in stacks), top(stacks)
    assert sum(stacks.values()) > 300
    assert not stats.unwind_tables.builds.get("no_usable_cfi")


def test_a_process_whose_main_thread_exited_gets_its_tables(built, start_target):
    """Its main thread's /proc entry opens none of its files (no root, no
    map_files): the objects are opened through a running thread's."""
    target = start_target(str(built / "chain_nofp"), "120", "orphan")
    chain = ["orphan", "chain_a", "chain_b", "chain_c"]

    def good(stack: tuple[str, ...]) -> bool:
        """libc's thread start (clone3, start_thread), then exactly the chain
        (and a kernel frame or two after it, in an interrupt)."""
        return list(stack[2:6]) == chain and all(
            f in ("clone3", "__clone3", "start_thread") or f.startswith("libc.so.6+0x")
            for f in stack[:2])

    stacks, _stats, mode = profile(target.pid, good)
    assert share(stacks, good) >= 0.95, top(stacks)
    loaded = {o.name for o in mode.objects() if o.state == "loaded"}
    assert {"chain_nofp", "libc.so.6"} <= loaded
