"""tramprof.export.series: stack and function series under a cardinality budget."""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from tramprof.export import families
from tramprof.export.series import (
    NO_FRAMES,
    OTHER,
    SeriesConfig,
    SeriesTracker,
    function_label,
    stack_label,
)
from tramprof.model import Stack
from tramprof.procfs.metadata import ProcessMetadata

STACKS = "tramprof_stack_samples_total"
FUNCTIONS = "tramprof_function_samples_total"
DROPPED = "tramprof_dropped_series_total"
SERIES = "tramprof_series"


def stk(frames: str | tuple[str, ...], count: int = 1, process: str = "app",
        pid: int = 100) -> Stack:
    if isinstance(frames, str):
        frames = tuple(frames.split(";")) if frames else ()
    return Stack(pid, process, process, frames, count)


def samples(tracker: SeriesTracker) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for m in tracker.collect() for s in m.samples]


def stack_series(tracker: SeriesTracker, process: str | None = None,
                 **labels: str) -> dict[str, float]:
    out = {}
    for name, lab, value in samples(tracker):
        if name != STACKS or (process is not None and lab["process"] != process):
            continue
        if all(lab[k] == v for k, v in labels.items()):
            assert lab["stack"] not in out, "duplicate series"
            out[lab["stack"]] = value
    return out


def function_series(tracker: SeriesTracker, process: str | None = None,
                    kind: str = "self") -> dict[str, float]:
    return {lab["function"]: value for name, lab, value in samples(tracker)
            if name == FUNCTIONS and lab["kind"] == kind
            and (process is None or lab["process"] == process)}


def dropped(tracker: SeriesTracker) -> dict[tuple[str, str], float]:
    return {(lab["family"], lab["reason"]): value for name, lab, value in samples(tracker)
            if name == DROPPED}


def live(tracker: SeriesTracker) -> dict[str, float]:
    return {lab["family"]: value for name, lab, value in samples(tracker) if name == SERIES}


def all_series(tracker: SeriesTracker) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for name, lab, value in samples(tracker):
        if name in (STACKS, FUNCTIONS):
            key = (name, tuple(sorted(lab.items())))
            assert key not in out, f"duplicate series {key}"
            out[key] = value
    return out


# ------------------------------------------------------------------ basics

def test_counts_stacks_and_functions() -> None:
    t = SeriesTracker()
    t.add([stk("main;run;parse", 5), stk("main;run;eval", 3), stk("main;run;parse", 2, pid=101)],
          now=0)
    assert stack_series(t) == {"main;run;parse": 7, "main;run;eval": 3}
    assert function_series(t, kind="self") == {"parse": 7, "eval": 3, "main": 0, "run": 0}
    assert function_series(t, kind="total") == {"parse": 7, "eval": 3, "main": 10, "run": 10}
    assert live(t) == {STACKS: 2, FUNCTIONS: 8}
    assert t.series_count() == 10
    # every family and label set as declared, nothing folded
    assert set(dropped(t).values()) == {0}
    assert {m.name for m in t.collect()} == {
        f.name for f in (families.STACK_SAMPLES, families.FUNCTION_SAMPLES,
                         families.DROPPED_SERIES, families.SERIES)}


def test_self_and_total_count_a_recursive_function_once_per_sample() -> None:
    t = SeriesTracker()
    t.add([stk("main;fib;fib;fib;fib", 4), stk("main;fib;helper;fib", 6),
           stk("main;helper", 1)], now=0)
    total = function_series(t, kind="total")
    selfs = function_series(t, kind="self")
    assert total == {"main": 11, "fib": 10, "helper": 7}
    assert selfs == {"main": 0, "fib": 10, "helper": 1}
    # every sample has exactly one leaf
    assert sum(selfs.values()) == 11


def test_counters_are_cumulative_across_drains() -> None:
    t = SeriesTracker()
    t.add([stk("a;b", 2)], now=0)
    t.add([stk("a;b", 3), stk("a;c", 1)], now=10)
    t.add([], now=20)
    assert stack_series(t) == {"a;b": 5, "a;c": 1}
    assert function_series(t, kind="total")["a"] == 6


