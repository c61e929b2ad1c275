"""Every attacker of tests/hostile at once, plus a churn of short-lived
processes, next to a well-behaved target, against one daemon for a long run:
is the daemon's memory bounded and flat, does it stay up, do the target's
stacks stay exact, does /metrics stay fast?

Run as root: python benchmarks/bench_hostile.py [--minutes 10]
"""

from __future__ import annotations

import argparse
import os
import pwd
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from common import HERE, Daemon, median

ATTACKERS = HERE.parent / "tests" / "hostile" / "attackers"
TARGETS = HERE.parent / "tests" / "targets"
ATTACKER = "tramprof-attacker"
CHAIN = ("main", "chain_a", "chain_b", "chain_c")


def attacker_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(ATTACKER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", ATTACKER], check=True)
        return pwd.getpwnam(ATTACKER)


def prepare(user: pwd.struct_passwd) -> tuple[Path, Path]:
    work = Path(tempfile.mkdtemp(prefix="tramprof-bench-hostile-"))
    shutil.copy(ATTACKERS / "attacker.py", work / "attacker.py")
    (work / "tramprof_trampolines").mkdir()
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o",
                    str(work / "tramprof_trampolines" / "_runtime.so"),
                    str(ATTACKERS / "lying_runtime.c")], check=True)
    for path in (work, *work.rglob("*")):
        os.chown(path, user.pw_uid, user.pw_gid)
    chain = work / "chain"
    subprocess.run(["gcc", "-O2", "-fno-omit-frame-pointer", "-o", str(chain),
                    str(TARGETS / "chain.c")], check=True)
    os.chmod(chain, 0o755)
    return work, chain


def start_attackers(user: pwd.struct_passwd, work: Path) -> list[subprocess.Popen[str]]:
    modes = [["descriptor", str(work / "tramprof_trampolines" / "_runtime.so")], ["fifo"],
             ["names", str(work)], ["forknames", "4"], ["elfbomb", str(work / "bomb.so")]]
    started = []
    for argv in modes:
        proc = subprocess.Popen(
            ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
             "--", "/usr/bin/python3", str(work / "attacker.py"), *argv],
            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", argv
        started.append(proc)
    return started


def churn(chain: Path, per_minute: int, stop: threading.Event, count: list[int]) -> None:
    """Short-lived processes (10 ms of CPU each) at a steady rate."""
    gap = 60.0 / per_minute
    next_at = time.monotonic()
    while not stop.is_set():
        subprocess.run([str(chain), "0.01"], stdout=subprocess.DEVNULL, check=False)
        count[0] += 1
        next_at += gap
        stop.wait(max(0.0, next_at - time.monotonic()))


def exact_share(d: Daemon, pid: int, seconds: float) -> tuple[float, int]:
    text = d.get(f"/profile?seconds={seconds:g}&format=folded&pid={pid}")
    total = exact = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        total += int(count)
        if "main" in frames and tuple(frames[frames.index("main"):]) == CHAIN:
            exact += int(count)
    return (exact / total if total else 0.0), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--churn-per-minute", type=int, default=1000)
    parser.add_argument("--every", type=float, default=15, help="seconds between checks")
    args = parser.parse_args()
    user = attacker_user()
    work, chain = prepare(user)
    target = subprocess.Popen([str(chain), str(args.minutes * 60 + 120)],
                              stdout=subprocess.PIPE, text=True)
    assert target.stdout is not None and target.stdout.readline().startswith("ready")
    daemon = Daemon("--interval", "5")
    attackers = start_attackers(user, work)
    stop, spawned = threading.Event(), [0]
    churner = threading.Thread(target=churn, args=(chain, args.churn_per_minute, stop, spawned))
    churner.start()
    rows = []
    began = time.monotonic()
    try:
        while time.monotonic() - began < args.minutes * 60:
            time.sleep(args.every)
            alive = daemon.proc.poll() is None
            t0 = time.monotonic()
            metrics = daemon.get("/metrics") if alive else ""
            scrape_ms = (time.monotonic() - t0) * 1000
            share, samples = exact_share(daemon, target.pid, args.every) if alive else (0, 0)
            rss, anon = daemon.rss_mib() if alive else (float("nan"), float("nan"))
            series = sum(1 for line in metrics.splitlines()
                         if line.startswith("tramprof_samples_total{"))
            rows.append((time.monotonic() - began, rss, anon, scrape_ms, share, samples, series,
                         alive))
            print(f"{rows[-1][0]:6.0f} s  RSS {rss:6.1f} MiB (anon {anon:5.1f})  "
                  f"/metrics {scrape_ms:6.1f} ms  target exact {share:6.1%} of {samples:5d}  "
                  f"samples_total series {series:3d}  churned {spawned[0]}", flush=True)
            if not alive:
                break
    finally:
        stop.set()
        churner.join()
        for proc in attackers:
            proc.kill()
            proc.wait()
            for name in (f"/tmp/perf-{proc.pid}.map", f"/tmp/jit-{proc.pid}.dump"):
                Path(name).unlink(missing_ok=True)
        up = daemon.proc.poll() is None
        peak = daemon.peak_rss_mib() if up else float("nan")
        if up:
            daemon.stop()
        target.kill()
        shutil.rmtree(work, ignore_errors=True)
    warm = [r for r in rows if r[0] >= 60] or rows
    print()
    print(f"daemon stayed up: {up} (restarts: {0 if up else 1}); short-lived processes: "
          f"{spawned[0]} in {rows[-1][0] / 60:.1f} min")
    print(f"RSS after the first minute: first {warm[0][1]:.1f}, last {warm[-1][1]:.1f}, "
          f"max {max(r[1] for r in warm):.1f} MiB; peak (VmHWM) {peak:.1f} MiB")
    scrapes = sorted(r[3] for r in rows)
    print(f"/metrics: median {median(scrapes):.1f} ms, max {scrapes[-1]:.1f} ms")
    print(f"target exact-stack share: median {median([r[4] for r in rows]):.1%}, "
          f"min {min(r[4] for r in rows):.1%}")


if __name__ == "__main__":
    main()
