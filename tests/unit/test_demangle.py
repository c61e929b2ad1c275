"""Demangling: C++ exactly as c++filt prints it, Rust as perf does (c++filt's
reading without the legacy hash and v0 crate disambiguators), and hostile
names that would make the demangler print gigabytes left mangled."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from tramprof.symbols.demangle import MAX_DEMANGLED_CHARS, MAX_MANGLED_CHARS, Demangler

pytestmark = pytest.mark.skipif(shutil.which("c++filt") is None,
                                reason="needs c++filt (binutils) for expected names")

CXX_NAMES = [
    "_ZNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEE9_M_appendEPKcm",
    "_ZN9__gnu_cxx13new_allocatorISt4pairIKiSt6vectorIiSaIiEEEE8allocateEmPKv",
    "_ZN12_GLOBAL__N_113hidden_helperEi",
    "_ZNK13tramprof_unit6detail11AccumulatorIlLi3EE3addERKSt6vectorIlSaIlEE.isra.0",
    "_ZN13tramprof_unit8describeImEENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEET_PKc",
    "_ZZ4mainENKUlvE_clEv",
    "_ZNSt6thread11_State_implINS_8_InvokerISt5tupleIJPFvvEEEEEE6_M_runEv",
    "_ZdlPvm",
    "_Z3fooi.cold",
]
RUST_NAMES = [
    "_ZN4core3fmt5Write9write_fmt17h0123456789abcdefE",
    "_ZN3std2rt10lang_start28_$u7b$$u7b$closure$u7d$$u7d$17h1a2b3c4d5e6f7a8bE",
    "_RNvCs1234_7mycrate4main",
    "_RINvNtCs9ltgdHTiPiY_4core3ptr13drop_in_placeINtNtCs2Qz0T1bJmQE_5alloc3vec3VecmEEB1a_",
    "_RNvMNtCs1234_7mycrate3fooNtB2_3Bar3new",
]


def _cxxfilt(names: list[str]) -> list[str]:
    return subprocess.run(["c++filt"], input="\n".join(names) + "\n", capture_output=True,
                          text=True, check=True).stdout.splitlines()


def _nested_pairs(levels: int) -> str:
    """f(pair<int,int>, pair<S,S>, pair<pair<S,S>,pair<S,S>>, ...): every
    parameter refers back twice to the one before, so the printed name doubles
    at each level while the mangled one grows by ten bytes."""
    def seq(i: int) -> str:
        if i == 0:
            return "S_"
        n, digits, s = i - 1, "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", ""
        while True:
            s, n = digits[n % 36] + s, n // 36
            if n == 0:
                return f"S{s}_"
    return "_Z1fSt4pairIiiE" + "".join(f"S_I{seq(i)}{seq(i)}E" for i in range(1, levels + 1))


@pytest.fixture
def failures() -> list[str]:
    return []


@pytest.fixture
def demangler(failures: list[str]):
    d = Demangler(timeout=1.0, on_failure=failures.append)
    yield d
    d.close()


def test_cxx_names_read_as_cxxfilt_prints_them(demangler: Demangler,
                                                failures: list[str]) -> None:
    assert [demangler.demangle(n) for n in CXX_NAMES] == _cxxfilt(CXX_NAMES)
    assert failures == [] and demangler.worker_starts == 1


def test_rust_names_as_perf_shows_them(demangler: Demangler) -> None:
    # c++filt's reading, minus the legacy hash and the v0 crate disambiguators.
    expected = [re.sub(r"::h[0-9a-f]{16}$|\[[0-9a-f]+\]", "", line)
                for line in _cxxfilt(RUST_NAMES)]
    assert [demangler.demangle(n) for n in RUST_NAMES] == expected
    assert expected[:3] == ["core::fmt::Write::write_fmt", "std::rt::lang_start::{{closure}}",
                            "mycrate::main"]
    assert demangler.worker_starts == 0  # Rust never goes to the C++ worker


def test_plain_and_invalid_names_stay_as_they_are(demangler: Demangler,
                                                   failures: list[str]) -> None:
    for name in ("main", "__libc_start_call_main", "_Zfoo", "_R", "_ZN3foo\nbar", "_Z3fooi\x00"):
        assert demangler.demangle(name) == name
    assert failures == []


def test_a_name_that_would_print_gigabytes_is_abandoned(demangler: Demangler,
                                                         failures: list[str]) -> None:
    hostile = _nested_pairs(25)  # 265 bytes; __cxa_demangle would print 2.2 GB
    assert len(hostile) < 300
    assert demangler.demangle(hostile) == hostile
    assert failures == ["demangle_timeout"]
    # Remembered: not tried again; and the next name gets a fresh worker.
    assert demangler.demangle(hostile) == hostile and failures == ["demangle_timeout"]
    assert demangler.demangle("_Z3fooi") == "foo(int)" and demangler.worker_starts == 2


def test_a_moderately_nested_name_is_demangled_in_full(demangler: Demangler) -> None:
    name = _nested_pairs(6)
    expected = _cxxfilt([name])[0]
    assert 4000 < len(expected) <= MAX_DEMANGLED_CHARS
    assert demangler.demangle(name) == expected


def test_a_demangled_name_over_the_cap_stays_mangled(demangler: Demangler,
                                                      failures: list[str]) -> None:
    name = _nested_pairs(9)
    assert len(_cxxfilt([name])[0]) > MAX_DEMANGLED_CHARS
    assert demangler.demangle(name) == name
    assert failures == ["demangle_too_long"] and demangler.worker_starts == 1


def test_overlong_names_are_not_sent(demangler: Demangler, failures: list[str]) -> None:
    name = "_ZN" + "3abc" * (MAX_MANGLED_CHARS // 4) + "Ev"
    assert demangler.demangle(name) == name
    assert failures == ["demangle_too_long"] and demangler.worker_starts == 0


def test_repeated_worker_failures_pause_cxx_demangling(failures: list[str]) -> None:
    now = [0.0]
    demangler = Demangler(timeout=0.5, on_failure=failures.append, max_restarts=1,
                          restart_window=600, clock=lambda: now[0])
    try:
        assert demangler.demangle(_nested_pairs(25)) == _nested_pairs(25)
        assert demangler.demangle("_Z3fooi") == "_Z3fooi"  # paused, and not remembered
        assert demangler.worker_starts == 1
        now[0] += 601
        assert demangler.demangle("_Z3fooi") == "foo(int)"
    finally:
        demangler.close()
    assert failures == ["demangle_timeout"]
