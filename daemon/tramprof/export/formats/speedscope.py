"""Profiles as speedscope JSON (https://www.speedscope.app/file-format-schema.json),
for the speedscope viewer's time-order, left-heavy and sandwich views.

One "sampled" profile per process, so a process can be looked at on its own;
all of them share one frame list. Each stack starts with the sampled thread's
name as its root frame (as folded output does), so threads stay apart within
a process. Weights are sample counts (unit "none"): with the sampling
frequency in the profile name a reader can turn them into CPU time.
"""

from __future__ import annotations

import json
from typing import Any

from tramprof import __version__
from tramprof.model import Profile, Stack

SCHEMA_URL = "https://www.speedscope.app/file-format-schema.json"


def _profile_name(pid: int, process: str) -> str:
    return f"{process or '[unknown]'} (pid {pid})"


def encode_speedscope(profile: Profile, name: str) -> bytes:
    """The profile as a speedscope file, processes with most samples first."""
    frame_index: dict[tuple[bool, str], int] = {}
    frames: list[dict[str, str]] = []

    def index(name: str, thread: bool = False) -> int:
        # Thread roots are frames of their own: speedscope tells frames apart by
        # index, so a thread called "main" does not merge with function main.
        found = frame_index.get((thread, name))
        if found is None:
            found = frame_index[(thread, name)] = len(frames)
            frames.append({"name": name or "[empty]"})
        return found

    by_process: dict[tuple[int, str], list[Stack]] = {}
    for stack in profile.stacks:
        by_process.setdefault((stack.pid, stack.process), []).append(stack)
    totals = {key: sum(s.count for s in stacks) for key, stacks in by_process.items()}

    profiles: list[dict[str, Any]] = []
    for key in sorted(by_process, key=lambda k: (-totals[k], k)):
        pid, process = key
        samples = [[index(stack.comm, thread=True), *(index(f) for f in stack.frames)]
                   for stack in by_process[key]]
        profiles.append({
            "type": "sampled",
            "name": _profile_name(pid, process),
            "unit": "none",
            "startValue": 0,
            "endValue": totals[key],
            "samples": samples,
            "weights": [stack.count for stack in by_process[key]],
        })
    document = {
        "$schema": SCHEMA_URL,
        "name": f"{name} ({profile.frequency_hz} Hz)",
        "exporter": f"tramprof {__version__}",
        "activeProfileIndex": 0,
        "profiles": profiles,
        "shared": {"frames": frames},
    }
    return json.dumps(document, separators=(",", ":")).encode("ascii")
