"""An object's key (build id, else file identity) is parsed once per file."""

from __future__ import annotations

import os
import shutil

from tramprof.unwind.tables import ObjectKeys


def key_of(keys: ObjectKeys, path: os.PathLike[str]) -> str:
    with open(path, "rb") as f:
        return keys.of(f)


def test_the_build_id_is_read_once_per_file(tmp_path):
    one, two, three = (tmp_path / name for name in ("one", "two", "three"))
    for path in (one, two, three):
        shutil.copy("/bin/true", path)
    keys = ObjectKeys(limit=2)
    first = key_of(keys, one)
    assert first.startswith("build-id:")
    assert key_of(keys, one) == first and keys.parses == 1

    os.utime(one, ns=(1, 1))  # changed since: read again
    assert key_of(keys, one) == first and keys.parses == 2

    key_of(keys, two)
    key_of(keys, three)  # over the limit: "one", least recently used, goes
    assert keys.parses == 4
    key_of(keys, three)
    assert keys.parses == 4
    key_of(keys, one)
    assert keys.parses == 5
