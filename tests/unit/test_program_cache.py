"""Program images and the cache that keeps them across restarts: what is
stored, what is refused, and that a refusal loses nothing but the cache."""

from __future__ import annotations

import json
import os
import struct

import pytest
from tramprof.sampler.compiler import LoadRequest
from tramprof.sampler.image import (
    IMAGE_FORMAT,
    ImageError,
    ImageMap,
    ImageProgram,
    ProgramImage,
    map_references,
)
from tramprof.sampler.loaded import MAP_ARRAY, MAP_ARRAY_OF_MAPS, MapSpec
from tramprof.sampler.programcache import KEEP_IMAGES, ProgramCache, cache_key

from tests.conftest import IS_ROOT

PERF_EVENT = 7


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, src << 4 | dst, off, imm)


# r1 = map (descriptor 42); r0 = 0; exit. A 64-bit load takes two slots.
PROGRAM = (insn(0x18, dst=1, src=1, imm=42) + insn(0) + insn(0xb7, dst=0) + insn(0x95))


def spec(name: str, map_type: int = MAP_ARRAY) -> MapSpec:
    return MapSpec(name=name.encode(), map_type=map_type, flags=0, max_entries=4, key_size=4,
                   leaf_size=8, key_desc='"int"', leaf_desc='"unsigned long long"')


def image(program: bytes = PROGRAM) -> ProgramImage:
    refs = map_references(program, {42: "settings"})
    return ProgramImage(
        (ImageMap(spec("settings"), ""), ImageMap(spec("inner"), ""),
         ImageMap(spec("outer", MAP_ARRAY_OF_MAPS), "inner")),
        (ImageProgram("on_tick", PERF_EVENT, "GPL", program, refs),), ())


def test_map_references_are_found_by_descriptor():
    assert map_references(PROGRAM, {42: "settings"}) == ((0, "settings"),)
    with pytest.raises(ImageError, match="descriptor 42, not a map"):
        map_references(PROGRAM, {7: "other"})


def test_an_image_survives_json():
    original = image()
    again = ProgramImage.from_json(json.loads(json.dumps(original.to_json())))
    assert again == original


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format=IMAGE_FORMAT + 1), "image format"),
    (lambda d: d["programs"][0].update(insns="AAAA"), "bytes of instructions"),
    (lambda d: d["programs"][0].update(insns="not base64!"), "malformed"),
    (lambda d: d["programs"][0].update(map_refs=[[2, "settings"]]), "not a 64-bit load"),
    (lambda d: d["programs"][0].update(map_refs=[[9, "settings"]]), "not a 64-bit load"),
    (lambda d: d["programs"][0].update(map_refs=[[0, "nowhere"]]), "unknown map"),
    (lambda d: d["maps"][2].update(inner=""), "bad inner map"),
    (lambda d: d["maps"][0].update(inner="outer"), "bad inner map"),
    (lambda d: d.update(tail_calls=[["settings", "nothing"]]), "tail call"),
    (lambda d: d.pop("maps"), "malformed"),
    (lambda d: d["maps"][0].update(key_size="four"), "malformed"),
])
def test_a_bad_image_is_refused_with_the_reason(change, message):
    data = image().to_json()
    change(data)
    with pytest.raises(ImageError, match=message):
        ProgramImage.from_json(data)


REQUEST = LoadRequest("int f(void *ctx) { return 0; }", ["-DX=1"], [("f", PERF_EVENT)], [])


def test_the_key_covers_source_flags_and_kernel(tmp_path):
    btf = tmp_path / "btf"
    btf.write_bytes(b"one kernel")
    key = cache_key(REQUEST, str(btf))
    assert key == cache_key(REQUEST, str(btf))
    others = {
        cache_key(LoadRequest(REQUEST.text + " ", REQUEST.cflags, REQUEST.programs, []),
                  str(btf)),
        cache_key(LoadRequest(REQUEST.text, ["-DX=2"], REQUEST.programs, []), str(btf)),
        cache_key(LoadRequest(REQUEST.text, REQUEST.cflags, REQUEST.programs, [],
                              [("a", "b")]), str(btf)),
    }
    btf.write_bytes(b"another kernel")
    others.add(cache_key(REQUEST, str(btf)))
    assert key not in others and len(others) == 4


