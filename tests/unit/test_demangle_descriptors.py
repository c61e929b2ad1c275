"""The demangler works when the daemon already holds over a thousand
descriptors (a busy host: files held open for hundreds of processes), so its
worker's pipe lands past select()'s limit of 1023."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess

import pytest
from tramprof.symbols.demangle import Demangler

HELD = 1100
NAME = "_ZNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEE9_M_appendEPKcm"


@pytest.fixture
def many_descriptors():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = HELD + 64
    if soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.skip(f"needs {wanted} descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(HELD)]
    try:
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="needs c++filt (binutils)")
def test_worker_started_past_descriptor_1023(many_descriptors) -> None:
    failures: list[str] = []
    demangler = Demangler(on_failure=failures.append)
    try:
        got = [demangler.demangle(f"{NAME}.part.{i}") for i in range(3)]
        worker_fd = demangler._worker._proc.stdout.fileno()  # type: ignore[union-attr]
    finally:
        demangler.close()
    expected = subprocess.run(["c++filt"], input="\n".join(f"{NAME}.part.{i}" for i in range(3)),
                              capture_output=True, text=True, check=True).stdout.splitlines()
    assert worker_fd > 1023
    assert got == expected
    assert failures == []