def test_stacks_without_frames_and_without_samples() -> None:
    t = SeriesTracker()
    t.add([stk((), 4), stk("a", 0), stk("b", -1)], now=0)
    assert stack_series(t) == {NO_FRAMES: 4}
    assert function_series(t) == {NO_FRAMES: 4}


def test_a_frame_called_other_does_not_duplicate_the_other_series() -> None:
    t = SeriesTracker(SeriesConfig(top_stacks=1, top_functions=1))
    t.add([stk("main;[other]", 5), stk("[other]", 3), stk("main;x", 1)], now=0)
    all_series(t)  # asserts uniqueness
    assert stack_series(t) == {"main;[other frame]": 5, OTHER: 3 + 1}
    assert function_series(t, kind="total") == {"[other frame]": 8}
    assert function_series(t, kind="self") == {"[other frame]": 8, OTHER: 1}
    series_lines = [line.rsplit(" ", 1)[0] for line in exposition(t).splitlines()
                    if not line.startswith("#")]
    assert len(series_lines) == len(set(series_lines))


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="unknown label"):
        SeriesConfig(group_by=("comm", "namespace"))
    with pytest.raises(ValueError, match="twice"):
        SeriesConfig(group_by=("pid", "pid"))
    with pytest.raises(ValueError, match="max_series"):
        SeriesConfig(max_series=1)
    with pytest.raises(ValueError, match="max_label_bytes"):
        SeriesConfig(max_label_bytes=8)
    with pytest.raises(ValueError, match="expiry"):
        SeriesConfig(expiry_seconds=0)
    with pytest.raises(ValueError, match="negative"):
        SeriesConfig(top_stacks=-1)
    assert SeriesConfig(group_by=["pid", "comm"]).group_by == ("pid", "comm")  # type: ignore[arg-type]


# ------------------------------------------------------------------- top-K

def test_top_k_admits_the_largest_and_folds_the_rest_exactly() -> None:
    t = SeriesTracker(SeriesConfig(top_stacks=3))
    t.add([stk(f"main;f{i}", count) for i, count in enumerate([1, 50, 7, 30, 2, 9])], now=0)
    assert stack_series(t) == {"main;f1": 50, "main;f3": 30, "main;f5": 9, OTHER: 1 + 7 + 2}
    assert dropped(t)[(STACKS, "top_k")] == 3
    assert dropped(t)[(STACKS, "budget")] == 0


def test_admitted_series_keep_counting_and_late_hot_stacks_go_to_other() -> None:
    t = SeriesTracker(SeriesConfig(top_stacks=2))
    t.add([stk("a", 5), stk("b", 4), stk("c", 1)], now=0)
    before = stack_series(t)
    assert before == {"a": 5, "b": 4, OTHER: 1}
    # "hot" arrives late: the group is full, so it is counted in [other];
    # a and b keep their series (counters must not go backwards).
    t.add([stk("hot", 100), stk("a", 1)], now=1)
    after = stack_series(t)
    assert after == {"a": 6, "b": 4, OTHER: 101}
    assert all(after[k] >= v for k, v in before.items())
    # per drain: c in drain 1, hot in drain 2
    assert dropped(t)[(STACKS, "top_k")] == 2
    # the function family has room (50), so "hot" is visible there
    assert function_series(t)["hot"] == 100


def test_top_functions_by_total_and_other_is_self_only() -> None:
    t = SeriesTracker(SeriesConfig(top_functions=2))
    # totals: main 10, x 6, y 4, z 3 (z is a leaf of 3 samples, y of 1)
    t.add([stk("main;x", 3), stk("main;x;z", 3), stk("main;y", 1), stk("main", 0)], now=0)
    t.add([stk("main;y;z", 3)], now=0)
    selfs = function_series(t, kind="self")
    totals = function_series(t, kind="total")
    assert set(totals) == {"main", "x"}  # the two largest totals of the first drain
    assert totals == {"main": 10, "x": 6}
    assert selfs == {"main": 0, "x": 3, OTHER: 3 + 1 + 3}
    assert OTHER not in totals
    assert sum(selfs.values()) == 10
    # drain 1: y and z were left out; drain 2: y and z again
    assert dropped(t)[(FUNCTIONS, "top_k")] == 4


