"""A fleet in miniature, with the shipped configurations (root).

A real `tramprof run` samples a known target; a Prometheus in agent mode
(deploy/prometheus/agent.yml) scrapes it and remote-writes to a central
Prometheus with the remote-write receiver (deploy/prometheus/central.yml and
its rules). Only the addresses and the intervals (1 s instead of 15/30 s)
differ from the shipped files. The central Prometheus then answers every
query of the Grafana dashboard, its template variables included, with the
target's data; sample rates match the CPU time the kernel accounted to the
target; the recording rules hold the target's stack and functions; the alert
rules evaluate cleanly and TramprofDown turns pending once the daemon stops.
The delay from a scrape on the node to the sample being queryable centrally
is measured and reported (``-s`` shows it).
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from tramprof.pipeline.stats import MAIN_THREAD_STAGES

from tests.conftest import requires_root
from tests.e2e.prometheus import PROMETHEUS, PrometheusServer, free_port
from tests.e2e.test_daemon import (
    Daemon,
    daemon,  # noqa: F401  (fixture)
    thread_cpu_seconds,
)
from tests.e2e.test_prometheus_scrape import wait_for
from tests.unit.test_dashboard import all_panels, load_dashboard, substitute_with

pytestmark = [requires_root, pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus is not installed (Debian package: prometheus)")]

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
NODE = "fleet-node-1"
FREQUENCY = 199
CHAIN = "main;chain_a;chain_b;chain_c"
# Grafana's values for a 1 s scrape interval and a 30 s time range.
RATE_INTERVAL = "10s"
# How late, in seconds, the daemon's counters may tell of its main thread:
# published at the drain after, then scraped (both every 1 s).
MAIN_THREAD_LAGS = (0.0, 0.4, 0.8, 1.2, 1.6, 2.0)


def central_config(port: int) -> dict[str, Any]:
    config = yaml.safe_load((PROMETHEUS_DIR / "central.yml").read_text())
    config["global"] = {"evaluation_interval": "1s", "scrape_interval": "1s"}
    config["rule_files"] = [str(PROMETHEUS_DIR / f) for f in config["rule_files"]]
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
    return config


def agent_config(tramprof_port: int, central_url: str) -> dict[str, Any]:
    config = yaml.safe_load((PROMETHEUS_DIR / "agent.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s")
    (job,) = config["scrape_configs"]
    assert job["static_configs"] == [{"targets": ["127.0.0.1:9947"]}]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{tramprof_port}"]}]
    (write,) = config["remote_write"]
    write["url"] = f"{central_url}/api/v1/write"
    return config


@pytest.fixture
def servers() -> Iterator[Callable[..., PrometheusServer]]:
    started: list[PrometheusServer] = []

    def start(*args: Any, **kwargs: Any) -> PrometheusServer:
        server = PrometheusServer(*args, **kwargs)
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in reversed(started):
        server.close()


class CpuClock:
    """The CPU time the kernel accounts to a process, polled in the background,
    so that sample rates can be compared with what the process really ran.
    With ``tid``, one thread's, to the nanosecond (the daemon's few
    milliseconds a second are below the clock tick's reach)."""

    def __init__(self, pid: int, tid: int | None = None) -> None:
        self.pid = pid
        self.read = self._process if tid is None else partial(thread_cpu_seconds, pid, tid)
        self.readings: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _process(self) -> float:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # utime and stime, fields 14 and 15 of stat: indexes 11 and 12 of
        # what follows the process name.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _poll(self) -> None:
        while not self.stop.wait(0.2):
            try:
                self.readings.append((time.time(), self.read()))
            except OSError:
                return

    def cores(self, start: float, end: float) -> float:
        """CPUs' worth of time the process ran between two wall-clock times."""
        def at(t: float) -> float:
            return min(self.readings, key=lambda r: abs(r[0] - t))[1]
        assert self.readings[0][0] <= start + 0.3 and end <= self.readings[-1][0] + 0.3
        return (at(end) - at(start)) / (end - start)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def values(result: list[dict[str, Any]], key: str) -> dict[str, float]:
    return {r["metric"].get(key, ""): float(r["value"][1]) for r in result}


def measure_remote_write_delay(central: PrometheusServer, seconds: float) -> list[float]:
    """Seconds from each scrape on the node (its samples' timestamp) to the
    first central query that returns it."""
    expr = f'up{{job="tramprof",instance="{NODE}"}}[60s]'
    seen: set[float] = set()
    delays: list[float] = []
    end = time.time() + seconds
    first = True
    while time.time() < end:
        (series,) = central.get("/api/v1/query", query=expr)["result"]
        now = time.time()
        for ts, _ in series["values"]:
            if ts not in seen:
                seen.add(ts)
                if not first:  # already there when measuring began: age unknown
                    delays.append(now - float(ts))
        first = False
        time.sleep(0.05)
    return delays


