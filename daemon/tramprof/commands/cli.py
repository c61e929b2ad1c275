"""Command line: ``tramprof run | record | doctor | metrics | config | completion | man``.

Exit status: 0 success, 1 a failure at run time (the sampler cannot load,
privileges cannot be dropped, the listen address is taken: a restart may
help), 2 a usage error, 78 (EX_CONFIG, sysexits.h) a configuration error
(bad file, setting or environment variable: restarting cannot help, so the
systemd unit lists it in RestartPreventExitStatus=). ``record -- COMMAND``
exits with the command's status.
"""

from __future__ import annotations

import argparse
import sys

import shtab

from tramprof import __version__
from tramprof.commands.logs import (
    LOG_FORMATS,
    LOG_LEVELS,
    PRIORITY_ERROR,
    configure_logging,
    stream_is_journal,
)
from tramprof.config import Config, ConfigError, describe, load
from tramprof.export.formats import FORMATS

EVENT_HELP = ("what drives sampling (default auto: hardware cycles where the machine has a "
              "PMU, otherwise cpu-clock)")
COMMAND_DRAIN_INTERVAL = 1.0
EXIT_USAGE = 2
EXIT_CONFIG = 78  # EX_CONFIG: the unit's RestartPreventExitStatus=


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _add_pids(parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup) -> None:
    parser.add_argument("--pid", "-p", dest="pids", type=int, nargs="+", action="extend",
                        metavar="PID", help="profile only these processes (repeatable)")


def _complete_files(action: argparse.Action) -> None:
    """Shell completion offers file names for this argument."""
    setattr(action, "complete", shtab.FILE)  # noqa: B010 - shtab reads it off the Action


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tramprof", description=(
        "Continuous CPU profiler: eBPF stack sampling that unwinds through JIT trampolines."))
    parser.add_argument("--version", action="version", version=f"tramprof {__version__}")
    _add_global_flags(parser, after_subcommand=False)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the daemon: sample continuously, serve /metrics")
    _complete_files(run.add_argument("--config", metavar="FILE",
                                     help="TOML configuration file"))
    run.add_argument("--listen", metavar="HOST:PORT", help="HTTP address (default "
                     "127.0.0.1:9947)")
    run.add_argument("--frequency", "-F", type=int, metavar="HZ",
                     help="samples per second per CPU (default 99)")
    run.add_argument("--interval", type=_positive_float, metavar="SECONDS",
                     help="how often the in-kernel buffers are drained (default 10)")
    run.add_argument("--event", choices=("auto", "cycles", "cpu-clock"), help=EVENT_HELP)
    run.add_argument("--scan-window", type=int, metavar="BYTES", dest="scan_window_bytes",
                     help="stack bytes scanned for CPython -X perf trampoline frames "
                     "(default 65536; cost grows with it, deeper Python stacks need more)")
    _add_pids(run)
    run.add_argument("--print-bpf", action="store_true", help=argparse.SUPPRESS)

    prepare = sub.add_parser("prepare", help="compile the BPF program into the program "
                             "cache (program_cache_dir) and exit, e.g. as an init container: "
                             "the daemon then starts from the cache")
    _complete_files(prepare.add_argument("--config", metavar="FILE",
                                         help="TOML configuration file (the daemon's)"))

    record = sub.add_parser("record", help="profile for a while, or a command until it "
                            "exits, and print the stacks",
                            usage="%(prog)s [options] [--pid PID ... | --all]\n"
                            "       %(prog)s [options] -- COMMAND [ARG ...]")
    target = record.add_mutually_exclusive_group()
    _add_pids(target)
    target.add_argument("--all", "-a", action="store_true", help="all processes (default)")
    record.add_argument("--duration", "-d", type=_positive_float, metavar="SECONDS",
                        help="how long to sample (default 10; with a COMMAND: until it "
                        "exits)")
    record.add_argument("--frequency", "-F", type=int, default=99, metavar="HZ",
                        help="samples per second per CPU (default 99)")
    record.add_argument("--format", "-f", choices=tuple(FORMATS), default="folded",
                        help="output format (default folded: comm;root;...;leaf COUNT)")
    _complete_files(record.add_argument("--output", "-o", metavar="FILE",
                                        help="write here instead of stdout"))
    record.add_argument("--event", choices=("auto", "cycles", "cpu-clock"), default="auto",
                        help=EVENT_HELP)
    record.add_argument("argv", nargs="*", metavar="COMMAND",
                        help="after --: start this command (TRAMPROF_TRAMPOLINES=1 in its "
                        "environment) and profile it and its children until it exits; "
                        "tramprof then exits with its status")

    doctor = sub.add_parser("doctor", help="check the host (and a process) for profiling")
    doctor.add_argument("--pid", "-p", type=int, help="also explain this process")
    doctor.add_argument("--sample-seconds", type=float, default=2.0, metavar="S",
                        help="with --pid: sample it this long to measure how many JIT "
                        "frames get names (0: skip; needs root)")

    sub.add_parser("metrics", help="print the table of exported metric families (Markdown)")
    from tramprof.commands import inject as inject_command

    inject_command.add_parser(sub)

    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate a configuration file")
    _complete_files(check.add_argument("file", metavar="FILE", help="TOML configuration file"))
    config_sub.add_parser("show", help="print every setting, its environment variable and "
                          "default")
    config_sub.add_parser("example", help="print a configuration file with every setting, "
                          "its documentation and default (deploy/tramprof.example.toml)")

    completion = sub.add_parser("completion", help="print a shell completion script "
                                "(bash: source <(tramprof completion bash))")
    completion.add_argument("shell", choices=("bash", "zsh"), help="the shell to complete for")
    sub.add_parser("man", help="print the manual page (roff): tramprof man | man -l -")
    _accept_global_flags_after_subcommands(parser)
    return parser


