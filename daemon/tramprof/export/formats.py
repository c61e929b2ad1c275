"""Every profile output format, by name: used by ``/profile`` and ``record``."""

from __future__ import annotations

import html
import io
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from tramprof.folded import write_folded
from tramprof.profile import Profile


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


FORMATS: dict[str, Format] = {
    "folded": Format(encode_folded, "text/plain; charset=utf-8"),
}


class IndexPage:
    """The page at ``/``: what the daemon serves, and the last window's profile."""

    @staticmethod
    def render(profile: Profile) -> bytes:
        links = "".join(f'<li><a href="/profile?format={name}">/profile?format={name}</a></li>'
                        for name in FORMATS)
        return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>tramprof</title>"
                f"</head><body><h1>tramprof</h1><p>{profile.total_samples} samples in the "
                f"last window.</p><ul><li><a href=\"/metrics\">/metrics</a></li>{links}"
                f"<li><a href=\"/healthz\">/healthz</a></li></ul><pre>"
                f"{html.escape(encode_folded(profile).decode()[:20000])}</pre></body></html>"
                ).encode()
