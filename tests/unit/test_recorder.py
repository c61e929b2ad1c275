"""Recordings of the next N seconds (/debug/pprof/profile), against a drain
loop shaped like the daemon's (select on the recorder, drain when due or
asked), on real threads and a real HTTP server."""

from __future__ import annotations

import gzip
import select
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.registry import CollectorRegistry
from tramprof.export.formats.pprof import ProfileMessage
from tramprof.export.http import MetricsServer
from tramprof.export.recorder import Recorder, RecordingFailed
from tramprof.model import Profile, Stack

# Every wait in this file is bounded by this (seconds).
PATIENCE = 10.0


class DrainLoop:
    """The daemon's loop in miniature: drains every ``interval`` seconds or
    when the recorder asks; window n holds one stack, ("drain", "n"), with
    one sample per pid 1 and pid 2."""

    def __init__(self, recorder: Recorder, interval: float) -> None:
        self.recorder = recorder
        self.interval = interval
        self.flips: list[float] = []  # monotonic time each drain started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        next_drain = time.monotonic() + self.interval
        while not self._stop.is_set():
            select.select([self.recorder.fileno()], [], [],
                          max(0.0, min(next_drain - time.monotonic(), 0.05)))
            if time.monotonic() >= next_drain or self.recorder.drain_due():
                self.drain()
                next_drain = time.monotonic() + self.interval

    def drain(self) -> None:
        self.recorder.drain_started()
        self.flips.append(time.monotonic())
        number = len(self.flips)
        start_ns = time.time_ns()
        window = Profile(tuple(Stack(pid, "p", "p", ("drain", str(number)), 1)
                               for pid in (1, 2)),
                         start_ns, 1_000_000, 99, {2: {"container_id": "c2"}})
        self.recorder.drain_finished(window)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(PATIENCE)

    def expected(self, requested: float, seconds: float) -> list[int]:
        """Drains whose windows Go's semantics give a recording asked for at
        ``requested``: after the first flip since then, up to and including
        the first flip ``seconds`` after that one."""
        first = next(i for i, t in enumerate(self.flips, 1) if t >= requested)
        last = next(i for i, t in enumerate(self.flips, 1)
                    if t >= self.flips[first - 1] + seconds)
        return list(range(first + 1, last + 1))


@pytest.fixture
def loop() -> Iterator[DrainLoop]:
    recorder = Recorder(lambda: 99)
    drains = DrainLoop(recorder, interval=0.3)
    yield drains
    drains.stop()
    recorder.close()


def drains_of(profile: Profile) -> list[int]:
    return sorted({int(stack.frames[1]) for stack in profile.stacks})


def test_recording_holds_exactly_the_next_seconds(loop):
    requested = time.monotonic()
    profile = loop.recorder.record(1.0)
    took = time.monotonic() - requested
    expected = loop.expected(requested, 1.0)
    assert drains_of(profile) == expected
    # Regular drains (every 0.3 s) fell inside: several windows, all kept.
    assert len(expected) >= 3
    assert profile.total_samples == 2 * len(expected)
    # It started at once (no wait for the regular drain) and ended soon after 1 s.
    first_flip = loop.flips[expected[0] - 2]
    last_flip = loop.flips[expected[-1] - 1]
    assert first_flip - requested < 0.2
    assert 1.0 <= last_flip - first_flip < 1.2
    assert 1.0 <= took < 1.5
    assert profile.process_labels == {2: {"container_id": "c2"}}


def test_overlapping_recordings_each_get_their_own_window(loop):
    results: dict[str, tuple[float, Profile]] = {}

    def record(name: str, seconds: float) -> None:
        requested = time.monotonic()
        results[name] = (requested, loop.recorder.record(seconds))

    long = threading.Thread(target=record, args=("long", 1.2))
    long.start()
    time.sleep(0.5)
    record("short", 0.4)
    long.join(PATIENCE)
    for name, seconds in (("long", 1.2), ("short", 0.4)):
        requested, profile = results[name]
        assert drains_of(profile) == loop.expected(requested, seconds), name


def test_close_fails_recordings_in_progress():
    recorder = Recorder(lambda: 99)
    loop = DrainLoop(recorder, interval=0.3)
    failures: list[str] = []

    def record() -> None:
        try:
            recorder.record(30)
        except RecordingFailed as exc:
            failures.append(str(exc))

    worker = threading.Thread(target=record)
    worker.start()
    time.sleep(0.3)
    began = time.monotonic()
    loop.stop()
    recorder.close()
    worker.join(PATIENCE)
    assert time.monotonic() - began < 1.0
    assert failures == ["the daemon is stopping"]
    with pytest.raises(RecordingFailed, match="stopping"):
        recorder.record(1)


