"""``tramprof inject PID... [--off]``: turn trampolines on (or off) in running
CPythons, so the profiler gets complete Python stacks without a restart.

Runs with the caller's privileges (root, or CAP_SYS_PTRACE + CAP_CHOWN +
CAP_DAC_OVERRIDE for processes of other users): it must attach to the
target and create files owned by the target's user in the target's /tmp.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from tramprof.config import load


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser("inject", help="turn trampolines on in running CPython processes")
    parser.add_argument("pids", type=int, nargs="+", metavar="PID")
    parser.add_argument("--off", action="store_true", help="turn them off instead")
    parser.add_argument("--timeout", type=float, metavar="SECONDS",
                        help="how long to wait for each process to answer (default: "
                        "the inject_timeout setting, 5)")
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file "
                        "(inject_runtime_dir, inject_timeout)")
    parser.add_argument("--json", action="store_true", help="one JSON object per process")


def main(args: argparse.Namespace) -> int:
    from tramprof.inject.injector import RuntimeStore, inject

    config = load(args.config)
    timeout = args.timeout if args.timeout is not None else config.inject_timeout
    runtimes = RuntimeStore(config.inject_runtime_dir or None)
    ok = True
    for pid in args.pids:
        result = inject(pid, off=args.off, timeout=timeout, runtimes=runtimes)
        ok = ok and result.ok
        if args.json:
            print(json.dumps(asdict(result), sort_keys=True), flush=True)
        else:
            print(result.render(), flush=True)
    if not ok and not args.json:
        print("tramprof inject: not every process was changed (see above)", file=sys.stderr)
    return 0 if ok else 1