def test_top_k_is_per_group() -> None:
    t = SeriesTracker(SeriesConfig(top_stacks=1))
    t.add([stk("a", 3, "p1", 1), stk("b", 2, "p1", 1), stk("a", 1, "p2", 2),
           stk("c", 5, "p2", 2)], now=0)
    assert stack_series(t, "p1") == {"a": 3, OTHER: 2}
    assert stack_series(t, "p2") == {"c": 5, OTHER: 1}


# ------------------------------------------------------------------ budget

def test_global_budget_is_shared_by_all_groups_and_families() -> None:
    cfg = SeriesConfig(max_series=6, top_functions=0)
    t = SeriesTracker(cfg)
    # Candidates, largest first: x (10, A), z (7, B), y (5, A).
    # x creates A: reserved [other] pair + 1 series -> 2 + 2 + 1 = 5 of 6.
    # z cannot create B (needs 3 more): B's samples go to the overflow group.
    # y fits in the last slot.
    t.add([stk("x", 10, "A", 1), stk("z", 7, "B", 2), stk("y", 5, "A", 1)], now=0)
    assert stack_series(t, "A") == {"x": 10, "y": 5}
    assert stack_series(t, "B") == {}
    assert stack_series(t, OTHER) == {OTHER: 7}
    # top_functions=0: every function folds into its group's [other] self
    assert function_series(t, "A") == {OTHER: 15}
    assert function_series(t, OTHER) == {OTHER: 7}
    assert t.budget_used() == 6
    assert t.series_count() == 5 <= cfg.max_series
    d = dropped(t)
    assert d[(STACKS, "budget")] == 1  # z
    assert d[(FUNCTIONS, "top_k")] == 2  # x and y: A's room is 0
    assert d[(FUNCTIONS, "budget")] == 1  # z: B was not created


def test_budget_folds_into_the_groups_other_once_full() -> None:
    t = SeriesTracker(SeriesConfig(max_series=10, top_functions=0))
    t.add([stk(f"s{i}", 100 - i) for i in range(20)], now=0)
    # 2 (overflow) + 2 (group) reserved: 6 stack series fit
    assert stack_series(t) == {**{f"s{i}": 100 - i for i in range(6)},
                               OTHER: sum(100 - i for i in range(6, 20))}
    assert dropped(t)[(STACKS, "budget")] == 14
    assert t.budget_used() == 10


def test_overflow_labels_with_extra_grouping_labels() -> None:
    t = SeriesTracker(SeriesConfig(max_series=2, group_by=("comm", "pid")))
    t.add([stk("a", 3)], now=0)
    (labels,) = [lab for name, lab, _ in samples(t) if name == STACKS]
    assert labels == {"process": OTHER, "pid": "", "stack": OTHER}
    text = exposition(t)
    assert 'tramprof_stack_samples_total{pid="",process="[other]",stack="[other]"} 3.0' in text


def test_a_process_named_like_the_overflow_group_does_not_duplicate_series() -> None:
    t = SeriesTracker(SeriesConfig(max_series=4))
    t.add([stk("a", 3, "big", 1), stk("b", 1, OTHER, 2)], now=0)
    t.add([stk("c", 2, "new", 3), stk("d", 2, OTHER, 2)], now=1)
    all_series(t)  # asserts uniqueness
    # nothing fits (4 = overflow pair + one group's pair): everything is in the overflow
    assert stack_series(t, OTHER) == {OTHER: 3 + 1 + 2 + 2}


# ---------------------------------------------------------- invariants (fuzz)