def _add_global_flags(parser: argparse.ArgumentParser, after_subcommand: bool) -> None:
    """Flags every command takes, before or after its name. After it, they
    default to "not given" so they never overwrite a value given before it."""
    default = argparse.SUPPRESS if after_subcommand else None
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=default,
                        help="log threshold (run: default info, or log_level from the "
                        "configuration; other commands: warning)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=default,
                        help="log line format on stderr (default text); under systemd "
                        "every line carries its journald priority")


def _accept_global_flags_after_subcommands(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in {id(p): p for p in action.choices.values()}.values():
                _add_global_flags(subparser, after_subcommand=True)
                _accept_global_flags_after_subcommands(subparser)


def _setup_logging(args: argparse.Namespace, level: str) -> None:
    configure_logging(level, args.log_format or "text")


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
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            config = _run_config(args)
            _setup_logging(args, config.log_level)
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
        if args.command == "prepare":
            config = load(args.config)
            _setup_logging(args, config.log_level)
            from tramprof.commands.prepare import prepare

            return prepare(config)
        if args.command == "record":
            _setup_logging(args, args.log_level or "warning")
            if args.argv and (args.pids or args.all):
                parser.error("record: give either a COMMAND or --pid/--all, not both")
            duration = args.duration or (None if args.argv else 10.0)
            # A command's processes may live only seconds: their samples are
            # named while they still run (see commands/record.py).
            interval = COMMAND_DRAIN_INTERVAL if args.argv else min(duration or 5.0, 5.0)
            config = Config(frequency=args.frequency, event=args.event,
                            pids=tuple(args.pids or ()), interval=interval)
            from tramprof.commands.record import record, record_command

            config = config.validated()
            if args.argv:
                return record_command(config, args.argv, duration, args.format, args.output,
                                      run_as=config.run_as_ids())
            assert duration is not None
            return record(config, duration, args.format, args.output,
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
            if args.config_command == "example":
                from tramprof.commands.config_example import example_toml

                print(example_toml(), end="")
                return 0
            for name, env, default in describe():
                print(f"{name:28} {env:38} {default}")
            return 0
        if args.command == "inject":
            from tramprof.commands import inject as inject_command

            _setup_logging(args, args.log_level or "warning")
            return inject_command.main(args)
        if args.command == "metrics":
            from tramprof.export.families import markdown_table

            print(markdown_table())
            return 0
        if args.command == "completion":
            print(shtab.complete(parser, shell=args.shell), end="")
            return 0
        if args.command == "man":
            from tramprof.commands.manpage import render

            print(render(parser), end="")
            return 0
    except ConfigError as exc:
        # Before logging is set up: in the journal too it is an error.
        prefix = f"<{PRIORITY_ERROR}>" if stream_is_journal() else ""
        print(f"{prefix}tramprof: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
