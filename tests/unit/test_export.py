"""Collector, metric table and HTTP endpoints, with a stats source the test owns."""

from __future__ import annotations

import gzip
import importlib.metadata
import os
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import CollectorRegistry
from prometheus_client.samples import Sample
from tramprof.config import parse_listen
from tramprof.export import families
from tramprof.export.collector import (
    BuildInfoCollector,
    ProfilerCollector,
    StoreCollector,
    daemon_registry,
)
from tramprof.export.http import MetricsServer
from tramprof.export.store import ProfileStore
from tramprof.pipeline.stats import ProcessSamples, ProfilerStats
from tramprof.sampler.layout import Counter as C

README = Path(__file__).resolve().parents[2] / "README.md"


def process_samples(counts: dict[str, int]) -> ProcessSamples:
    samples = ProcessSamples()
    samples.add(counts.items())
    return samples


def stats() -> ProfilerStats:
    return ProfilerStats(
        samples_by_process=process_samples({"python3": 120, "nginx": 7}),
        bpf_counters={c: 0 for c in C} | {C.RECORDED: 127, C.IDLE: 50, C.FILTERED: 3,
                                          C.LOST_COUNTS_FULL: 2, C.LOST_USTACKS_FULL: 1,
                                          C.KSTACK_COLLISION: 4, C.USTACK_TRUNCATED: 5},
        symbolization_failures=Counter({"no_symbol": 9}),
        processes=2, process_events=Counter({"exit": 3, "overrun": 0}),
        new_processes=Counter({"warmed": 11}), scheduler_slice_seconds=0.0001,
        drains=4, last_drain_seconds=0.25, last_drain_cpu_seconds=0.125,
        bpf_run_time_ns=3_000_000, bpf_run_count=1000,
        heap_full_collections=2, heap_full_collection_seconds=0.75,
        main_thread_cpu_seconds={"drain": 1.5, "heap": 0.25, "aggregate": 0.5,
                                 "process_events": 0.875},
        python_duty={"python3": (0.125, 0.0625)}, python_duty_writes_failed=6)


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
    assert get("tramprof_new_processes_total", {"result": "warmed"}) == 11
    assert get("tramprof_new_processes_total", {"result": "exited"}) == 0  # shown from the start
    assert get("tramprof_scheduler_slice_seconds") == 0.0001
    assert get("tramprof_bpf_run_time_seconds_total") == pytest.approx(0.003)
    assert get("tramprof_bpf_runs_total") == 1000
    assert get("tramprof_drain_duration_seconds") == 0.25
    assert get("tramprof_drain_cpu_seconds") == 0.125
    assert get("tramprof_heap_full_collections_total") == 2
    assert get("tramprof_heap_full_collection_seconds_total") == 0.75
    assert {stage: get("tramprof_main_thread_cpu_seconds_total", {"stage": stage})
            for stage in ("drain", "heap", "aggregate", "process_events")} == \
        {"drain": 1.5, "heap": 0.25, "aggregate": 0.5, "process_events": 0.875}
    assert get("tramprof_python_duty_cycle", {"process": "python3"}) == 0.125
    assert get("tramprof_python_overhead_ratio", {"process": "python3"}) == 0.0625
    assert get("tramprof_python_duty_writes_failed_total") == 6


def test_main_thread_stages_start_at_zero():
    """Every stage has its series from the start, so rate() sees it begin."""
    assert ProfilerStats().main_thread_cpu_seconds == {
        "drain": 0.0, "heap": 0.0, "aggregate": 0.0, "process_events": 0.0}


