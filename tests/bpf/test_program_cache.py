"""The compiled program kept across restarts: an image loads without the
compiler and works exactly like the compiled program; a cache the kernel
refuses costs one compile and nothing else (root: real bcc, real kernel)."""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from tramprof.config import Config
from tramprof.pipeline.profiler import Profiler
from tramprof.sampler.compiler import LoadRequest, compile_and_load
from tramprof.sampler.image import ImageError, load_image
from tramprof.sampler.perfring import close_rings, open_rings

from tests.bpf.test_compiler import ALL_MAPS, PERF_EVENT
from tests.bpf.test_privileges_root import CHAIN
from tests.conftest import TRAMPROF, requires_root

pytestmark = requires_root


@pytest.fixture(scope="module")
def all_maps_image():
    compiled = compile_and_load(
        LoadRequest(ALL_MAPS, [], [("writer", PERF_EVENT)], [("jumps", "writer")],
                    [("outer", "inner")]), image=True)
    compiled.program.cleanup()
    assert compiled.image is not None, compiled.image_problem
    return compiled.image


def test_an_image_loads_and_runs_without_the_compiler(all_maps_image):
    """Maps of every kind come back with bcc's shapes; the program reaches
    them through the patched descriptors: it counts in `things`, reads
    `settings` into `narrow`, submits to `events`, and the program array holds
    it (it calls itself through `jumps`)."""
    before = set(os.listdir("/proc/self/fd"))
    started = time.monotonic()
    program = load_image(all_maps_image)
    took = time.monotonic() - started
    assert sorted(program.map_names()) == sorted(
        m.spec.name for m in all_maps_image.maps)
    program[b"settings"][0] = program[b"settings"].Leaf(5)
    program[b"outer"][0] = program[b"inner"].map_fd  # the inner shape fits
    records: list[int] = []
    rings = open_rings(program[b"events"], 8)
    program.attach_perf_event(ev_type=1, ev_config=0, fn_name=b"writer", sample_freq=999)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and len(records) < 50:
        for ring in rings:
            records += (int.from_bytes(raw[:8], "little") for raw in ring.read()[0])
    things = [(key.pid, value.value) for key, value in program[b"things"].items()]
    narrow = sum(program[b"narrow"].getvalue(program[b"narrow"].Key(0)))
    close_rings(program[b"events"], rings)
    program.cleanup()
    assert len(records) >= 50 and set(records) == {2}  # outer[0] is set: one = 2
    assert things == [(0, 1)]  # counted before outer is looked at
    assert narrow > 0 and narrow % 5 == 0
    assert not set(os.listdir("/proc/self/fd")) - before
    assert took < 30


def test_an_image_the_verifier_refuses_says_why_and_leaves_nothing(all_maps_image):
    program = all_maps_image.programs[0]
    insns = bytearray(program.insns)
    # Make the first instruction read through r3, which holds nothing yet.
    struct.pack_into("<BBhi", insns, 0, 0x79, 3 << 4 | 0, 0, 0)  # r0 = *(u64 *)(r3 + 0)
    broken = all_maps_image.__class__(
        all_maps_image.maps,
        (program.__class__(program.name, program.prog_type, program.license, bytes(insns),
                           program.map_refs),), all_maps_image.tail_calls)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(ImageError, match="writer") as caught:
        load_image(broken)
    assert "R3 !read_ok" in str(caught.value)
    assert not set(os.listdir("/proc/self/fd")) - before


def chain_stack(frames: tuple[str, ...]) -> bool:
    """main, chain_a, chain_b, chain_c in a row (kernel frames of an
    interrupt may follow, libc's start-up frames come before)."""
    at = frames.index("main") if "main" in frames else -1
    return at >= 0 and frames[at:at + 4] == CHAIN


def profile_chain(pid: int, cache: Path) -> tuple[str, float, int]:
    """Where the daemon's program came from, the share of exact chain stacks
    and the samples, over 2 s of profiling."""
    profiler = Profiler(Config(pids=(pid,), frequency=499, interval=0.5,
                               program_cache_dir=str(cache)))
    profiler.start()
    try:
        stacks: Counter[tuple[str, ...]] = Counter()
        end = time.monotonic() + 2
        while time.monotonic() < end:
            profiler.wait(0.5)
            for stack in profiler.collect():
                stacks[stack.frames] += stack.count
        origin = profiler.sampler.loaded_from
    finally:
        profiler.close()
    total = sum(stacks.values())
    exact = sum(n for s, n in stacks.items() if chain_stack(s))
    return origin, exact / max(total, 1), total


def test_the_daemon_starts_from_its_cache_and_profiles_the_same(
        targets, start_target, tmp_path):
    """First start compiles and keeps the image; the next loads it and gives
    the same exact stacks. An image the kernel refuses is compiled anew and
    replaced."""
    target = start_target(str(targets / "chain"), "60")
    cache = tmp_path / "cache"
    first = profile_chain(target.proc.pid, cache)
    (stored,) = cache.iterdir()
    second = profile_chain(target.proc.pid, cache)
    assert (first[0], second[0]) == ("compiler", "cache")
    assert first[1] >= 0.95 and second[1] >= 0.95, (first, second)
    assert min(first[2], second[2]) >= 500

    data = json.loads(stored.read_bytes())
    insns = bytearray(base64.b64decode(data["programs"][0]["insns"]))
    struct.pack_into("<BBhi", insns, 0, 0x79, 3 << 4 | 0, 0, 0)
    data["programs"][0]["insns"] = base64.b64encode(insns).decode()
    stored.write_text(json.dumps(data))
    third = profile_chain(target.proc.pid, cache)
    assert third[0] == "compiler" and third[1] >= 0.95, third
    fourth = profile_chain(target.proc.pid, cache)
    assert fourth[0] == "cache" and fourth[1] >= 0.95, fourth


def prepare(cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TRAMPROF, "prepare", "--log-level", "info"], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "TRAMPROF_PROGRAM_CACHE_DIR": str(cache)})


def test_prepare_fills_the_cache_the_daemon_starts_from(targets, start_target, tmp_path):
    """``tramprof prepare`` (an init container's job) compiles into the cache
    and exits; the daemon then starts from it; a second prepare only loads
    it; a cache it may not write is a warning, not a failure."""
    cache = tmp_path / "cache"
    first = prepare(cache)
    assert first.returncode == 0 and "ready (compiled now)" in first.stderr, first.stderr
    (stored,) = cache.iterdir()
    target = start_target(str(targets / "chain"), "60")
    origin, exact, total = profile_chain(target.proc.pid, cache)
    assert origin == "cache" and exact >= 0.95 and total >= 500, (origin, exact, total)
    again = prepare(cache)
    assert again.returncode == 0 and "held the program already" in again.stderr, again.stderr
    assert "compiled and loaded" not in again.stderr and list(cache.iterdir()) == [stored]

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # anyone could plant an image here: never used
    refused = prepare(shared)
    assert refused.returncode == 0, refused.stderr
    assert "could not be kept" in refused.stderr and not list(shared.iterdir()), refused.stderr
