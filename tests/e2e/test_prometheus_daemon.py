"""A real Prometheus scrapes the real daemon sampling a real target (root)."""

from __future__ import annotations

import subprocess

import pytest

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
    finally:
        prometheus.close()
    exposition = d.get("/metrics")
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=exposition, text=True,
                           capture_output=True)
    assert check.returncode == 0 and check.stdout == "" and check.stderr == "", (
        check.stdout, check.stderr)
