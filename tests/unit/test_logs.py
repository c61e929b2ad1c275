"""Log lines: text, logfmt and JSON formats, journald priority prefixes when
stderr is the journal stream (JOURNAL_STREAM), and the CLI's --log-format."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tramprof.commands.logs import (
    configure_logging,
    stream_is_journal,
    syslog_priority,
)

from tests.conftest import TRAMPROF

LOGFMT_PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s"=]+)(?: |$)')


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


def emit(tmp_path: Path, fmt: str, journal: bool | None = None,
         environ: dict[str, str] | None = None) -> list[str]:
    """Log a few records through configure_logging into a real file; its lines."""
    path = tmp_path / f"log-{fmt}-{journal}"
    with open(path, "w") as stream:
        if environ is not None:
            old = dict(os.environ)
            os.environ.update(environ)
        try:
            configure_logging("debug", fmt, stream=stream, journal=journal)
        finally:
            if environ is not None:
                os.environ.clear()
                os.environ.update(old)
        log = logging.getLogger("tramprof.test")
        log.debug("debug %d", 1)
        log.info('pid 42: comm "evil\nname=x" done')
        log.warning("warned")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("drain failed")
        log.critical("critical")
    return path.read_text().splitlines()


def test_priorities_follow_syslog() -> None:
    assert [syslog_priority(level) for level in (logging.DEBUG, logging.INFO, logging.WARNING,
                                                 logging.ERROR, logging.CRITICAL)] == \
        [7, 6, 4, 3, 2]
    assert syslog_priority(logging.INFO + 5) == 6  # custom levels fall to the one below


def test_journal_detection_compares_device_and_inode(tmp_path: Path) -> None:
    path = tmp_path / "stream"
    with open(path, "w") as f, open(tmp_path / "other", "w") as other:
        st = os.fstat(f.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert stream_is_journal(f.fileno(), env)
        assert not stream_is_journal(other.fileno(), env)  # inherited, but not our stream
        assert not stream_is_journal(f.fileno(), {})
        for bad in ("", f"{st.st_dev}", f"{st.st_dev}:", f"x:{st.st_ino}",
                    f"{st.st_dev}:{st.st_ino}:1", f"-{st.st_dev}:{st.st_ino}"):
            assert not stream_is_journal(f.fileno(), {"JOURNAL_STREAM": bad}), bad
        fd = f.fileno()
    assert not stream_is_journal(fd, env)  # closed descriptor


def test_text_lines(tmp_path: Path, restore_logging: None) -> None:
    lines = emit(tmp_path, "text", journal=False)
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    assert re.fullmatch(stamp + r" DEBUG tramprof\.test: debug 1", lines[0]), lines[0]
    assert re.fullmatch(stamp + r" WARNING tramprof\.test: warned", lines[3]), lines
    assert lines[-1].endswith(" CRITICAL tramprof.test: critical")
    assert "Traceback (most recent call last):" in lines
    assert "ValueError: boom" in lines


def test_journal_prefixes_every_line_and_drops_the_time(tmp_path: Path,
                                                        restore_logging: None) -> None:
    lines = emit(tmp_path, "text", journal=True)
    assert lines[0] == "<7>tramprof.test: debug 1"
    assert lines[1] == '<6>tramprof.test: pid 42: comm "evil'
    assert lines[2] == '<6>name=x" done'  # a continuation keeps the record's priority
    assert lines[3] == "<4>tramprof.test: warned"
    error = lines.index("<3>tramprof.test: drain failed")
    traceback = lines[error + 1:-1]
    assert traceback[0] == "<3>Traceback (most recent call last):"
    assert traceback[-1] == "<3>ValueError: boom"
    assert all(line.startswith("<3>") for line in traceback)
    assert lines[-1] == "<2>tramprof.test: critical"


def test_journal_detected_from_the_environment(tmp_path: Path, restore_logging: None) -> None:
    """configure_logging finds the journal by itself: JOURNAL_STREAM names
    the very file it writes to."""
    path = tmp_path / "log-text-None"
    path.touch()
    st = path.stat()
    lines = emit(tmp_path, "text", environ={"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
    assert lines[0] == "<7>tramprof.test: debug 1"


def test_logfmt_lines(tmp_path: Path, restore_logging: None) -> None:
    lines = emit(tmp_path, "logfmt", journal=False)
    assert len(lines) == 5  # one line per record, the traceback included
    records = []
    for line in lines:
        pairs = LOGFMT_PAIR.findall(line)
        assert " ".join(f"{k}={v}" for k, v in pairs) == line, line
        records.append({k: json.loads(v) if v.startswith('"') else v for k, v in pairs})
    assert [r["level"] for r in records] == ["debug", "info", "warning", "error", "critical"]
    assert all(r["logger"] == "tramprof.test" for r in records)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", records[0]["time"])
    assert records[0]["msg"] == "debug 1"
    assert lines[0].endswith(' msg="debug 1"')
    assert records[1]["msg"] == 'pid 42: comm "evil\nname=x" done'
    assert records[2]["msg"] == "warned" and lines[2].endswith(" msg=warned")
    assert records[3]["msg"] == "drain failed"
    assert records[3]["exception"].endswith("ValueError: boom")


def test_json_lines_under_the_journal(tmp_path: Path, restore_logging: None) -> None:
    lines = emit(tmp_path, "json", journal=True)
    assert len(lines) == 5
    priorities = [int(line[1]) for line in lines]
    assert priorities == [7, 6, 4, 3, 2]
    records = [json.loads(line[3:]) for line in lines]
    assert [r["level"] for r in records] == ["debug", "info", "warning", "error", "critical"]
    assert records[1]["message"] == 'pid 42: comm "evil\nname=x" done'
    assert set(records[3]) == {"time", "level", "logger", "message", "exception"}
    assert records[3]["exception"].startswith("Traceback (most recent call last):")


def test_configuring_again_replaces_the_handler(tmp_path: Path, restore_logging: None) -> None:
    emit(tmp_path, "text", journal=False)
    lines = emit(tmp_path, "json", journal=False)
    assert all(line.startswith("{") for line in lines)  # no second, text handler
    with pytest.raises(ValueError, match="log format must be one of text, logfmt, json"):
        configure_logging("info", "xml")


def test_configuration_error_exits_78(tmp_path: Path) -> None:
    """The real CLI, global flags after the command: a bad setting is exit
    78 (EX_CONFIG, which the systemd unit does not restart on)."""
    bad = tmp_path / "bad.toml"
    bad.write_text("frequency = 0\n")
    proc = subprocess.run([TRAMPROF, "run", "--config", str(bad), "--log-format", "json",
                           "--log-level", "debug"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 78, proc.stderr
    assert proc.stderr == \
        f"tramprof: configuration error: {bad}: frequency: must be 1..10000 (Hz)\n"


def test_cli_sets_up_the_format_given_after_the_command() -> None:
    """A real process: logging as the CLI sets it up from ``metrics
    --log-format logfmt`` writes logfmt lines to stderr."""
    code = ("import logging, sys; from tramprof.commands.cli import _setup_logging, "
            "build_parser; args = build_parser().parse_args(sys.argv[1:]); "
            "_setup_logging(args, 'info'); logging.getLogger('tramprof.x').warning('w %s', 1)")
    proc = subprocess.run([sys.executable, "-c", code, "metrics", "--log-format", "logfmt"],
                          capture_output=True, text=True, timeout=60, env={
                              k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"})
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r'time=\S+Z level=warning logger=tramprof\.x msg="w 1"\n', proc.stderr)


def test_configuration_error_has_error_priority_in_the_journal(tmp_path: Path) -> None:
    """Under systemd, the configuration error (printed before logging is set
    up) is still an error for journald, not an info line."""
    bad = tmp_path / "bad.toml"
    bad.write_text("frequncy = 99\n")
    err = tmp_path / "stderr"
    with open(err, "w") as stream:
        st = os.fstat(stream.fileno())
        proc = subprocess.run([TRAMPROF, "config", "check", str(bad)], stderr=stream,
                              stdout=subprocess.DEVNULL, timeout=60,
                              env={**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
    assert proc.returncode == 78
    assert err.read_text().startswith("<3>tramprof: configuration error: "), err.read_text()
