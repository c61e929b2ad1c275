"""Young interpreters: which processes are looked at again in their first
seconds, when, and how many at once."""

from __future__ import annotations

import pytest
from tramprof.pipeline import young
from tramprof.pipeline.young import LOOK_AFTER, YoungInterpreters, is_interpreter
from tramprof.procfs.maps import Mapping


def mapping(path: str, perms: str = "r-xp") -> Mapping:
    return Mapping(0x1000, 0x2000, perms, 0, 8, 1, 42, path)


@pytest.mark.parametrize(("path", "perms", "expected"), [
    ("/usr/bin/python3.11", "r-xp", True),
    ("/usr/local/bin/python3.13t", "r-xp", True),
    ("/opt/conda/bin/python3", "r-xp", True),
    ("/usr/lib/x86_64-linux-gnu/libpython3.12.so.1.0", "r-xp", True),
    ("/usr/lib/libpython3.9.so", "r-xp", True),
    ("/usr/bin/python3.11", "r--p", False),            # mapped, not as code
    ("/usr/lib/python3.11/lib-dynload/_json.cpython-311-x86_64-linux-gnu.so", "r-xp", False),
    ("/usr/bin/python2.7", "r-xp", False),
    ("/home/u/python3.11/evil", "r-xp", False),
    ("/usr/bin/node", "r-xp", False),
    ("[anon:python3.11]", "r-xp", False),
])
def test_is_interpreter(path: str, perms: str, expected: bool) -> None:
    assert is_interpreter([mapping("/usr/lib/x86_64-linux-gnu/libc.so.6"),
                           mapping(path, perms)]) is expected


def test_looks_come_at_their_times_then_stop() -> None:
    now = [10.0]
    followed = YoungInterpreters(clock=lambda: now[0])
    key = (7, 123, 0)
    followed.add(key)
    assert followed.seconds_to_next() == pytest.approx(LOOK_AFTER[0])
    taken = []
    for step in range(1, 301):  # 3 s in 10 ms steps
        now[0] = 10.0 + step / 100
        due = followed.take_due()
        if due:
            assert due == [(key, 4096 * len(taken))]  # the vsize the last look saw
            followed.saw(key, 4096 * (len(taken) + 1))
            taken.append(round(now[0] - 10.0, 2))
    assert taken == list(LOOK_AFTER)
    assert len(followed) == 0 and followed.seconds_to_next() is None


def test_forgotten_and_exited_processes_are_not_looked_at() -> None:
    now = [0.0]
    followed = YoungInterpreters(clock=lambda: now[0])
    followed.add((1, 1, 0))
    followed.add((2, 2, 0))
    followed.add((3, 3, 0))
    followed.forget(1)
    followed.forget_exited({2})
    now[0] = 1.0
    assert followed.take_due() == [((2, 2, 0), 0)]


def test_at_most_max_followed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(young, "MAX_FOLLOWED", 3)
    followed = YoungInterpreters(clock=lambda: 0.0)
    for pid in range(10):
        followed.add((pid, pid, 0))
    assert len(followed) == 3