def _spin(seconds: float) -> None:
    """Run on this thread's CPU for ``seconds``."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_uncounted_cpu_makes_the_stages_add_up():
    """What the thread ran around its stages is charged once to the stage
    named; what a stage counted is not charged again."""
    stats = ProfilerStats()
    began = time.thread_time()
    mark = stats.cpu_mark()
    _spin(0.02)
    counted_from = time.thread_time()
    _spin(0.03)
    stats.add_cpu("drain", time.thread_time() - counted_from)
    _spin(0.01)
    stats.add_uncounted_cpu("process_events", mark)
    ran = time.thread_time() - began
    stages = stats.main_thread_cpu_seconds
    assert sum(stages.values()) == pytest.approx(ran, abs=1e-3), (stages, ran)
    assert 0.03 <= stages["drain"] < 0.031, stages
    assert stages["process_events"] == pytest.approx(0.03, abs=1e-3), stages
    # A stage counted more than the thread ran since the mark: nothing is
    # charged, and nothing taken back.
    mark = stats.cpu_mark()
    stats.add_cpu("heap", 1.0)
    stats.add_uncounted_cpu("process_events", mark)
    assert stages["heap"] == 1.0 and stages["process_events"] == pytest.approx(0.03, abs=1e-3)


def _daemon_registry():
    from tramprof.export.series import SeriesTracker
    from tramprof.model import Stack

    tracker = SeriesTracker()
    tracker.add([Stack(1, "app", "app", ("main", "work"), 3)], now=0.0)
    return daemon_registry([ProfilerCollector(stats), tracker, StoreCollector(ProfileStore())],
                           threading.Lock())


# prometheus-client's ProcessCollector on Linux: the daemon's own process.
PROCESS_METRICS = {"process_virtual_memory_bytes", "process_resident_memory_bytes",
                   "process_start_time_seconds", "process_cpu_seconds", "process_open_fds",
                   "process_max_fds"}


def test_every_declared_family_is_exported():
    """The daemon's registry: every family of families.ALL, and besides them
    only the standard process_* metrics of the daemon itself."""
    exported = {m.name for m in _daemon_registry().collect()}
    assert exported == {f.name for f in families.ALL} | PROCESS_METRICS


def test_build_info_and_process_metrics():
    import platform

    import tramprof

    registry = _daemon_registry()
    labels = {"version": tramprof.__version__, "python_version": platform.python_version(),
              "bcc_version": importlib.metadata.version("bcc"), "naming": "compiled"}
    assert registry.get_sample_value("tramprof_build_info", labels) == 1
    assert next(m for m in registry.collect() if m.name == "tramprof_build_info").samples \
        == [Sample("tramprof_build_info", labels, 1)]
    # This process's own numbers, as /proc says.
    fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
    ticks = os.sysconf("SC_CLK_TCK")
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime"))
    assert registry.get_sample_value("process_start_time_seconds") == pytest.approx(
        boot + int(fields[19]) / ticks)
    cpu = registry.get_sample_value("process_cpu_seconds_total")
    # prometheus_client adds utime/ticks and stime/ticks: 0.82 + 0.07 is
    # 0.8899999999999999, below 89/100.
    assert (int(fields[11]) + int(fields[12])) / ticks - 1e-9 <= cpu \
        <= time.process_time() + 0.05
    # Both counts include the descriptor listdir itself holds. Threads left
    # by earlier tests may open and close descriptors meanwhile: compare in
    # a moment when the count held still.
    for _attempt in range(20):
        before = len(os.listdir("/proc/self/fd"))
        reported = registry.get_sample_value("process_open_fds")
        if len(os.listdir("/proc/self/fd")) == before:
            assert reported == before
            break
    else:
        pytest.fail("the descriptor count never held still")


def test_build_info_labels_are_fixed_by_the_constructor():
    registry = CollectorRegistry()
    registry.register(BuildInfoCollector({"version": "9.9", "python_version": "3.99.0",
                                          "bcc_version": "", "naming": "python"}))
    assert registry.get_sample_value("tramprof_build_info", {
        "version": "9.9", "python_version": "3.99.0", "bcc_version": "",
        "naming": "python"}) == 1


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


def _profile():
    from tramprof.model import Profile, Stack

    return Profile((Stack(1, "app", "app", ("main", "work"), 30),
                    Stack(2, "db", "db", ("main", "query"), 12)),
                   start_ns=1_700_000_000_000_000_000, duration_ns=10_000_000_000,
                   frequency_hz=99)


def _server(registry, **kw):
    server = MetricsServer("127.0.0.1:0", registry, lambda: (True, "ok"),
                           profiles=lambda seconds: _profile(), **kw)
    server.start()
    return server


def test_profile_endpoint_formats_and_pid_filter(registry):
    server = _server(registry)
    base = f"http://127.0.0.1:{server.address[1]}"
    try:
        with urllib.request.urlopen(base + "/profile?seconds=30") as r:
            assert r.read().decode() == "app;main;work 30\ndb;main;query 12\n"
        with urllib.request.urlopen(base + "/profile?format=folded&pid=2") as r:
            assert r.read().decode() == "db;main;query 12\n"
        for bad in ("format=gif", "seconds=-1", "seconds=x", "pid=abc"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(f"{base}/profile?{bad}")
            assert err.value.code == 400
        with urllib.request.urlopen(base + "/") as r:
            assert r.headers["Content-Type"].startswith("text/html")
            assert "main" in r.read().decode()
    finally:
        server.close()


def test_basic_auth_and_tls(registry, tmp_path):
    import base64
    import shutil
    import socket
    import ssl
    import subprocess

    from tramprof.export.http import HttpSecurity

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    security = HttpSecurity.from_files(str(cert), str(key), "prom", str(password))
    server = _server(registry, security=security)
    base = f"https://127.0.0.1:{server.address[1]}"
    context = ssl.create_default_context(cafile=str(cert))
    context.check_hostname = False
    try:
        stalled = socket.create_connection(("127.0.0.1", server.address[1]))  # no handshake
        with urllib.request.urlopen(base + "/healthz", context=context) as r:
            assert r.read() == b"ok\n"  # probes need no credentials
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/metrics", context=context)
        assert err.value.code == 401
        for user, word, code in (("prom", "wrong", 401), ("prom", "s3cret", 200)):
            token = base64.b64encode(f"{user}:{word}".encode()).decode()
            request = urllib.request.Request(base + "/metrics",
                                             headers={"Authorization": f"Basic {token}"})
            if code == 200:
                with urllib.request.urlopen(request, context=context) as r:
                    assert b"tramprof_samples_total" in r.read()
            else:
                with pytest.raises(urllib.error.HTTPError) as err:
                    urllib.request.urlopen(request, context=context)
                assert err.value.code == code
        with pytest.raises(OSError):  # plain HTTP is not served
            urllib.request.urlopen(f"http://127.0.0.1:{server.address[1]}/healthz", timeout=3)
        stalled.close()
    finally:
        server.close()


def test_process_names_beyond_the_cap_are_counted_in_other():
    """A process forking children with random names cannot grow
    tramprof_samples_total without bound; no sample is lost."""
    now = [0.0]
    samples = ProcessSamples(max_names=10, expiry=60, clock=lambda: now[0])
    samples.add((f"name-{i}", 2) for i in range(1000))
    counts = dict(samples.items())
    assert len(counts) == 11 and counts["[other]"] == 2 * 990
    assert sum(counts.values()) == 2000 and samples.folded == 1980
    now[0] = 61.0  # none of them sampled for longer than the expiry
    samples.add([("steady", 5)])
    assert samples.items() == [("steady", 5)]

    registry = CollectorRegistry()
    registry.register(ProfilerCollector(lambda: ProfilerStats(samples_by_process=samples)))
    assert registry.get_sample_value("tramprof_samples_total", {"process": "steady"}) == 5


def _get(url: str, **headers: str) -> tuple[dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as r:
        return dict(r.headers), r.read()


def test_metrics_gzip_and_content_negotiation(registry):
    """What prometheus-client's own exposition gives, gzipped when asked for."""
    server = MetricsServer("127.0.0.1:0", registry, lambda: (True, "ok"))
    server.start()
    url = f"http://127.0.0.1:{server.address[1]}/metrics"
    text, openmetrics = generate_latest(registry), generate_openmetrics(registry)
    try:
        headers, body = _get(url)
        assert body == text and "Content-Encoding" not in headers
        assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        for accept_encoding in ("gzip", "deflate, gzip;q=1.0, *;q=0.5", "GZIP"):
            headers, body = _get(url, **{"Accept-Encoding": accept_encoding})
            assert headers["Content-Encoding"] == "gzip", accept_encoding
            assert int(headers["Content-Length"]) == len(body)
            assert gzip.decompress(body) == text
        headers, body = _get(url, **{"Accept-Encoding": "br, identity"})
        assert body == text and "Content-Encoding" not in headers
        # What Prometheus sends.
        headers, body = _get(url, **{
            "Accept-Encoding": "gzip",
            "Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-"
                      "text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"})
        assert headers["Content-Type"].startswith("application/openmetrics-text")
        assert gzip.decompress(body) == openmetrics
        assert headers["Vary"] == "Accept, Accept-Encoding"
    finally:
        server.close()


