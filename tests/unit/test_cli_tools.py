"""CLI habits: shell completion, the man page, --version, the license file,
and the parts of ``record -- COMMAND`` that need no BPF (the held command,
the process tree, exit statuses, the progress line)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import os
import re
import shutil
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import pytest
from tramprof import __version__
from tramprof.commands.cli import build_parser
from tramprof.commands.manpage import escape
from tramprof.commands.record import (
    EXIT_NOT_STARTED,
    CommandTree,
    HeldCommand,
    Progress,
    exit_status,
)
from tramprof.procfs.events import ProcPollingSource

from tests.conftest import TRAMPROF

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> str:
    return subprocess.run([TRAMPROF, *args], capture_output=True, text=True, check=True,
                          timeout=60).stdout


def every_command(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
                  ) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """(command words, parser) of every leaf command, nested ones included."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = every_command(sub, (*prefix, name))
                out += nested or [((*prefix, name), sub)]
    return out


# --------------------------------------------------------------------------
# --version, LICENSE
# --------------------------------------------------------------------------


def test_version_comes_from_pyproject() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert __version__ == importlib.metadata.version("tramprof") == declared
    assert run("--version") == f"tramprof {declared}\n"


def test_license_is_the_apache_2_text() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    text = (REPO / "LICENSE").read_text()
    assert text.splitlines()[1].strip() == "Apache License"
    assert text.splitlines()[2].strip() == "Version 2.0, January 2004"
    assert "END OF TERMS AND CONDITIONS" in text
    reference = Path("/usr/share/common-licenses/Apache-2.0")  # Debian's base-files
    if reference.exists():
        assert text == reference.read_text()


# --------------------------------------------------------------------------
# Shell completion
# --------------------------------------------------------------------------


