"""What a process is, before anything is injected into it: which CPython,
where its interpreter lives in memory, and every reason to leave it alone.

Everything here is read from outside (``/proc``, the mapped ELF files, the
process's memory), and all of it is the target's to choose: files are opened
through ``safeopen``, ELF tables are size-capped, and the version is taken
from the interpreter's own data (``Py_Version``, the debug offsets) or from
which API functions it exports, never from a file name alone.
"""

from __future__ import annotations

import os
import re
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from tramprof.model import SymbolizationError
from tramprof.procfs.identity import read_start_ticks, read_stat, read_status_ids
from tramprof.procfs.maps import Mapping, read_maps
from tramprof.procfs.memory import MemoryReadError, read_memory
from tramprof.symbols.safeopen import Refusal, open_mapping, open_untrusted
from tramprof.unwind.descriptor import DescriptorError, is_runtime_extension, read_descriptor

# Refusal reasons, exported as the ``result`` label of tramprof_injections_total.
NOT_CPYTHON = "not_cpython"
UNSUPPORTED_VERSION = "unsupported_version"
REMOTE_DEBUG_DISABLED = "remote_debug_disabled"
PTRACE_DENIED = "ptrace_denied"
SELF = "self"
ALREADY_ACTIVE = "already_active"
GONE = "gone"

#: Oldest and newest minor versions injection knows how to handle.
OLDEST = (3, 9)
NEWEST = (3, 15)
#: From this version on, CPython's own remote-execution protocol is used.
PEP768_FROM = (3, 14)
#: From this version on, CPython has its own perf trampolines.
PERF_TRAMPOLINE_FROM = (3, 12)

# Caps on what is read from the target's files.
MAX_DYNSYM_BYTES = 16 << 20
MAX_SECTIONS = 4096
MAX_ENVIRON_BYTES = 1 << 20
MAX_PERF_MAP_PEEK = 64 << 10
MAX_FDS_CHECKED = 65536
_LIBPYTHON_RE = re.compile(r"/libpython3\.\d+[a-z]*\.so[.\d]*(?: \(deleted\))?$")
_PYTHON_EXE_RE = re.compile(r"/python[\d.]*[a-z]*(?: \(deleted\))?$")
# Exported functions that appeared in a given version (present from it on).
_VERSION_MARKERS = (((3, 10), "Py_NewRef"), ((3, 9), "PyType_GetModule"))
WANTED_SYMBOLS = ("Py_AddPendingCall", "PyRun_SimpleString", "Py_Version", "Py_NewRef",
                  "PyType_GetModule")


