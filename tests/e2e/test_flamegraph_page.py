"""The flame-graph page in a real headless Chromium: what it draws (DOM dump,
screenshot pixels) and how it reacts to the mouse and the search box (driven
over the DevTools protocol on a pipe, so no extra packages are needed)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import shutil
import struct
import subprocess
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tramprof.export.formats.flamegraph import render_flamegraph_html
from tramprof.model import TRUNCATED, Profile, Stack

EVIL = "<img src=x onerror=alert(1)>"
SCRIPT_END = "</script><script>alert(2)</script>"
CHAIN = ("_start", "__libc_start_main", "main", "chain_a", "chain_b", "chain_c")
WIDTH, HEIGHT = 1200, 800
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", f"--window-size={WIDTH},{HEIGHT}"]


def browser_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium: install the Debian package 'chromium' for the flame graph tests")


def flame_profile() -> Profile:
    stacks = [
        Stack(100, "chain", "chain", CHAIN, 600),
        Stack(100, "chain", "chain", CHAIN[:5], 200),
        Stack(100, "chain", "worker", ("_start", "main", "read", "entry_SYSCALL_64",
                                       "do_syscall_64", "ksys_read", "vfs_read"), 150),
        Stack(200, "python3", "python3", (TRUNCATED, "_PyEval_EvalFrameDefault"), 650),
        Stack(300, "evil", "evil", (EVIL, SCRIPT_END), 400),
    ]
    # 8000 narrow stacks (10,000 samples in all): they must end up in [other],
    # not in the DOM.
    stacks += [Stack(400 + i % 7, "noise", "noise", ("_start", f"fn_{i % 40}", f"leaf_{i}"), 1)
               for i in range(8000)]
    return Profile(tuple(stacks), 1_700_000_000_000_000_000, 10_000_000_000, 99)


@pytest.fixture(scope="module")
def page_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("flame") / "flame.html"
    path.write_bytes(render_flamegraph_html(flame_profile(), "host-a: last 10 s"))
    return path.as_uri()


def run_browser(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([browser_binary(), *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                           *args], capture_output=True, text=True, timeout=30, check=True)


def test_dom_after_scripts_ran(page_url: str, tmp_path: Path):
    dom = run_browser(tmp_path, "--dump-dom", page_url).stdout
    assert 'data-ready="1"' in dom, "the page script did not run to the end"
    for name in ("all", "chain", "main", "chain_a", "chain_b", "chain_c", "noise",
                 "[truncated]"):
        assert f">{name}<" in dom, f"frame {name} not drawn"
    # Hostile names are text, never markup.
    assert ">&lt;img src=x onerror=alert(1)&gt;<" in dom
    assert ">&lt;/script&gt;&lt;script&gt;alert(2)&lt;/script&gt;<" in dom
    assert "<img" not in dom
    assert dom.count("<script") == 2
    # Narrow frames are folded away: far fewer divs than stacks.
    assert "leaf_" not in dom
    assert dom.count('class="frame') < 400
    assert "10,000 samples" in dom and "2023-11-14 22:13:20 \u2013 22:13:30 UTC" in dom


def test_empty_profile_page(tmp_path: Path):
    path = tmp_path / "empty.html"
    path.write_bytes(render_flamegraph_html(Profile((), 0, 0, 99), "idle host"))
    dom = run_browser(tmp_path, "--dump-dom", path.as_uri()).stdout
    assert 'data-ready="1"' in dom
    assert '<p id="empty">No samples in this time range.</p>' in dom
    assert 'class="frame' not in dom


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """RGB rows of an 8-bit, non-interlaced PNG (what Chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, bpp = 8, [], 0, 0, 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        assert zlib.crc32(kind + body) == struct.unpack(">I", data[pos + 8 + length:][:4])[0]
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and colour in (2, 6) and interlace == 0
            bpp = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    raw = zlib.decompress(b"".join(idat))
    stride = width * bpp
    assert len(raw) == height * (stride + 1)
    rows, prev = [], bytearray(stride)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + ((a + b) >> 1)) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(b for i, b in enumerate(line) if bpp == 3 or i % 4 != 3))
        prev = line
    return width, height, rows


def test_screenshot_shows_a_flame_graph(page_url: str, tmp_path: Path):
    png = tmp_path / "flame.png"
    run_browser(tmp_path, f"--screenshot={png}", page_url)
    if os.environ.get("TRAMPROF_KEEP_SCREENSHOT"):
        shutil.copy(png, os.environ["TRAMPROF_KEEP_SCREENSHOT"])
    width, height, rows = decode_png(png.read_bytes())
    assert (width, height) == (WIDTH, HEIGHT)

    def pixels(y: int) -> list[tuple[int, int, int]]:
        row = rows[y]
        return [(row[i], row[i + 1], row[i + 2]) for i in range(0, len(row), 3)]

    warm = [sum(1 for r, g, b in pixels(y) if r >= 200 and b <= 60 and r - b > 150)
            for y in range(0, HEIGHT, 4)]
    # Frames in the flame palette fill most of some rows, and the page below the
    # deepest stack (9 levels of 18 px under a ~100 px header) is blank.
    assert max(warm) > WIDTH * 0.6
    assert all(set(pixels(y)) == {(255, 255, 255)} for y in range(HEIGHT - 200, HEIGHT, 10))


def high_fd(fd: int) -> int:
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


