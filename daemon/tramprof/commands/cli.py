"""Command line: ``tramprof run | record | doctor | metrics``."""

from __future__ import annotations

import argparse
import logging
import sys

from tramprof import __version__
from tramprof.config import Config, ConfigError, describe, load
from tramprof.export.formats import FORMATS


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _add_pids(parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup) -> None:
    parser.add_argument("--pid", "-p", dest="pids", type=int, nargs="+", action="extend",
                        metavar="PID", help="profile only these processes (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tramprof", description=(
        "Continuous CPU profiler: eBPF stack sampling that unwinds through JIT trampolines."))
    parser.add_argument("--version", action="version", version=f"tramprof {__version__}")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the daemon: sample continuously, serve /metrics")
    run.add_argument("--config", metavar="FILE", help="TOML configuration file")
    run.add_argument("--listen", metavar="HOST:PORT", help="HTTP address (default "
                     "127.0.0.1:9947)")
    run.add_argument("--frequency", "-F", type=int, metavar="HZ",
                     help="samples per second per CPU (default 99)")
    run.add_argument("--interval", type=_positive_float, metavar="SECONDS",
                     help="how often the in-kernel buffers are drained (default 10)")
    run.add_argument("--event", choices=("auto", "cycles", "cpu-clock"))
    run.add_argument("--scan-window", type=int, metavar="BYTES", dest="scan_window_bytes",
                     help="stack bytes scanned for CPython -X perf trampoline frames "
                     "(default 65536; cost grows with it, deeper Python stacks need more)")
    _add_pids(run)
    run.add_argument("--print-bpf", action="store_true", help=argparse.SUPPRESS)

    record = sub.add_parser("record", help="profile for a while and print the stacks")
    target = record.add_mutually_exclusive_group()
    _add_pids(target)
    target.add_argument("--all", "-a", action="store_true", help="all processes (default)")
    record.add_argument("--duration", "-d", type=_positive_float, default=10.0,
                        metavar="SECONDS", help="how long to sample (default 10)")
    record.add_argument("--frequency", "-F", type=int, default=99, metavar="HZ",
                        help="samples per second per CPU (default 99)")
    record.add_argument("--format", "-f", choices=tuple(FORMATS), default="folded",
                        help="output format (default folded: comm;root;...;leaf COUNT)")
    record.add_argument("--output", "-o", metavar="FILE", help="write here instead of stdout")
    record.add_argument("--event", choices=("auto", "cycles", "cpu-clock"), default="auto")

    doctor = sub.add_parser("doctor", help="check the host (and a process) for profiling")
    doctor.add_argument("--pid", "-p", type=int, help="also explain this process")
    doctor.add_argument("--sample-seconds", type=float, default=2.0, metavar="S",
                        help="with --pid: sample it this long to measure how many JIT "
                        "frames get names (0: skip; needs root)")

    sub.add_parser("metrics", help="print the table of exported metric families (Markdown)")

    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate a configuration file")
    check.add_argument("file", metavar="FILE")
    config_sub.add_parser("show", help="print every setting, its environment variable and "
                          "default")
    return parser


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _run_config(args: argparse.Namespace) -> Config:
    """Defaults < config file < TRAMPROF_* environment < command-line flags."""
    return load(args.config, overrides=_flag_overrides(args))


def _flag_overrides(args: argparse.Namespace) -> dict[str, object]:
    return {
        "listen": args.listen, "frequency": args.frequency, "interval": args.interval,
        "event": args.event, "log_level": args.log_level,
        "scan_window_bytes": args.scan_window_bytes,
        "pids": tuple(args.pids) if args.pids else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            config = _run_config(args)
            _setup_logging(config.log_level)
            if args.print_bpf:
                from tramprof.pipeline.profiler import sampler_config
                from tramprof.sampler.program import build_cflags, program_source

                print("// cflags: " + " ".join(build_cflags(sampler_config(config))))
                print(program_source())
                return 0
            from tramprof.commands.run import run_daemon

            overrides = _flag_overrides(args)
            return run_daemon(config, reload=lambda: load(args.config, overrides=overrides),
                              run_as=config.run_as_ids())
        if args.command == "record":
            _setup_logging(args.log_level or "warning")
            config = Config(frequency=args.frequency, event=args.event,
                            pids=tuple(args.pids or ()), interval=min(args.duration, 5.0))
            from tramprof.commands.record import record

            config = config.validated()
            return record(config, args.duration, args.format, args.output,
                          run_as=config.run_as_ids())
        if args.command == "doctor":
            from tramprof.commands import doctor

            checks, ok = doctor.run(args.pid, sample_seconds=args.sample_seconds)
            for check in checks:
                print(check.render())
            return 0 if ok else 1
        if args.command == "config":
            if args.config_command == "check":
                load(args.file)
                print(f"{args.file}: ok")
                return 0
            for name, env, default in describe():
                print(f"{name:28} {env:38} {default}")
            return 0
        if args.command == "metrics":
            from tramprof.export.families import markdown_table

            print(markdown_table())
            return 0
    except ConfigError as exc:
        print(f"tramprof: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
