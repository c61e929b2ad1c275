"""CPython's own regression tests with the runtime active, on every
interpreter (Debian packages libpython3.X-testsuite; roots.py installs them
in the chroots). About 15 s per interpreter on a 2-CPU VM."""

from __future__ import annotations

import re

import pytest

from .conftest import Interp, check, read_perf_map

TESTS = ["test_generators", "test_coroutines", "test_exceptions", "test_threading",
         "test_sys_setprofile", "test_contextlib", "test_asyncgen"]

# Runs regrtest in this very process after printing the pid, so the test
# can find the perf map the runtime wrote for it.
RUNNER = ("import os, runpy, sys; print('pid', os.getpid(), flush=True); "
          "sys.argv = ['test', *sys.argv[1:]]; "
          "runpy.run_module('test', run_name='__main__', alter_sys=True)")


def test_regrtest_with_runtime(interp: Interp) -> None:
    if interp.run("-c", "import test.test_generators").returncode != 0:
        pytest.skip(f"no CPython test suite for {interp.name} "
                    "(apt-get install -y libpython3.X-testsuite)")
    tmp = interp.host_path("/tmp")
    before = set(tmp.glob("perf-*.map"))
    try:
        proc = interp.run("-c", RUNNER, *TESTS, env={"TRAMPROF_TRAMPOLINES": "1"},
                          timeout=1200)
        check(proc, f"regrtest on {interp.name}")
        _check_result(interp, proc.stdout, proc.stderr)
    finally:
        # regrtest's own child interpreters inherit the variable and write
        # maps too: remove every map this run created.
        for path in set(tmp.glob("perf-*.map")) - before:
            path.unlink(missing_ok=True)


def _check_result(interp: Interp, stdout: str, stderr: str) -> None:
    assert "Tests result: SUCCESS" in stdout, stdout[-4000:]
    assert "not activated" not in stderr
    pid = int(re.search(r"^pid (\d+)$", stdout, re.M).group(1))
    names = {name for _a, _s, name in read_perf_map(interp.perf_map(pid))}
    # The runtime really ran the tests: their functions have stubs.
    for module in ("test_generators", "test_coroutines", "test_asyncgen", "test_threading"):
        assert any(f"/test/{module}.py" in name for name in names), module
