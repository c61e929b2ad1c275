"""tramprof.export.exposition: /metrics bodies with the stack and function
samples written from kept label text, line for line what prometheus-client
writes itself."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from tramprof.export.collector import ProfilerCollector, daemon_registry
from tramprof.export.exposition import LabelTexts, encode
from tramprof.export.series import SeriesConfig, SeriesTracker
from tramprof.model import Stack
from tramprof.pipeline.stats import ProfilerStats
from tramprof.procfs.metadata import ProcessMetadata

OPENMETRICS = "application/openmetrics-text; version=1.0.0"
# What Prometheus sends by default: OpenMetrics first.
PROMETHEUS = ("application/openmetrics-text;version=1.0.0;q=0.5,"
              "application/openmetrics-text;version=0.0.1;q=0.4,"
              "text/plain;version=0.0.4;q=0.3,*/*;q=0.2")

# Names a profiled process chooses (perf maps, comm, cgroup paths).
HOSTILE = ['quote"d', "back\\slash", "new\nline", "brace}{", 'x",evil="1', "ünï…",
           "comma,equal=", "\\\"\\n", "tab\tand\rcr"]


def tracker_with_hostile_names() -> SeriesTracker:
    config = SeriesConfig(group_by=("comm", "container_id", "pid"), top_stacks=50,
                          top_functions=50)
    tracker = SeriesTracker(config, metadata_for=lambda stack: ProcessMetadata(
        stack.process, "/bin/app", f'ctr"{stack.pid}\\', ""))
    stacks = [Stack(100 + at, name, name, ("main", name, f"leaf {at}"), 3 + at)
              for at, name in enumerate(HOSTILE)]
    # Counts around where Go's float format turns to an exponent.
    stacks += [Stack(7, "big", "big", ("main", "work"), 12_345_678),
               Stack(8, "big", "big", ("main", "rest"), 999_999),
               Stack(9, "big", "big", ("main", "more"), 1_000_000)]
    tracker.add(stacks, now=0.0)
    return tracker


def registry_of(tracker: SeriesTracker) -> CollectorRegistry:
    """The daemon's /metrics registry (process_* metrics aside: they change
    between two scrapes)."""
    return daemon_registry([ProfilerCollector(ProfilerStats), tracker], threading.Lock(),
                           proc_root="/nonexistent")


@pytest.mark.parametrize(("accept", "library"), [
    ("", generate_latest), ("text/plain", generate_latest),
    (OPENMETRICS, generate_openmetrics), (PROMETHEUS, generate_openmetrics)])
def test_the_body_holds_the_lines_the_library_writes(accept, library):
    """The same lines as prometheus-client's own encoder, families in
    another order; scraped twice, the kept label texts give the same body."""
    registry = registry_of(tracker_with_hostile_names())
    expected = library(registry).decode().splitlines()
    body, content_type = encode(registry, accept)
    lines = body.decode().splitlines()
    assert sorted(lines) == sorted(expected)
    assert lines != expected  # written here: the stack and function families come last
    assert len(lines) > 60
    assert encode(registry, accept) == (body, content_type)
    if library is generate_openmetrics:
        assert content_type.startswith("application/openmetrics-text")
        assert lines[-1] == "# EOF" and lines.count("# EOF") == 1
    else:
        assert content_type.startswith("text/plain; version=0.0.4")
        parsed = {(s.name, tuple(sorted(s.labels.items()))): s.value
                  for family in text_string_to_metric_families(body.decode())
                  for s in family.samples}
        assert parsed[("tramprof_stack_samples_total", (
            ("container_id", 'ctr"104\\'), ("pid", "104"), ("process", 'x",evil="1'),
            ("stack", 'main;x",evil="1;leaf 4')))] == 7.0
        assert parsed[("tramprof_function_samples_total", (
            ("container_id", 'ctr"7\\'), ("function", "work"), ("kind", "self"), ("pid", "7"),
            ("process", "big")))] == 12_345_678.0


def test_other_name_escapings_are_the_librarys_whole():
    """An escaping scheme that changes valid names too is left to the
    library: its answer byte for byte."""
    registry = registry_of(tracker_with_hostile_names())
    accept = "application/openmetrics-text; version=1.0.0; escaping=dots"
    body, content_type = encode(registry, accept)
    assert "escaping=dots" in content_type
    assert body == generate_openmetrics(registry, escaping="dots")


def test_label_texts_are_kept_while_their_series_live():
    texts = LabelTexts(("process", "stack"))
    assert texts.text(("app", 'a"b')) == 'process="app",stack="a\\"b"'
    texts.forget_unused()
    assert len(texts) == 1
    assert texts.text(("app", 'a"b')) == 'process="app",stack="a\\"b"'
    texts.text(("app", "c"))
    texts.forget_unused()
    assert len(texts) == 2
    texts.text(("app", "c"))  # the other series expired: not asked for
    texts.forget_unused()
    assert len(texts) == 1


def test_label_names_are_written_sorted():
    """As the library writes them, whatever order the family declares."""
    texts = LabelTexts(("process", "container_id", "stack", "pid"))
    assert texts.text(("p", "c", "s", "1")) == 'container_id="c",pid="1",process="p",stack="s"'


def test_only_the_families_asked_for():
    """``name[]`` (a restricted registry) gives copies of the families the
    library writes whole, stack samples included."""
    registry = registry_of(tracker_with_hostile_names())
    restricted = registry.restricted_registry(["tramprof_stack_samples_total"])
    body, _content_type = encode(restricted, "")
    assert body == generate_latest(restricted)
    assert body.count(b"\ntramprof_stack_samples_total{") == len(HOSTILE) + 3
