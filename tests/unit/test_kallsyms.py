"""KernelSymbols: parsing, region boundaries and module naming of kallsyms."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tramprof.symbols.kallsyms import KernelSymbols

# Unsorted on purpose (module symbols first, as modules can be listed in any
# order), with aliases, weak symbols, data terminators and section markers.
KALLSYMS = """\
ffffffffc0001080 t mod_fn_b\t[mymod]
ffffffffc0001000 t mod_fn_a\t[mymod]
ffffffffc0001100 d mod_data\t[mymod]
ffffffffc0005000 T other_fn\t[othermod]
ffffffffc0010000 t bpf_prog_6deef7357e7b4530_handler\t[bpf]
ffffffff81000000 T _stext
ffffffff81000000 T _text
ffffffff81000000 T startup_64
ffffffff81000100 T vfs_read
ffffffff81000200 W weak_impl
ffffffff81000200 T strong_impl
ffffffff81000300 t __do_sys_read
ffffffff81000300 T __x64_sys_read
ffffffff81000340 T __softirqentry_text_start
ffffffff81000340 t __do_softirq
ffffffff81000380 T __irqentry_text_end
ffffffff81000400 T last_core_fn
ffffffff81000480 T _etext
ffffffff81200000 D __start_rodata
ffffffff81200100 d some_data
ffffffff81300000 T _sinittext
ffffffff81300000 t init_fn
ffffffff81300050 T _einittext
ffffffff81400000 B __bss_start
"""


@pytest.fixture
def ksyms(tmp_path: Path) -> KernelSymbols:
    p = tmp_path / "kallsyms"
    p.write_text(KALLSYMS)
    return KernelSymbols(str(p))


def test_core_symbols(ksyms: KernelSymbols) -> None:
    assert ksyms.available
    assert ksyms.unavailable_reason is None
    assert ksyms.resolve(0xFFFFFFFF81000100) == "vfs_read"
    assert ksyms.resolve(0xFFFFFFFF810001FF) == "vfs_read"
    assert ksyms.resolve(0xFFFFFFFF81300010) == "init_fn"


def test_aliases_prefer_strong_global_fewest_underscores(ksyms: KernelSymbols) -> None:
    assert ksyms.resolve(0xFFFFFFFF81000000) == "startup_64"
    assert ksyms.resolve(0xFFFFFFFF81000210) == "strong_impl"
    assert ksyms.resolve(0xFFFFFFFF81000300) == "__x64_sys_read"
    assert ksyms.resolve(0xFFFFFFFF81000344) == "__do_softirq"  # local beats a marker


def test_addresses_outside_text(ksyms: KernelSymbols) -> None:
    assert ksyms.resolve(0) is None
    assert ksyms.resolve(0xFFFFFFFF80FFFFFF) is None  # before the first symbol
    assert ksyms.resolve(0xFFFFFFFF81000390) is None  # after an *_text_end marker
    assert ksyms.resolve(0xFFFFFFFF8100047F) == "last_core_fn"
    assert ksyms.resolve(0xFFFFFFFF81000480) is None  # _etext
    assert ksyms.resolve(0xFFFFFFFF81100000) is None  # between _etext and rodata
    assert ksyms.resolve(0xFFFFFFFF81200180) is None  # data
    assert ksyms.resolve(0xFFFFFFFF81300060) is None  # after _einittext


def test_module_symbols_carry_module_name(ksyms: KernelSymbols) -> None:
    assert ksyms.resolve(0xFFFFFFFFC0001000) == "mod_fn_a [mymod]"
    assert ksyms.resolve(0xFFFFFFFFC000107F) == "mod_fn_a [mymod]"
    assert ksyms.resolve(0xFFFFFFFFC0001090) == "mod_fn_b [mymod]"
    assert ksyms.resolve(0xFFFFFFFFC0001100) is None  # module data
    assert ksyms.resolve(0xFFFFFFFFC0010040) == "bpf_prog_6deef7357e7b4530_handler [bpf]"


def test_last_symbol_of_a_region_does_not_run_into_the_next(ksyms: KernelSymbols) -> None:
    # other_fn is the last symbol of [othermod]: it gets 4 KiB rounded up to
    # a page boundary, not everything up to the [bpf] program 44 KiB later.
    assert ksyms.resolve(0xFFFFFFFFC0005FFF) == "other_fn [othermod]"
    assert ksyms.resolve(0xFFFFFFFFC0006000) is None
    assert ksyms.resolve(0xFFFFFFFFC000F000) is None
    assert ksyms.resolve(0xFFFFFFFFC0010FFF) == "bpf_prog_6deef7357e7b4530_handler [bpf]"
    assert ksyms.resolve(0xFFFFFFFFC0011000) is None
    assert ksyms.resolve(2**64 - 1) is None


def test_len_counts_distinct_functions(ksyms: KernelSymbols) -> None:
    # startup_64, vfs_read, strong_impl, __x64_sys_read, __do_softirq,
    # last_core_fn, init_fn, mod_fn_a, mod_fn_b, other_fn, bpf prog.
    assert len(ksyms) == 11


def test_zero_addresses_mean_unavailable(tmp_path: Path) -> None:
    p = tmp_path / "kallsyms"
    p.write_text("0000000000000000 T vfs_read\n0000000000000000 t mod_fn\t[mymod]\n")
    k = KernelSymbols(str(p))
    assert not k.available
    assert k.unavailable_reason is not None
    assert "kptr_restrict" in k.unavailable_reason
    assert k.resolve(0xFFFFFFFF81000000) is None
    assert len(k) == 0


def test_missing_file_is_unavailable_and_lazy(tmp_path: Path) -> None:
    k = KernelSymbols(str(tmp_path / "nope"))  # constructing must not touch the file
    assert not k.available
    assert k.unavailable_reason is not None
    assert "cannot read" in k.unavailable_reason
    assert k.resolve(0xFFFFFFFF81000000) is None


def test_no_text_symbols(tmp_path: Path) -> None:
    p = tmp_path / "kallsyms"
    p.write_text("ffffffff82400000 D __start_rodata\n")
    k = KernelSymbols(str(p))
    assert not k.available
    assert k.resolve(0xFFFFFFFF82400000) is None


def test_malformed_lines_are_skipped(tmp_path: Path) -> None:
    p = tmp_path / "kallsyms"
    p.write_text("garbage\nzzzz T nothex\n\nffffffff81000000 T good_fn\n")
    k = KernelSymbols(str(p))
    assert k.resolve(0xFFFFFFFF81000004) == "good_fn"
    assert len(k) == 1


def test_reload_sees_new_symbols(tmp_path: Path) -> None:
    p = tmp_path / "kallsyms"
    p.write_text("ffffffff81000000 T first\n")
    k = KernelSymbols(str(p))
    assert k.resolve(0xFFFFFFFFC0000010) is None
    p.write_text("ffffffff81000000 T first\nffffffffc0000000 t loaded\t[newmod]\n")
    assert k.resolve(0xFFFFFFFFC0000010) is None  # cached until reload
    k.reload()
    assert k.resolve(0xFFFFFFFFC0000010) == "loaded [newmod]"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=2**20), min_size=1, max_size=60, unique=True).map(
        sorted
    )
)
def test_every_address_between_two_symbols_resolves_to_the_first(
    tmp_path_factory: pytest.TempPathFactory, offsets: list[int]
) -> None:
    base = 0xFFFFFFFF81000000
    p = tmp_path_factory.mktemp("ks") / "kallsyms"
    p.write_text("".join(f"{base + o * 16:016x} T fn_{i}\n" for i, o in enumerate(offsets)))
    k = KernelSymbols(str(p))
    for i, o in enumerate(offsets):
        start = base + o * 16
        end = base + offsets[i + 1] * 16 if i + 1 < len(offsets) else start + 16
        assert k.resolve(start) == f"fn_{i}"
        assert k.resolve(end - 1) == f"fn_{i}"
    assert k.resolve(base + offsets[0] * 16 - 1) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="real kallsyms addresses need root (kptr_restrict)")
def test_real_kallsyms_resolves_its_own_functions() -> None:
    k = KernelSymbols()
    if not k.available:
        pytest.skip(f"kallsyms unavailable: {k.unavailable_reason}")
    wanted = {"vfs_read", "schedule", "do_sys_openat2"}
    found: dict[str, int] = {}
    with open("/proc/kallsyms") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] in wanted and parts[1] in "tT":
                found[parts[2]] = int(parts[0], 16)
    assert found
    for name, addr in found.items():
        assert k.resolve(addr) == name
        assert k.resolve(addr + 1) == name
