"""Build the prebuilt runtimes the daemon injects into CPython 3.9-3.11 (the
versions without perf trampolines of their own), one shared object per minor
version, into the daemon's package data:

    python3 trampolines/build_runtimes.py --root /path/to/debian11-root

--root: a Debian 11 (glibc 2.31) root with gcc, libc6-dev and python3.9-dev,
the oldest glibc supported: objects linked there load in containers with any
newer glibc. 3.9 is built with the root's own headers; every other version
without perf trampolines whose headers the build machine has
(/usr/include/python3.X) is built in the same root with those headers (they
do not depend on glibc). Each result is checked: it must need no glibc symbol
version newer than the root's. A MANIFEST.json records the sources' digest,
so a rerun with unchanged sources builds nothing.

Runs as root (chroot), on the build machine's python3 (stdlib only).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "src"
SOURCE_FILES = ("tramprof.c", "tramprof.h", "inject_module.c", "build_injectable.py")
DEFAULT_OUTPUT = HERE.parent / "daemon" / "tramprof" / "inject" / "runtimes"
#: Minor versions that need our runtime (3.12+ have sys.activate_stack_trampoline).
VERSIONS = ((3, 9), (3, 10), (3, 11))
ROOT_VERSION = (3, 9)
MANIFEST = "MANIFEST.json"
_GLIBC = re.compile(rb"GLIBC_(\d+)\.(\d+)")


def sources_digest() -> str:
    digest = hashlib.sha256()
    for name in SOURCE_FILES:
        digest.update(name.encode() + b"\0" + (SOURCES / name).read_bytes())
    return digest.hexdigest()[:16]


def file_name(version: tuple[int, int]) -> str:
    """Named as the daemon's RuntimeStore looks it up."""
    return f"_runtime-cp{version[0]}{version[1]}.so"


def host_headers(version: tuple[int, int], include: Path = Path("/usr/include")
                 ) -> list[Path] | None:
    """Debian's layout: Python.h in python3.X, pyconfig.h under the multiarch
    directory; None if this machine lacks that version's headers."""
    main = include / f"python{version[0]}.{version[1]}"
    multiarch = next(iter(sorted(include.glob(f"*-linux-gnu/python{version[0]}.{version[1]}"))),
                     None)
    if not (main / "Python.h").is_file() or multiarch is None:
        return None
    return [main, multiarch]


def glibc_version(root: Path) -> tuple[int, int]:
    """glibc of the root, from its libc's own version definitions."""
    libcs = sorted(root.glob("lib/x86_64-linux-gnu/libc.so.6")) or \
        sorted(root.glob("usr/lib/*-linux-gnu/libc.so.6"))
    if not libcs:
        raise SystemExit(f"{root}: no libc.so.6 found (not a Debian root?)")
    return max(_needed_glibc(libcs[0].read_bytes()))


def _needed_glibc(data: bytes) -> set[tuple[int, int]]:
    return {(int(a), int(b)) for a, b in _GLIBC.findall(data)}


def needed_glibc(path: Path) -> tuple[int, int]:
    """Newest glibc symbol version ``path`` refers to (its version strings)."""
    versions = _needed_glibc(path.read_bytes())
    return max(versions) if versions else (0, 0)


def build(root: Path, output: Path, *, force: bool = False) -> dict[str, object]:
    digest = sources_digest()
    manifest_path = output / MANIFEST
    if not force and manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("sources") == digest and all(
                (output / name).is_file() for name in manifest.get("runtimes", {})):
            return dict(manifest)
    glibc = glibc_version(root)
    root_include = root / "usr" / "include"
    if host_headers(ROOT_VERSION, root_include) is None:
        raise SystemExit(f"{root}: no python{ROOT_VERSION[0]}.{ROOT_VERSION[1]} headers "
                         "(install python3-dev, gcc and libc6-dev in it)")
    work = Path(tempfile.mkdtemp(prefix="tramprof-runtimes-", dir=root / "tmp"))
    inside = "/" + str(work.relative_to(root))
    built: dict[str, dict[str, object]] = {}
    try:
        shutil.copytree(SOURCES, work / "src", ignore=shutil.ignore_patterns("__pycache__"))
        commands = []
        for version in VERSIONS:
            if version == ROOT_VERSION:
                includes = [f"/usr/include/python{version[0]}.{version[1]}",
                            "/usr/include"]
                origin = "root"
            else:
                found = host_headers(version)
                if found is None:
                    print(f"python{version[0]}.{version[1]}: no headers on this machine, "
                          "not built", file=sys.stderr)
                    continue
                target = work / "include"
                for path in found:
                    shutil.copytree(path, target / path.relative_to("/usr/include"))
                includes = [f"{inside}/include/{found[0].name}", f"{inside}/include"]
                origin = "build machine"
            name = file_name(version)
            commands.append(f"python3 src/build_injectable.py {' '.join(includes)} -o {name}")
            built[name] = {"python": f"{version[0]}.{version[1]}", "headers": origin}
        proc = subprocess.run(
            ["chroot", str(root), "sh", "-ec", f"cd {inside}; " + "; ".join(commands)],
            capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"build failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        partial = output.with_name(output.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for name, info in built.items():
            needed = needed_glibc(work / name)
            if needed > glibc:
                raise SystemExit(f"{name} needs glibc {needed[0]}.{needed[1]}, newer than "
                                 f"the root's {glibc[0]}.{glibc[1]}")
            shutil.copyfile(work / name, partial / name)
            os.chmod(partial / name, 0o644)
            info["glibc"] = "%d.%d" % needed
            info["sha256"] = hashlib.sha256((work / name).read_bytes()).hexdigest()
        manifest = {"sources": digest, "root_glibc_newest_symbols": "%d.%d" % glibc,
                    "runtimes": built}
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        shutil.rmtree(output, ignore_errors=True)
        partial.rename(output)
        return manifest
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True,
                        help="Debian 11 root with gcc, libc6-dev, python3.9-dev")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT,
                        help=f"where the runtimes go (default {DEFAULT_OUTPUT})")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    manifest = build(args.root.resolve(), args.output, force=args.force)
    for name, info in sorted(manifest["runtimes"].items()):  # type: ignore[attr-defined]
        print(f"{args.output / name}: CPython {info['python']}, needs glibc {info['glibc']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