def test_a_loop_that_does_not_drain_fails_the_recording():
    recorder = Recorder(lambda: 99, boundary_timeout=0.3)
    began = time.monotonic()
    with pytest.raises(RecordingFailed, match="did not drain within"):
        recorder.record(1)
    assert 0.3 <= time.monotonic() - began < 1.0
    # The wake-up is pending for the loop, and a failed drain (no window)
    # counts as a boundary with nothing in it.
    assert select.select([recorder.fileno()], [], [], 0)[0] == [recorder.fileno()]
    assert recorder.drain_due()
    recorder.drain_started()
    assert not recorder.drain_due()
    assert select.select([recorder.fileno()], [], [], 0)[0] == []
    recorder.drain_finished(None)
    recorder.close()


# ------------------------------------------------------------------ over HTTP


def _server(recorder: Recorder, **kw: object) -> MetricsServer:
    server = MetricsServer("127.0.0.1:0", CollectorRegistry(), lambda: (True, "ok"),
                           profiles=lambda seconds: Profile((), 0, 0, 99),
                           recorder=recorder, **kw)  # type: ignore[arg-type]
    server.start()
    return server


def _get(server: MetricsServer, path: str) -> tuple[int, dict[str, str], bytes]:
    url = f"http://127.0.0.1:{server.address[1]}{path}"
    try:
        with urllib.request.urlopen(url, timeout=PATIENCE) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_debug_pprof_profile_records_then_answers_pprof(loop):
    server = _server(loop.recorder)
    try:
        requested = time.monotonic()
        status, headers, body = _get(server, "/debug/pprof/profile?seconds=1")
        assert status == 200
        assert headers["Content-Type"] == "application/octet-stream"
        assert headers["Content-Disposition"] == 'attachment; filename="profile.pb.gz"'
        message = ProfileMessage()
        message.ParseFromString(gzip.decompress(body))
        strings = list(message.string_table)
        functions = {f.id: strings[f.name] for f in message.function}
        locations = {loc.id: functions[loc.line[0].function_id] for loc in message.location}
        got = sorted(int(locations[s.location_id[0]]) for s in message.sample)
        expected = loop.expected(requested, 1.0)
        assert got == sorted(expected * 2)  # pid 1 and pid 2 in each window
        assert message.period == 1_000_000_000 // 99
        labels = [{strings[label.key]: strings[label.str] or label.num for label in s.label}
                  for s in message.sample]
        assert {(lab["pid"], lab.get("container_id")) for lab in labels} == {
            (1, None), (2, "c2")}

        status, _, body = _get(server, "/debug/pprof/profile?seconds=1&pid=2")
        message.ParseFromString(gzip.decompress(body))
        assert status == 200 and {s.label[0].num for s in message.sample} == {2}
    finally:
        server.close()


def test_debug_pprof_profile_bounds(loop):
    server = _server(loop.recorder, max_record_seconds=5, max_profile_requests=1)
    try:
        for bad, why in (("seconds=0", b"seconds must be in [1, 5]"),
                         ("seconds=0.5", b"seconds must be in [1, 5]"),
                         ("seconds=5.5", b"seconds must be in [1, 5]"),
                         ("seconds=nan", b"seconds must be in [1, 5]"),
                         ("seconds=x", b"seconds must be a number"),
                         ("seconds=1&pid=x", b"pid must be a process id, got 'x'")):
            status, _, body = _get(server, f"/debug/pprof/profile?{bad}")
            assert (status, body) == (400, why + b"\n"), bad
        # One recording at a time here: a second one is refused at once.
        first: list[int] = []
        worker = threading.Thread(
            target=lambda: first.append(_get(server, "/debug/pprof/profile?seconds=1.5")[0]))
        worker.start()
        time.sleep(0.5)
        began = time.monotonic()
        status, headers, _ = _get(server, "/debug/pprof/profile?seconds=1")
        assert status == 429 and headers["Retry-After"] == "2"
        assert time.monotonic() - began < 0.5
        # Look-back profiles are not held up by a recording.
        assert _get(server, "/profile")[0] == 200
        worker.join(PATIENCE)
        assert first == [200]
    finally:
        server.close()


def test_debug_pprof_profile_when_the_daemon_stops():
    recorder = Recorder(lambda: 99)
    server = _server(recorder)
    try:
        threading.Timer(0.3, recorder.close).start()
        status, headers, body = _get(server, "/debug/pprof/profile?seconds=5")
        assert (status, body) == (503, b"recording failed: the daemon is stopping\n")
        assert headers["Retry-After"] == "2"
    finally:
        server.close()


def test_no_recorder_no_endpoint():
    server = MetricsServer("127.0.0.1:0", CollectorRegistry(), lambda: (True, "ok"))
    server.start()
    try:
        assert _get(server, "/debug/pprof/profile?seconds=1")[0] == 404
    finally:
        server.close()