drain_strategy = st.lists(
    st.tuples(st.integers(0, 6),  # pid; process name is "p<pid % 4>"
              st.lists(st.sampled_from("abcdef"), max_size=5).map(tuple),
              st.integers(1, 20)),
    max_size=25)


@settings(max_examples=150, deadline=None)
@given(drains=st.lists(drain_strategy, min_size=1, max_size=6),
       max_series=st.integers(2, 40), top_stacks=st.integers(0, 4),
       top_functions=st.integers(0, 4), by_pid=st.booleans())
def test_invariants_hold_for_any_input(drains: list[list[tuple[int, tuple[str, ...], int]]],
                                       max_series: int, top_stacks: int, top_functions: int,
                                       by_pid: bool) -> None:
    cfg = SeriesConfig(max_series=max_series, top_stacks=top_stacks,
                       top_functions=top_functions,
                       group_by=("comm", "pid") if by_pid else ("comm",))
    t = SeriesTracker(cfg)
    added = 0
    previous: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for n, drain in enumerate(drains):
        stacks = [stk(frames, count, f"p{pid % 4}", pid) for pid, frames, count in drain]
        added += sum(count for _, _, count in drain)
        t.add(stacks, now=n)  # all within the expiry time: nothing is removed
        now_series = all_series(t)
        # every sample is in exactly one stack series and one self series
        assert sum(v for (name, _), v in now_series.items() if name == STACKS) == added
        assert sum(v for (name, lab), v in now_series.items()
                   if name == FUNCTIONS and ("kind", "self") in lab) == added
        # the budget holds, and the gauge tells the truth
        assert t.series_count() == len(now_series) <= t.budget_used() <= max_series
        assert sum(live(t).values()) == len(now_series)
        # monotonic: no series disappears or decreases while it lives
        for key, value in previous.items():
            assert now_series[key] >= value, key
        # total >= self for every admitted function
        for (name, lab), value in now_series.items():
            if name == FUNCTIONS and ("kind", "total") in lab:
                self_key = (name, tuple(sorted({**dict(lab), "kind": "self"}.items())))
                assert value >= now_series[self_key]
        previous = now_series


@settings(max_examples=100, deadline=None)
@given(drains=st.lists(st.tuples(drain_strategy, st.floats(0, 3)), min_size=1, max_size=8),
       max_series=st.integers(2, 30), top_stacks=st.integers(0, 3),
       top_functions=st.integers(0, 3))
def test_budget_bookkeeping_survives_expiry(drains: list[tuple[list[tuple[int, tuple[str, ...],
                                                                           int]], float]],
                                            max_series: int, top_stacks: int,
                                            top_functions: int) -> None:
    t = SeriesTracker(SeriesConfig(max_series=max_series, top_stacks=top_stacks,
                                   top_functions=top_functions, expiry_seconds=2))
    now = 0.0
    for drain, step in drains:
        now += step
        t.add([stk(frames, count, f"p{pid % 3}", pid) for pid, frames, count in drain], now)
        assert t.series_count() <= t.budget_used() <= max_series
        # every stack series lives because it received samples within the last 2 s
        assert all(v > 0 for (name, _), v in all_series(t).items() if name == STACKS)
    t.add([], now + 2.5)  # everything has expired (+ 2 exactly may round to "not yet")
    assert (t.series_count(), t.budget_used()) == (0, 2)


def test_per_group_sums_equal_group_samples_when_the_budget_allows() -> None:
    rng = random.Random(7)
    t = SeriesTracker(SeriesConfig(top_stacks=5, top_functions=4))
    expected: Counter[str] = Counter()
    for n in range(20):
        drain = []
        for _ in range(rng.randint(0, 40)):
            index = rng.randint(0, 9)
            process = f"proc{index}"
            frames = tuple(rng.choice("abcdefghij") for _ in range(rng.randint(1, 8)))
            count = rng.randint(1, 9)
            drain.append(stk(frames, count, process, pid=100 + index))
            expected[process] += count
        t.add(drain, now=n * 10)
        for process, total in expected.items():
            assert sum(stack_series(t, process).values()) == total
            assert sum(function_series(t, process, "self").values()) == total
    assert dropped(t)[(STACKS, "top_k")] > 0  # the test did exercise [other]


