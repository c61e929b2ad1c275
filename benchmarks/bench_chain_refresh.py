"""What the chain mode's look after a drain costs with many idle Python
processes under the trampoline runtime, when it reads every runtime's
descriptor and when it reads only those the drain had samples of (root:
the BPF maps, and other processes' memory).

``--runtimes`` Python processes run the runtime, make their stubs, then
wait idle, as the workers of a mostly idle service do. A real sampler's maps
take the chain mode's installs. Then, alternating round by round so that both
see the same conditions, ``ChainMode.refresh`` after a drain:

* ``all``: the drain's samples not known, every descriptor read (what every
  drain did before the walker's reports were trusted for idle processes);
* ``sampled``: a drain that had samples of ``--sampled`` of them.

each after ``--pause`` seconds asleep, as between drains. Reported: CPU per
refresh (``time.thread_time_ns``, median and 90th percentile) of each, and
their ratio.

    sudo .venv/bin/python benchmarks/bench_chain_refresh.py [--runtimes 80] [--sampled 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import install_trampolines, median, percentile
from tramprof.procfs.maps import read_maps
from tramprof.sampler.program import Sampler, SamplerConfig
from tramprof.unwind.chain import ChainMode

# Calls through a few functions (their stubs made), then idle until stdin closes.
_IDLE_WORKER = """\
import sys
def leaf(n):
    return sum(i * i for i in range(n))
def handler(n):
    return leaf(n) + leaf(n // 2)
for _ in range(200):
    handler(500)
print("ready", flush=True)
sys.stdin.read()
"""


@contextmanager
def idle_runtimes(count: int) -> Iterator[list[int]]:
    """``count`` idle Python processes under the runtime, ready."""
    env = install_trampolines()
    env.pop("TRAMPROF_TRAMPOLINES")  # -m tramprof_trampolines activates it
    with tempfile.TemporaryDirectory(prefix="tramprof-bench-chain-") as work:
        script = Path(work) / "worker.py"
        script.write_text(_IDLE_WORKER)
        procs = [subprocess.Popen(["/usr/bin/python3", "-m", "tramprof_trampolines",
                                   str(script)], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True) for _ in range(count)]
        try:
            for proc in procs:
                assert proc.stdout is not None
                if proc.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"worker {proc.pid} did not start")
            yield [proc.pid for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtimes", type=int, default=80)
    parser.add_argument("--sampled", type=int, default=2,
                        help="runtimes the drain had samples of")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--pause", type=float, default=0.1,
                        help="seconds asleep before each refresh")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_chain_refresh: needs root (BPF maps, process memory)", file=sys.stderr)
        return 1
    with idle_runtimes(args.runtimes) as pids, \
            Sampler(SamplerConfig(frequency=99)) as sampler:
        sampler.set_targets([])  # the maps are what is needed, not samples
        chain = ChainMode(sampler)
        for pid in pids:
            chain.consider(pid, read_maps(pid))
        walked = chain.unwound()
        if walked != set(pids):
            print(f"bench_chain_refresh: {len(pids) - len(walked)} runtimes not active",
                  file=sys.stderr)
            return 1
        live, sampled = set(pids), set(pids[:args.sampled])
        spent: dict[str, list[int]] = {"all": [], "sampled": []}
        for round_ in range(2 * args.rounds):
            name = ("all", "sampled")[round_ % 2]
            time.sleep(args.pause)
            began = time.thread_time_ns()
            chain.refresh(live, full=True, sampled=None if name == "all" else sampled)
            spent[name].append(time.thread_time_ns() - began)
    every, few = spent["all"], spent["sampled"]
    print(f"{args.runtimes} idle runtimes, {args.sampled} sampled in the drain, "
          f"{args.rounds} refreshes each")
    print(f"{'':8s} {'us p50':>8s} {'p90':>8s}")
    for name, values in spent.items():
        print(f"{name:8s} {median(values) / 1e3:8.0f} {percentile(values, 0.9) / 1e3:8.0f}")
    print(f"sampled / all (p50): {median(few) / median(every):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
