"""Collector, metric table and HTTP endpoints, with a stats source the test owns."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.registry import CollectorRegistry
from tramprof.bpf_layout import Counter as C
from tramprof.export import families
from tramprof.export.collector import ProfilerCollector
from tramprof.export.http import MetricsServer, parse_listen
from tramprof.stats import ProfilerStats

README = Path(__file__).resolve().parents[2] / "README.md"


def stats() -> ProfilerStats:
    return ProfilerStats(
        samples_by_process=Counter({"python3": 120, "nginx": 7}),
        bpf_counters={c: 0 for c in C} | {C.RECORDED: 127, C.IDLE: 50, C.FILTERED: 3,
                                          C.LOST_COUNTS_FULL: 2, C.LOST_USTACKS_FULL: 1,
                                          C.KSTACK_COLLISION: 4, C.USTACK_TRUNCATED: 5},
        symbolization_failures=Counter({"no_symbol": 9}),
        processes=2, process_events=Counter({"exit": 3, "overrun": 0}),
        drains=4, last_drain_seconds=0.25, bpf_run_time_ns=3_000_000, bpf_run_count=1000)


@pytest.fixture
def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(ProfilerCollector(stats))
    return reg


def test_collector_values(registry):
    get = registry.get_sample_value
    assert get("tramprof_samples_total", {"process": "python3"}) == 120
    assert get("tramprof_samples_total", {"process": "nginx"}) == 7
    assert get("tramprof_perf_events_total", {"outcome": "recorded"}) == 127
    assert get("tramprof_perf_events_total", {"outcome": "lost"}) == 3
    assert get("tramprof_lost_samples_total", {"reason": "counts_map_full"}) == 2
    assert get("tramprof_lost_samples_total", {"reason": "user_stacks_map_full"}) == 1
    assert get("tramprof_kernel_stacks_lost_total", {"reason": "collision"}) == 4
    assert get("tramprof_truncated_stacks_total") == 5
    assert get("tramprof_symbolization_failures_total", {"reason": "no_symbol"}) == 9
    assert get("tramprof_processes") == 2
    assert get("tramprof_process_events_total", {"kind": "exit"}) == 3
    assert get("tramprof_bpf_run_time_seconds_total") == pytest.approx(0.003)
    assert get("tramprof_bpf_runs_total") == 1000


def test_every_declared_family_is_exported(registry):
    exported = {m.name for m in registry.collect()}
    assert exported == {f.name for f in families.ALL}


def test_readme_metric_table_matches_code():
    assert families.markdown_table() in README.read_text()


def test_listen_parsing():
    assert parse_listen("127.0.0.1:9947") == ("127.0.0.1", 9947)
    assert parse_listen("[::1]:80") == ("::1", 80)
    assert parse_listen(":9000") == ("127.0.0.1", 9000)
    for bad in ("localhost", "1.2.3.4:x", "1.2.3.4:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_listen(bad)


def test_http_endpoints_text_and_openmetrics(registry):
    healthy = [True]
    server = MetricsServer("127.0.0.1:0", registry,
                           lambda: (healthy[0], "ok" if healthy[0] else "stalled"))
    server.start()
    base = f"http://127.0.0.1:{server.address[1]}"
    try:
        with urllib.request.urlopen(base + "/metrics") as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            assert 'tramprof_samples_total{process="python3"} 120.0' in r.read().decode()
        request = urllib.request.Request(
            base + "/metrics", headers={"Accept": "application/openmetrics-text"})
        with urllib.request.urlopen(request) as r:
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            assert r.read().decode().rstrip().endswith("# EOF")
        with urllib.request.urlopen(base + "/healthz") as r:
            assert r.read() == b"ok\n"
        healthy[0] = False
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/healthz")
        assert err.value.code == 503
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/nope")
        assert err.value.code == 404
    finally:
        server.close()
