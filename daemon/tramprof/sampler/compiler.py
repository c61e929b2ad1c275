"""Compiles and loads the BPF program in a short-lived child process.

bcc compiles with clang and LLVM inside the calling process: importing bcc
maps and relocates ~60 MB of LLVM, and clang then parses the kernel headers
three times (bcc's rewriting passes) in ~70 MB of heap. None of it is needed
once the program is loaded, yet a process's peak resident memory stays its
peak, and a container's memory limit must cover it. So the daemon runs bcc
here, in a child it spawns (a fresh interpreter, not a copy of the daemon):
the daemon sends the source, the flags and which programs to load; the child
compiles, loads the programs, fills the tail-call program arrays and passes
every map and program descriptor back over a Unix socket (SCM_RIGHTS),
together with bcc's description of each map, then exits. The kernel objects
live on through the daemon's descriptors (``sampler.loaded``); the compiler's
memory leaves with the child.

The child runs with the daemon's privileges of that moment (before the
privilege drop) and takes nothing from the outside but the daemon's request.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tramprof.sampler.image import ImageError, ImageMap, ImageProgram, ProgramImage, map_references
from tramprof.sampler.loaded import LoadedProgram, MapSpec, runtime

#: Seconds to wait for the compiler (~3 s here; a busy 2-core machine is slower).
COMPILE_TIMEOUT = 300.0
_MAX_REPLY_BYTES = 1 << 20
_MAX_IMAGE_BYTES = 16 << 20
_MAX_FDS = 250  # one message carries at most SCM_MAX_FD (253) descriptors
_MADV_DONTNEED = 4
_COMPILER_LIBRARIES = re.compile(r"/lib(LLVM|clang)[^/]*\.so")


class CompileError(RuntimeError):
    """The child could not compile or load the program. ``stage`` is
    ``compile``, ``load`` (``program`` names which) or ``child`` (the child
    failed or timed out); ``output`` is what bcc, clang and the verifier
    printed."""

    def __init__(self, stage: str, message: str, output: str, program: str = "") -> None:
        super().__init__(message)
        self.stage = stage
        self.output = output
        self.program = program


@dataclass(frozen=True)
class LoadRequest:
    text: str
    cflags: Sequence[str]
    programs: Sequence[tuple[str, int]]  # (function, BPF program type) to load
    tail_calls: Sequence[tuple[str, str]]  # (program array, function) placed at index 0
    # (map of maps, the map whose shape its entries have): bcc knows it from
    # the source but does not tell; a program image needs it.
    inner_maps: Sequence[tuple[str, str]] = ()

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "cflags": list(self.cflags),
                "programs": [list(p) for p in self.programs],
                "tail_calls": [list(t) for t in self.tail_calls],
                "inner_maps": [list(m) for m in self.inner_maps]}


@dataclass(frozen=True)
class Compiled:
    program: LoadedProgram
    output: str  # compiler warnings, if any
    image: ProgramImage | None = None  # when asked for and the bytecode allows one
    image_problem: str = ""  # why there is none


def compile_and_load(request: LoadRequest, timeout: float = COMPILE_TIMEOUT,
                     image: bool = False) -> Compiled:
    """Run the compiler child; the loaded program (with its image if
    ``image``), or CompileError."""
    try:
        runtime()  # what the daemon uses the program with: fail before compiling
    except OSError as exc:
        raise CompileError("child", f"cannot load bcc's runtime library: {exc} "
                                    "(install libbpfcc)", "") from exc
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, tempfile.TemporaryFile() as output, tempfile.TemporaryFile() as image_file:
        passed = (theirs.fileno(), image_file.fileno()) if image else (theirs.fileno(),)
        try:
            child = subprocess.Popen(
                [sys.executable, "-m", "tramprof.sampler.compiler", *map(str, passed)],
                pass_fds=passed, stdin=subprocess.PIPE, stdout=output, stderr=output)
        finally:
            theirs.close()
        try:
            message, fds = _exchange(child, ours, request, timeout)
        finally:
            _reap(child)
        output.seek(0)
        printed = output.read().decode(errors="replace")
        image_file.seek(0)
        image_text = image_file.read(_MAX_IMAGE_BYTES + 1)
    try:
        program = _unpack(message, fds, printed, child.returncode)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    if not image:
        return Compiled(program, printed)
    try:
        if len(image_text) > _MAX_IMAGE_BYTES:
            raise ImageError(f"the image exceeds {_MAX_IMAGE_BYTES} bytes")
        reply = json.loads(image_text or b'{"problem": "the compiler wrote no image"}')
        if "problem" in reply:
            return Compiled(program, printed, image_problem=str(reply["problem"]))
        return Compiled(program, printed, ProgramImage.from_json(reply))
    except (ImageError, ValueError) as exc:
        return Compiled(program, printed, image_problem=str(exc))


def _exchange(child: subprocess.Popen[bytes], sock: socket.socket, request: LoadRequest,
              timeout: float) -> tuple[bytes, list[int]]:
    assert child.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # the child died: the socket says so
        child.stdin.write(json.dumps(request.to_json()).encode())
    with contextlib.suppress(BrokenPipeError):
        child.stdin.close()
    sock.settimeout(timeout)
    try:
        message, fds, flags, _addr = socket.recv_fds(sock, _MAX_REPLY_BYTES, _MAX_FDS + 1)
    except TimeoutError:
        child.kill()
        raise CompileError("child", f"the BPF compiler did not finish within {timeout:.0f} s",
                           "") from None
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        raise CompileError("child", "the BPF compiler's reply was truncated", "")
    return message, fds


def _reap(child: subprocess.Popen[bytes]) -> None:
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _unpack(message: bytes, fds: list[int], printed: str,
            returncode: int | None) -> LoadedProgram:
    if not message:
        raise CompileError("child", f"the BPF compiler exited with status {returncode} "
                                    "before replying", printed)
    reply = json.loads(message)
    if "error" in reply:
        raise CompileError(str(reply["stage"]), str(reply["error"]), printed,
                           str(reply.get("program", "")))
    specs = [MapSpec.from_json(m) for m in reply["maps"]]
    names = [str(name).encode() for name in reply["programs"]]
    if len(fds) != len(specs) + len(names):
        raise CompileError("child", f"the BPF compiler sent {len(fds)} descriptors for "
                                    f"{len(specs)} maps and {len(names)} programs", printed)
    maps = {spec.name: (spec, fd) for spec, fd in zip(specs, fds, strict=False)}
    functions = dict(zip(names, fds[len(specs):], strict=True))
    return LoadedProgram(maps, functions)


# --- the child ---------------------------------------------------------------

def release_library_pages() -> None:
    """Unmap the LLVM and clang pages that loading the libraries touched
    (relocation tables, symbol lookups, static constructors: ~50 MB), so the
    compile starts from what it really runs. Only read-only mappings without
    a private copy are dropped: they come back from the page cache, unchanged,
    when touched again."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    candidates: list[tuple[int, int]] = []
    current: tuple[int, int] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                current = None
                if (len(fields) == 6 and _COMPILER_LIBRARIES.search(fields[5])
                        and "w" not in fields[1]):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    current = (start, end - start)
            elif fields[0] == "Anonymous:" and current is not None:
                if int(fields[1]) == 0:
                    candidates.append(current)
                current = None
    for start, length in candidates:
        libc.madvise(start, length, _MADV_DONTNEED)