BASH_COMPLETE = """
source <({tramprof} completion bash)
complete_words() {{
  COMP_WORDS=("$@"); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1))
  COMP_LINE="$*"; COMP_POINT=${{#COMP_LINE}}; COMPREPLY=()
  _shtab_tramprof tramprof "${{COMP_WORDS[-1]}}" "${{COMP_WORDS[-2]}}"
  printf '%s\\n' "${{COMPREPLY[@]}}" | sort
  echo --
}}
complete_words tramprof ''
complete_words tramprof record --fo
complete_words tramprof run --log-
complete_words tramprof --log-format ''
complete_words tramprof config ''
complete_words tramprof record --format ''
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_bash_completion_completes_commands_flags_and_choices() -> None:
    out = subprocess.run(["bash", "-c", BASH_COMPLETE.format(tramprof=TRAMPROF)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    answers = [block.split() for block in out.split("--\n")[:-1]]
    commands = sorted(name for (name, *_), _p in every_command(build_parser()))
    assert answers[0] == sorted(set(commands))
    assert answers[1] == ["--format"]
    assert answers[2] == ["--log-format", "--log-level"]  # global flags after the command
    assert answers[3] == ["json", "logfmt", "text"]
    assert answers[4] == sorted(words[1] for words, _p in every_command(build_parser())
                                if words[0] == "config")
    assert answers[5] == ["flamegraph", "folded", "pprof", "speedscope"]


def test_zsh_completion_names_every_command() -> None:
    script = run("completion", "zsh")
    assert script.startswith("#compdef tramprof")
    for words, _parser in every_command(build_parser()):
        assert re.search(rf"^\s+{words[-1]}:'", script, re.M), words
    if shutil.which("zsh"):
        subprocess.run(["zsh", "-n", "-c", script], check=True, timeout=60)


# --------------------------------------------------------------------------
# The man page
# --------------------------------------------------------------------------


def test_man_page_covers_every_command_and_flag() -> None:
    page = run("man")
    parser = build_parser()
    for flag in ("--version", "--log-level", "--log-format"):
        assert f"\\fB{escape(flag)}\\fR" in page
    for words, sub in every_command(parser):
        assert f'.SS "{escape(" ".join(("tramprof", *words)))}"' in page, words
        for action in sub._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings:
                assert f"\\fB{escape(flag)}\\fR" in page, (words, flag)
    assert "--print-bpf" not in page.replace("\\-", "-")  # hidden flags stay hidden
    for code in ("0", "1", "2", "78"):
        assert f".TP\n\\fB{code}\\fR" in page


@pytest.mark.skipif(shutil.which("man") is None, reason="man is not installed (man-db)")
def test_man_page_renders_without_warnings(tmp_path: Path) -> None:
    page = tmp_path / "tramprof.1"
    page.write_text(run("man"))
    proc = subprocess.run(["man", "--warnings", "-l", str(page)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "MANWIDTH": "80",
                                                      "MAN_KEEP_FORMATTING": "0"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    text = re.sub(r".\x08", "", proc.stdout)  # overstrike bold/underline
    assert text.startswith("TRAMPROF(1)")
    assert "tramprof record [options] -- COMMAND [ARG ...]" in text
    assert "--log-format {text,logfmt,json}" in text
    # Justified lines get their extra spaces on alternating sides (groff):
    # where depends on how many lines come before.
    assert re.search(r"^ +78 +A +configuration +error +\(EX_CONFIG\)", text, re.M), text


# --------------------------------------------------------------------------
# record -- COMMAND, without BPF
# --------------------------------------------------------------------------


def test_exit_status_like_a_shell() -> None:
    assert [exit_status(code) for code in (0, 3, 255, -9, -15)] == [0, 3, 255, 137, 143]


def test_held_command_runs_only_when_released(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    argv = ["/bin/sh", "-c", f'echo "$0 $1" > {marker}; ls /proc/self/fd | wc -l >> {marker}',
            "a b", "c"]
    held = HeldCommand(argv, {"PATH": "/usr/bin:/bin"})
    time.sleep(0.3)
    assert held.poll() is None and not marker.exists()
    held.release()
    assert held.wait() == 0
    # Arguments arrive untouched; nothing but 0, 1, 2 reaches the command
    # (plus the descriptor ls opens for /proc/self/fd).
    assert marker.read_text() == "a b c\n4\n"

    aborted = HeldCommand(["/bin/sh", "-c", f"touch {marker}.2"], {"PATH": "/usr/bin:/bin"})
    assert aborted.abort() == EXIT_NOT_STARTED
    assert not Path(f"{marker}.2").exists()


def test_process_tree_follows_forks_and_exits() -> None:
    """Real processes, /proc polling: children and grandchildren join the
    tree, their exits leave it; unrelated processes never join."""
    source = ProcPollingSource()
    stranger = subprocess.Popen(["sleep", "30"])
    root = subprocess.Popen(["/bin/sh", "-c", "sleep 30 & (sleep 30 & wait) & wait"],
                            start_new_session=True)
    try:
        tree = CommandTree(root.pid, source)
        deadline = time.monotonic() + 10
        while len(tree.live) < 4 and time.monotonic() < deadline:
            tree.update()
            time.sleep(0.05)
        # sh, its sleep, the subshell and the subshell's sleep.
        assert len(tree.live) == 4, tree.live
        assert stranger.pid not in tree.live
        assert set(tree.started) == tree.live
        os.killpg(root.pid, signal.SIGKILL)
        root.wait(timeout=10)
        deadline = time.monotonic() + 10
        while len(tree.live) > 1 and time.monotonic() < deadline:
            tree.update()
            time.sleep(0.05)
        assert tree.live == {root.pid}  # the root leaves only when record stops
        assert len(tree.seen) == 4
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(root.pid, signal.SIGKILL)
        root.wait()
        stranger.kill()
        stranger.wait()
        source.close()


def test_progress_line() -> None:
    assert Progress.line(1.25, None, 1234, 1) == \
        "tramprof: recording 1.2 s, 1,234 samples, 1 process"
    assert Progress.line(12.0, 30.0, 5, 3) == \
        "tramprof: recording 12.0 s / 30 s, 5 samples, 3 processes"
    stream = io.StringIO()
    progress = Progress(stream, enabled=True)
    progress.update(0.5, 2.0, 10, 1)
    progress.update(0.6, 2.0, 11, 1)  # within PROGRESS_EVERY: not redrawn
    progress.update(1.0, 2.0, 20, 2, force=True)
    progress.finish()
    assert stream.getvalue() == (
        "\r\x1b[Ktramprof: recording 0.5 s / 2 s, 10 samples, 1 process"
        "\r\x1b[Ktramprof: recording 1.0 s / 2 s, 20 samples, 2 processes\n")
    quiet = io.StringIO()  # not a terminal: nothing at all
    progress = Progress(quiet)
    progress.update(1.0, None, 1, 1, force=True)
    progress.finish()
    assert quiet.getvalue() == ""