def test_a_process_that_execs_within_one_drain_counts_under_both_names() -> None:
    t = SeriesTracker(SeriesConfig())
    t.add([stk("main;fork_exec", 3, "bash", pid=4242),
           stk("main;work", 5, "python3", pid=4242)], now=0)
    assert stack_series(t, "bash") == {"main;fork_exec": 3}
    assert stack_series(t, "python3") == {"main;work": 5}


# ------------------------------------------------------------------ expiry

def test_series_expire_and_free_their_budget() -> None:
    cfg = SeriesConfig(max_series=7, top_functions=0, expiry_seconds=600)
    t = SeriesTracker(cfg)
    t.add([stk("a", 5, "old", 1), stk("b", 3, "old", 1)], now=0)
    assert t.budget_used() == 6  # 2 + 2 + a + b
    t.add([stk("a", 1, "old", 1)], now=300)
    # b got nothing for 600 s: removed; a is still counting
    t.add([], now=600)
    assert stack_series(t, "old") == {"a": 6}
    assert t.budget_used() == 5
    # 599.9 s after its last sample a series is still there, at 600 s it is gone
    t.add([], now=899.9)
    assert "a" in stack_series(t, "old")
    t.add([], now=900)
    assert stack_series(t) == {}
    assert t.budget_used() == 2
    assert t.series_count() == 0
    assert live(t) == {STACKS: 0, FUNCTIONS: 0}


def test_stack_label_is_reused_after_expiry_starting_from_zero() -> None:
    t = SeriesTracker(SeriesConfig(expiry_seconds=60))
    t.add([stk("a", 5)], now=0)
    t.add([], now=60)
    t.add([stk("a", 2)], now=61)
    assert stack_series(t) == {"a": 2}


def test_expired_groups_make_room_for_new_ones() -> None:
    cfg = SeriesConfig(max_series=8, top_functions=0, expiry_seconds=600)
    t = SeriesTracker(cfg)
    t.add([stk("x", 1, "gone", 1), stk("y", 1, "gone", 1)], now=0)
    t.add([stk("new", 9, "fresh", 2)], now=100)  # no room: 2 + 2 + 2 + 2 reserved/used
    assert stack_series(t, "fresh") == {}
    assert stack_series(t, OTHER) == {OTHER: 9}
    t.add([stk("new", 4, "fresh", 2)], now=600)  # "gone" exited 600 s ago
    assert stack_series(t, "gone") == {}
    assert stack_series(t, "fresh") == {"new": 4}


def test_a_full_group_admits_again_once_a_slot_expires() -> None:
    t = SeriesTracker(SeriesConfig(top_stacks=1, expiry_seconds=100))
    t.add([stk("cold", 1)], now=0)
    t.add([stk("hot", 50)], now=50)
    assert stack_series(t) == {"cold": 1, OTHER: 50}
    t.add([stk("hot", 7)], now=100)  # cold expired at 100 s
    assert stack_series(t) == {"hot": 7, OTHER: 50}


def test_expire_without_adding() -> None:
    t = SeriesTracker(SeriesConfig(expiry_seconds=10))
    t.add([stk("a", 1)], now=0)
    t.expire(now=10)
    assert t.series_count() == 0


# -------------------------------------------------------------- long labels

def test_stack_label_truncation_keeps_the_leaf_end() -> None:
    frames = tuple(f"frame_{i:03d}" for i in range(100))  # 9 bytes each
    label, cut = stack_label(frames, 64)
    assert cut
    assert label.startswith("…;")
    assert label.endswith(";frame_099")
    assert len(label.encode()) <= 64
    # as many whole frames as fit: 4 bytes of "…;" + 6 * 9 + 5 separators = 63
    assert label == "…;" + ";".join(frames[-6:])
    assert stack_label(frames[-6:], 64) == (";".join(frames[-6:]), False)


