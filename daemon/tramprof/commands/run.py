"""``tramprof run``: the long-running daemon loop.

One thread samples, drains and symbolizes; HTTP threads only read snapshots
(stats, the profile store). Signals: SIGTERM/SIGINT stop (every BPF program
detached and unloaded), SIGHUP reloads the configuration in place.
"""

from __future__ import annotations

import logging
import signal
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from types import FrameType

from tramprof.commands.privileges import (
    DEFAULT_RUN_AS,
    PrivilegeError,
    check_start_capabilities,
    drop_after_start,
    runtime_capabilities,
)
from tramprof.commands.scheduling import LoopSlice
from tramprof.commands.sdnotify import Notifier
from tramprof.config import Config, ConfigError
from tramprof.export.collector import ProfilerCollector, StoreCollector, daemon_registry
from tramprof.export.http import HttpSecurity, MetricsServer
from tramprof.export.recorder import Recorder
from tramprof.export.series import SeriesConfig, SeriesTracker
from tramprof.export.store import ProfileStore
from tramprof.inject import policy as inject_policy
from tramprof.model import Profile, Stack
from tramprof.pipeline.profiler import Profiler
from tramprof.pipeline.stats import ProfilerStats
from tramprof.procfs.metadata import ProcessMetadata
from tramprof.sampler.program import SamplerError

log = logging.getLogger(__name__)

# Settings that only take effect at start-up (the rest apply on SIGHUP).
RESTART_ONLY = ("listen", "event", "max_keys", "max_user_stacks", "max_kernel_stacks",
                "scan_window_bytes",
                "proc_root", "tls_cert_file", "tls_key_file", "basic_auth_user",
                "basic_auth_password_file", "http_request_timeout", "http_max_connections",
                "http_max_profile_requests", "http_allowed_hosts", "run_as")