class Refused(Exception):
    """The process must not (or cannot) be injected; ``reason`` is a metric
    label value, the message says why in words."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Interpreter:
    """The ELF object (executable or libpython) that holds the interpreter."""

    path: str                     # as the process maps it
    bias: int                     # load bias: runtime address = bias + ELF address
    symbols: dict[str, int]       # WANTED_SYMBOLS found, as runtime addresses
    py_runtime: int | None        # address of the .PyRuntime section, if any


@dataclass(frozen=True)
class Target:
    pid: int
    nspid: int                    # the pid as the process sees itself
    euid: int
    egid: int
    start_ticks: int
    version: tuple[int, int]
    version_hex: int | None       # PY_VERSION_HEX when the process publishes it
    interpreter: Interpreter
    mappings: tuple[Mapping, ...] = field(repr=False)

    @property
    def root(self) -> str:
        return f"/proc/{self.pid}/root"

    @property
    def version_text(self) -> str:
        if self.version_hex is not None:
            micro = (self.version_hex >> 8) & 0xFF
            return f"{self.version[0]}.{self.version[1]}.{micro}"
        return f"{self.version[0]}.{self.version[1]}"


def _open_object(pid: int, mapping: Mapping, proc_root: str) -> BinaryIO:
    errors: list[str] = []
    opened = open_mapping(f"{proc_root}/{pid}", mapping, errors)
    if opened is None:
        raise OSError("cannot open the interpreter's ELF file: " + "; ".join(errors))
    return opened


def _elf_facts(f: BinaryIO) -> tuple[int, dict[str, int], int | None] | None:
    """(page address of the offset-0 PT_LOAD, wanted dynamic symbols, .PyRuntime
    address), all as ELF addresses; None when the file is no usable ELF."""
    try:
        elf = ELFFile(f)
        if elf["e_shnum"] > MAX_SECTIONS or elf["e_phnum"] > MAX_SECTIONS:
            return None
        base = None
        for segment in elf.iter_segments():
            if segment["p_type"] == "PT_LOAD" and segment["p_offset"] == 0:
                base = segment["p_vaddr"] & ~0xFFF
                break
        if base is None:
            return None
        symbols: dict[str, int] = {}
        dynsym = elf.get_section_by_name(".dynsym")
        if isinstance(dynsym, SymbolTableSection) and dynsym["sh_size"] <= MAX_DYNSYM_BYTES:
            for name in WANTED_SYMBOLS:
                found = dynsym.get_symbol_by_name(name)
                if found:
                    symbol = found[0]
                    if symbol["st_shndx"] != "SHN_UNDEF" and symbol["st_value"]:
                        symbols[name] = symbol["st_value"]
        runtime = elf.get_section_by_name(".PyRuntime")
        return base, symbols, (runtime["sh_addr"] if runtime is not None else None)
    except (ELFError, ValueError, KeyError, struct.error, OSError):
        return None


def find_interpreter(pid: int, mappings: Sequence[Mapping], proc_root: str = "/proc"
                     ) -> Interpreter | None:
    """The mapped executable or libpython that exports the interpreter's API
    (a shared libpython wins: it is where an executable linked to it finds it)."""
    by_path: dict[str, list[Mapping]] = {}
    for m in mappings:
        if m.is_file_backed and (_LIBPYTHON_RE.search(m.path) or _PYTHON_EXE_RE.search(m.path)):
            by_path.setdefault(m.path, []).append(m)
    ordered = sorted(by_path, key=lambda p: 0 if _LIBPYTHON_RE.search(p) else 1)
    for path in ordered:
        maps = by_path[path]
        base_maps = [m for m in maps if m.offset == 0]
        if not base_maps:
            continue
        first = min(base_maps, key=lambda m: m.start)
        try:
            with _open_object(pid, first, proc_root) as f:
                facts = _elf_facts(f)
        except OSError:
            continue
        if facts is None:
            continue
        base, symbols, runtime = facts
        if "Py_AddPendingCall" not in symbols:
            continue
        bias = first.start - base
        return Interpreter(path=path, bias=bias,
                           symbols={k: bias + v for k, v in symbols.items()},
                           py_runtime=bias + runtime if runtime is not None else None)
    return None


def _version(pid: int, interp: Interpreter, proc_root: str) -> tuple[tuple[int, int], int | None]:
    """(major, minor) and PY_VERSION_HEX when published (3.11+: Py_Version)."""
    address = interp.symbols.get("Py_Version")
    if address is not None:
        raw = read_memory(pid, address, 8, proc_root)
        hexversion = struct.unpack("<Q", raw)[0] & 0xFFFFFFFF
        return ((hexversion >> 24) & 0xFF, (hexversion >> 16) & 0xFF), hexversion
    for version, marker in _VERSION_MARKERS:
        if marker in interp.symbols:
            return version, None
    return (3, 8), None  # older than every version injection supports


def free_threaded(pid: int, interp: Interpreter, proc_root: str = "/proc") -> bool:
    """3.13+ publish it in the debug offsets at the start of .PyRuntime."""
    if interp.py_runtime is None:
        return False
    raw = read_memory(pid, interp.py_runtime, 24, proc_root)
    if raw[:8] != b"xdebugpy":
        return False
    return bool(struct.unpack_from("<Q", raw, 16)[0] != 0)


def read_environ(pid: int, proc_root: str = "/proc") -> dict[bytes, bytes]:
    """The environment the process started with (bounded)."""
    with open(f"{proc_root}/{pid}/environ", "rb") as f:
        data = f.read(MAX_ENVIRON_BYTES)
    out = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key] = value
    return out


def remote_debug_opt_out(pid: int, proc_root: str = "/proc") -> str | None:
    """Why the owner disabled remote debugging (respected on every version:
    3.14+ enforces it itself, older ones have no such switch but the intent is
    the same), or None."""
    try:
        env = read_environ(pid, proc_root)
        with open(f"{proc_root}/{pid}/cmdline", "rb") as f:
            argv = f.read(MAX_ENVIRON_BYTES).split(b"\0")
    except OSError as exc:
        raise Refused(PTRACE_DENIED, f"cannot read its environment: {exc.strerror}") from exc
    if b"PYTHON_DISABLE_REMOTE_DEBUG" in env:
        return "PYTHON_DISABLE_REMOTE_DEBUG is set in its environment"
    for i, arg in enumerate(argv):
        if arg == b"-X" and i + 1 < len(argv) and argv[i + 1] == b"disable-remote-debug":
            return "started with -X disable-remote-debug"
        if arg == b"-Xdisable-remote-debug":
            return "started with -X disable-remote-debug"
    return None


def ptrace_obstacle(pid: int, euid: int) -> str | None:
    """Why this process may not attach to ``pid`` (Yama, capabilities), or None.
    The kernel has the last word; this turns its EPERM into a reason."""
    has_cap = _has_sys_ptrace()
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read().strip() or 0)
    except (OSError, ValueError):
        scope = 0
    if scope >= 3:
        return "Yama ptrace_scope is 3: no process may attach to another"
    if scope >= 1 and not has_cap:
        return (f"Yama ptrace_scope is {scope} and this process lacks CAP_SYS_PTRACE "
                "(only descendants or CAP_SYS_PTRACE holders may attach)")
    if not has_cap and euid != os.geteuid():
        return (f"the process runs as uid {euid}, this one as uid {os.geteuid()} without "
                "CAP_SYS_PTRACE")
    return None


def _has_sys_ptrace() -> bool:
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"CapEff:"):
                    return bool(int(line.split()[1], 16) & (1 << 19))
    except OSError:
        pass
    return False


def _perf_map_has_stubs(pid: int, nspid: int, euid: int, proc_root: str) -> bool:
    """CPython's own trampolines (or ours) already write a perf map in this
    process: it holds ``/tmp/perf-NSPID.map`` open (a file left by an earlier
    process with the same pid, common for pid 1 in containers, is not), and
    the file names py:: stubs."""
    name = f"/tmp/perf-{nspid}.map"
    fd_dir = f"{proc_root}/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return False
    holds = False
    for fd in fds[:MAX_FDS_CHECKED]:
        try:
            if os.readlink(f"{fd_dir}/{fd}") == name:
                holds = True
                break
        except OSError:
            continue
    if not holds:
        return False
    opened = open_untrusted(name.lstrip("/"), euid, MAX_PERF_MAP_PEEK,
                            root=f"{proc_root}/{pid}/root")
    if isinstance(opened, Refusal):
        return False
    with opened:
        return b" py::" in opened.read_at(0, MAX_PERF_MAP_PEEK)


def trampolines_active(pid: int, nspid: int, euid: int, start_ticks: int,
                       mappings: Sequence[Mapping], proc_root: str = "/proc") -> str | None:
    """Which trampolines already run in the process, or None."""
    if any(is_runtime_extension(m.path) for m in mappings):
        try:
            if read_descriptor(pid, proc_root).active:
                return "tramprof's trampoline runtime is active"
        except DescriptorError:
            pass
    if _perf_map_has_stubs(pid, nspid, euid, proc_root):
        return f"it already writes py:: trampolines to /tmp/perf-{nspid}.map"
    return None


def inspect(pid: int, proc_root: str = "/proc", *, for_off: bool = False) -> Target:
    """Everything injection needs to know about ``pid``; Refused otherwise."""
    if pid == os.getpid():
        raise Refused(SELF, "it is this tramprof process")
    try:
        mappings = read_maps(pid, proc_root)
        ids = read_status_ids(pid, proc_root)
        euid, egid, nspid = ids.euid, ids.egid, ids.inner_pid
        start_ticks = read_start_ticks(pid, proc_root)
    except PermissionError as exc:
        raise Refused(PTRACE_DENIED, f"cannot read /proc/{pid}: {exc.strerror}") from exc
    except (OSError, SymbolizationError, ValueError, IndexError) as exc:
        raise Refused(GONE, f"cannot read /proc/{pid}: {exc}") from exc
    if not mappings:
        raise Refused(NOT_CPYTHON, "it has no user-space memory (a kernel thread)")
    interp = find_interpreter(pid, mappings, proc_root)
    if interp is None:
        raise Refused(NOT_CPYTHON, "no mapped python executable or libpython exports "
                      "CPython's C API (Py_AddPendingCall)")
    try:
        version, version_hex = _version(pid, interp, proc_root)
        threaded = free_threaded(pid, interp, proc_root)
    except MemoryReadError as exc:
        raise Refused(PTRACE_DENIED, f"cannot read its memory: {exc}") from exc
    if version < OLDEST or version > NEWEST:
        raise Refused(UNSUPPORTED_VERSION, f"CPython {version[0]}.{version[1]} (supported: "
                      f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]})")
    if threaded:
        raise Refused(UNSUPPORTED_VERSION, "free-threaded CPython builds are not supported")
    if version < PERF_TRAMPOLINE_FROM and "PyRun_SimpleString" not in interp.symbols:
        raise Refused(NOT_CPYTHON, "the interpreter does not export PyRun_SimpleString")
    opt_out = remote_debug_opt_out(pid, proc_root)
    if opt_out is not None:
        raise Refused(REMOTE_DEBUG_DISABLED, opt_out)
    obstacle = ptrace_obstacle(pid, euid)
    if obstacle is not None:
        raise Refused(PTRACE_DENIED, obstacle)
    if not for_off:
        active = trampolines_active(pid, nspid, euid, start_ticks, mappings, proc_root)
        if active is not None:
            raise Refused(ALREADY_ACTIVE, active)
    return Target(pid=pid, nspid=nspid, euid=euid, egid=egid, start_ticks=start_ticks,
                  version=version, version_hex=version_hex, interpreter=interp,
                  mappings=tuple(mappings))


def main_thread_running(target: Target, proc_root: str = "/proc") -> bool:
    """The process inspected is still there (not another one given its pid)
    and its main thread, the one that runs pending calls, has not exited."""
    try:
        stat = read_stat(target.pid, proc_root)
    except (OSError, SymbolizationError, ValueError, IndexError):
        return False
    return stat.start_ticks == target.start_ticks and not stat.leader_exited


def pause_point(name: str) -> None:
    """Fault injection for tests: ``TRAMPROF_INJECT_PAUSE_AT=NAME`` holds the
    injector here (target stopped or mid-call) for 60 s, so a test can kill
    it at exactly this point and check that the target survives."""
    if os.environ.get("TRAMPROF_INJECT_PAUSE_AT") == name:
        print(f"tramprof-inject: paused at {name}", flush=True)
        time.sleep(60)