def test_the_key_covers_the_headers_of_the_include_directories(tmp_path):
    """The source includes its own headers: one of them changed (an upgrade
    touching only a header) is another program."""
    btf = tmp_path / "btf"
    btf.write_bytes(b"one kernel")
    headers = tmp_path / "include"
    headers.mkdir()
    (headers / "walk.h").write_text("#define CHECK 0\n")
    (headers / "notes.txt").write_text("not a header")
    request = LoadRequest(REQUEST.text, [*REQUEST.cflags, f"-I{headers}"], REQUEST.programs, [])
    key = cache_key(request, str(btf))
    (headers / "notes.txt").write_text("still not a header")
    assert cache_key(request, str(btf)) == key
    (headers / "walk.h").write_text("#define CHECK 1\n")
    changed = cache_key(request, str(btf))
    (headers / "scan.h").write_text("")
    assert len({key, changed, cache_key(request, str(btf))}) == 3


def test_stored_images_come_back_and_only_the_newest_are_kept(tmp_path):
    cache = ProgramCache(str(tmp_path / "cache"))
    assert cache.load("a" * 64) is None  # no directory yet: nothing, no error
    for n in range(KEEP_IMAGES + 2):
        assert cache.store(f"{n:064x}", image())
        os.utime(cache._path(f"{n:064x}"), ns=(n * 10**9, n * 10**9))
    cache.store("f" * 64, image())  # prunes
    kept = sorted(os.listdir(tmp_path / "cache"))
    assert len(kept) == KEEP_IMAGES and f"program-{'f' * 64}.json" in kept
    assert f"program-{0:064x}.json" not in kept
    assert cache.load("f" * 64) == image()
    assert os.stat(tmp_path / "cache").st_mode & 0o777 == 0o700
    assert os.stat(cache._path("f" * 64)).st_mode & 0o777 == 0o600


def test_a_damaged_image_is_removed(tmp_path, caplog):
    cache = ProgramCache(str(tmp_path))
    path = tmp_path / f"program-{'a' * 64}.json"
    path.write_bytes(b'{"format": 1, "maps": [')
    path.chmod(0o600)
    assert cache.load("a" * 64) is None
    assert not path.exists()
    assert "damaged" in caplog.text


def test_untrusted_places_are_not_read(tmp_path, caplog):
    key = "b" * 64
    cache = ProgramCache(str(tmp_path / "cache"))
    assert cache.store(key, image())
    path = tmp_path / "cache" / f"program-{key}.json"

    (tmp_path / "cache").chmod(0o777)  # anyone could have put it there
    assert cache.load(key) is None and "writable by others" in caplog.text
    assert not cache.store(key, image())
    (tmp_path / "cache").chmod(0o700)

    path.chmod(0o622)
    assert cache.load(key) is None
    path.chmod(0o600)
    assert cache.load(key) == image()

    real = tmp_path / "elsewhere.json"
    path.rename(real)
    path.symlink_to(real)
    assert cache.load(key) is None and path.is_symlink() and real.exists()
    path.unlink()

    with open(path, "wb") as f:  # sparse, past the bound
        f.truncate(17 << 20)
    path.chmod(0o600)
    assert cache.load(key) is None and "regular file of at most" in caplog.text
    path.unlink()

    os.mkfifo(path, 0o600)  # would block a plain open
    assert cache.load(key) is None
    path.unlink()


@pytest.mark.skipif(not IS_ROOT, reason="needs root: files owned by another user")
def test_an_image_of_another_user_is_not_read(tmp_path, caplog):
    key = "c" * 64
    cache = ProgramCache(str(tmp_path))
    assert cache.store(key, image())
    os.chown(tmp_path / f"program-{key}.json", 12345, 12345)
    assert cache.load(key) is None and "uid 12345" in caplog.text
    os.chown(tmp_path, 12345, 12345)
    assert not cache.store(key, image())
