"""A real Prometheus scrapes the real daemon sampling a real target (root)."""

from __future__ import annotations

import gzip
import os
import platform
import subprocess
import urllib.request
from pathlib import Path

import pytest
import tramprof

from tests.conftest import requires_root
from tests.e2e.test_daemon import daemon  # noqa: F401  (fixture)
from tests.e2e.test_prometheus_scrape import PROMETHEUS, PROMTOOL, Prometheus, wait_for

pytestmark = [requires_root, pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="prometheus/promtool are not installed (Debian package: prometheus)")]


def test_promql_names_the_targets_hot_function(daemon, targets, start_target,  # noqa: F811
                                               tmp_path):
    target = start_target(str(targets / "chain"), "60")
    d = daemon("--interval", "1", "--frequency", "199", "--pid", str(target.pid))
    prometheus = Prometheus(tmp_path, d.port)
    try:
        expr = ('topk(1, sum by (process, function) '
                '(rate(tramprof_function_samples_total{kind="self"}[5s])))')
        result = wait_for(lambda: prometheus.query(expr), 30, "function rates in Prometheus")
        assert result[0]["metric"] == {"process": "chain", "function": "chain_c"}
        totals = prometheus.query('tramprof_function_samples_total{kind="total",'
                                  'function="chain_a"}')
        self_c = prometheus.query('tramprof_function_samples_total{kind="self",'
                                  'function="chain_c"}')
        # Every sample passes through chain_a, nearly all end in chain_c.
        assert float(self_c[0]["value"][1]) >= 0.9 * float(totals[0]["value"][1])
        targets_up = prometheus.api("targets")["activeTargets"]
        assert [t["health"] for t in targets_up] == ["up"], targets_up
        # Prometheus scrapes with gzip; what it stored is the daemon's own
        # build info and process metrics.
        info = prometheus.query("tramprof_build_info")
        assert [(r["metric"]["version"], r["metric"]["python_version"], r["value"][1])
                for r in info] == [(tramprof.__version__, platform.python_version(), "1")]
        started = prometheus.query("process_start_time_seconds")
        assert float(started[0]["value"][1]) == pytest.approx(
            process_start_time(d.proc.pid), abs=0.02)
    finally:
        prometheus.close()
    request = urllib.request.Request(f"http://127.0.0.1:{d.port}/metrics",
                                     headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.headers["Content-Encoding"] == "gzip"
        exposition = gzip.decompress(r.read()).decode()
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=exposition, text=True,
                           capture_output=True)
    assert check.returncode == 0 and check.stdout == "" and check.stderr == "", (
        check.stdout, check.stderr)


def process_start_time(pid: int) -> float:
    """Start time of ``pid`` in seconds since the epoch, as /proc gives it."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime"))
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