class DevTools:
    """A minimal Chrome DevTools Protocol client over --remote-debugging-pipe."""

    def __init__(self, binary: str, user_data_dir: Path) -> None:
        # High descriptor numbers, so the redirections to 3 and 4 below
        # cannot overwrite one of them before it is copied.
        to_chrome_r, self._to_chrome, self._from_chrome, from_chrome_w = (
            high_fd(fd) for pipe in (os.pipe(), os.pipe()) for fd in pipe)
        # Chromium reads commands on fd 3 and writes replies on fd 4.
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec 3<&{to_chrome_r} 4>&{from_chrome_w} "$0" "$@"', binary, *FLAGS,
             "--remote-debugging-pipe", f"--user-data-dir={user_data_dir}", "about:blank"],
            pass_fds=(to_chrome_r, from_chrome_w), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        self.session = ""

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_chrome], [], [], left)[0]:
                raise TimeoutError("no reply from Chromium")
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise EOFError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def call(self, method: str, timeout: float = 10, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        command: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if self.session and not method.startswith(("Target.", "Browser.")):
            command["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(command).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            message = self._read_message(deadline)
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_event(self, method: str, timeout: float = 10) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events:
                if event.get("method") == method:
                    self.events.remove(event)
                    return event
            self.events.append(self._read_message(deadline))

    def js(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        self.call("Page.enable")
        # Record alert() calls: the page's own CSP cannot block this injected script.
        self.call("Page.addScriptToEvaluateOnNewDocument",
                  source="window.__alerts = []; window.alert = (m) => __alerts.push(m);")
        self.call("Page.navigate", url=url)
        self.wait_event("Page.loadEventFired")

    def mouse(self, kind: str, x: float, y: float) -> None:
        params: dict[str, Any] = {"type": kind, "x": x, "y": y}
        if kind != "mouseMoved":
            params.update(button="left", clickCount=1)
        self.call("Input.dispatchMouseEvent", **params)

    def click(self, x: float, y: float) -> None:
        self.mouse("mouseMoved", x, y)
        self.mouse("mousePressed", x, y)
        self.mouse("mouseReleased", x, y)

    def close(self) -> None:
        with contextlib.suppress(OSError, TimeoutError, EOFError, RuntimeError):
            self.call("Browser.close", timeout=5)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)


@pytest.fixture
def devtools(page_url: str, tmp_path: Path) -> Iterator[DevTools]:
    client = DevTools(browser_binary(), tmp_path / "profile")
    try:
        client.open(page_url)
        yield client
    finally:
        client.close()


FRAME_BOX = """(() => {
  const el = [...document.querySelectorAll("#flame .frame")].find(e => e.textContent === %s);
  if (!el) return null;
  const r = el.getBoundingClientRect();
  return {x: r.left + r.width / 2, y: r.top + r.height / 2, width: r.width,
          classes: el.className};
})()"""


def frame_box(client: DevTools, name: str) -> dict[str, Any] | None:
    return client.js(FRAME_BOX % json.dumps(name))


def test_hover_shows_tooltip(devtools: DevTools):
    assert devtools.js("document.getElementById('tip').hidden") is True
    box = frame_box(devtools, "chain_c")
    assert box is not None
    devtools.mouse("mouseMoved", box["x"], box["y"])
    tip = devtools.js("document.getElementById('tip').innerText")
    assert devtools.js("document.getElementById('tip').hidden") is False
    assert tip.splitlines() == ["chain_c", "600 samples, 6.06 s CPU", "6.0% of all samples"]
    evil = frame_box(devtools, EVIL)
    assert evil is not None
    devtools.mouse("mouseMoved", evil["x"], evil["y"])
    assert devtools.js("document.getElementById('tip').innerText").splitlines()[0] == EVIL
    assert devtools.js("document.querySelectorAll('img').length") == 0
    assert devtools.js("window.__alerts") == []


def test_click_zooms_and_reset_restores(devtools: DevTools):
    full = devtools.js("document.getElementById('flame').clientWidth")
    before = frame_box(devtools, "chain_b")
    assert before is not None and before["width"] < full / 5
    devtools.click(before["x"], before["y"])
    assert devtools.js("document.getElementById('flame').dataset.zoom") == "chain_b"
    after = frame_box(devtools, "chain_b")
    child = frame_box(devtools, "chain_c")
    assert after is not None and child is not None
    assert abs(after["width"] - full) < 2
    assert abs(child["width"] - full * 600 / 800) < 2  # children keep their proportions
    assert "ancestor" in frame_box(devtools, "main")["classes"]  # type: ignore[index]
    assert frame_box(devtools, "noise") is None  # other branches are gone
    assert "Zoomed into chain_b" in devtools.js("document.getElementById('zoom-status').innerText")

    reset = devtools.js("(() => { const r = document.getElementById('reset')"
                        ".getBoundingClientRect(); return [r.left + 5, r.top + 5]; })()")
    devtools.click(*reset)
    assert devtools.js("document.getElementById('flame').dataset.zoom") == "all"
    restored = frame_box(devtools, "chain_b")
    assert restored is not None and abs(restored["width"] - before["width"]) < 1


def test_search_highlights_matches(devtools: DevTools):
    devtools.js("document.getElementById('search').focus()")
    devtools.call("Input.insertText", text="CHAIN_")
    highlighted = devtools.js(
        "[...document.querySelectorAll('#flame .frame.match')].map(e => e.textContent)")
    assert sorted(highlighted) == ["chain_a", "chain_b", "chain_c"]
    colour = devtools.js("getComputedStyle(document.querySelector('.frame.match'))"
                         ".backgroundColor")
    assert colour == "rgb(230, 0, 230)"
    # chain_a holds chain_b and chain_c: 800 of 10,000 samples, counted once.
    assert devtools.js("document.getElementById('matched').innerText") == \
        "Matched: 8.0% (800 samples)"
    devtools.call("Input.dispatchKeyEvent", type="keyDown", key="Escape", code="Escape",
                  windowsVirtualKeyCode=27)
    assert devtools.js("document.getElementById('search').value") == ""
    assert devtools.js("document.querySelectorAll('.frame.match').length") == 0
