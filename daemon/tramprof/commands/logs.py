"""Log lines on stderr as text, logfmt or JSON, with journald priorities
under systemd.

systemd connects a service's stderr to the journal and says so in
``JOURNAL_STREAM`` ("DEVICE:INODE" of that stream, systemd.exec(5)); a
process whose fd 2 has exactly that device and inode is writing to the
journal, and then every line starts with an sd-daemon(3) priority prefix
(``<3>`` error ... ``<7>`` debug), so ``journalctl -p warning`` and the
journal's colours work. The comparison matters: a child whose stderr was
redirected elsewhere inherits the variable but not the stream.

logfmt and JSON lines are always one line per record (a traceback becomes
one escaped field); text records may span lines, and under the journal each
of their lines carries the prefix, so continuation lines (tracebacks, bcc
output) keep the record's priority. The journal stamps every line and keeps
the priority, so text lines there leave out the time and the level name.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TextIO

LOG_FORMATS = ("text", "logfmt", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")

# syslog(3) priorities, as journald stores them in PRIORITY.
PRIORITY_CRITICAL, PRIORITY_ERROR, PRIORITY_WARNING = 2, 3, 4
PRIORITY_INFO, PRIORITY_DEBUG = 6, 7


def syslog_priority(levelno: int) -> int:
    if levelno >= logging.CRITICAL:
        return PRIORITY_CRITICAL
    if levelno >= logging.ERROR:
        return PRIORITY_ERROR
    if levelno >= logging.WARNING:
        return PRIORITY_WARNING
    if levelno >= logging.INFO:
        return PRIORITY_INFO
    return PRIORITY_DEBUG


def stream_is_journal(fd: int = 2, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``fd`` is the journal stream systemd set up (systemd.exec(5),
    JOURNAL_STREAM: compare st_dev and st_ino of the descriptor)."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    device, colon, inode = value.partition(":")
    if not colon or not device.isdigit() or not inode.isdigit():
        return False
    try:
        status = os.fstat(fd)
    except OSError:
        return False
    return (status.st_dev, status.st_ino) == (int(device), int(inode))


def _timestamp(record: logging.LogRecord) -> str:
    moment = datetime.fromtimestamp(record.created, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _details(formatter: logging.Formatter, record: logging.LogRecord) -> dict[str, str]:
    """Exception and stack text of a record, if any, as fields."""
    out = {}
    if record.exc_info:
        record.exc_text = record.exc_text or formatter.formatException(record.exc_info)
    if record.exc_text:
        out["exception"] = record.exc_text
    if record.stack_info:
        out["stack"] = formatter.formatStack(record.stack_info)
    return out


class LogfmtFormatter(logging.Formatter):
    """``time=... level=info logger=tramprof.x msg="..."``: values are quoted
    (JSON string escapes) when they hold spaces, quotes, ``=`` or anything
    outside printable ASCII, so a hostile process name cannot break a line."""

    def format(self, record: logging.LogRecord) -> str:
        fields = {"time": _timestamp(record), "level": record.levelname.lower(),
                  "logger": record.name, "msg": record.getMessage(),
                  **_details(self, record)}
        return " ".join(f"{key}={_logfmt_value(value)}" for key, value in fields.items())


def _logfmt_value(value: str) -> str:
    if value and all("!" <= ch <= "~" and ch not in '"=\\' for ch in value):
        return value
    return json.dumps(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (+ exception, stack)."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps({"time": _timestamp(record), "level": record.levelname.lower(),
                           "logger": record.name, "message": record.getMessage(),
                           **_details(self, record)})


class JournalFormatter(logging.Formatter):
    """Prefixes every line of another formatter's output with the record's
    sd-daemon priority."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in self.inner.format(record).split("\n"))


def make_formatter(fmt: str, journal: bool) -> logging.Formatter:
    if fmt == "logfmt":
        inner: logging.Formatter = LogfmtFormatter()
    elif fmt == "json":
        inner = JsonFormatter()
    elif fmt == "text":
        # The journal has the time and, from the prefix, the level.
        inner = logging.Formatter("%(name)s: %(message)s" if journal else
                                  "%(asctime)s %(levelname)s %(name)s: %(message)s")
    else:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    return JournalFormatter(inner) if journal else inner


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """Ours, so that configuring again replaces it instead of adding a second."""


def configure_logging(level: str, fmt: str = "text", stream: TextIO | None = None,
                      journal: bool | None = None) -> None:
    """Root logger at ``level``, one handler writing ``fmt`` lines to
    ``stream`` (stderr). ``journal`` None: detected from JOURNAL_STREAM."""
    target = sys.stderr if stream is None else stream
    if journal is None:
        try:
            journal = stream_is_journal(target.fileno())
        except (AttributeError, OSError, ValueError):
            journal = False
    handler = _Handler(target)
    handler.setFormatter(make_formatter(fmt, journal))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
