"""Profile writers: pprof (decoded twice, by our classes and by an independent
JS decoder), speedscope (validated against the official schema) and the flame
graph page (data, escaping, pruning; the browser side is in tests/e2e)."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest
from tramprof.export.formats.flamegraph import MIN_FRACTION, render_flamegraph_html
from tramprof.export.formats.pprof import ProfileMessage, encode_pprof
from tramprof.export.formats.speedscope import SCHEMA_URL, encode_speedscope
from tramprof.model import TRUNCATED, Profile, Stack

START_NS = 1_700_000_000_123_456_789
CHAIN = ("_start", "__libc_start_main", "main", "chain_a", "chain_b", "chain_c")
SYSCALL = ("_start", "main", "read", "entry_SYSCALL_64", "do_syscall_64", "ksys_read")
EVIL = "<img src=x onerror=alert(1)>"
SCRIPT_END = "</script><script>alert(2)</script><!--"

CACHE = Path(os.environ.get("TRAMPROF_TEST_CACHE", "/var/cache/tramprof-test"))
SPEEDSCOPE = ("speedscope", "1.25.0")
PPROF_FORMAT = ("pprof-format", "2.3.2")


def sample_profile() -> Profile:
    stacks = (
        Stack(pid=100, process="chain", comm="chain", frames=CHAIN, count=600),
        Stack(pid=100, process="chain", comm="chain", frames=CHAIN[:5], count=200),
        Stack(pid=100, process="chain", comm="worker", frames=SYSCALL, count=150),
        Stack(pid=200, process="python3", comm="python3",
              frames=(TRUNCATED, "_PyEval_EvalFrameDefault", "main"), count=40),
        Stack(pid=300, process="evil", comm="ev;il\n", frames=(EVIL, SCRIPT_END, ""), count=7),
        Stack(pid=301, process="kworker/0:1", comm="kworker/0:1",
              frames=("ret_from_fork", "kthread", "worker_thread"), count=3),
        Stack(pid=400, process="empty", comm="empty", frames=(), count=1),
    )
    return Profile(stacks, START_NS, 10_000_000_000, 99)


# --- pprof -----------------------------------------------------------------------------------

def decode_pprof(data: bytes):
    message = ProfileMessage()
    message.ParseFromString(gzip.decompress(data))
    return message


def test_pprof_is_gzipped_with_header_fields():
    profile = sample_profile()
    data = encode_pprof(profile)
    assert data[:2] == b"\x1f\x8b"
    p = decode_pprof(data)
    s = list(p.string_table)
    assert s[0] == ""
    assert len(s) == len(set(s)), "string table has duplicates"
    assert [(s[t.type], s[t.unit]) for t in p.sample_type] == [
        ("samples", "count"), ("cpu", "nanoseconds")]
    assert (s[p.period_type.type], s[p.period_type.unit]) == ("cpu", "nanoseconds")
    assert p.period == profile.period_ns == 10_101_010
    assert p.time_nanos == START_NS
    assert p.duration_nanos == 10_000_000_000
    assert s[p.default_sample_type] == "cpu"


def test_pprof_samples_totals_order_and_labels():
    profile = sample_profile()
    p = decode_pprof(encode_pprof(profile))
    s = list(p.string_table)
    functions = {f.id: s[f.name] for f in p.function}
    locations = {loc.id: loc for loc in p.location}
    assert len(functions) == len(p.function) and len(locations) == len(p.location)
    assert 0 not in functions and 0 not in locations
    distinct = {f for stack in profile.stacks for f in stack.frames}
    assert len(p.location) == len(p.function) == len(distinct)

    assert sum(x.value[0] for x in p.sample) == profile.total_samples == 1001
    decoded = []
    for x in p.sample:
        assert len(x.value) == 2 and x.value[1] == x.value[0] * profile.period_ns
        names = []
        for location_id in x.location_id:
            loc = locations[location_id]
            assert loc.address == 0 and len(loc.line) == 1
            names.append(functions[loc.line[0].function_id])
        labels = {s[label.key]: (s[label.str] if label.str else label.num) for label in x.label}
        decoded.append((labels["pid"], labels["process"], labels["comm"], tuple(names),
                        x.value[0]))
    # Leaf first: the first location of the chain sample is chain_c.
    assert decoded[0] == (100, "chain", "chain", tuple(reversed(CHAIN)), 600)
    assert decoded[2] == (100, "chain", "worker", tuple(reversed(SYSCALL)), 150)
    assert decoded[3][3][-1] == TRUNCATED  # markers are kept, at the root end
    assert decoded[4][2] == "ev;il\n"
    assert decoded[4][3] == ("[empty]", SCRIPT_END, EVIL)
    assert decoded[6] == (400, "empty", "empty", (), 1)


def test_pprof_survives_names_that_are_not_utf8():
    lone = "sym_\udcff"  # what surrogateescape decoding of a bad byte leaves behind
    profile = Profile((Stack(1, "p\udc80", "t", ("main", lone), 2),), START_NS, 10**9, 100)
    p = decode_pprof(encode_pprof(profile))
    names = {p.string_table[f.name] for f in p.function}
    assert names == {"main", "sym_\\udcff"}


def test_pprof_empty_profile():
    p = decode_pprof(encode_pprof(Profile((), 0, 0, 99)))
    assert len(p.sample) == 0 and p.string_table[0] == ""


def npm_package(name: str, version: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The unpacked npm package, fetched once with ``npm pack`` into the test cache."""
    if shutil.which("npm") is None:
        pytest.skip(f"npm is not installed: cannot fetch the {name} package")
    try:
        CACHE.mkdir(parents=True, exist_ok=True)
        base = CACHE / name / version
        base.mkdir(parents=True, exist_ok=True)
    except OSError:
        base = tmp_path_factory.mktemp(name)
    package = base / "package"
    if package.is_dir():
        return package
    try:
        out = subprocess.run(["npm", "pack", f"{name}@{version}", "--silent"], cwd=base,
                             capture_output=True, text=True, timeout=120, check=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"npm pack {name}@{version} failed (no registry?): {e}")
    tarball = base / out.stdout.strip().splitlines()[-1]
    staging = base / f"staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(tarball) as tar:  # regular files only, nothing outside staging
        for member in tar.getmembers():
            parts = Path(member.name).parts
            source = tar.extractfile(member) if member.isfile() else None
            if source is None or member.name.startswith("/") or ".." in parts:
                continue
            target = staging.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read())
    (staging / "package").rename(package)
    shutil.rmtree(staging)
    tarball.unlink()
    return package