def _describe_maps(lib: Any, module: Any) -> list[tuple[MapSpec, int]]:
    size_t, c_void_p = ctypes.c_size_t, ctypes.c_void_p
    for name, restype in (("bpf_table_name", ctypes.c_char_p), ("bpf_table_fd_id", ctypes.c_int),
                          ("bpf_table_type_id", ctypes.c_int),
                          ("bpf_table_flags_id", ctypes.c_int),
                          ("bpf_table_max_entries_id", size_t),
                          ("bpf_table_key_desc_id", ctypes.c_char_p),
                          ("bpf_table_leaf_desc_id", ctypes.c_char_p),
                          ("bpf_table_key_size_id", size_t),
                          ("bpf_table_leaf_size_id", size_t)):
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = [c_void_p, size_t]
    lib.bpf_num_tables.restype = size_t
    lib.bpf_num_tables.argtypes = [c_void_p]
    maps = []
    for i in range(lib.bpf_num_tables(module)):
        fd = lib.bpf_table_fd_id(module, i)
        if fd < 0:
            continue
        spec = MapSpec(name=lib.bpf_table_name(module, i),
                       map_type=lib.bpf_table_type_id(module, i),
                       flags=lib.bpf_table_flags_id(module, i),
                       max_entries=lib.bpf_table_max_entries_id(module, i),
                       key_size=lib.bpf_table_key_size_id(module, i),
                       leaf_size=lib.bpf_table_leaf_size_id(module, i),
                       key_desc=(lib.bpf_table_key_desc_id(module, i) or b"").decode(),
                       leaf_desc=(lib.bpf_table_leaf_desc_id(module, i) or b"").decode())
        maps.append((spec, fd))
    return maps


