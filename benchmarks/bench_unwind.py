"""BPF program run time per sample, by unwinding mode and Python depth (root).

chain: the system python3 with the trampoline runtime (TRAMPROF_TRAMPOLINES=1),
nesting.py recurse at ~10/50/128 Python frames. scan: trixie's python3.13
-X perf (CPython's own stubs), same depths. Only the target is sampled (pid
filter); kernel bpf_stats give ns per program run.

    .venv/bin/python benchmarks/bench_unwind.py [--seconds 3] [--modes chain]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "trampolines"))
sys.path.insert(0, str(REPO))

from tramprof.sampler.layout import Counter as BpfCounter  # noqa: E402

from tests.trampolines import conftest  # noqa: E402

DEPTHS = (10, 50, 128)


def measure(proc: subprocess.Popen[str], seconds: float, scan_bytes: int) -> tuple[float, int]:
    from tramprof.config import Config
    from tramprof.pipeline.profiler import (
        Profiler,  # the daemon's pipeline installs chain/scan info
    )

    profiler = Profiler(Config(pids=(proc.pid,), frequency=499, scan_window_bytes=scan_bytes))
    profiler.start()
    try:
        warm = time.monotonic() + 0.5
        while time.monotonic() < warm:
            profiler.wait(0.1)
        profiler.collect()
        before = profiler.sampler.run_time() or (0, 0)
        rec0 = profiler.sampler.counters()[BpfCounter.RECORDED]
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            profiler.wait(0.2)
        profiler.collect()
        after = profiler.sampler.run_time() or (0, 0)
        recorded = profiler.sampler.counters()[BpfCounter.RECORDED] - rec0
    finally:
        profiler.close()
    # Runs on idle CPUs / other processes are cheap exits; charge all run time
    # to the target's recorded samples (an upper bound per sample).
    return (after[0] - before[0]) / max(1, recorded), recorded


def start(interp: conftest.Interp, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    proc = interp.popen(*args, env=env)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--modes", default="chain,scan 64K,scan 16K",
                        help="comma-separated subset of: chain, scan 64K, scan 16K")
    parser.add_argument("--depths", default=",".join(map(str, DEPTHS)),
                        help="comma-separated Python depths")
    args = parser.parse_args()
    rows = []
    work = Path(tempfile.mkdtemp(prefix="tramprof-bench-"))
    host = conftest.Interp("host", conftest.HOST_PYTHON, None, Path("/"), str(work),
                           env={"PYTHONUSERBASE": str(work / "userbase")})
    conftest._install(host)
    trixie = conftest.root_interp("trixie")
    cases = [("chain", host, [], {"TRAMPROF_TRAMPOLINES": "1"},
              65536)]
    cases += [("scan 64K", trixie, ["-X", "perf"], {}, 65536),
              ("scan 16K", trixie, ["-X", "perf"], {}, 16384)]
    modes = {m.strip() for m in args.modes.split(",")}
    depths = [int(d) for d in args.depths.split(",")]
    for name, interp, pre, env, window in cases:
        if name not in modes:
            continue
        for depth in depths:
            proc = start(interp, [*pre, interp.script("nesting.py"), "recurse",
                                  str(args.seconds + 15), str(depth)], env)
            try:
                ns, runs = measure(proc, args.seconds, window)
            finally:
                proc.kill()
                proc.wait()
            rows.append((name, depth, ns, runs))
            print(f"{name:10} {depth:4} frames  {ns / 1000:6.2f} us/sample  ({runs} samples)",
                  flush=True)
    print("\nmode       depth  us/sample")
    for name, depth, ns, _runs in rows:
        print(f"{name:10} {depth:5}  {ns / 1000:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