@pytest.fixture(scope="session")
def pprof_format(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("node") is None:
        pytest.skip("node is not installed: no independent pprof decoder")
    return npm_package(*PPROF_FORMAT, tmp_path_factory) / "dist" / "commonjs" / "index.js"


DECODE_JS = r"""
const fs = require("fs"), zlib = require("zlib");
const { Profile } = require(process.argv[2]);
const p = Profile.decode(zlib.gunzipSync(fs.readFileSync(process.argv[3])));
const s = p.stringTable.strings;
const num = (x) => Number(x);
const fn = new Map(p.function.map((f) => [num(f.id), s[num(f.name)]]));
const loc = new Map(p.location.map((l) => [num(l.id), fn.get(num(l.line[0].functionId))]));
console.log(JSON.stringify({
  sampleType: p.sampleType.map((t) => [s[num(t.type)], s[num(t.unit)]]),
  periodType: [s[num(p.periodType.type)], s[num(p.periodType.unit)]],
  period: String(p.period), timeNanos: String(p.timeNanos),
  durationNanos: String(p.durationNanos), defaultSampleType: s[num(p.defaultSampleType)],
  samples: p.sample.map((x) => ({
    frames: x.locationId.map((id) => loc.get(num(id))),
    values: x.value.map(String),
    labels: Object.fromEntries(x.label.map((l) =>
      [s[num(l.key)], num(l.str) ? s[num(l.str)] : num(l.num)])),
  })),
}));
"""


def test_pprof_decoded_by_independent_decoder(pprof_format: Path, tmp_path: Path):
    """Datadog's pure-JS pprof-format decoder (written against profile.proto, not
    sharing our descriptor) reads the same profile back."""
    profile = sample_profile()
    path = tmp_path / "cpu.pb.gz"
    path.write_bytes(encode_pprof(profile))
    script = tmp_path / "decode.cjs"
    script.write_text(DECODE_JS)
    out = subprocess.run(["node", str(script), str(pprof_format), str(path)],
                         capture_output=True, text=True, timeout=30, check=True)
    got = json.loads(out.stdout)
    assert got["sampleType"] == [["samples", "count"], ["cpu", "nanoseconds"]]
    assert got["periodType"] == ["cpu", "nanoseconds"]
    assert got["period"] == str(profile.period_ns)
    assert got["timeNanos"] == str(START_NS)
    assert got["durationNanos"] == "10000000000"
    assert got["defaultSampleType"] == "cpu"
    expected = [{"frames": [f or "[empty]" for f in reversed(st.frames)],
                 "values": [str(st.count), str(st.count * profile.period_ns)],
                 "labels": {"pid": st.pid, "comm": st.comm, "process": st.process}}
                for st in profile.stacks]
    assert got["samples"] == expected


# --- speedscope ------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def speedscope_schema(tmp_path_factory: pytest.TempPathFactory) -> dict:
    package = npm_package(*SPEEDSCOPE, tmp_path_factory)
    return json.loads((package / "dist" / "release" / "file-format-schema.json").read_text())


def test_speedscope_matches_official_schema(speedscope_schema: dict):
    import jsonschema

    document = json.loads(encode_speedscope(sample_profile(), "host-a last 10s"))
    validator = jsonschema.Draft7Validator(speedscope_schema)
    errors = [e.message for e in validator.iter_errors(document)]
    assert errors == []
    # The schema is strict enough to catch a wrong unit or a missing field.
    broken = json.loads(json.dumps(document))
    broken["profiles"][0]["unit"] = "samples"
    del broken["profiles"][1]["weights"]
    assert len(list(validator.iter_errors(broken))) >= 2


def test_speedscope_content():
    profile = sample_profile()
    document = json.loads(encode_speedscope(profile, "host-a"))
    assert document["$schema"] == SCHEMA_URL
    assert document["name"] == "host-a (99 Hz)"
    frames = [f["name"] for f in document["shared"]["frames"]]
    names = [p["name"] for p in document["profiles"]]
    # One profile per process, most samples first.
    assert names == ["chain (pid 100)", "python3 (pid 200)", "evil (pid 300)",
                     "kworker/0:1 (pid 301)", "empty (pid 400)"]
    expected: dict[str, Counter[tuple[str, ...]]] = {}
    for stack in profile.stacks:
        key = f"{stack.process} (pid {stack.pid})"
        frames_of = (stack.comm, *(f or "[empty]" for f in stack.frames))
        expected.setdefault(key, Counter())[frames_of] += stack.count
    for p in document["profiles"]:
        assert p["type"] == "sampled" and p["unit"] == "none"
        assert len(p["samples"]) == len(p["weights"])
        assert p["startValue"] == 0 and p["endValue"] == sum(p["weights"])
        got: Counter[tuple[str, ...]] = Counter()
        for sample, weight in zip(p["samples"], p["weights"], strict=True):
            got[tuple(frames[i] for i in sample)] += weight
        assert got == expected[p["name"]]
    assert sum(p["endValue"] for p in document["profiles"]) == profile.total_samples
    # The thread "main" would be a frame of its own, apart from function main.
    threads = Profile((Stack(1, "main", "main", ("main",), 1),), 0, 1, 99)
    assert len(json.loads(encode_speedscope(threads, "x"))["shared"]["frames"]) == 2


# --- flame graph page ------------------------------------------------------------------------

DATA_RE = re.compile(rb'<script type="application/json" id="flame-data">(.*?)</script>', re.S)


def page_data(page: bytes) -> dict:
    match = DATA_RE.search(page)
    assert match is not None
    raw = match.group(1)
    assert b"<" not in raw and b">" not in raw and b"&" not in raw
    return json.loads(raw)


def walk(node: dict, path: tuple[str, ...] = ()):
    """(path, node) for every node, iteratively (trees can be deep)."""
    work = [((*path, node["name"]), node)]
    while work:
        p, n = work.pop()
        yield p, n
        for child in n.get("children", []):
            work.append(((*p, child["name"]), child))


def test_flamegraph_tree_matches_profile():
    profile = sample_profile()
    tree = page_data(render_flamegraph_html(profile, "t"))["tree"]
    nodes = dict(walk(tree))
    assert tree["name"] == "all" and tree["value"] == profile.total_samples
    assert nodes[("all", "chain", *CHAIN)]["value"] == 600
    assert nodes[("all", "chain", *CHAIN[:5])]["value"] == 800
    assert nodes[("all", "chain", "_start")]["value"] == 950
    assert "children" not in nodes[("all", "chain", *CHAIN)]
    assert nodes[("all", "evil", EVIL, SCRIPT_END, "[empty]")]["value"] == 7
    assert nodes[("all", "empty")]["value"] == 1
    for _path, node in nodes.items():
        assert node["value"] >= sum(c["value"] for c in node.get("children", []))


def test_flamegraph_prunes_narrow_frames_into_other():
    stacks = [Stack(1, "big", "big", ("main", "hot"), 100_000)]
    stacks += [Stack(2, "small", "small", ("main", f"cold_{i}"), 1) for i in range(10_000)]
    stacks += [Stack(3, "tiny", "tiny", ("x",), 1)]
    profile = Profile(tuple(stacks), START_NS, 10**9, 99)
    page = render_flamegraph_html(profile, "t")
    tree = page_data(page)["tree"]
    threshold = tree["value"] * MIN_FRACTION
    nodes = dict(walk(tree))
    assert nodes[("all", "small", "main")]["value"] == 10_000
    assert [c["name"] for c in nodes[("all", "small", "main")]["children"]] == ["[other]"]
    assert nodes[("all", "small", "main", "[other]")]["value"] == 10_000
    assert nodes[("all", "[other]")]["value"] == 1  # the tiny process
    for path, node in nodes.items():
        assert path[-1] == "[other]" or node["value"] >= threshold
        children = node.get("children", [])
        assert sum(c["value"] for c in children) <= node["value"]
    assert len(page) < 20_000


def test_flamegraph_escapes_hostile_names():
    profile = sample_profile()
    title = "</title><script>alert(3)</script>"
    odd = Stack(5, "p\u2028q", "x", ("a\u2029b", "&amp;", "</SCRIPT>", "\udcff"), 1)
    hostile = Profile((*profile.stacks, odd), START_NS, 1, 99)
    page = render_flamegraph_html(hostile, title)
    text = page.decode("utf-8")
    # Exactly the two script elements of the page end; nothing from the data does.
    assert text.lower().count("</script") == 2
    assert "<img" not in text and "<!--" not in text
    assert "\u2028" not in text and "\u2029" not in text
    assert "<title>&lt;/title&gt;&lt;script&gt;alert(3)&lt;/script&gt;</title>" in text
    data = page_data(page)
    assert data["title"] == title
    names = {path[-1] for path, _ in walk(data["tree"])}
    assert {EVIL, SCRIPT_END, "p\u2028q", "a\u2029b", "&amp;", "</SCRIPT>"} <= names


def test_flamegraph_csp_allows_exactly_the_inline_code():
    text = render_flamegraph_html(sample_profile(), "t").decode()
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', text)
    assert csp is not None
    policy = csp.group(1)
    assert "default-src 'none'" in policy and "unsafe-inline" not in policy
    script = re.search(r"<script>(.*?)</script>", text, re.S)
    style = re.search(r"<style>(.*?)</style>", text, re.S)
    assert script is not None and style is not None
    for body in (script.group(1), style.group(1)):
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in policy
    assert "http://" not in text and "https://" not in text  # nothing to fetch


def test_flamegraph_summary_shows_samples_and_time_range():
    text = render_flamegraph_html(sample_profile(), "host-a").decode()
    assert "1,001 samples \u00b7 2023-11-14 22:13:20 \u2013 22:13:30 UTC (10.0 s)" in text
    empty = render_flamegraph_html(Profile((), 0, 0, 99), "none").decode()
    assert "0 samples" in empty and '"value":0' in empty


def test_flamegraph_deep_and_large_profiles():
    deep = Profile((Stack(1, "r", "r", tuple(f"f{i}" for i in range(2000)), 3),), 0, 1, 99)
    page = render_flamegraph_html(deep, "deep")  # no recursion in the writer
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)  # Python's own JSON decoder recurses
    try:
        tree = page_data(page)["tree"]
    finally:
        sys.setrecursionlimit(limit)
    assert max(len(path) for path, _ in walk(tree)) == 2002  # all, process, 2000 frames

    stacks = tuple(Stack(i % 50, f"proc{i % 50}", "t",
                         tuple(f"mod{i % 7}::fn{(i * 31 + d) % 997}" for d in range(30)),
                         1 + i % 5)
                   for i in range(10_000))
    profile = Profile(stacks, START_NS, 10**10, 99)
    page = render_flamegraph_html(profile, "large")  # timed in benchmarks/bench_export.py
    assert len(page) < 1_000_000
    assert page_data(page)["tree"]["value"] == profile.total_samples
