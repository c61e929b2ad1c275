"""Doctor's checks on inputs the test controls."""

from __future__ import annotations

from pathlib import Path

from tramprof import speedups
from tramprof.commands import doctor


def status(caps: int) -> str:
    return f"Name:\tx\nCapEff:\t{caps:016x}\n"


def test_privileges():
    root = doctor.check_privileges(status((1 << 41) - 1))
    assert root.ok
    none = doctor.check_privileges(status(0))
    assert not none.ok and not none.warning and "CAP_BPF" in none.fix
    bpf_only = doctor.check_privileges(status(1 << doctor.CAP_BPF | 1 << doctor.CAP_PERFMON))
    assert not bpf_only.ok and bpf_only.warning and "CAP_SYS_PTRACE" in bpf_only.fix


def test_kallsyms_zeroed_is_a_warning(tmp_path):
    zeroed = tmp_path / "kallsyms"
    zeroed.write_text("0000000000000000 T _stext\n")
    check = doctor.check_kallsyms(str(zeroed))
    assert not check.ok and check.warning and "kptr_restrict" in check.fix
    real = tmp_path / "real"
    real.write_text("ffffffff81000000 T _stext\n")
    assert doctor.check_kallsyms(str(real)).ok


def test_compiled_naming_missing_is_a_warning(monkeypatch):
    """Built (as ``make setup`` builds it) it is reported as such; without
    it profiling works, slower, and the fix says what to install."""
    assert doctor.check_compiled_naming().ok
    monkeypatch.setattr(speedups, "compiled", None)
    check = doctor.check_compiled_naming()
    assert not check.ok and check.warning and "python3-dev" in check.fix
    assert speedups.naming_passes() == "python"


def test_btf_failure_says_what_to_do(tmp_path):
    bogus = tmp_path / "vmlinux"
    bogus.write_bytes(b"\0" * 64)
    check = doctor.check_btf(str(bogus))
    assert not check.ok and "CONFIG_DEBUG_INFO_BTF" in check.fix


def test_process_checks_on_a_running_process_and_on_a_missing_pid(sleepers: list[int]):
    # A small program, not the test process: this one maps bcc's LLVM, whose
    # unwind table alone takes the native check over a minute to compile.
    pid = sleepers[0]
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    files = sum(1 for line in maps
                if line.split()[1][2] == "x" and line.split()[-1].startswith("/"))
    checks = doctor.check_process(pid)
    assert files >= 2  # sleep and the C library at least
    assert checks[0].ok and checks[0].detail.startswith(f"{files} executable file mappings,")
    missing = doctor.check_process(2**22 + 1)
    assert len(missing) == 1 and not missing[0].ok


def test_render():
    text = doctor.Check("x", False, "broken", "do y").render()
    assert text == "[FAIL] x: broken\n       fix: do y"