def test_agent_remote_write_to_central_answers_the_dashboard(
        daemon, targets, start_target, servers, tmp_path,  # noqa: F811
        record_property) -> None:
    target = start_target(str(targets / "chain"), "180")
    cpu = CpuClock(target.pid)
    d: Daemon = daemon("--interval", "1", "--frequency", str(FREQUENCY),
                       "--pid", str(target.pid))
    daemon_main_thread = CpuClock(d.proc.pid, d.proc.pid)
    port = free_port()
    central = servers(tmp_path, "central", port, central_config(port),
                      [f"--storage.tsdb.path={tmp_path / 'central-data'}",
                       "--web.enable-remote-write-receiver"])
    agent = servers(tmp_path, "agent", free_port(), agent_config(d.port, central.url),
                    ["--enable-feature=agent,expand-external-labels,extra-scrape-metrics",
                     f"--storage.agent.path={tmp_path / 'agent-data'}"],
                    env={"NODE_NAME": NODE})

    stack_expr = f'tramprof_stack_samples_total{{instance="{NODE}",process="chain"}}'
    wait_for(lambda: any(r["metric"]["stack"].endswith(CHAIN)
                         for r in central.query(stack_expr)),
             60, "the target's stack in the central Prometheus")
    first_seen = time.time()

    # Only the node's name tells the hosts apart: no `node` label, no address.
    up = central.query('up{job="tramprof"}')
    assert [r["metric"] for r in up] == [
        {"__name__": "up", "job": "tramprof", "instance": NODE}]

    delays = measure_remote_write_delay(central, 15)
    assert len(delays) >= 5, delays
    report = (f"remote-write delay scrape -> central query over {len(delays)} scrapes: "
              f"min {min(delays):.2f} s, median {statistics.median(delays):.2f} s, "
              f"max {max(delays):.2f} s")
    print(report)
    record_property("remote_write_delay_seconds", report)
    # The queue sends a batch when it is full or batch_send_deadline (5 s) old:
    # bounded, not stuck (the figure itself is what the report is for).
    assert max(delays) < 15, report

    try:
        # Queries are evaluated where every sample has arrived, with 30 s of
        # data before.
        settle = max(delays) + 1
        time.sleep(max(0.0, first_seen + 31 - (time.time() - settle)))
        check_dashboard(central, d, cpu, daemon_main_thread, at=time.time() - settle)
    finally:
        cpu.close()
        daemon_main_thread.close()
    check_recording_rules(central)
    check_alert_rules(central)

    failed = [line for line in agent.metrics_text().splitlines()
              if line.startswith("prometheus_remote_storage_samples_failed_total")]
    assert failed and all(line.endswith(" 0") for line in failed), failed

    # The daemon stops: the node's scrapes fail and TramprofDown turns pending.
    d.stop()
    wait_for(lambda: alert_states(central).get("TramprofDown") == [("pending", NODE)], 30,
             "TramprofDown pending for the stopped daemon")


def check_dashboard(central: PrometheusServer, d: Daemon, cpu: CpuClock,
                    daemon_main_thread: CpuClock, at: float) -> None:
    """Every panel query, with the template variables resolved the way
    Grafana resolves them, returns the target's (and the daemon's) real
    numbers at ``at``."""
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    chosen = {"instance": NODE, "process": "chain"}
    for name in ("instance", "process"):
        query = substitute_with(variables[name]["query"]["query"], {"instance": NODE})
        metric, label = query.removeprefix("label_values(").removesuffix(")").rsplit(", ", 1)
        # What Grafana asks for a label_values(metric, label) variable.
        options = central.get(f"/api/v1/label/{label}/values", **{"match[]": [metric]})
        assert options == [chosen[name]], (name, options)
    substitutions = {**chosen, "__rate_interval": RATE_INTERVAL, "__range": "30s",
                     "__interval": "1s"}

    # Samples per second of a busy target: the frequency times the CPUs' worth
    # of time it ran (it competes for two CPUs with everything else here).
    # Over 30 s, within 20%: counters move at drains (every 1 s) and
    # scrapes (every 1 s), either end of the window may be off by one.
    expected_range = FREQUENCY * cpu.cores(at - 30, at)
    (increase,) = central.query(f'increase(tramprof_samples_total{{instance="{NODE}",'
                                f'process="chain"}}[30s])', at=at)
    assert 0.8 * expected_range <= float(increase["value"][1]) / 30 <= 1.2 * expected_range, (
        increase, expected_range)
    # The panels' 10 s windows ($__rate_interval), within 40%.
    expected = FREQUENCY * cpu.cores(at - 10, at)
    checks = panel_checks(central, d, (0.6 * expected, 1.4 * expected),
                          (0.8 * expected_range, 1.2 * expected_range), at,
                          [daemon_main_thread.cores(at - 10 - lag, at - lag)
                           for lag in MAIN_THREAD_LAGS])
    panels = [p for p in all_panels(dashboard["panels"]) if p["type"] != "row"]
    assert {p["title"] for p in panels} == set(checks), "every panel needs a check here"
    for panel in panels:
        exprs = [substitute_with(t["expr"], substitutions) for t in panel["targets"]]
        checks[panel["title"]]([(e, central.query(e, at=at)) for e in exprs])


