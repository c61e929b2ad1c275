"""Start a process in its own Debian root, mount namespace and PID namespace,
as a container would run it, and find its pid as the host sees it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "trampolines"))
import roots  # noqa: E402

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
       "PYTHONDONTWRITEBYTECODE": "1"}


def contained_command(root: str | None, argv: list[str]) -> list[str]:
    """argv run as pid 1's child in a new PID namespace, chrooted in ``root``
    (None: the host's file system) with its own /proc."""
    if root is None:
        return ["unshare", "--pid", "--fork", "--mount-proc", *argv]
    path = roots.root_path(root)
    script = ('set -e; r="$1"; shift; mount -t proc proc "$r/proc"; '
              'mount --rbind /dev "$r/dev"; exec /usr/sbin/chroot "$r" "$@"')
    return ["unshare", "--pid", "--fork", "--mount", "--propagation", "private",
            "sh", "-c", script, "sh", str(path), *argv]


def host_pid_of_child(parent: int, timeout: float = 10.0) -> int:
    """The pid (as the host sees it) of the process ``unshare`` forked (it
    execs into the final program)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            children = []
        if children:
            return int(children[0])
        time.sleep(0.01)
    raise TimeoutError(f"unshare {parent} started no child")


def start(root: str | None, argv: list[str], env: dict[str, str] | None = None
          ) -> tuple[subprocess.Popen[str], int]:
    """(the unshare process, the pid of the program inside, as the host sees it)."""
    proc = subprocess.Popen(contained_command(root, argv), env={**ENV, **(env or {})},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc, host_pid_of_child(proc.pid)


def exe_of(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/exe")
