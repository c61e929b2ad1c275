"""CPython's own regression tests pass in a process injected while they run:
the trampolines switched on mid-run change no result (root; each interpreter
in its own root and PID namespace)."""

from __future__ import annotations

import os
import re
import time

import pytest
from tramprof.inject.injector import RuntimeStore, inject

from .conftest import make_python

# The same subset tests/trampolines runs with the runtime active from the start.
TESTS = ["test_generators", "test_coroutines", "test_exceptions", "test_threading",
         "test_sys_setprofile", "test_contextlib", "test_asyncgen"]
RUNNER = ("import os, runpy, sys; print('ready', flush=True); "
          "sys.argv = ['test', *sys.argv[1:]]; "
          "runpy.run_module('test', run_name='__main__', alter_sys=True)")
# Left out: a CPython test that can hang by itself, in a child interpreter
# the injection never touches. Its child recurses near the limit until a
# thread interrupts it; when the interrupt's handler runs at the limit, it
# raises RecursionError, which the child catches and recurses on, forever.
# (Seen once here, in trixie's 3.13, under load; 0 of 56 runs alone.)
# -W: a failed test's own output is printed (the failure says which and how).
OPTIONS = ["-W", "--ignore", "test_print_exception_gh_102056"]

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: ptrace, chroots"),
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 only"),
]


# One interpreter per way in: our runtime by a ptrace-scheduled pending call
# (3.11), CPython's trampolines the same way (3.13), PEP 768 (3.14).
@pytest.mark.parametrize("name", ["host-3.11", "trixie-3.13", "sid-3.14"])
def test_regrtest_passes_when_injected_mid_run(name: str, runtime_dir) -> None:
    python = make_python(name)
    probe, _pid = python.start("-c", "import test.test_generators")
    probe.communicate(timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"no CPython test suite in {name}")
    proc, pid = python.start("-c", RUNNER, *OPTIONS, *TESTS)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(2.0)  # well inside the first tests
        assert proc.poll() is None, "the tests ended before the injection"
        # The activation runs when the main thread next executes Python code;
        # a test may keep it waiting in C (a join, a lock) for seconds, longer
        # on a loaded machine (one CI run: over the default 5 s).
        result = inject(pid, timeout=30.0, runtimes=RuntimeStore(runtime_dir))
        if not result.ok:   # which test was running, and what the target said
            proc.kill()
            out, err = proc.communicate(timeout=60)
            pytest.fail(f"{result.render()}\n--- stdout ---\n{out[-2000:]}\n"
                        f"--- stderr ---\n{err[-3000:]}")
        out, err = proc.communicate(timeout=1200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or "Tests result: SUCCESS" not in out:
        # In full (an assertion's message would be cut): which test failed, how.
        pytest.fail(f"regrtest exited with {proc.returncode}\n--- stdout ---\n{out[-4000:]}\n"
                    f"--- stderr ---\n{err[-8000:]}")
    # The trampolines were really on while the rest ran: their perf map names
    # functions of the tests that ran after the injection.
    perf_maps = list(python.host_path("/tmp").glob("perf-*.map"))
    names = "".join(p.read_text(errors="replace") for p in perf_maps
                    if p.stat().st_mtime >= time.time() - 1300)
    later = [m for m in TESTS[2:] if re.search(rf"/test/{m}\.py", names)]
    assert later, "no stub for a test that ran after the injection"