class Daemon:
    def __init__(self, config: Config, reload: Callable[[], Config] | None = None,
                 run_as: tuple[int, int] | None = DEFAULT_RUN_AS) -> None:
        self.config = config
        self._run_as = run_as
        self._reload = reload
        self.notifier = Notifier.from_environment(unset_environment=True)
        self.profiler = Profiler(config)
        self.store = ProfileStore(config.profile_retention, max_bytes=config.profile_store_bytes)
        self._stop = False
        self._slice = LoopSlice()  # the main loop's scheduler slice
        self._reload_requested = False
        self._last_drain = time.monotonic()
        self._window_start_ns = time.time_ns()
        self._snapshot = ProfilerStats()
        self.series = SeriesTracker(series_config(config), self._metadata)
        self._publish_lock = threading.Lock()
        registry = daemon_registry([ProfilerCollector(lambda: self._snapshot), self.series,
                                    StoreCollector(self.store)], self._publish_lock)
        # Drains on demand for /debug/pprof/profile (Go's next-N-seconds profile).
        self.recorder = Recorder(lambda: self.config.frequency)
        security = HttpSecurity.from_files(config.tls_cert_file, config.tls_key_file,
                                           config.basic_auth_user,
                                           config.basic_auth_password_file)
        self.server = MetricsServer(config.listen, registry, self.health,
                                    profiles=self._profiles, index_seconds=config.interval,
                                    security=security,
                                    request_timeout=config.http_request_timeout,
                                    max_connections=config.http_max_connections,
                                    max_profile_requests=config.http_max_profile_requests,
                                    allowed_hosts=config.http_allowed_hosts,
                                    recorder=self.recorder)

    def _metadata(self, stack: Stack) -> ProcessMetadata:
        return self.profiler.registry.metadata(stack.pid) or ProcessMetadata(
            comm=stack.process, exe="", container_id="", pod_uid="")

    def _profiles(self, seconds: float) -> Profile:
        return self.store.last(seconds, self.config.frequency)

    def health(self) -> tuple[bool, str]:
        age = time.monotonic() - self._last_drain
        if age > 3 * self.config.interval + 5:
            return False, f"last drain {age:.0f}s ago (interval {self.config.interval}s)"
        return True, "ok"

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: stopping", signum)
        self._stop = True

    def _on_reload(self, signum: int, frame: FrameType | None) -> None:
        self._reload_requested = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_reload)
        try:
            check_start_capabilities(self._run_as)
            self.profiler.start()
        except (PrivilegeError, SamplerError) as exc:
            log.error("%s", exc)
            self.notifier.notify(STATUS=f"failed: {str(exc).splitlines()[0]}")
            self.server.close()
            return 1
        try:
            self._drop_privileges()
        except PrivilegeError as exc:
            # Fail closed: never sample, parse other processes' files or
            # serve with more privileges than intended.
            log.error("%s; stopping", exc)
            self.notifier.notify(STATUS=f"failed: {str(exc).splitlines()[0]}")
            self.profiler.close()
            self.server.close()
            return 1
        self.server.start()
        self._apply_scheduler_slice(self.config.scheduler_slice)
        self._window_start_ns = time.time_ns()
        self.notifier.ready(self._status())
        next_drain = time.monotonic() + self.config.interval
        try:
            stats = self.profiler.stats
            while not self._stop:
                # What the loop does around its stages counts too, the
                # scheduler slice's switches with the drain and the rest
                # with process_events: the stages add up to the thread's CPU.
                iteration = stats.cpu_mark()
                self.profiler.wait(min(next_drain - time.monotonic(), 1.0),
                                   (self.recorder.fileno(),))
                # From the main loop, so a stuck loop stops the pings and
                # systemd restarts the service.
                self.notifier.watchdog_if_due()
                if self._reload_requested:
                    self._reload_requested = False
                    self.notifier.reloading()
                    self.reload()
                    self.notifier.ready(self._status())
                if time.monotonic() >= next_drain or self.recorder.drain_due():
                    draining = stats.cpu_mark()
                    try:
                        with self._slice.batch():
                            self.drain()
                    except Exception:
                        # Keep sampling; /healthz turns unhealthy if this persists.
                        log.exception("drain failed")
                    stats.add_uncounted_cpu("drain", draining)
                    next_drain = time.monotonic() + self.config.interval
                stats.add_uncounted_cpu("process_events", iteration)
        finally:
            self._slice.release()
            self.notifier.stopping("detaching BPF programs")
            self.recorder.close()
            self.profiler.close()
            self.server.close()
        log.info("stopped")
        return 0

    def _status(self) -> str:
        target = f"{len(self.config.pids)} processes" if self.config.pids else "all processes"
        return (f"sampling {target} at {self.config.frequency} Hz on "
                f"{self.profiler.sampler.event_name}, serving {self.config.listen}")

    def _apply_scheduler_slice(self, seconds: float) -> None:
        """Ask for the main loop's scheduler slice (commands.scheduling), from
        the loop's own thread: the threads and children it starts later keep
        the kernel's default."""
        outcome = self._slice.set(seconds)
        self.profiler.stats.scheduler_slice_seconds = outcome.slice_ns / 1e9
        if outcome.taken:
            log.info("main loop: %.2f ms scheduler slice%s", outcome.slice_ns / 1e6,
                     "" if seconds else " (the kernel's default)")
        else:
            log.info("main loop: scheduler slice %s: %s", "kept" if seconds else "unchanged",
                     outcome.reason)

    def _drop_privileges(self) -> None:
        """Keep only what the running daemon needs: reading other processes'
        /proc files (a SIGHUP frequency change needs nothing: see
        Sampler.set_frequency), and leave uid 0 for ``run_as``. Under
        systemd the daemon already runs as a DynamicUser= and only drops
        capabilities; without capabilities and uid 0 there is nothing to drop.
        With an inject policy, also what placing files in a target's root as
        its owner needs (``inject.policy.CAPABILITIES``). Raises
        PrivilegeError when the drop fails (the caller stops)."""
        keep = None
        if inject_policy.enabled(self.config):
            keep = runtime_capabilities() | inject_policy.CAPABILITIES
        drop_after_start(self._run_as, keep)

    def drain(self) -> None:
        self.recorder.drain_started()
        # The kernel buffers flip as collect() begins: the window ends here.
        now_ns = time.time_ns()
        window = None
        try:
            stacks = self.profiler.collect()
            cpu_began = time.thread_time()
            snapshot = self.profiler.stats.copy()
            with self._publish_lock:
                self.series.add(stacks, time.monotonic())
                self._snapshot = snapshot
            window = Profile(tuple(stacks), self._window_start_ns,
                             now_ns - self._window_start_ns, self.config.frequency,
                             self._process_labels(stacks))
            self.store.add(window)
            # Published with the next drain's figures.
            self.profiler.stats.add_cpu("aggregate", time.thread_time() - cpu_began)
            self._window_start_ns = now_ns
            self._last_drain = time.monotonic()
        finally:
            self.recorder.drain_finished(window)

    def _process_labels(self, stacks: list[Stack]) -> dict[int, dict[str, str]]:
        """The container labels profiles carry per pid (pprof sample labels)."""
        labels = {}
        for pid in {stack.pid for stack in stacks}:
            metadata = self.profiler.registry.metadata(pid)
            if metadata is not None and (metadata.container_id or metadata.pod_uid):
                labels[pid] = {name: value for name, value in (
                    ("container_id", metadata.container_id), ("pod_uid", metadata.pod_uid))
                    if value}
        return labels

    def reload(self) -> None:
        """Re-read the configuration; apply what can change without a restart."""
        if self._reload is None:
            return
        try:
            new = self._reload()
        except ConfigError as exc:
            log.error("reload failed, keeping the running configuration: %s", exc)
            return
        ignored = [name for name in RESTART_ONLY if getattr(new, name) != getattr(self.config,
                                                                                   name)]
        if ignored:
            log.warning("reload: %s change only at restart; keeping the running values",
                        ", ".join(ignored))
        if new.frequency != self.config.frequency:
            self.profiler.sampler.set_frequency(new.frequency)
        if new.pids != self.config.pids:
            self.profiler.sampler.set_targets(new.pids or None)
        if new.scheduler_slice != self.config.scheduler_slice:
            self._apply_scheduler_slice(new.scheduler_slice)
        try:
            self.series.reconfigure(series_config(new))
        except ValueError as exc:
            log.warning("reload: %s; keeping the running grouping", exc)
            new = replace(new, group_by=self.config.group_by)
        logging.getLogger().setLevel(new.log_level.upper())
        self.store.reconfigure(new.profile_retention, new.profile_store_bytes)
        processes = self.profiler.stats.samples_by_process
        processes.max_names, processes.expiry = new.max_process_series, new.series_expiry
        self.profiler.config = new
        self.config = new
        log.info("configuration reloaded: %d Hz, interval %.1f s, %s", new.frequency,
                 new.interval, f"pids {list(new.pids)}" if new.pids else "all processes")


def series_config(config: Config) -> SeriesConfig:
    return SeriesConfig(group_by=config.group_by, top_stacks=config.stack_series_per_group,
                        top_functions=config.function_series_per_group,
                        max_series=config.max_series, max_label_bytes=config.max_label_bytes,
                        expiry_seconds=config.series_expiry)


def run_daemon(config: Config, reload: Callable[[], Config] | None = None,
               run_as: tuple[int, int] | None = DEFAULT_RUN_AS) -> int:
    """``run_as``: the (uid, gid) a daemon started as root switches to once
    the program is attached (None: stay root, only drop capabilities)."""
    try:
        daemon = Daemon(config, reload, run_as)
    except OSError as exc:  # the listen address is taken, a TLS or password file is missing
        log.error("cannot start: %s", exc)
        return 1
    except (ValueError, ssl.SSLError) as exc:
        log.error("cannot start: %s", exc)
        return 1
    return daemon.run()
