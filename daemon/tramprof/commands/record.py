"""``tramprof record``: a one-shot profile in any output format, of running
processes for a while or of a command (and its children) until it exits.

Like the daemon, it gives up what only loading and attaching needed as soon
as ``Profiler.start()`` returns: it keeps the runtime capabilities (reading
other processes' /proc files) and a root process switches to ``run_as``
(``nobody`` by default). The output file is opened before that, so it can be
anywhere the caller may write. If the drop fails, nothing is sampled.

``record -- COMMAND``: the command is started first but held (a shell waits
on a FIFO before it execs the command) until the program is attached and the
privileges are dropped, so it runs only when profiling works and is sampled
from its first instruction, as the invoking user, without tramprof's ambient
capabilities. Its children are followed through fork events (the process
connector, else /proc polling) and added to the sampled set as they appear.
``TRAMPROF_TRAMPOLINES=1`` is put in its environment (unless set), so every
Python process in the tree that has the trampoline runtime installed
activates it. SIGTERM and SIGHUP are passed on to the command; SIGINT is not
(the terminal sends it to the command itself). tramprof exits with the
command's status (128+N for signal N).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TextIO

from tramprof.commands.privileges import DEFAULT_RUN_AS, PrivilegeError, drop_after_start
from tramprof.commands.scheduling import LoopSlice
from tramprof.config import Config
from tramprof.export.formats import FORMATS
from tramprof.model import Profile, SymbolizationError, merge
from tramprof.pipeline.profiler import Profiler
from tramprof.procfs.events import ProcessEventSource, open_event_source
from tramprof.procfs.maps import read_maps
from tramprof.sampler.layout import Counter as BpfCounter
from tramprof.sampler.program import SamplerError

log = logging.getLogger(__name__)

EXIT_NOT_FOUND = 127  # as shells report a command that does not exist
EXIT_NOT_STARTED = 125  # the held command was never released
# Interpreters whose name says they are CPython (python, python3, python3.13, ...).
PYTHON_NAME = re.compile(r"python(\d+(\.\d+)?)?(-dbg)?")
PROGRESS_EVERY = 0.5  # seconds between progress line updates
# The command's shell waits for "go" on the FIFO named by $0, then execs it.
HOLD_SCRIPT = 'read -r go < "$0" && [ "$go" = go ] || exit 125; exec "$@"'
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
# How long after its fork or exec, and how often, a process of the command's
# tree is looked at for a trampoline runtime loaded by its start-up.
WATCH_SECONDS, WATCH_EVERY = 10.0, 0.1

def _open_output(path: str) -> tuple[int, bool]:
    """A descriptor for ``path`` and whether it was created now. An existing
    file is truncated only when the profile is written."""
    flags = os.O_WRONLY | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666), True
    except FileExistsError:
        return os.open(path, flags), False


class Progress:
    """One line on stderr, rewritten in place, when stderr is a terminal:
    elapsed (and total) time, samples so far, processes seen."""

    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._shown = False
        self._last = -PROGRESS_EVERY

    @staticmethod
    def line(elapsed: float, total: float | None, samples: int, processes: int) -> str:
        time_part = f"{elapsed:.1f} s" + (f" / {total:g} s" if total is not None else "")
        return (f"tramprof: recording {time_part}, {samples:,} samples, "
                f"{processes:,} process{'es' if processes != 1 else ''}")

    def update(self, elapsed: float, total: float | None, samples: int, processes: int,
               force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < PROGRESS_EVERY):
            return
        self._last = now
        self.stream.write("\r\x1b[K" + self.line(elapsed, total, samples, processes))
        self.stream.flush()
        self._shown = True

    def finish(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False


class CommandTree:
    """The command's process and every process forked below it, from fork
    and exit events (a fork's parent is a process, so threads do not count)."""

    def __init__(self, root: int, events: ProcessEventSource,
                 proc_root: str = "/proc") -> None:
        self.root = root
        self.events = events
        self.proc_root = proc_root
        self.live = {root}
        self.seen = {root}
        # pid -> when it last started a new image (fork or exec), monotonic.
        self.started = {root: time.monotonic()}

    def fileno(self) -> int | None:
        return self.events.fileno()

    def update(self) -> bool:
        """Apply queued events; True when the set of live processes changed."""
        before = set(self.live)
        forks: dict[int, int] = {}
        for event in self.events.read_events():
            if event.kind == "fork" and event.ppid is not None:
                forks[event.pid] = event.ppid
            elif event.kind == "exec" and event.pid in self.live:
                self.started[event.pid] = time.monotonic()
            elif event.kind == "exit" and event.pid != self.root:
                forks.pop(event.pid, None)
                self.live.discard(event.pid)
                self.started.pop(event.pid, None)
        self._adopt(forks)
        if self.events.take_resync_request():
            self._adopt(self._parents())  # events were lost: /proc says who is whose
        return self.live != before

    def _adopt(self, parents: dict[int, int]) -> None:
        """Add every process whose parent is (transitively) in the tree."""
        pending = dict(parents)
        while True:
            new = {pid for pid, ppid in pending.items() if ppid in self.live}
            if not new:
                return
            self.live |= new
            self.seen |= new
            for pid in new:
                del pending[pid]
                self.started[pid] = time.monotonic()

    def _parents(self) -> dict[int, int]:
        parents = {}
        for entry in Path(self.proc_root).iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat = (entry / "stat").read_bytes()
                    parents[int(entry.name)] = int(stat[stat.rindex(b")") + 2:].split()[1])
        return parents


class StartupWatch:
    """Hands the command's young Python processes to the unwinding modes
    every WATCH_EVERY seconds until one takes them.

    The trampoline runtime is loaded by the interpreter's start-up (the
    .pth), just after the process was first sampled and looked at; the
    profiler itself looks again only after a drain that saw its maps change,
    which for a command living a few seconds is most of its life."""

    def __init__(self, profiler: Profiler, proc_root: str = "/proc") -> None:
        self.profiler = profiler
        self.proc_root = proc_root
        self._next = 0.0

    def check(self, tree: CommandTree) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + WATCH_EVERY
        modes = self.profiler.unwinders.modes
        for pid, started in list(tree.started.items()):
            if now - started > WATCH_SECONDS or any(m.unwinds(pid) for m in modes):
                continue
            try:
                mappings = read_maps(pid, self.proc_root)
            except (OSError, SymbolizationError):
                continue
            if any("python" in os.path.basename(m.path) for m in mappings):
                try:
                    self.profiler.unwinders.consider(pid, mappings)
                except Exception:
                    log.exception("pid %d: unwinding modes failed to look at it", pid)


_LIBC = ctypes.CDLL(None, use_errno=True)


def _clear_ambient_capabilities() -> None:
    """In the forked child before exec: the command gets none of the
    capabilities tramprof may hold in its ambient set."""
    _LIBC.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)