def _image(lib: Any, module: Any, request: dict[str, Any],
           maps: list[tuple[MapSpec, int]]) -> dict[str, Any]:
    """The loaded program as an image (``sampler.image``), or why there is none."""
    lib.bpf_function_start.restype = ctypes.c_void_p
    lib.bpf_function_start.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.bpf_function_size.restype = ctypes.c_size_t
    lib.bpf_function_size.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.bpf_module_license.restype = ctypes.c_char_p
    lib.bpf_module_license.argtypes = [ctypes.c_void_p]
    names_by_fd = {fd: spec.name.decode() for spec, fd in maps}
    inner = {str(outer): str(template) for outer, template in request.get("inner_maps", ())}
    try:
        programs = []
        for name, prog_type in request["programs"]:
            start = lib.bpf_function_start(module, str(name).encode())
            if not start:
                raise ImageError(f"bcc has no bytecode for {name}")
            insns = ctypes.string_at(start, lib.bpf_function_size(module, str(name).encode()))
            programs.append(ImageProgram(str(name), int(prog_type),
                                         (lib.bpf_module_license(module) or b"").decode(),
                                         insns, map_references(insns, names_by_fd)))
        image = ProgramImage(
            tuple(ImageMap(spec, inner.get(spec.name.decode(), "")) for spec, _fd in maps),
            tuple(programs), tuple((str(a), str(f)) for a, f in request["tail_calls"]))
        image.check()
    except ImageError as exc:
        return {"problem": str(exc)}
    return image.to_json()


def build(request: dict[str, Any],
          image_file: Any = None) -> tuple[dict[str, Any], list[int]]:
    """Compile and load; the reply and the descriptors to send with it. With
    ``image_file``, the program's image is written there."""
    from bcc import BPF  # loads LLVM: only ever in this child
    from bcc.libbcc import lib

    release_library_pages()
    try:
        bpf = BPF(text=str(request["text"]).encode(), cflags=list(request["cflags"]))
    except Exception as exc:
        return {"stage": "compile", "error": str(exc)}, []
    functions: dict[str, int] = {}
    for name, prog_type in request["programs"]:
        try:
            functions[name] = bpf.load_func(str(name).encode(), int(prog_type)).fd
        except Exception as exc:
            return {"stage": "load", "program": name, "error": str(exc)}, []
    for array, name in request["tail_calls"]:
        try:
            bpf.get_table(str(array).encode())[ctypes.c_int(0)] = ctypes.c_int(functions[name])
        except Exception as exc:
            return {"stage": "load", "program": name,
                    "error": f"placing it in {array}: {exc}"}, []
    maps = _describe_maps(lib, bpf.module)
    if len(maps) + len(functions) > _MAX_FDS:
        return {"stage": "load", "error": f"{len(maps)} maps and {len(functions)} programs "
                                          f"exceed {_MAX_FDS} descriptors"}, []
    if image_file is not None:
        image_file.write(json.dumps(_image(lib, bpf.module, request, maps)).encode())
        image_file.flush()
    reply = {"maps": [spec.to_json() for spec, _fd in maps], "programs": list(functions)}
    return reply, [fd for _spec, fd in maps] + list(functions.values())


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    image_file = open(int(argv[1]), "wb", closefd=False) if len(argv) > 1 else None  # noqa: SIM115
    reply, fds = build(json.loads(sys.stdin.buffer.read()), image_file)
    socket.send_fds(sock, [json.dumps(reply).encode()], fds)
    sys.stderr.flush()
    # Skip tearing down LLVM and bcc's module: the descriptors are the
    # daemon's now, and the kernel closes ours.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
