"""A real Prometheus scrapes a SeriesTracker and ranks its functions.

The test process serves a registry holding a SeriesTracker that is fed
synthetic stacks (``hot_function`` dominant) on 127.0.0.1; a Prometheus
server (Debian package ``prometheus``) scrapes it every second into a
temporary TSDB; then Prometheus's HTTP API answers PromQL over what it stored.
Needs no root.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
from prometheus_client import CollectorRegistry, make_wsgi_app
from tramprof.export.series import SeriesConfig, SeriesTracker
from tramprof.model import Stack

from tests.e2e.prometheus import PROMETHEUS, PrometheusServer, free_port
from tests.unit.test_dashboard import dashboard_expressions

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="prometheus/promtool are not installed (Debian package: prometheus)")

# Per feed tick (every 0.1 s): samples per (process, stack).
FEED = [
    ("api", ("main", "serve", "handle", "hot_function"), 40),
    ("api", ("main", "serve", "handle", "warm_function"), 12),
    ("api", ("main", "serve", "cold_function"), 3),
    ("worker", ("main", "loop", "hot_function"), 20),
    ("worker", ("main", "loop", "warm_function"), 10),
    ("worker", ("main", "loop", "[kernel stack lost]"), 1),
]


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class Exporter:
    """The tracker, an HTTP server for it, and a thread feeding it stacks."""

    def __init__(self) -> None:
        self.tracker = SeriesTracker(SeriesConfig(group_by=("comm", "pid")))
        self.registry = CollectorRegistry()
        self.registry.register(self.tracker)
        self.server = make_server("127.0.0.1", 0, make_wsgi_app(self.registry),
                                  handler_class=QuietHandler)
        self.port = self.server.server_port
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.server.serve_forever, daemon=True),
                        threading.Thread(target=self.feed, daemon=True)]
        for t in self.threads:
            t.start()

    def feed(self) -> None:
        pids = {"api": 4242, "worker": 4343}
        while not self.stop.wait(0.1):
            self.tracker.add([Stack(pids[p], p, p, frames, n) for p, frames, n in FEED],
                             now=time.monotonic())

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
        for t in self.threads:
            t.join(5)


class Prometheus(PrometheusServer):
    """Scrapes the exporter every second into a temporary TSDB."""

    def __init__(self, workdir: Path, target_port: int) -> None:
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                  "scrape_configs": [{"job_name": "tramprof", "static_configs": [
                      {"targets": [f"127.0.0.1:{target_port}"]}]}]}
        super().__init__(workdir, "prometheus", free_port(), config,
                         [f"--storage.tsdb.path={workdir / 'data'}"])
        self.wait_ready()

    def api(self, path: str, **params: str) -> Any:
        return self.get(f"/api/v1/{path}", **params)

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        result = super().query(expr, at)
        assert isinstance(result, list)
        return result


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    e = Exporter()
    yield e
    e.close()


@pytest.fixture
def prometheus(tmp_path: Path, exporter: Exporter) -> Iterator[Prometheus]:
    p = Prometheus(tmp_path, exporter.port)
    yield p
    p.close()


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_prometheus_ranks_the_hot_function_first(exporter: Exporter,
                                                  prometheus: Prometheus) -> None:
    expr = 'topk(3, rate(tramprof_function_samples_total{kind="self"}[10s]))'
    # rate() needs two scrapes of a series within the window
    result = wait_for(lambda: prometheus.query(expr), 20, "rates in Prometheus")
    targets = prometheus.api("targets")["activeTargets"]
    assert [t["health"] for t in targets] == ["up"], targets
    ranked = sorted(result, key=lambda r: float(r["value"][1]), reverse=True)
    assert len(ranked) == 3
    assert ranked[0]["metric"]["function"] == "hot_function"
    assert ranked[0]["metric"]["process"] == "api"
    assert ranked[0]["metric"]["pid"] == "4242"
    assert ranked[0]["metric"]["job"] == "tramprof"
    assert [(r["metric"]["process"], r["metric"]["function"]) for r in ranked[1:]] == [
        ("worker", "hot_function"), ("api", "warm_function")]
    # Fed together, scraped together: the rates keep the feed's proportions
    # (40 : 20 : 12 per tick), whatever the feed thread's actual tick rate. The
    # absolute rates are low while the series are younger than the 10 s window.
    rates = [float(r["value"][1]) for r in ranked]
    assert rates[0] / rates[1] == pytest.approx(2.0, rel=0.05)
    assert rates[0] / rates[2] == pytest.approx(40 / 12, rel=0.05)

    # Stack series add up, in Prometheus too, to the samples of each process.
    by_process = prometheus.query(
        'sum by (process) (tramprof_stack_samples_total) - on (process) '
        'sum by (process) (tramprof_function_samples_total{kind="self"})')
    assert {r["metric"]["process"]: float(r["value"][1]) for r in by_process} == {
        "api": 0.0, "worker": 0.0}

    # Every dashboard query runs against a real Prometheus (variables substituted).
    for title, dashboard_expr in dashboard_expressions():
        prometheus.api("query", query=dashboard_expr)  # asserts status == success
        if "tramprof_function_samples_total" in dashboard_expr:
            assert prometheus.query(dashboard_expr), f"{title}: no data"


def test_exposition_passes_promtool_check_metrics(exporter: Exporter) -> None:
    wait_for(lambda: exporter.tracker.series_count() > 0, 5, "the first drain")
    text = exporter.metrics_text()
    assert "tramprof_stack_samples_total{" in text
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                            text=True, timeout=30)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