class HeldCommand:
    """The command, started but waiting until ``release()``; ``abort()``
    makes it exit 125 without ever running the command.

    The shell waits reading a FIFO in a private directory. Both ends are
    open before this returns and the FIFO is unlinked at once, so releasing
    needs no file-system access (tramprof may have dropped its privileges
    by then) and a tramprof that dies closes the write end: the shell then
    reads end-of-file and exits instead of running the command."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        private = tempfile.mkdtemp(prefix="tramprof-hold-")
        fifo = os.path.join(private, "go")
        try:
            os.mkfifo(fifo, 0o600)
            self.proc = subprocess.Popen(["/bin/sh", "-c", HOLD_SCRIPT, fifo, *argv], env=env,
                                         preexec_fn=_clear_ambient_capabilities)
            self.pid = self.proc.pid
            self._go = self._open_writer(fifo)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(fifo)
            os.rmdir(private)

    def _open_writer(self, fifo: str) -> int:
        """The write end, once the shell opened the read end (ENXIO until then)."""
        while True:
            try:
                return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                if exc.errno != errno.ENXIO or self.proc.poll() is not None:
                    raise
            time.sleep(0.002)

    def release(self) -> None:
        os.write(self._go, b"go\n")
        os.close(self._go)

    def abort(self) -> int:
        os.close(self._go)
        return self.proc.wait()

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self) -> int:
        return self.proc.wait()


def exit_status(returncode: int) -> int:
    """A child's status the way shells report it: 128+N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


