"""Overhead of tramprof_trampolines: recursive fib (worst case) and a
pyperformance subset, per configuration, A/B alternating over rounds.

Configurations (each a fresh interpreter per measurement):
  off        no runtime
  hook-only  the PEP 523 hook calling the default evaluator, no stubs
  stubs      the full runtime (hook + per-code-object stub + TLS chain)
  -X perf    CPython's builtin perf trampoline (3.12+ only)
  budget     the full runtime under `tramprof run` with python_overhead_budget
             (--budget, default 0.05; root): the daemon duty-cycles the hook.
             Measured in a second pass, alternating with its own "off" runs
             under the same daemon (the budget applies to every runtime the
             daemon sees, so it cannot run next to "stubs"); its ratio is
             against that pass's "off". The daemon runs as shipped (its
             default interval, 10 s): a worker's runtime is found and its
             duty cycle set about 0.1 s after its first sample. Workers run
             20 warm-up values first, in both passes, so the duty cycle has
             settled before values count.

Interpreters: the host's /usr/bin/python3.11 and, with --root NAME (root
needed), a Debian chroot from tests/trampolines/roots.py, e.g. trixie (3.13).

    python benchmarks/bench_trampolines.py [--rounds 5] [--root trixie] [--budget 0.05]

Benchmarks are pyperformance's own run_benchmark.py files, run with pyperf in
worker mode (`--worker -l LOOPS -w 1 -n 3`), loops calibrated once with the
runtime off. pyperformance and pyperf are fetched with `pip download` (wheels,
no install) into a cache directory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "trampolines"))
import roots  # noqa: E402
from common import Daemon  # noqa: E402

CACHE = Path(os.environ.get("TRAMPROF_BENCH_CACHE", "/var/cache/tramprof-test/bench"))
#: Warm-up values per worker (discarded): the budget's duty cycle settles meanwhile.
WARMUPS = 20
PYPERFORMANCE_BENCHES = ["nbody", "richards", "float", "chaos", "deltablue", "go", "raytrace",
                         "json_dumps"]
ROOT_PYTHONS = {"trixie": "python3.13", "bullseye": "python3.9", "sid": "python3.14",
                "sid315": "python3.15"}
FIB = '''
import pyperf

def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)

runner = pyperf.Runner()
runner.bench_func("fib", fib, 22)
'''


def fetch_wheels() -> Path:
    """pyperformance + pyperf, unpacked, in CACHE/wheels (pip download once)."""
    wheels = CACHE / "wheels"
    unpacked = CACHE / "unpacked"
    if not (unpacked / "pyperf").is_dir():
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d",
                        str(wheels), "pyperformance==1.14.0", "pyperf==2.11.0"], check=True)
        for wheel in wheels.glob("*.whl"):
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(unpacked)
    return unpacked


@dataclass
class Target:
    name: str
    python: str
    root: str | None
    prefix: Path  # host path of the interpreter's "/"
    work: str     # work dir as the interpreter sees it

    def host(self, path: str) -> Path:
        return self.prefix / path.lstrip("/") if self.root else Path(path)

    def run(self, argv: list[str], env: dict[str, str], timeout: float = 600,
            ) -> subprocess.CompletedProcess[str]:
        full_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                    "PYTHONUSERBASE": self.work + "/userbase",
                    "PYTHONPATH": self.work + "/lib", **env}
        command = roots.root_command(self.root, argv, cwd=self.work) if self.root else argv
        return subprocess.run(command, env=full_env, capture_output=True, text=True,
                              timeout=timeout, cwd=None if self.root else self.work)


def prepare(target: Target, unpacked: Path) -> None:
    work = target.host(target.work)
    work.mkdir(parents=True, exist_ok=True)
    shutil.copytree(unpacked / "pyperf", work / "lib" / "pyperf")
    benches = unpacked / "pyperformance" / "data-files" / "benchmarks"
    for name in PYPERFORMANCE_BENCHES:
        shutil.copytree(benches / f"bm_{name}", work / "benches" / name)
    (work / "benches" / "fib").mkdir()
    (work / "benches" / "fib" / "run_benchmark.py").write_text(FIB)
    shutil.copytree(REPO / "trampolines", work / "src", ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", "*.so"))
    proc = target.run([target.python, "-m", "pip", "install", "-q", "--user",
                       "--no-build-isolation", "--no-deps", "--disable-pip-version-check",
                       target.work + "/src"],
                      env={"PIP_BREAK_SYSTEM_PACKAGES": "1", "PIP_ROOT_USER_ACTION": "ignore"})
    if proc.returncode != 0:
        raise SystemExit(f"installing the runtime into {target.name} failed:\n{proc.stderr}")


def configs(target: Target) -> dict[str, tuple[list[str], dict[str, str]]]:
    out = {"off": ([], {}),
           "hook-only": ([], {"TRAMPROF_TRAMPOLINES": "1",
                              "TRAMPROF_TRAMPOLINES_MODE": "hook-only"}),
           "stubs": ([], {"TRAMPROF_TRAMPOLINES": "1"})}
    probe = target.run([target.python, "-c", "import sys; print(sys.version_info >= (3, 12))"],
                       env={})
    if probe.stdout.strip() == "True":
        out["-X perf"] = (["-X", "perf"], {})
    return out


def bench_once(target: Target, bench: str, loops: int, xargs: list[str], env: dict[str, str],
               check_mode: str) -> float:
    """Mean seconds per loop iteration of one worker process."""
    out = f"{target.work}/out-{bench}.json"
    argv = [target.python, *xargs, f"{target.work}/benches/{bench}/run_benchmark.py",
            "--worker", "-l", str(loops), "-w", str(WARMUPS), "-n", "3", "-o", out]
    proc = target.run(argv, env)
    if proc.returncode != 0:
        raise SystemExit(f"{bench} failed on {target.name}:\n{proc.stderr[-3000:]}")
    if "not activated" in proc.stderr:
        raise SystemExit(f"runtime did not activate ({check_mode}): {proc.stderr}")
    host_out = target.host(out)
    data = json.loads(host_out.read_text())
    host_out.unlink()
    values = [v for run in data["benchmarks"][0]["runs"] for v in run.get("values", [])]
    return statistics.mean(values)


def calibrate(target: Target, bench: str) -> int:
    out = f"{target.work}/cal-{bench}.json"
    proc = target.run([target.python, f"{target.work}/benches/{bench}/run_benchmark.py",
                       "--worker", "--calibrate-loops", "-o", out], env={})
    if proc.returncode != 0:
        raise SystemExit(f"calibrating {bench} failed:\n{proc.stderr[-3000:]}")
    return int(json.loads(target.host(out).read_text())["metadata"]["loops"])


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def run_rounds(target: Target, cfgs: dict[str, tuple[list[str], dict[str, str]]],
               benches: list[str], loops: dict[str, int], rounds: int, label: str,
               ) -> dict[tuple[str, str], list[float]]:
    names = list(cfgs)
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate: A/B alternation
        for bench in benches:
            for cfg in order:
                xargs, env = cfgs[cfg]
                times.setdefault((bench, cfg), []).append(
                    bench_once(target, bench, loops[bench], xargs, env, cfg))
        print(f"  {label} round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    return times


def measure(target: Target, rounds: int, budget: float) -> None:
    cfgs = configs(target)
    names = list(cfgs)
    benches = ["fib", *PYPERFORMANCE_BENCHES]
    loops = {b: calibrate(target, b) for b in benches}
    times = run_rounds(target, cfgs, benches, loops, rounds, "plain")
    if budget and os.geteuid() != 0:
        print("budget pass skipped: the daemon needs root", file=sys.stderr)
        budget = 0.0
    if budget:
        with tempfile.NamedTemporaryFile("w", suffix=".toml") as config:
            config.write(f"python_overhead_budget = {budget}\n")
            config.flush()
            daemon = Daemon("--config", config.name)
            try:
                under = run_rounds(target, {"off": cfgs["off"], "budget": cfgs["stubs"]},
                                   benches, loops, rounds, f"budget {budget}")
            finally:
                daemon.stop()
        name = f"budget {budget:g}"
        names.append(name)
        for bench in benches:
            # Scaled to the plain pass's "off" by this pass's own "off".
            scale = statistics.median(times[(bench, "off")]) / \
                statistics.median(under[(bench, "off")])
            times[(bench, name)] = [t * scale for t in under[(bench, "budget")]]

    version = target.run([target.python, "-c", "import sys; print(sys.version.split()[0])"],
                         env={}).stdout.strip()
    print(f"\n{target.name}: Python {version}, {rounds} rounds, median of per-process means")
    header = f"{'benchmark':<12} {'off':>10}" + "".join(f" {n:>11}" for n in names[1:])
    print(header)
    print("-" * len(header))
    ratios: dict[str, list[float]] = {n: [] for n in names[1:]}
    for bench in benches:
        base = statistics.median(times[(bench, "off")])
        row = f"{bench:<12} {base * 1e3:>8.2f}ms"
        for cfg in names[1:]:
            ratio = statistics.median(times[(bench, cfg)]) / base
            if bench != "fib":
                ratios[cfg].append(ratio)
            row += f" {(ratio - 1) * 100:>+10.1f}%"
        print(row)
    row = f"{'geomean*':<12} {'':>10}"
    for cfg in names[1:]:
        row += f" {(geomean(ratios[cfg]) - 1) * 100:>+10.1f}%"
    print("-" * len(header))
    print(row)
    print("* geometric mean over the pyperformance subset (fib excluded)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--root", action="append", default=[],
                        help="also measure inside this Debian root (trixie = 3.13)")
    parser.add_argument("--no-host", action="store_true")
    parser.add_argument("--budget", type=float, default=0.05,
                        help="python_overhead_budget of the budget pass (0: no such pass)")
    args = parser.parse_args()
    unpacked = fetch_wheels()
    with tempfile.TemporaryDirectory(prefix="bench-trampolines-") as tmp:
        targets = []
        if not args.no_host:
            targets.append(Target("host", "/usr/bin/python3.11", None, Path("/"), tmp))
        for name in args.root:
            path = roots.ensure_root(name)
            work = f"/tmp/{Path(tmp).name}"
            targets.append(Target(name, ROOT_PYTHONS[name], name, path, work))
        try:
            for target in targets:
                print(f"preparing {target.name}", file=sys.stderr, flush=True)
                prepare(target, unpacked)
                measure(target, args.rounds, args.budget)
        finally:
            for target in targets:
                if target.root:
                    shutil.rmtree(target.host(target.work), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
