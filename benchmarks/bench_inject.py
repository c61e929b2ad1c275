"""Injection, per interpreter (root; the Debian roots of tests/trampolines):

- how long the target's threads are stopped (target: <= 10 ms);
- time from calling inject to the first sample with the complete Python chain;
- the workload's throughput before and after injection, and when started
  under the trampolines from the beginning (-X perf on 3.12+, the runtime via
  TRAMPROF_TRAMPOLINES=1 needs it installed: not measured here).

    .venv/bin/python benchmarks/bench_inject.py [NAME...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tramprof.config import Config  # noqa: E402
from tramprof.inject.injector import RuntimeStore, inject  # noqa: E402
from tramprof.pipeline.profiler import Profiler  # noqa: E402

from tests.inject.conftest import INTERPRETERS, build_runtimes, make_python  # noqa: E402

RATE_SCRIPT = """
import sys, threading, time
def leaf(seed):
    total = seed
    for i in range(3000):
        total = (total * 31 + i) % 1000003
    return total
def inner(s): return leaf(s)
def middle(s): return inner(s)
def outer(s): return middle(s)
count = [0]
def work():
    s = 1
    while True:
        s = outer(s); count[0] += 1
threading.Thread(target=work, daemon=True).start()
print("ready", flush=True)
import select
while True:
    # The main thread polls (a pending call runs only where it runs Python).
    while not select.select([sys.stdin], [], [], 0.02)[0]:
        pass
    line = sys.stdin.readline().strip()
    if line != "rate":
        break
    start = count[0]; time.sleep(2.0)
    print((count[0] - start) / 2.0, flush=True)
"""


def rate(proc) -> float:
    proc.stdin.write("rate\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


def first_complete(profiler: Profiler, pid: int, began: float, limit: float = 10) -> float:
    while time.monotonic() - began < limit:
        profiler.wait(0.05)
        for stack in profiler.collect():
            names = [f[4:].split(":", 1)[0] for f in stack.frames if f.startswith("py::")]
            if stack.pid == pid and names[-4:] == ["outer", "middle", "inner", "leaf"]:
                return time.monotonic() - began
    return float("nan")


def bench(name: str, runtimes: RuntimeStore) -> dict[str, float]:
    python = make_python(name)
    script = python.host_path(python.workdir + "/rate.py")
    script.write_text(RATE_SCRIPT)
    proc, pid = python.start(python.workdir + "/rate.py")
    assert proc.stdout.readline().strip() == "ready"
    before = rate(proc)
    profiler = Profiler(Config(pids=(pid,), frequency=499, interval=0.2))
    profiler.start()
    try:
        began = time.monotonic()
        result = inject(pid, runtimes=runtimes)
        assert result.ok, result.render()
        profiler.injector.note_injected(pid)
        to_stack = first_complete(profiler, pid, began)
    finally:
        profiler.close()
    after = rate(proc)
    proc.stdin.write("stop\n")
    proc.stdin.flush()
    proc.wait(30)
    out = {"stop_ms": result.stop_seconds * 1e3, "answer_s": result.seconds,
           "first_complete_stack_s": to_stack, "rounds_per_s_before": before,
           "rounds_per_s_after": after}
    if python.version >= (3, 12):
        proc, pid = python.start("-X", "perf", python.workdir + "/rate.py")
        assert proc.stdout.readline().strip() == "ready"
        out["rounds_per_s_started_with_-X_perf"] = rate(proc)
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        proc.wait(30)
    return out


def main(names: list[str]) -> int:
    runtimes = RuntimeStore(build_runtimes())
    for name in names or list(INTERPRETERS):
        print(name, {k: round(v, 3) for k, v in bench(name, runtimes).items()}, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