Queries = list[tuple[str, list[dict[str, Any]]]]  # (expression, instant result) per target


def panel_checks(central: PrometheusServer, d: Daemon, rate: tuple[float, float],
                 range_rate: tuple[float, float], at: float,
                 main_thread_cores: list[float]) -> dict[str, Callable[[Queries], None]]:
    """A check per panel title; ``rate`` and ``range_rate`` bound the target's
    samples per second over $__rate_interval and over $__range;
    ``main_thread_cores`` is the daemon's main thread's CPU over
    $__rate_interval ending at ``at`` and at each of MAIN_THREAD_LAGS before
    it, as the kernel accounts it."""
    low, high = rate

    def top_self(queries: Queries) -> None:
        ((_, result),) = queries
        top = max(result, key=lambda r: float(r["value"][1]))
        assert top["metric"] == {"function": "chain_c"}
        assert low <= float(top["value"][1]) <= high, top

    def top_total(queries: Queries) -> None:
        ((_, result),) = queries
        rates = values(result, "function")
        # Every sample passes through all four; a few end in the kernel.
        peak = max(rates.values())
        assert {f for f, v in rates.items() if v >= 0.95 * peak} >= {
            "main", "chain_a", "chain_b", "chain_c"}, rates
        assert low <= peak <= high

    def by_process(queries: Queries) -> None:
        ((_, result),) = queries
        rates = values(result, "process")
        assert list(rates) == ["chain"] and low <= rates["chain"] <= high, rates

    def hottest(queries: Queries) -> None:
        ((_, result),) = queries
        top = max(result, key=lambda r: float(r["value"][1]))
        assert top["metric"]["process"] == "chain"
        assert top["metric"]["stack"].endswith(CHAIN), top
        # Nearly every sample: a few end in the kernel (interrupts).
        assert 0.9 * range_rate[0] <= float(top["value"][1]) <= range_rate[1], top

    def lost(queries: Queries) -> None:
        ((_, result),) = queries
        assert values(result, "reason") == {
            "counts_map_full": 0, "user_stacks_map_full": 0, "user_stack_collision": 0}

    def symbolization(queries: Queries) -> None:
        ((_, result),) = queries
        # The reasons the node exports, at a rate no higher than its samples.
        exported = {dict(labels).get("reason", "") for name, labels in d.metrics()
                    if name == "tramprof_symbolization_failures_total"}
        rates = values(result, "reason")
        assert set(rates) == exported
        assert all(0 <= v <= high for v in rates.values()), rates

    def dropped(queries: Queries) -> None:
        ((_, result),) = queries
        # One process, far from every limit: 2 families x 3 reasons, all at 0.
        assert len(result) == 6 and all(float(r["value"][1]) == 0 for r in result), result

    def series_count(queries: Queries) -> None:
        ((_, result),) = queries
        assert set(values(result, "family")) == {"tramprof_stack_samples_total",
                                                 "tramprof_function_samples_total"}
        # The node's count of its live series is the number that arrived here.
        for family, count in values(result, "family").items():
            arrived = central.query(f'count({family}{{instance="{NODE}"}})', at=at)
            assert count == float(arrived[0]["value"][1]), (family, count, arrived)
            assert count >= (8 if "function" in family else 1)  # 4 functions, self + total

    def bpf_time(queries: Queries) -> None:
        ((_, result),) = queries
        (per_sample,) = values(result, "instance").values()
        # The daemon runs as root here and enables the kernel's BPF statistics.
        assert math.isfinite(per_sample) and 0 < per_sample < 1e-3, per_sample

    def drain(queries: Queries) -> None:
        (_, drains), (_, collections) = queries
        assert 0 < values(drains, "instance")[NODE] < 5
        # The daemon's first whole-heap collection comes 5 minutes after its start.
        assert values(collections, "instance") == {NODE: 0}

    def unwind_modes(queries: Queries) -> None:
        ((_, result),) = queries
        modes = values(result, "mode")
        assert modes["chain"] == 0 and modes["scan"] == 0
        assert low <= modes["fp"] <= high, modes

    def python_frames(queries: Queries) -> None:
        # Native code only: nothing lost, stopped or refused. Counters without
        # labels are exported at 0 from the start; labelled ones have no series.
        assert len(queries) == 7
        for expr, result in queries:
            if "by (instance)" in expr:
                assert values(result, "instance") == {NODE: 0}, expr
            else:
                assert all(float(r["value"][1]) == 0 for r in result), (expr, result)

    def cpu_by_stage(queries: Queries) -> None:
        ((_, result),) = queries
        stages = values(result, "stage")
        assert set(stages) == set(MAIN_THREAD_STAGES), result
        assert stages["drain"] > 0 and min(stages.values()) >= 0, stages
        # Together, the main thread's CPU: the counters move at drains
        # (every 1 s) and are published with the next one, then scraped
        # every 1 s, so they tell of the thread's same 10 s up to ~2 s late.
        # Measured here over 150 s: the whole main thread (99.7%), and every
        # 10-s window within 9% of one of those (median 0.7%; 9-10% off for
        # the windows ending at ``at`` alone).
        total = sum(stages.values())
        assert any(0.85 * cores - 1e-4 <= total <= 1.15 * cores + 1e-4
                   for cores in main_thread_cores), (stages, main_thread_cores)

    def new_processes(queries: Queries) -> None:
        ((_, result),) = queries
        # Only the target is sampled (--pid), warmed at its first sample more
        # than 30 s before the window: none since. Both outcomes are
        # exported from the start.
        assert values(result, "result") == {"warmed": 0, "exited": 0}, result
        node = {dict(labels)["result"]: count for (name, labels), count in d.metrics().items()
                if name == "tramprof_new_processes_total"}
        assert node["warmed"] >= 1 and node["exited"] == 0, node

    def python_budget(queries: Queries) -> None:
        (_, duty), (_, overhead), (_, refused) = queries
        # No process under the trampoline runtime: no duty cycle, no
        # estimate; the counter of refused writes is there from the start.
        assert duty == [] and overhead == [], (duty, overhead)
        assert values(refused, "instance") == {NODE: 0}, refused

    return {
        "Top functions by self CPU": top_self,
        "Top functions by total CPU": top_total,
        "CPU samples by process": by_process,
        "Hottest stacks": hottest,
        "Lost samples by reason": lost,
        "Symbolization failures by reason": symbolization,
        "Dropped series": dropped,
        "Series count": series_count,
        "BPF run time per sample": bpf_time,
        "Drain duration": drain,
        "User stacks by unwinding mode": unwind_modes,
        "Python frames lost or rejected": python_frames,
        "Profiler CPU by stage": cpu_by_stage,
        "New processes: warmed or gone first": new_processes,
        "Python overhead budget": python_budget,
    }