@pytest.mark.parametrize("max_bytes", [16, 17, 20, 33, 64, 100, 1024])
@pytest.mark.parametrize("frames", [
    tuple(f"fn{i}" for i in range(400)),
    ("main", "é" * 50, "π漢字" * 30, "leaf_é"),
    ("root", "x" * 5000),  # a leaf longer than the cap by itself
    ("ü" * 5000,),
    ("a", "ü" * 3000, "b"),
])
def test_stack_labels_never_exceed_the_cap(frames: tuple[str, ...], max_bytes: int) -> None:
    label, cut = stack_label(frames, max_bytes)
    full = ";".join(frames)
    assert cut == (len(full.encode()) > max_bytes)
    assert len(label.encode()) <= max_bytes
    if cut:
        assert label.startswith("…")
        # the label is the leaf end of the full stack
        assert full.endswith(label.removeprefix("…;").removeprefix("…"))
        # and as long as possible, within a frame (4 bytes of "…;" or 3 of "…" + 3
        # bytes of a partial UTF-8 character at most)
        assert len(label.encode()) >= min(max_bytes - 3 - 3, len(frames[-1].encode()))
    else:
        assert label == full


@pytest.mark.parametrize("name", ["short", "x" * 2000, "é" * 700, "a" + "漢" * 500])
def test_function_label_keeps_the_head(name: str) -> None:
    label, cut = function_label(name, 64)
    assert len(label.encode()) <= 64
    assert cut == (len(name.encode()) > 64)
    if cut:
        assert label.endswith("…")
        assert name.startswith(label.removesuffix("…"))
        assert len(label.encode()) >= 64 - 3 - 3
    else:
        assert label == name


def test_long_stacks_are_counted_and_share_their_shortened_label() -> None:
    t = SeriesTracker(SeriesConfig(max_label_bytes=32))
    # "…;middle_function;leaf_func" is 29 bytes: no root-side frame fits with it
    tail = ("middle_function", "leaf_func")
    deep1 = (*(f"root{i}" for i in range(10)), *tail)
    deep2 = (*(f"other{i}" for i in range(10)), *tail)
    t.add([stk(deep1, 3), stk(deep2, 4), stk("short;leaf", 1)], now=0)
    assert stack_series(t) == {"…;middle_function;leaf_func": 7, "short;leaf": 1}
    # one shortened label in this drain (both stacks map to it)
    assert dropped(t)[(STACKS, "label_too_long")] == 1
    # functions are whole: no name is over the cap
    assert function_series(t, kind="total")["root0"] == 3


def test_long_function_names_are_shortened_consistently() -> None:
    t = SeriesTracker(SeriesConfig(max_label_bytes=32))
    long_a = "std::vector<std::basic_string<char>>::push_back_a"
    long_b = "std::vector<std::basic_string<char>>::push_back_b"
    short = function_label(long_a, 32)[0]
    assert short == function_label(long_b, 32)[0]
    # recursion and name collisions still count a sample once in total
    t.add([stk(("main", long_a, long_b, long_a), 5)], now=0)
    assert function_series(t, kind="total") == {"main": 5, short: 5}
    assert function_series(t, kind="self") == {"main": 0, short: 5}
    assert dropped(t)[(FUNCTIONS, "label_too_long")] == 1


# ---------------------------------------------------------------- grouping

CID_A = "a" * 64
CID_B = "b" * 64
POD = "1234abcd-56ef-78ab-90cd-ef1234567890"


def container_metadata(stack: Stack) -> ProcessMetadata:
    cid = CID_A if stack.pid < 200 else CID_B
    return ProcessMetadata(stack.process, f"/usr/bin/{stack.process}", cid,
                           POD if stack.pid < 200 else "")


