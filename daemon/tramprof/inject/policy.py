"""The daemon's automatic injection: processes chosen by the ``inject_*``
settings are injected on their first sample, once per process image, at
most one per ``inject_interval`` seconds, by one worker thread (a tracer
must make every ptrace call of an injection itself, and the drain loop must
never wait for a target). Results are counted by label for
``tramprof_injections_total{result}``.

Off unless a selector is set. Injecting processes of other users needs the
daemon to keep CAP_CHOWN, CAP_FOWNER and CAP_DAC_OVERRIDE besides
CAP_SYS_PTRACE (files in their /tmp owned by them): ``CAPABILITIES``.
"""

from __future__ import annotations

import fnmatch
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable

from tramprof.config import Config
from tramprof.inject.injector import Result, RuntimeStore, inject
from tramprof.procfs.identity import read_cgroup, read_comm, read_exe
from tramprof.procfs.metadata import container_id_from_cgroup

log = logging.getLogger(__name__)

#: What the running daemon needs on top of its runtime capabilities to
#: inject processes of other users.
CAPABILITIES = frozenset({"CAP_CHOWN", "CAP_FOWNER", "CAP_DAC_OVERRIDE"})
#: Processes waiting for the worker at most; more are counted as skipped.
MAX_QUEUED = 64
#: Process images remembered as already offered.
MAX_REMEMBERED = 65536


def enabled(config: Config) -> bool:
    return bool(config.inject_comm or config.inject_exe or config.inject_cgroup
                or config.inject_container)


def selected(config: Config, pid: int, proc_root: str = "/proc") -> bool:
    """Does ``pid`` match every non-empty ``inject_*`` selector?"""
    if not enabled(config):
        return False
    if config.inject_comm and read_comm(pid, proc_root) not in config.inject_comm:
        return False
    if config.inject_exe:
        exe = read_exe(pid, proc_root) or ""
        if not any(fnmatch.fnmatchcase(exe, p) for p in config.inject_exe):
            return False
    if config.inject_cgroup or config.inject_container:
        cgroup = read_cgroup(pid, proc_root)
        if config.inject_cgroup and not any(
                fnmatch.fnmatchcase(cgroup, p) for p in config.inject_cgroup):
            return False
        if config.inject_container:
            container = container_id_from_cgroup(cgroup)
            if not container or not any(p == "*" or container.startswith(p)
                                        for p in config.inject_container):
                return False
    return True


class AutoInjector:
    def __init__(self, config: Config,
                 injector: Callable[..., Result] = inject) -> None:
        self.config = config
        self.enabled = enabled(config)
        self.results: Counter[str] = Counter()
        self.last: dict[int, Result] = {}
        self._inject = injector
        # pid -> its latest sampled image (pid, start, exec id); bounded.
        self._seen: dict[int, tuple[int, int, int]] = {}
        self._queue: queue.Queue[tuple[int, int, int] | None] = queue.Queue(MAX_QUEUED)
        self._injected: list[tuple[int, int, int]] = []
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._runtimes = RuntimeStore(config.inject_runtime_dir or None)

    def offer(self, pid: int, start: int, exec_id: int) -> None:
        """A process image was sampled for the first time."""
        key = (pid, start, exec_id)
        if self._seen.get(pid) == key:
            return
        self._seen.pop(pid, None)
        self._seen[pid] = key
        while len(self._seen) > MAX_REMEMBERED:
            del self._seen[next(iter(self._seen))]
        if not self.enabled:
            return
        try:
            chosen = selected(self.config, pid, self.config.proc_root)
        except Exception:  # it exited, or its /proc is unreadable: not chosen
            return
        if not chosen:
            return
        try:
            self._queue.put_nowait(key)
        except queue.Full:
            with self._lock:
                self.results["skipped"] += 1
            return
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="tramprof-inject",
                                            daemon=True)
            self._worker.start()

    def note_injected(self, pid: int) -> None:
        """``pid`` was injected from outside (``tramprof inject``): look at it
        again like at a process this daemon injected."""
        key = self._seen.get(pid)
        if key is not None:
            with self._lock:
                self._injected.append(key)

    def take_injected(self) -> list[tuple[int, int, int]]:
        """(pid, start, exec id) of the images injected since the last call:
        their maps must be read again (new stubs, a runtime library)."""
        with self._lock:
            done, self._injected = self._injected, []
        return done

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.results)

    def _run(self) -> None:
        next_at = 0.0
        while True:
            key = self._queue.get()
            if key is None:
                return
            pid = key[0]
            time.sleep(max(0.0, next_at - time.monotonic()))
            try:
                result = self._inject(pid, timeout=self.config.inject_timeout,
                                      runtimes=self._runtimes,
                                      proc_root=self.config.proc_root)
            except Exception:  # a bug in injection must not stop the worker
                log.exception("injecting pid %d failed", pid)
                result = Result(pid, "failed", "internal error")
            next_at = time.monotonic() + self.config.inject_interval
            with self._lock:
                self.results[result.result] += 1
                self.last[pid] = result
                while len(self.last) > MAX_REMEMBERED:
                    del self.last[next(iter(self.last))]
                if result.ok:
                    self._injected.append(key)
            log.log(logging.INFO if result.ok else logging.WARNING, "inject %s",
                    result.render())

    def close(self) -> None:
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=self.config.inject_timeout + 2)
