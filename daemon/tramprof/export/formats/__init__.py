"""Every profile output format, by name: used by ``/profile`` and ``record``."""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from tramprof.export.formats.flamegraph import render_flamegraph_html
from tramprof.export.formats.folded import write_folded
from tramprof.export.formats.pprof import encode_pprof
from tramprof.export.formats.speedscope import encode_speedscope
from tramprof.model import Profile


@dataclass(frozen=True)
class Format:
    encode: Callable[[Profile], bytes]
    content_type: str
    filename: str = ""  # set: served as a download


def encode_folded(profile: Profile) -> bytes:
    stacks: Counter[tuple[str, ...]] = Counter()
    for stack in profile.stacks:
        stacks[stack.folded_key()] += stack.count
    out = io.StringIO()
    write_folded(stacks, out)
    return out.getvalue().encode()


def _flamegraph(profile: Profile) -> bytes:
    return render_flamegraph_html(profile, "tramprof CPU profile")


FORMATS: dict[str, Format] = {
    "folded": Format(encode_folded, "text/plain; charset=utf-8"),
    "pprof": Format(encode_pprof, "application/octet-stream", "profile.pb.gz"),
    "speedscope": Format(lambda p: encode_speedscope(p, "tramprof"), "application/json",
                         "profile.speedscope.json"),
    "flamegraph": Format(_flamegraph, "text/html; charset=utf-8"),
}


class IndexPage:
    """The page at ``/``: a flame graph of the last window (links to the
    other endpoints are in the page's header)."""

    @staticmethod
    def render(profile: Profile) -> bytes:
        return render_flamegraph_html(profile, "tramprof: last window")