def check_recording_rules(central: PrometheusServer) -> None:
    top = wait_for(lambda: central.query(
        'process_stack:tramprof_stack_samples:top20_rate5m{process="chain"}'), 30,
        "the recorded top stacks")
    hottest = max(top, key=lambda r: float(r["value"][1]))
    assert hottest["metric"]["job"] == "tramprof" and hottest["metric"]["stack"].endswith(CHAIN)
    assert all(r["metric"]["stack"] != "[other]" for r in top)
    shares = wait_for(lambda: central.query(
        'process_function_kind:tramprof_function_samples:ratio_rate5m'
        '{process="chain",function="chain_c"}'), 30, "the recorded function shares")
    by_kind = values(shares, "kind")
    # Nearly every sample ends in chain_c; all pass through it (the windows of
    # the two families may differ by a scrape: a little over 1 is possible).
    assert 0.9 <= by_kind["self"] <= by_kind["total"] <= 1.05, by_kind
    # The fleet-wide rule is the sum of the per-service one at the same evaluation.
    fleet = central.query('function_kind:tramprof_function_samples:rate5m{function="chain_c"}')
    at = float(fleet[0]["value"][0])
    per_service = central.query('sum by (job, function, kind) (process_function_kind:'
                                'tramprof_function_samples:rate5m{function="chain_c"})', at=at)
    assert values(fleet, "kind") == values(per_service, "kind")
    assert values(fleet, "kind")["self"] > 0


def alert_states(central: PrometheusServer) -> dict[str, list[tuple[str, str]]]:
    states: dict[str, list[tuple[str, str]]] = {}
    for group in central.get("/api/v1/rules", type="alert")["groups"]:
        for rule in group["rules"]:
            states[rule["name"]] = sorted((a["state"], a["labels"]["instance"])
                                          for a in rule["alerts"])
    return states


def check_alert_rules(central: PrometheusServer) -> None:
    groups = central.get("/api/v1/rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 16  # 6 recording rules, 10 alerts
    for rule in rules:
        assert rule["health"] == "ok", rule
        assert rule["lastEvaluation"] != "0001-01-01T00:00:00Z", rule
    # A healthy node: nothing pending, nothing firing.
    assert all(alerts == [] for alerts in alert_states(central).values()), alert_states(central)