def python_without_runtime(path: str, env: dict[str, str]) -> bool:
    """Whether ``path`` is a CPython that cannot import the trampoline runtime
    (then its frames are not unwound through trampolines)."""
    if not PYTHON_NAME.fullmatch(os.path.basename(path)):
        return False
    probe_env = {k: v for k, v in env.items() if k != "TRAMPROF_TRAMPOLINES"}
    code = ("import importlib.util, sys; "
            "sys.exit(0 if importlib.util.find_spec('tramprof_trampolines') else 3)")
    try:
        proc = subprocess.run([path, "-c", code], env=probe_env, stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 3


class _Session:
    """Sampling, draining and the progress line, shared by both kinds of record."""

    def __init__(self, profiler: Profiler, config: Config, total: float | None,
                 tree: CommandTree | None) -> None:
        self.profiler = profiler
        self.config = config
        self.total = total
        self.tree = tree
        self.windows: list[Profile] = []
        self.progress = Progress()
        self.began = time.monotonic()
        self._window_start = time.time_ns()
        self._next_drain = self.began + config.interval
        self._processes: set[int] = set()
        self.watch = StartupWatch(profiler, config.proc_root) if tree else None
        # Woken for a new process, run at once: a build's compilers live
        # milliseconds (commands.scheduling).
        self.slice = LoopSlice()
        self.slice.set(config.scheduler_slice)

    def drain(self) -> None:
        with self.slice.batch():
            stacks = self.profiler.collect()
        now = time.time_ns()
        self.windows.append(Profile(tuple(stacks), self._window_start,
                                    now - self._window_start, self.config.frequency))
        self._processes.update(stack.pid for stack in stacks)
        self._window_start = now
        self._next_drain = time.monotonic() + self.config.interval

    def step(self, timeout: float) -> None:
        """Wait for process events up to ``timeout``, handle them, drain when due."""
        timeout = max(0.0, min(timeout, self._next_drain - time.monotonic()))
        if self.tree is None:
            self.profiler.wait(timeout)
        else:
            # The profiler's descriptors and the tree's fork events; at most
            # WATCH_EVERY (/proc polling has no descriptor; the start-up watch).
            fds = self.profiler.event_fds()
            tree_fd = self.tree.fileno()
            if tree_fd is not None:
                fds.append(tree_fd)
            with contextlib.suppress(InterruptedError):
                select.select(fds, [], [], min(timeout, WATCH_EVERY))
            if self.tree.update():
                self.profiler.sampler.set_targets(self.tree.live)
            assert self.watch is not None
            self.watch.check(self.tree)
            self.profiler.poll_process_events()
        if time.monotonic() >= self._next_drain:
            self.drain()
        self.show_progress()

    def show_progress(self, force: bool = False) -> None:
        if not self.progress.enabled:
            return
        samples = self.profiler.sampler.counters().get(BpfCounter.RECORDED, 0)
        if self.tree is not None:
            processes = len(self.tree.seen)
        else:
            self._processes.update(self.profiler.registry.pids())
            processes = len(self._processes)
        self.progress.update(time.monotonic() - self.began, self.total, samples, processes,
                             force)

    def finish(self) -> Profile:
        self.drain()
        self.slice.release()
        self.show_progress(force=True)
        self.progress.finish()
        return merge(self.windows, self.config.frequency)


def _start(profiler: Profiler, output: str | None, run_as: tuple[int, int] | None,
           on_failure: Callable[[], object]) -> tuple[int | None, int]:
    """Attach, open the output, drop privileges: (None, output descriptor or
    -1) when all worked, else (exit status, -1) with everything closed and
    nothing sampled. The descriptor outlives the drop of privileges."""
    try:
        profiler.start()
    except SamplerError as exc:
        on_failure()
        print(f"tramprof: {exc}", file=sys.stderr)
        return 1, -1
    out_fd, created = -1, False
    try:
        if output:
            out_fd, created = _open_output(output)
        drop_after_start(run_as)
    except (OSError, PrivilegeError) as exc:
        # Fail closed: no sampling, no reading of other processes' files
        # with more privileges than intended.
        profiler.close()
        on_failure()
        if out_fd >= 0:
            os.close(out_fd)
            if created and output:
                with contextlib.suppress(OSError):
                    os.unlink(output)
        what = exc if isinstance(exc, PrivilegeError) else f"{output}: {exc.strerror}"
        print(f"tramprof: {what}", file=sys.stderr)
        return 1, -1
    return None, out_fd


def _write(profile: Profile, fmt: str, out_fd: int) -> None:
    body = FORMATS[fmt].encode(profile)
    if out_fd >= 0:
        with open(out_fd, "wb") as f:
            f.truncate(0)
            f.write(body)
    else:
        sys.stdout.buffer.write(body)
        sys.stdout.flush()


def record(config: Config, duration: float, fmt: str, output: str | None,
           run_as: tuple[int, int] | None = DEFAULT_RUN_AS) -> int:
    """Profile ``config.pids`` (or every process) for ``duration`` seconds."""
    if fmt not in FORMATS:
        print(f"tramprof: unknown format {fmt}", file=sys.stderr)
        return 2
    profiler = Profiler(config)
    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    failed, out_fd = _start(profiler, output, run_as, on_failure=lambda: None)
    if failed is not None:
        return failed
    session = _Session(profiler, config, duration, None)
    try:
        deadline = time.monotonic() + duration
        while not stop and (left := deadline - time.monotonic()) > 0:
            session.step(min(0.5, left))
        profile = session.finish()
    finally:
        profiler.close()
    _write(profile, fmt, out_fd)
    return 0


def record_command(config: Config, argv: list[str], duration: float | None, fmt: str,
                   output: str | None, run_as: tuple[int, int] | None = DEFAULT_RUN_AS
                   ) -> int:
    """Start ``argv`` and profile it and its children until it exits (or for
    ``duration`` seconds, after which it runs on unprofiled); returns its
    exit status."""
    if fmt not in FORMATS:
        print(f"tramprof: unknown format {fmt}", file=sys.stderr)
        return 2
    path = shutil.which(argv[0])
    if path is None:
        print(f"tramprof: {argv[0]}: command not found", file=sys.stderr)
        return EXIT_NOT_FOUND
    env = dict(os.environ)
    env.setdefault("TRAMPROF_TRAMPOLINES", "1")
    if python_without_runtime(path, env):
        print(f"tramprof: {argv[0]} cannot import tramprof_trampolines: its Python frames "
              f"are not unwound through trampolines (install the runtime's wheel into that "
              f"interpreter: trampolines/README.md)", file=sys.stderr)
    events = open_event_source(log, config.proc_root)
    command = HeldCommand(argv, env)
    tree = CommandTree(command.pid, events, config.proc_root)
    config = replace(config, pids=(command.pid,))
    profiler = Profiler(config)

    def forward(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(OSError):  # it exited, or it is root and we no longer
            os.kill(command.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGHUP, forward)
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    failed, out_fd = _start(profiler, output, run_as, on_failure=command.abort)
    if failed is not None:
        events.close()
        return failed
    command.release()
    session = _Session(profiler, config, duration, tree)
    try:
        deadline = None if duration is None else time.monotonic() + duration
        while command.poll() is None:
            left = 0.5 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                break
            session.step(min(0.5, left))
        profile = session.finish()
    finally:
        profiler.close()
        events.close()
    status = exit_status(command.wait())
    _write(profile, fmt, out_fd)
    return status
