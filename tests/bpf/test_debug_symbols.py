"""Native frames named as perf names them (root): libc's start-up code from
Debian's separate debug file (libc6-dbg), and C++ demangled; the same
target recorded by ``tramprof record`` and by ``perf record`` on this host."""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from tramprof.export.formats.folded import parse_folded
from tramprof.symbols.elf import ElfSymbols

from tests.conftest import TRAMPROF, requires_root

pytestmark = requires_root


def _libc_path() -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if path.endswith("/libc.so.6"):
                return path
    raise AssertionError("this Python has no libc.so.6 mapped")


def _libc_debug_file() -> Path:
    build_id = ElfSymbols.from_path(_libc_path()).build_id
    assert build_id is not None
    return Path(f"/usr/lib/debug/.build-id/{build_id[:2]}/{build_id[2:]}.debug")


needs_libc_dbg = pytest.mark.skipif(
    not _libc_debug_file().exists(),
    reason="libc's debug file is not installed (Debian: apt-get install libc6-dbg; "
           "the Makefile's TEST_PACKAGES has it)")
needs_perf = pytest.mark.skipif(shutil.which("perf") is None,
                                reason="needs perf (Debian: linux-perf) to compare with")


def _tramprof_record(pid: int, seconds: float) -> dict[tuple[str, ...], int]:
    result = subprocess.run(
        [TRAMPROF, "record", "--pid", str(pid), "--duration", str(seconds),
         "--frequency", "499"], capture_output=True, text=True, timeout=120, check=True)
    return dict(parse_folded(result.stdout))


def _perf_record(pid: int, seconds: float, out: Path) -> list[list[str]]:
    """Stacks perf recorded (frame-pointer call graphs), root first."""
    # perf starts the sleep only once its events are open, and writes a
    # complete file when the sleep ends. A timer started beside perf instead
    # can fire while perf is still starting (cold caches on a fresh machine),
    # and the signal then ends perf before it wrote anything.
    record = subprocess.run(["perf", "record", "-q", "-g", "-F", "499", "-p", str(pid),
                             "-o", str(out), "--", "sleep", str(seconds)],
                            capture_output=True, text=True, timeout=120)
    assert record.returncode == 0, record.stderr
    script = subprocess.run(["perf", "script", "-i", str(out), "-F", "ip,sym"],
                            capture_output=True, text=True, timeout=120)
    assert script.returncode == 0, script.stderr
    stacks = []
    for block in script.stdout.split("\n\n"):
        frames = [line.split(None, 1)[1] for line in block.strip().splitlines()
                  if len(line.split(None, 1)) == 2]
        if frames:
            stacks.append(frames[::-1])
    return stacks


def _callers_of(stacks: list[tuple[list[str], int]], function: str) -> Counter[str]:
    """Samples by the name of the frame just above ``function``."""
    out: Counter[str] = Counter()
    for frames, count in stacks:
        if function in frames[1:]:
            out[frames[frames.index(function) - 1]] += count
    return out


@needs_libc_dbg
def test_libc_start_frame_is_named_from_the_debug_file_as_in_perf(
        targets, start_target, tmp_path: Path) -> None:
    target = start_target(str(targets / "chain"), "300")  # killed at the end
    stacks = _tramprof_record(target.pid, 3)
    ours = _callers_of([(list(stack[1:]), count) for stack, count in stacks.items()], "main")
    total = sum(ours.values())
    assert total > 300, stacks  # ~1500 at 499 Hz for 3 s on an idle CPU
    # Not libc.so.6+0x27249: libc has no .symtab, its debug file has.
    assert ours["__libc_start_call_main"] / total >= 0.95, ours
    if shutil.which("perf") is None:
        pytest.skip("perf (Debian: linux-perf) is not installed: no comparison with it")
    theirs = _callers_of([(s, 1) for s in _perf_record(target.pid, 2, tmp_path / "perf.data")],
                         "main")
    assert theirs.most_common(1)[0][0] == "__libc_start_call_main", theirs


CXX_SPIN = r"""
#include <cstdio>
#include <cstdlib>
#include <ctime>
namespace outer { namespace inner {
template <typename T> struct Box {
    __attribute__((noinline)) T spin(T seed) const {
        volatile T x = seed;
        for (long i = 0; i < 2000000; i++) x = x * 3 + 1;
        return x;
    }
};
}}
static volatile unsigned long sink;
int main(int argc, char **argv) {
    time_t end = time(0) + (time_t)(argc > 1 ? atof(argv[1]) : 30);
    std::printf("ready\n");
    std::fflush(stdout);
    outer::inner::Box<unsigned long> box;
    while (time(0) < end) sink += box.spin(sink);
}
"""


@needs_perf
def test_cxx_frames_are_demangled_like_cxxfilt(start_target, tmp_path: Path) -> None:
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to build the C++ target")
    source, exe = tmp_path / "spin.cc", tmp_path / "cxx_spin"
    source.write_text(CXX_SPIN)
    subprocess.run(["g++", "-O2", "-fno-omit-frame-pointer", "-o", str(exe), str(source)],
                   check=True)
    (mangled,) = [line.split()[-1] for line in subprocess.run(
        ["readelf", "-W", "--syms", str(exe)], capture_output=True, text=True,
        check=True).stdout.splitlines() if "_ZNK5outer5inner3BoxImE4spinEm" in line]
    expected = subprocess.run(["c++filt", mangled], capture_output=True, text=True,
                              check=True).stdout.strip()
    assert expected.startswith("outer::inner::Box<unsigned long>::spin(unsigned long) const")
    target = start_target(str(exe), "300")  # killed at the end
    leaves: Counter[str] = Counter()
    for stack, count in _tramprof_record(target.pid, 3).items():
        leaves[stack[-1]] += count
    assert sum(leaves.values()) > 300, leaves
    assert leaves[expected] / sum(leaves.values()) >= 0.9, leaves
    # perf prints the same name without the parameter list (its default).
    perf_leaves = Counter(stack[-1] for stack in _perf_record(target.pid, 2,
                                                              tmp_path / "perf.data"))
    assert perf_leaves.most_common(1)[0][0] == "outer::inner::Box<unsigned long>::spin"
