"""Stack and function series for Prometheus, under a cardinality budget (one
job, over 400 lines: top-K per group, the global budget and expiry together).

Every sample lands in exactly one stack series and one self series, so the
series of a family always add up to the samples profiled:

``tramprof_stack_samples_total{process, <grouping labels>, stack}``
    ``stack`` is the folded stack, root first, frames joined by ``;``. At most
    ``top_stacks`` stacks of a process group get a series of their own; the
    samples of the others go to ``stack="[other]"`` of the group. A label
    longer than ``max_label_bytes`` (UTF-8) loses frames on the root side and
    starts with ``…;`` instead, so the leaf end stays readable (a leaf frame
    that is too long by itself keeps its last bytes, after ``…``).

``tramprof_function_samples_total{process, <grouping labels>, function, kind}``
    ``kind="self"``: samples whose leaf frame is the function; ``kind="total"``:
    samples with the function anywhere on the stack, once per sample however
    often it recurses. At most ``top_functions`` functions per group get a
    pair of series (self and total); the self samples of the others go to
    ``function="[other]", kind="self"``. There is no ``[other]`` total: a
    sample can hold several folded functions, so such a sum would count
    samples more than once and mean nothing. Too long names keep their first
    bytes and end in ``…``.

A process group is the set of processes sharing the values of the grouping
labels: ``process`` always (the process's comm, or its executable's basename
when grouping by ``exe`` but not ``comm``), plus ``exe``, ``container_id``,
``pod_uid`` and ``pid`` when they are in ``group_by``. Grouping by pid is
for single hosts: on a fleet it makes a group, and series, of every process.

Admission: counters must only grow while a series lives, so a series, once
admitted, is never taken away while it keeps receiving samples. Within one
drain, candidates for new series (stacks by their sample count in the drain,
functions by their total) are admitted largest first, across all groups,
while their group has room (``top_stacks``/``top_functions``) and the global
budget ``max_series`` (stack plus function series) has room. A group's two
``[other]`` series are reserved in the budget when the group is created, so
folding never needs room. A group that cannot be created for lack of budget
sends that drain's samples to the overflow group ``process="[other]"``
(other grouping labels empty), whose two ``[other]`` series are reserved
from the start.

Expiry: a series that received nothing for ``expiry_seconds`` is removed and
its budget freed; a group without samples for that long is removed with its
reservation. Exited processes thus free their series after the expiry time.
A stack that comes back later starts a new series from zero, which
Prometheus treats as a counter reset (the expiry is longer than its 5 minute
staleness window, so the old series has already ended).

``tramprof_dropped_series_total{family, reason}`` counts, once per drain in
which they occur, the stacks and functions that went to ``[other]`` (reason
``top_k``: their group was full; ``budget``: the global budget was) and the
stack and function labels that were shortened (``label_too_long``: they keep
their series, under the shortened label). ``tramprof_series{family}`` is the
number of live series per family.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tramprof.config import GROUP_LABELS
from tramprof.export import families as fam
from tramprof.export.exposition import LabelTexts, RenderedCounter
from tramprof.procfs.metadata import ProcessMetadata

if TYPE_CHECKING:
    from tramprof.model import Stack

__all__ = [
    "GROUP_LABELS",
    "NO_FRAMES",
    "OTHER",
    "OTHER_FRAME",
    "SeriesConfig",
    "SeriesTracker",
    "function_label",
    "stack_label",
]

OTHER = "[other]"
#: What a frame that is itself called "[other]" is shown as.
OTHER_FRAME = "[other frame]"
#: The stack (and leaf function) of a sample without a single frame.
NO_FRAMES = "[no frames]"
#: The process label when neither a comm nor an executable is known.
UNKNOWN_PROCESS = "[unknown]"
ELLIPSIS = "…"
_CUT_PREFIX = ELLIPSIS + ";"
_ELLIPSIS_BYTES = len(ELLIPSIS.encode())
_CUT_PREFIX_BYTES = len(_CUT_PREFIX.encode())

#: Every grouping label; the optional ones appear in metrics in this order.
_EXTRA_LABELS = ("exe", "container_id", "pod_uid", "pid")
_MIN_LABEL_BYTES = 16

_STACKS = fam.STACK_SAMPLES.exposed_name
_FUNCTIONS = fam.FUNCTION_SAMPLES.exposed_name
_DROP_KEYS = (
    (_STACKS, "top_k"), (_STACKS, "budget"), (_STACKS, "label_too_long"),
    (_FUNCTIONS, "top_k"), (_FUNCTIONS, "budget"), (_FUNCTIONS, "label_too_long"),
)


@dataclass(frozen=True)
class SeriesConfig:
    """Limits of the stack and function families; the defaults suit a fleet."""

    group_by: tuple[str, ...] = ("comm",)
    top_stacks: int = 20  # stack series per process group, [other] not included
    top_functions: int = 50  # functions (self + total series) per group
    max_series: int = 10_000  # stack + function series, [other] included
    max_label_bytes: int = 1024  # UTF-8 bytes of a stack or function label
    expiry_seconds: float = 600.0  # series without samples this long are removed

    def __post_init__(self) -> None:
        unknown = [g for g in self.group_by if g not in GROUP_LABELS]
        if unknown:
            raise ValueError(f"group_by: unknown label(s) {', '.join(unknown)}; "
                             f"choose from {', '.join(GROUP_LABELS)}")
        if len(set(self.group_by)) != len(self.group_by):
            raise ValueError("group_by: a label is listed twice")
        if self.top_stacks < 0 or self.top_functions < 0:
            raise ValueError("top_stacks and top_functions must not be negative")
        if self.max_series < 2:
            raise ValueError("max_series must be at least 2 (the overflow group's [other] "
                             "series)")
        if self.max_label_bytes < _MIN_LABEL_BYTES:
            raise ValueError(f"max_label_bytes must be at least {_MIN_LABEL_BYTES}")
        if self.expiry_seconds <= 0:
            raise ValueError("expiry_seconds must be positive")
        object.__setattr__(self, "group_by", tuple(self.group_by))  # from a list in a config

    @property
    def extra_labels(self) -> tuple[str, ...]:
        """The optional grouping labels in effect, in exposition order."""
        return tuple(name for name in _EXTRA_LABELS if name in self.group_by)


def _utf8_len(text: str) -> int:
    # A str of n characters encodes to at most 4n bytes: skip the encoding
    # when that already fits.
    return len(text) if text.isascii() else len(text.encode())


def stack_label(frames: tuple[str, ...], max_bytes: int) -> tuple[str, bool]:
    """The ``stack`` label of root-first ``frames`` and whether it was shortened."""
    if not frames:
        return NO_FRAMES, False
    label = ";".join(frames)
    if len(label) <= max_bytes // 4:
        return label, False
    # Keep the longest leaf-side run of whole frames that fits after "…;".
    # ';' is one byte in UTF-8 and never part of a multi-byte character, so
    # searching the encoded label finds frame boundaries.
    ascii_label = label.isascii()
    data: str | bytes = label if ascii_label else label.encode()
    if len(data) <= max_bytes:
        return label, False
    room = max_bytes - _CUT_PREFIX_BYTES
    if ascii_label:
        boundary = label.find(";", len(label) - room - 1)
        if boundary >= 0:
            return _CUT_PREFIX + label[boundary + 1:], True
        return ELLIPSIS + label[-(max_bytes - _ELLIPSIS_BYTES):], True
    assert isinstance(data, bytes)
    boundary = data.find(b";", len(data) - room - 1)
    if boundary >= 0:
        return _CUT_PREFIX + data[boundary + 1:].decode(), True
    # The leaf alone is too long: its last bytes, cut at a character boundary.
    tail = data[-(max_bytes - _ELLIPSIS_BYTES):]
    return ELLIPSIS + tail.decode("utf-8", "ignore"), True


def function_label(name: str, max_bytes: int) -> tuple[str, bool]:
    """The ``function`` label of a frame name and whether it was shortened."""
    if len(name) <= max_bytes // 4 or _utf8_len(name) <= max_bytes:
        return name, False
    head = name.encode()[: max_bytes - _ELLIPSIS_BYTES]
    return head.decode("utf-8", "ignore") + ELLIPSIS, True


class _Group:
    """The live series of one process group.

    A series is a list ``[count, last_sample_time]`` (functions:
    ``[self, total, last_sample_time]``) so the hot path updates it in place.
    """

    __slots__ = ("functions", "labels", "last", "other_self", "other_stack", "overflow",
                 "stacks")

    def __init__(self, labels: tuple[str, ...], overflow: bool) -> None:
        self.labels = labels
        self.overflow = overflow
        self.stacks: dict[str, list[float]] = {}
        self.functions: dict[str, list[float]] = {}
        self.other_stack: list[float] | None = None
        self.other_self: list[float] | None = None
        self.last = 0.0

    def fold_stack(self, count: int, now: float) -> None:
        if self.other_stack is None:
            self.other_stack = [count, now]
        else:
            self.other_stack[0] += count
            self.other_stack[1] = now

    def fold_self(self, count: int, now: float) -> None:
        if count == 0:
            return
        if self.other_self is None:
            self.other_self = [count, now]
        else:
            self.other_self[0] += count
            self.other_self[1] = now

    def own_series(self) -> int:
        """Series counted against the budget, the reserved [other] pair aside."""
        return len(self.stacks) + 2 * len(self.functions)


_STACK, _FUNCTION = 0, 1
_Key = tuple[str, ...]  # a process group: its label values


def _split(items: list[tuple[str, int]], room: int, kind: int, key: _Key,
           candidates: list[tuple[int, int, _Key, str]]) -> list[tuple[str, int]]:
    """Move the ``room`` largest ``(label, count)`` items to ``candidates``; return the rest."""
    if room <= 0:
        return items
    if len(items) > room:
        items.sort(key=itemgetter(1), reverse=True)
        candidates.extend((count, kind, key, label) for label, count in items[:room])
        return items[room:]
    candidates.extend((count, kind, key, label) for label, count in items)
    return []



# (stack label, leaf function label, distinct function labels,
#  shortened labels as (kind, label))
_Shape = tuple[str, str, Iterable[str], tuple[tuple[int, str], ...]]


def _shape(frames: tuple[str, ...], max_bytes: int) -> _Shape:
    """The labels one stack contributes to, computed once per drain and stack."""
    if OTHER in frames:
        # A symbol may be called anything (perf maps are written by the
        # profiled process): it must not become a second [other] series.
        frames = tuple(OTHER_FRAME if frame == OTHER else frame for frame in frames)
    label, label_cut = stack_label(frames, max_bytes)
    shortened: list[tuple[int, str]] = [(_STACK, label)] if label_cut else []
    if not frames:
        return label, NO_FRAMES, (NO_FRAMES,), ()
    names: Iterable[str] = set(frames)
    leaf = frames[-1]
    # Only a label over the cap can hold a name over the cap.
    if label_cut and max(map(len, names)) > max_bytes // 4:
        short_names = set()
        for name in names:
            short, name_cut = function_label(name, max_bytes)
            if name_cut:
                shortened.append((_FUNCTION, short))
            short_names.add(short)
        names = short_names
        leaf = function_label(leaf, max_bytes)[0]
    return label, leaf, names, tuple(shortened)


_RESERVED = 2  # a group's [other] stack series and [other] self series


def _default_metadata(stack: Stack) -> ProcessMetadata:
    return ProcessMetadata(stack.process, "", "", "")


class SeriesTracker:
    """Cumulative stack and function counters under a series budget.

    ``add`` is called by the drain loop, ``collect`` by scrapes (it is a
    prometheus-client collector: register it); both may run concurrently.
    ``metadata_for`` gives the grouping metadata of a stack's process; it is
    called once per (pid, process name) and drain and must not raise (see
    :func:`tramprof.procfs.metadata.read_metadata`). By default the group is the
    stack's ``process`` name.
    """

    def __init__(self, config: SeriesConfig | None = None,
                 metadata_for: Callable[[Stack], ProcessMetadata] | None = None) -> None:
        self.config = config or SeriesConfig()
        self._metadata_for = metadata_for or _default_metadata
        self._extras = self.config.extra_labels
        by = self.config.group_by
        self._process_from_exe = "exe" in by and "comm" not in by
        self._lock = threading.Lock()
        self._groups: dict[tuple[str, ...], _Group] = {}
        self._overflow_key = (OTHER,) + ("",) * len(self._extras)
        self._used = _RESERVED  # the overflow group's reservation
        self._dropped = dict.fromkeys(_DROP_KEYS, 0)
        base = fam.STACK_SAMPLES.labels
        self._stack_labels = (*base[:1], *self._extras, *base[1:])
        base = fam.FUNCTION_SAMPLES.labels
        self._function_labels = (*base[:1], *self._extras, *base[1:])
        # Label text of the live series, rendered once (export.exposition).
        self._stack_texts = LabelTexts(self._stack_labels)
        self._function_texts = LabelTexts(self._function_labels)

    # ---------------------------------------------------------------- adding

    def _group_key(self, stack: Stack, md: ProcessMetadata) -> tuple[str, ...]:
        process = md.comm or stack.process
        if self._process_from_exe and md.exe:
            process = os.path.basename(md.exe)
        if not process:
            process = os.path.basename(md.exe) or UNKNOWN_PROCESS
        values = [process]
        for name in self._extras:
            values.append(str(stack.pid) if name == "pid" else getattr(md, name))
        return tuple(values)

    def add(self, stacks: Iterable[Stack], now: float) -> None:
        """Count one drain's stacks; ``now`` is a monotonic time in seconds."""
        max_bytes = self.config.max_label_bytes
        # Stacks of one group with the same frames (threads, worker processes)
        # are counted together first: the rest of the work is per distinct stack.
        # Keyed by pid and name: a process that execs within one drain
        # changes its name under the same pid.
        keys: dict[tuple[int, str], _Key] = {}
        by_group: dict[_Key, dict[tuple[str, ...], int]] = {}
        for stack in stacks:
            count = stack.count
            if count <= 0:
                continue
            identity = (stack.pid, stack.process)
            key = keys.get(identity)
            if key is None:
                key = keys[identity] = self._group_key(stack, self._metadata_for(stack))
            group_frames = by_group.get(key)
            if group_frames is None:
                group_frames = by_group[key] = {}
            frames = stack.frames
            group_frames[frames] = group_frames.get(frames, 0) + count

        # group -> label -> samples in this drain
        d_stacks: dict[_Key, dict[str, int]] = {}
        d_self: dict[_Key, dict[str, int]] = {}
        d_total: dict[_Key, dict[str, int]] = {}
        cut: set[tuple[int, _Key, str]] = set()
        shapes: dict[tuple[str, ...], _Shape] = {}
        for key, group_frames in by_group.items():
            group_stacks: dict[str, int] = {}
            selfs: dict[str, int] = {}
            totals: dict[str, int] = {}
            stacks_get, selfs_get, totals_get = group_stacks.get, selfs.get, totals.get
            for frames, count in group_frames.items():
                shape = shapes.get(frames)
                if shape is None:
                    shape = shapes[frames] = _shape(frames, max_bytes)
                label, leaf, names, shortened = shape
                if shortened:
                    for kind, short in shortened:
                        cut.add((kind, key, short))
                group_stacks[label] = stacks_get(label, 0) + count
                selfs[leaf] = selfs_get(leaf, 0) + count
                for name in names:
                    totals[name] = totals_get(name, 0) + count
            d_stacks[key] = group_stacks
            d_self[key] = selfs
            d_total[key] = totals

        with self._lock:
            self._expire(now)
            self._merge(d_stacks, d_self, d_total, now)
            for kind, _key, _label in cut:
                self._dropped[(_STACKS if kind == _STACK else _FUNCTIONS,
                               "label_too_long")] += 1

    def _merge(self, d_stacks: dict[_Key, dict[str, int]], d_self: dict[_Key, dict[str, int]],
               d_total: dict[_Key, dict[str, int]], now: float) -> None:
        cfg = self.config
        groups = self._groups
        dropped = self._dropped
        # Would-be new series within their group's room, from all groups:
        # (drain count, kind, group key, label); admitted largest first below.
        candidates: list[tuple[int, int, _Key, str]] = []
        # New groups' stacks and functions beyond the group's room: they go to
        # [other] whatever the budget, once the group is created or refused.
        deferred: list[tuple[_Key, list[tuple[str, int]], list[tuple[str, int]]]] = []
        for key, group_stacks in d_stacks.items():
            selfs = d_self[key]
            group = groups.get(key)
            if group is None:
                stack_excess = _split(list(group_stacks.items()), cfg.top_stacks, _STACK, key,
                                      candidates)
                function_excess = _split(list(d_total[key].items()), cfg.top_functions,
                                         _FUNCTION, key, candidates)
                if stack_excess or function_excess:
                    deferred.append((key, stack_excess, function_excess))
                continue
            group.last = now
            new: list[tuple[str, int]] = []
            live = group.stacks
            for label, count in group_stacks.items():
                series = live.get(label)
                if series is None:
                    new.append((label, count))
                else:
                    series[0] += count
                    series[1] = now
            room = 0 if group.overflow else max(0, cfg.top_stacks - len(live))
            excess = _split(new, room, _STACK, key, candidates) if new else new
            if excess:
                group.fold_stack(sum(count for _, count in excess), now)
                dropped[(_STACKS, "budget" if group.overflow else "top_k")] += len(excess)
            new = []
            functions = group.functions
            for name, total in d_total[key].items():
                fseries = functions.get(name)
                if fseries is None:
                    new.append((name, total))
                else:
                    fseries[0] += selfs.get(name, 0)
                    fseries[1] += total
                    fseries[2] = now
            room = 0 if group.overflow else max(0, cfg.top_functions - len(functions))
            excess = _split(new, room, _FUNCTION, key, candidates) if new else new
            if excess:
                group.fold_self(sum(selfs.get(name, 0) for name, _ in excess), now)
                dropped[(_FUNCTIONS, "budget" if group.overflow else "top_k")] += len(excess)

        # Largest count first, stacks before functions at equal counts, else
        # in arrival order: two stable sorts on C-level keys (a full budget
        # turns every refused group's stacks into candidates at every drain).
        candidates.sort(key=itemgetter(1))
        candidates.sort(key=itemgetter(0), reverse=True)
        refused: set[_Key] = set()
        for count, kind, key, label in candidates:
            cost = 1 if kind == _STACK else 2
            group = groups.get(key)
            if group is None and key not in refused:
                group = self._create_group(key, cost)
                if group is None:
                    refused.add(key)
            if group is None or group.overflow:
                group, reason = self._overflow_group(), "budget"
            elif self._used + cost > cfg.max_series:
                reason = "budget"
            else:
                self._used += cost
                if kind == _STACK:
                    group.stacks[label] = [count, now]
                else:
                    group.functions[label] = [d_self[key].get(label, 0), count, now]
                group.last = now
                continue
            group.last = now
            if kind == _STACK:
                group.fold_stack(count, now)
                dropped[(_STACKS, reason)] += 1
            else:
                group.fold_self(d_self[key].get(label, 0), now)
                dropped[(_FUNCTIONS, reason)] += 1

        for key, stack_excess, function_excess in deferred:
            group = groups.get(key)
            if group is None and key not in refused:
                # A group without a single candidate (both rooms are 0).
                group = self._create_group(key, 0)
            if group is None or group.overflow:
                group, reason = self._overflow_group(), "budget"
            else:
                reason = "top_k"
            group.last = now
            if stack_excess:
                group.fold_stack(sum(count for _, count in stack_excess), now)
                dropped[(_STACKS, reason)] += len(stack_excess)
            if function_excess:
                selfs = d_self[key]
                group.fold_self(sum(selfs.get(name, 0) for name, _ in function_excess), now)
                dropped[(_FUNCTIONS, reason)] += len(function_excess)

    def _create_group(self, key: _Key, first_cost: int) -> _Group | None:
        """A new group, if the budget holds its [other] pair and its first series."""
        if key == self._overflow_key:
            return self._overflow_group()
        if self._used + _RESERVED + first_cost > self.config.max_series:
            return None
        group = self._groups[key] = _Group(key, overflow=False)
        self._used += _RESERVED
        return group

    def _overflow_group(self) -> _Group:
        group = self._groups.get(self._overflow_key)
        if group is None:
            group = self._groups[self._overflow_key] = _Group(self._overflow_key, overflow=True)
        return group

    def _expire(self, now: float) -> None:
        cutoff = now - self.config.expiry_seconds
        dead = []
        for key, group in self._groups.items():
            if group.last <= cutoff:
                dead.append(key)
                continue
            stale = [label for label, s in group.stacks.items() if s[1] <= cutoff]
            for label in stale:
                del group.stacks[label]
            stale_functions = [name for name, f in group.functions.items() if f[2] <= cutoff]
            for name in stale_functions:
                del group.functions[name]
            self._used -= len(stale) + 2 * len(stale_functions)
            if group.other_stack is not None and group.other_stack[1] <= cutoff:
                group.other_stack = None
            if group.other_self is not None and group.other_self[1] <= cutoff:
                group.other_self = None
        for key in dead:
            group = self._groups.pop(key)
            self._used -= group.own_series() + (0 if group.overflow else _RESERVED)

    def expire(self, now: float) -> None:
        """Remove what has expired by ``now`` (``add`` does this too)."""
        with self._lock:
            self._expire(now)

    # ------------------------------------------------------------- reading

    def reconfigure(self, config: SeriesConfig) -> None:
        """New limits from the next drain on; existing series keep counting (a
        lower budget is reached as series expire). The grouping defines the
        series themselves, so it changes only at restart."""
        if config.group_by != self.config.group_by:
            raise ValueError("group_by changes only at restart")
        with self._lock:
            self.config = config

    def series_count(self) -> int:
        """Live stack and function series, ``[other]`` included."""
        with self._lock:
            return sum(self._family_counts())

    def _family_counts(self) -> tuple[int, int]:
        stacks = functions = 0
        for group in self._groups.values():
            stacks += len(group.stacks) + (group.other_stack is not None)
            functions += 2 * len(group.functions) + (group.other_self is not None)
        return stacks, functions

    def budget_used(self) -> int:
        """Series counted against ``max_series``: live ones plus reserved ``[other]``s."""
        with self._lock:
            return self._used

    def describe(self) -> Iterator[Metric]:
        yield from self._sample_families()
        yield from self._tally_families()

    def _sample_families(self) -> tuple[RenderedCounter, RenderedCounter]:
        """The stack and function families, empty; their sample lines are
        written from the kept label texts (filled under the lock that guards
        those)."""
        return (RenderedCounter(fam.STACK_SAMPLES.name, fam.STACK_SAMPLES.help,
                                self._stack_labels, self._stack_texts),
                RenderedCounter(fam.FUNCTION_SAMPLES.name, fam.FUNCTION_SAMPLES.help,
                                self._function_labels, self._function_texts))

    @staticmethod
    def _tally_families() -> tuple[CounterMetricFamily, GaugeMetricFamily]:
        """The dropped-series and live-series families, empty."""
        return (CounterMetricFamily(fam.DROPPED_SERIES.name, fam.DROPPED_SERIES.help,
                                    labels=fam.DROPPED_SERIES.labels),
                GaugeMetricFamily(fam.SERIES.name, fam.SERIES.help, labels=fam.SERIES.labels))

    def collect(self) -> Iterator[Metric]:
        dropped, series = self._tally_families()
        with self._lock:
            stacks, functions = self._sample_families()
            add_stack, add_function = stacks.add, functions.add
            for group in self._groups.values():
                base = group.labels
                for label, s in group.stacks.items():
                    add_stack((*base, label), s[0])
                if group.other_stack is not None:
                    add_stack((*base, OTHER), group.other_stack[0])
                for name, f in group.functions.items():
                    add_function((*base, name, "self"), f[0])
                    add_function((*base, name, "total"), f[1])
                if group.other_self is not None:
                    add_function((*base, OTHER, "self"), group.other_self[0])
            for (family, reason), value in self._dropped.items():
                dropped.add_metric((family, reason), value)
            stack_count, function_count = self._family_counts()
            self._stack_texts.forget_unused()
            self._function_texts.forget_unused()
        series.add_metric((_STACKS,), stack_count)
        series.add_metric((_FUNCTIONS,), function_count)
        yield stacks
        yield functions
        yield dropped
        yield series
