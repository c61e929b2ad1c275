"""tramprof(1), generated from the argument parser itself, so every command
and flag the CLI accepts is in the manual page and nothing else is (no copy
to keep in step)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from tramprof import __version__

SUMMARY = "continuous CPU profiler: eBPF stack sampling that unwinds through JIT trampolines"

EXIT_STATUS = (
    ("0", "Success."),
    ("1", "A failure at run time: the BPF program cannot be loaded or attached, "
          "privileges cannot be dropped, the listen address is taken, an output file "
          "cannot be written. Restarting may help."),
    ("2", "A usage error (unknown flag or command, bad argument)."),
    ("78", "A configuration error (EX_CONFIG): a bad configuration file, setting or "
           "environment variable. Restarting cannot help; the systemd unit does not "
           "restart on it (RestartPreventExitStatus=)."),
    ("N", "record \\-\\- COMMAND: the command's own exit status (128+signal when a "
          "signal ended it)."),
)

ENVIRONMENT = (
    ("TRAMPROF_\\fISETTING\\fR", "Any configuration setting, between the configuration "
     "file and the flags (tramprof config show lists them)."),
    ("JOURNAL_STREAM", "Set by systemd. When it names the stream on standard error, log "
     "lines carry sd-daemon(3) priority prefixes (journalctl -p works)."),
    ("NOTIFY_SOCKET, WATCHDOG_USEC", "Set by systemd for Type=notify services: readiness, "
     "status and watchdog pings."),
    ("TRAMPROF_TRAMPOLINES", "Set to 1 for record \\-\\- COMMAND: Python processes that "
     "have the trampoline runtime installed activate it at start."),
)

SEE_ALSO = "journalctl(1), systemd.exec(5), sd-daemon(3), perf(1)"


def escape(text: str) -> str:
    """Text for a roff line: backslashes and hyphens escaped, no line may
    start with a control character."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line
                     for line in text.split("\n"))


def _bold(text: str) -> str:
    return f"\\fB{escape(text)}\\fR"


def _italic(text: str) -> str:
    return f"\\fI{escape(text)}\\fR"


def _formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(parser.prog, width=10_000)


def _metavar(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    default = action.dest.upper() if action.option_strings else action.dest
    return _formatter(parser)._format_args(action, default)


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return _formatter(parser)._expand_help(action) if action.help else ""


def _subcommands(parser: argparse.ArgumentParser
                 ) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of every subcommand, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield sub.prog, helps.get(name, ""), sub
                yield from _subcommands(sub)


def _visible(action: argparse.Action, global_dests: set[str]) -> bool:
    return (action.help != argparse.SUPPRESS
            and not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
            and action.dest not in global_dests)


def _option_entry(parser: argparse.ArgumentParser, action: argparse.Action) -> list[str]:
    metavar = _metavar(parser, action)
    if action.option_strings:
        head = ", ".join(_bold(flag) + (" " + _italic(metavar) if metavar else "")
                         for flag in action.option_strings)
    else:
        head = _italic(metavar)
    return [".TP", head, escape(_help(parser, action))]


def _synopsis(parser: argparse.ArgumentParser, global_dests: set[str]) -> list[str]:
    if parser.usage:
        lines = parser.usage.replace("%(prog)s", parser.prog).split("\n")
        return [".nf", *(escape(line.strip()) for line in lines), ".fi"]
    words = [_bold(parser.prog)]
    for action in parser._actions:
        if not _visible(action, global_dests):
            continue
        metavar = _metavar(parser, action)
        if action.option_strings:
            flag = _bold(action.option_strings[0]) + (" " + _italic(metavar) if metavar else "")
            words.append(flag if action.required else f"[{flag}]")
        else:
            words.append(_italic(metavar))
    return [" ".join(words)]


def render(parser: argparse.ArgumentParser) -> str:
    """The whole page, roff (man macros)."""
    globals_ = [a for a in parser._actions if _visible(a, set())]
    global_dests = {a.dest for a in globals_ if a.dest != "version"}
    commands = [c for c in _subcommands(parser)
                if not any(isinstance(a, argparse._SubParsersAction) for a in c[2]._actions)]
    out = [f'.TH TRAMPROF 1 "" "tramprof {escape(__version__)}" "User Commands"',
           ".nh", ".SH NAME", f"tramprof \\- {escape(SUMMARY)}", ".SH SYNOPSIS"]
    for _prog, _help_text, sub in commands:
        out += [".PP", *_synopsis(sub, global_dests)]
    out += [".SH DESCRIPTION", escape(parser.description or SUMMARY), ".PP",
            "Global options may be given before or after the command name "
            f"({_bold('tramprof run --log-level debug')} or "
            f"{_bold('tramprof --log-level debug run')}).",
            ".SH GLOBAL OPTIONS"]
    for action in globals_:
        out += _option_entry(parser, action)
    out.append(".SH COMMANDS")
    for prog, help_text, sub in commands:
        out += [f'.SS "{escape(prog)}"', escape(help_text[:1].upper() + help_text[1:]) + "."]
        for action in sub._actions:
            if _visible(action, global_dests):
                out += _option_entry(sub, action)
    out.append(".SH EXIT STATUS")
    for code, meaning in EXIT_STATUS:
        out += [".TP", _bold(code), meaning]
    out.append(".SH ENVIRONMENT")
    for name, meaning in ENVIRONMENT:
        out += [".TP", f"\\fB{name}\\fR", meaning]
    out += [".SH SEE ALSO", escape(SEE_ALSO)]
    return "\n".join(out) + "\n"
