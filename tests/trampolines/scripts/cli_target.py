"""Run through `python -m tramprof_trampolines`: reports how it was run."""

import json
import sys

import tramprof_trampolines as t

print(json.dumps({"argv": sys.argv, "name": __name__, "active": t.is_active(),
                  "path0": sys.path[0]}))
sys.exit(3)
