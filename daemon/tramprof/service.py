"""``tramprof run``: the long-running daemon loop."""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

from prometheus_client.registry import CollectorRegistry

from tramprof.config import Config
from tramprof.export.collector import ProfilerCollector
from tramprof.export.http import MetricsServer
from tramprof.profiler import Profiler
from tramprof.sampler import SamplerError
from tramprof.stats import ProfilerStats

log = logging.getLogger(__name__)


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.profiler = Profiler(config)
        self._stop = False
        self._last_drain = time.monotonic()
        self._snapshot = ProfilerStats()
        registry = CollectorRegistry(auto_describe=True)
        registry.register(ProfilerCollector(lambda: self._snapshot))
        self.server = MetricsServer(config.listen, registry, self.health)

    def health(self) -> tuple[bool, str]:
        age = time.monotonic() - self._last_drain
        if age > 3 * self.config.interval + 5:
            return False, f"last drain {age:.0f}s ago (interval {self.config.interval}s)"
        return True, "ok"

    def stop(self, signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: stopping", signum)
        self._stop = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        try:
            self.profiler.start()
        except SamplerError as exc:
            log.error("%s", exc)
            self.server.close()
            return 1
        self.server.start()
        next_drain = time.monotonic() + self.config.interval
        try:
            while not self._stop:
                self.profiler.wait(min(next_drain - time.monotonic(), 1.0))
                if time.monotonic() >= next_drain:
                    try:
                        self.drain()
                    except Exception:
                        # Keep sampling; /healthz turns unhealthy if this persists.
                        log.exception("drain failed")
                    next_drain = time.monotonic() + self.config.interval
        finally:
            self.profiler.close()
            self.server.close()
        log.info("stopped")
        return 0

    def drain(self) -> None:
        self.profiler.collect()
        self._snapshot = self.profiler.stats.copy()
        self._last_drain = time.monotonic()


def run_daemon(config: Config) -> int:
    return Daemon(config).run()