def test_metrics_name_selects_families():
    server = MetricsServer("127.0.0.1:0", _daemon_registry(), lambda: (True, "ok"))
    server.start()
    base = f"http://127.0.0.1:{server.address[1]}/metrics"
    try:
        _, body = _get(base + "?name[]=tramprof_drains_total&name[]=tramprof_processes")
        samples = [line for line in body.decode().splitlines() if not line.startswith("#")]
        assert sorted(samples) == ["tramprof_drains_total 4.0", "tramprof_processes 2.0"]
        _, body = _get(base + "?name[]=process_max_fds")
        samples = [line for line in body.decode().splitlines() if not line.startswith("#")]
        assert [line.split()[0] for line in samples] == ["process_max_fds"]
    finally:
        server.close()


def test_a_scrape_sees_one_drain_never_half_of_one():
    """Drains publish stats and stack series together under the lock; every
    gzipped scrape taken while drains run adds up exactly."""
    from prometheus_client.parser import text_string_to_metric_families
    from tramprof.export.series import SeriesTracker
    from tramprof.model import Stack

    lock = threading.Lock()
    tracker = SeriesTracker()
    published = [ProfilerStats()]
    registry = daemon_registry([ProfilerCollector(lambda: published[0]), tracker], lock)
    server = MetricsServer("127.0.0.1:0", registry, lambda: (True, "ok"))
    server.start()
    stop = threading.Event()
    drains = [0]

    def drain_loop() -> None:
        while not stop.is_set():
            stacks = [Stack(1, "app", "app", ("main", f"f{drains[0] % 7}"), 3),
                      Stack(1, "app", "app", ("main", "g"), 1)]
            snapshot = ProfilerStats(samples_by_process=process_samples(
                {"app": 4 * (drains[0] + 1)}), drains=drains[0] + 1)
            with lock:
                # Slow on purpose: a scrape that did not wait would see half.
                tracker.add(stacks, now=float(drains[0]))
                time.sleep(0.001)
                published[0] = snapshot
            drains[0] += 1

    writer = threading.Thread(target=drain_loop)
    writer.start()
    seen = set()
    try:
        url = f"http://127.0.0.1:{server.address[1]}/metrics"
        for _ in range(60):
            _, body = _get(url, **{"Accept-Encoding": "gzip"})
            values = {}
            stack_sum = 0.0
            for family in text_string_to_metric_families(gzip.decompress(body).decode()):
                for sample in family.samples:
                    if sample.name == "tramprof_stack_samples_total":
                        stack_sum += sample.value
                    elif sample.labels in ({}, {"process": "app"}):
                        values[sample.name] = sample.value
            drain = values["tramprof_drains_total"]
            seen.add(drain)
            assert stack_sum == values.get("tramprof_samples_total", 0) == 4 * drain
    finally:
        stop.set()
        writer.join()
        server.close()
    assert len(seen) > 5, "scrapes did not overlap with drains"