def test_grouping_by_container_and_pod() -> None:
    t = SeriesTracker(SeriesConfig(group_by=("comm", "container_id", "pod_uid")),
                      metadata_for=container_metadata)
    t.add([stk("a", 2, "nginx", 100), stk("a", 3, "nginx", 101), stk("a", 5, "nginx", 300)],
          now=0)
    got = {(lab["container_id"], lab["pod_uid"]): v for name, lab, v in samples(t)
           if name == STACKS}
    assert got == {(CID_A, POD): 5, (CID_B, ""): 5}
    # the label names do not depend on group_by's order
    t2 = SeriesTracker(SeriesConfig(group_by=("pod_uid", "container_id", "comm")),
                       metadata_for=container_metadata)
    t2.add([stk("a", 2, "nginx", 100)], now=0)
    for tracker in (t, t2):
        stacks, functions = [m for m in tracker.collect()
                             if m.name in ("tramprof_stack_samples", "tramprof_function_samples")]
        assert list(stacks.samples[0].labels) == ["process", "container_id", "pod_uid", "stack"]
        assert list(functions.samples[0].labels) == [
            "process", "container_id", "pod_uid", "function", "kind"]


def test_grouping_by_pid_separates_processes_and_default_does_not() -> None:
    drain = [stk("a", 2, "worker", 1), stk("a", 3, "worker", 2)]
    by_comm = SeriesTracker()
    by_comm.add(drain, now=0)
    assert stack_series(by_comm) == {"a": 5}
    by_pid = SeriesTracker(SeriesConfig(group_by=("comm", "pid")))
    by_pid.add(drain, now=0)
    assert stack_series(by_pid, pid="1") == {"a": 2}
    assert stack_series(by_pid, pid="2") == {"a": 3}


def test_process_label_from_exe_when_grouping_by_exe_only() -> None:
    def md(stack: Stack) -> ProcessMetadata:
        return ProcessMetadata({1: "gunicorn: work", 2: "gunicorn: mast"}[stack.pid],
                               "/usr/bin/python3.11", "", "")
    t = SeriesTracker(SeriesConfig(group_by=("exe",)), metadata_for=md)
    t.add([stk("a", 2, pid=1), stk("a", 3, pid=2)], now=0)
    assert [(lab["process"], lab["exe"], v) for name, lab, v in samples(t) if name == STACKS] \
        == [("python3.11", "/usr/bin/python3.11", 5)]
    # with comm in group_by, process stays the comm
    t = SeriesTracker(SeriesConfig(group_by=("comm", "exe")), metadata_for=md)
    t.add([stk("a", 2, pid=1), stk("a", 3, pid=2)], now=0)
    assert sorted(lab["process"] for name, lab, _ in samples(t) if name == STACKS) == [
        "gunicorn: mast", "gunicorn: work"]


def test_process_label_fallbacks() -> None:
    def md(stack: Stack) -> ProcessMetadata:
        return {1: ProcessMetadata("", "", "", ""),
                2: ProcessMetadata("", "/opt/bin/server (x)", "", ""),
                3: ProcessMetadata("named", "", "", ""),
                4: ProcessMetadata("", "", "", "")}[stack.pid]
    t = SeriesTracker(metadata_for=md)
    t.add([stk("a", 1, "", 1), stk("a", 2, "", 2), stk("a", 3, "fromstack", 3),
           stk("a", 4, "fromstack", 4)], now=0)
    got = {lab["process"]: v for name, lab, v in samples(t) if name == STACKS}
    assert got == {"[unknown]": 1, "server (x)": 2, "named": 3, "fromstack": 4}


def test_metadata_is_asked_once_per_pid_and_drain() -> None:
    calls: Counter[int] = Counter()

    def md(stack: Stack) -> ProcessMetadata:
        calls[stack.pid] += 1
        return ProcessMetadata(stack.process, "", "", "")
    t = SeriesTracker(metadata_for=md)
    t.add([stk("a", 1, pid=1), stk("b", 1, pid=1), stk("a", 1, pid=2)], now=0)
    t.add([stk("a", 1, pid=1)], now=1)
    assert calls == {1: 2, 2: 1}


