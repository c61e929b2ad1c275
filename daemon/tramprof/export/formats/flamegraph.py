"""Profiles as one self-contained, interactive flame-graph HTML page.

The page works offline and from ``file://``: CSS and JS (``assets/``) are
inlined and the profile is embedded as a JSON tree (``name``, ``value``,
``children``), root ``all``, then the process name, then the frames root
first. The tree is merged here and children narrower than
``MIN_FRACTION`` of all samples are summed into one ``[other]`` child per
parent, so pages of profiles with tens of thousands of stacks stay small and
draw quickly.

Frame names are attacker-influenced (perf maps, JIT dumps, comm): the JSON is
embedded with ``<``, ``>``, ``&``, U+2028 and U+2029 escaped so nothing in it can
end the script element, the JS only sets names as ``textContent``, and a
Content-Security-Policy allows only the page's own inline script and style
(by hash), so even markup that got through could neither run nor load anything.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
from datetime import UTC, datetime
from functools import cache
from importlib import resources

from tramprof.model import Profile

#: Children below this share of all samples are merged into ``[other]``.
MIN_FRACTION = 0.0005
OTHER = "[other]"
ROOT = "all"

_JSON_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026",
                               "\u2028": "\\u2028", "\u2029": "\\u2029"})


class _Node:
    __slots__ = ("children", "name", "value")

    def __init__(self, name: str) -> None:
        self.name = name
        self.value = 0
        self.children: dict[str, _Node] = {}


def _merge(profile: Profile) -> _Node:
    root = _Node(ROOT)
    for stack in profile.stacks:
        root.value += stack.count
        node = root
        for name in (stack.process or "[unknown]", *stack.frames):
            child = node.children.get(name)
            if child is None:
                child = node.children[name] = _Node(name or "[empty]")
            child.value += stack.count
            node = child
    return root


def _shown_children(node: _Node, min_value: float) -> list[_Node]:
    """Children sorted by name (so layouts are stable), small ones as ``[other]``."""
    shown: list[_Node] = []
    other = 0
    for name in sorted(node.children):
        child = node.children[name]
        if child.value < min_value or name == OTHER:
            other += child.value
        else:
            shown.append(child)
    if other:
        rest = _Node(OTHER)
        rest.value = other
        shown.append(rest)
    return shown


def _tree_json(root: _Node, min_fraction: float) -> str:
    """The pruned tree as JSON, written iteratively: stacks can be very deep."""
    min_value = root.value * min_fraction
    out: list[str] = []
    levels: list[list[_Node]] = [[root]]  # children still to write, reversed
    while levels:
        if not levels[-1]:
            levels.pop()
            if levels:
                out.append("]}")
            continue
        node = levels[-1].pop()
        if out and out[-1] != ',"children":[':
            out.append(",")
        out.append(f'{{"name":{json.dumps(node.name)},"value":{node.value}')
        children = _shown_children(node, min_value)
        if children:
            out.append(',"children":[')
            levels.append(children[::-1])
        else:
            out.append("}")
    return "".join(out)


@cache
def _asset(name: str) -> str:
    text = resources.files("tramprof.export.formats").joinpath("assets", name).read_text("utf-8")
    if "</" in text or "<!--" in text:  # would end or confuse the inline element
        raise ValueError(f"asset {name} cannot be inlined: contains '</' or '<!--'")
    return text


def _csp_hash(text: str) -> str:
    digest = base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")
    return f"'sha256-{digest}'"


def _utc(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _summary(profile: Profile, total: int) -> str:
    if total == 0:
        return "0 samples"
    start, end = _utc(profile.start_ns), _utc(profile.start_ns + profile.duration_ns)
    if start[:10] == end[:10]:
        end = end[11:]
    return (f"{total:,} samples \u00b7 {start} \u2013 {end} UTC "
            f"({profile.duration_ns / 1e9:.1f} s) \u00b7 {profile.frequency_hz} Hz")


def render_flamegraph_html(profile: Profile, title: str) -> bytes:
    """The whole page, UTF-8 encoded."""
    root = _merge(profile)
    meta = json.dumps({"title": title, "period_ns": profile.period_ns,
                       "start_ns": profile.start_ns, "duration_ns": profile.duration_ns,
                       "frequency_hz": profile.frequency_hz})
    data = f'{meta[:-1]},"tree":{_tree_json(root, MIN_FRACTION)}}}'.translate(_JSON_ESCAPES)
    css, js = _asset("flamegraph.css"), _asset("flamegraph.js")
    csp = (f"default-src 'none'; script-src {_csp_hash(js)}; style-src {_csp_hash(css)}; "
           "img-src data:; base-uri 'none'; form-action 'none'")
    heading = html.escape(title)
    page = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{heading}</title>
<style>{css}</style>
</head>
<body>
<header>
<h1 id="title">{heading}</h1>
<p id="summary">{html.escape(_summary(profile, root.value))}</p>
<div class="controls">
<input id="search" type="search" placeholder="Search frames (substring)" autocomplete="off"
 aria-label="Search frames">
<button id="reset" type="button">Reset zoom</button>
<span id="matched"></span>
<span id="zoom-status"></span>
<span class="legend">Root at top, callees below; width = samples; click to zoom, Esc to reset.
<span class="swatch process"></span>process<span class="swatch code"></span>code
<span class="swatch marker"></span>[marker]</span>
</div>
</header>
<p id="empty" hidden>No samples in this time range.</p>
<div id="flame"></div>
<div id="tip" hidden></div>
<script type="application/json" id="flame-data">{data}</script>
<script>{js}</script>
</body>
</html>
"""
    return page.encode("utf-8", "backslashreplace")