# ------------------------------------------------------------- exposition

def exposition(tracker: SeriesTracker) -> str:
    registry = CollectorRegistry()
    registry.register(tracker)
    return generate_latest(registry).decode()


def test_exposition_round_trips_awkward_labels() -> None:
    t = SeriesTracker(SeriesConfig(group_by=("comm", "exe")),
                      metadata_for=lambda s: ProcessMetadata('we"ird\\comm', "/bin/x\ny", "",
                                                             ""))
    frames = ('py::f:"quoted".py', "back\\slash", "new\nline", "ünïcode")
    t.add([stk(frames, 3)], now=0)
    parsed = {(s.name, s.labels.get("stack"), s.labels.get("function"), s.labels.get("kind")):
              s.value for fam in text_string_to_metric_families(exposition(t))
              for s in fam.samples}
    assert parsed[(STACKS, ";".join(frames), None, None)] == 3
    assert parsed[(FUNCTIONS, None, "ünïcode", "self")] == 3
    registry = CollectorRegistry()
    registry.register(t)
    assert b'tramprof_stack_samples_total{' in generate_openmetrics(registry)
    assert registry.get_sample_value(
        STACKS, {"process": 'we"ird\\comm', "exe": "/bin/x\ny",
                 "stack": ";".join(frames)}) == 3


def test_dropped_and_series_families_are_always_exposed() -> None:
    text = exposition(SeriesTracker())
    for family in (STACKS.removesuffix("_total"), FUNCTIONS.removesuffix("_total")):
        for reason in ("top_k", "budget", "label_too_long"):
            assert (f'tramprof_dropped_series_total{{family="{family}_total",'
                    f'reason="{reason}"}} 0.0') in text
        assert f'tramprof_series{{family="{family}_total"}} 0.0' in text


def test_describe_names_the_families() -> None:
    assert [m.name for m in SeriesTracker().describe()] == [
        "tramprof_stack_samples", "tramprof_function_samples", "tramprof_dropped_series",
        "tramprof_series"]


def test_concurrent_adds_and_scrapes() -> None:
    t = SeriesTracker(SeriesConfig(top_stacks=5, max_series=200, expiry_seconds=5))
    stop = threading.Event()
    errors: list[BaseException] = []

    def scrape() -> None:
        try:
            while not stop.is_set():
                all_series(t)
        except BaseException as e:  # reported below
            errors.append(e)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    rng = random.Random(3)
    try:
        for n in range(300):
            t.add([stk(tuple(rng.choice("abcdefgh") for _ in range(4)), 1,
                       f"p{rng.randint(0, 20)}", rng.randint(1, 50)) for _ in range(30)],
                  now=n * 0.1)
    finally:
        stop.set()
        scraper.join()
    assert not errors


# ------------------------------------------------------------- large input
# Speed is measured in benchmarks/bench_export.py, not asserted here.

def synthetic_stacks(n: int, groups: int, seed: int = 1) -> list[Stack]:
    """Python-like stacks: 5-45 frames of ~60 bytes from 300 names per process."""
    rng = random.Random(seed)
    vocab = {g: [f"py::mod{g % 7}.Class{j % 13}.method_{j}:/srv/app/pkg{j % 9}/mod.py"
                 for j in range(300)] for g in range(groups)}
    return [Stack(1000 + i % groups, f"proc{i % groups}", f"proc{i % groups}",
                  tuple(rng.choice(vocab[i % groups]) for _ in range(rng.randint(5, 45))),
                  rng.randint(1, 50)) for i in range(n)]


@pytest.mark.parametrize("max_series", [1_000, 10_000])
def test_a_large_input_fills_the_budget(max_series: int) -> None:
    t = SeriesTracker(SeriesConfig(max_series=max_series))
    t.add(synthetic_stacks(10_000, 100), now=0)
    t.add(synthetic_stacks(10_000, 100, seed=2), now=1)
    assert max_series * 0.95 < t.series_count() <= max_series
