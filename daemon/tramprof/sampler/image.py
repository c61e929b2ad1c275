"""A compiled program in loadable form, and loading it without a compiler.

bcc hands out each function's bytecode after compiling (``bpf_function_start``
and ``bpf_function_size``), with the descriptors of the maps it created
already written into the map-loading instructions. Kept together with the
maps' shapes and where each map is referenced, that bytecode can be loaded
again later, on the same kernel, by creating fresh maps and patching their
descriptors in: no clang, no LLVM, a few milliseconds instead of seconds and
none of the compiler's memory. ``sampler.programcache`` keeps images across
restarts; this module builds them (in the compiler child) and loads them.

What bcc adds on top is left out: BTF type information for the maps and the
programs. The verifier does not need it for this program (no spin locks, no
global functions); ``bpftool map dump`` then shows values in hex.
"""

from __future__ import annotations

import base64
import ctypes
import os
import struct
from dataclasses import dataclass
from typing import Any

from tramprof.sampler.loaded import (
    MAP_ARRAY_OF_MAPS,
    MAP_HASH_OF_MAPS,
    LoadedProgram,
    MapSpec,
    libc,
    runtime,
)

#: Version of the image layout; part of the program cache's key.
IMAGE_FORMAT = 1

_INSN_BYTES = 8
_MAX_INSNS = 1_000_000  # the verifier's own limit on processed instructions
_LD_IMM64 = 0x18  # BPF_LD | BPF_IMM | BPF_DW: loads a map when src_reg says so
_PSEUDO_MAP_FD = 1
_PSEUDO_MAP_VALUE = 2
_OBJ_NAME_LEN = 16
_LOG_BYTES = 1 << 20
_SYS_BPF = 321  # x86-64
_BPF_MAP_CREATE = 0
_BPF_PROG_LOAD = 5


class ImageError(ValueError):
    """An image that is malformed, or that this kernel would not load."""


@dataclass(frozen=True)
class ImageMap:
    spec: MapSpec
    inner: str  # for a map of maps: the map whose shape its entries have

    def to_json(self) -> dict[str, Any]:
        return {**self.spec.to_json(), "inner": self.inner}


@dataclass(frozen=True)
class ImageProgram:
    name: str
    prog_type: int
    license: str
    insns: bytes
    map_refs: tuple[tuple[int, str], ...]  # (instruction index, map name)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "prog_type": self.prog_type, "license": self.license,
                "insns": base64.b64encode(self.insns).decode(),
                "map_refs": [list(ref) for ref in self.map_refs]}


@dataclass(frozen=True)
class ProgramImage:
    maps: tuple[ImageMap, ...]
    programs: tuple[ImageProgram, ...]
    tail_calls: tuple[tuple[str, str], ...]  # (program array, program) at index 0

    def to_json(self) -> dict[str, Any]:
        return {"format": IMAGE_FORMAT, "maps": [m.to_json() for m in self.maps],
                "programs": [p.to_json() for p in self.programs],
                "tail_calls": [list(t) for t in self.tail_calls]}

    @classmethod
    def from_json(cls, data: Any) -> ProgramImage:
        """The image, checked for consistency; ImageError if it is not one."""
        try:
            if data["format"] != IMAGE_FORMAT:
                raise ImageError(f"image format {data['format']!r}, expected {IMAGE_FORMAT}")
            maps = tuple(ImageMap(MapSpec.from_json(m), str(m["inner"])) for m in data["maps"])
            programs = tuple(
                ImageProgram(str(p["name"]), int(p["prog_type"]), str(p["license"]),
                             base64.b64decode(str(p["insns"]), validate=True),
                             tuple((int(i), str(n)) for i, n in p["map_refs"]))
                for p in data["programs"])
            tail_calls = tuple((str(a), str(f)) for a, f in data["tail_calls"])
        except ImageError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ImageError(f"malformed program image: {exc!r}") from None
        image = cls(maps, programs, tail_calls)
        image.check()
        return image

    def check(self) -> None:
        names = {m.spec.name.decode() for m in self.maps}
        functions = {p.name for p in self.programs}
        for m in self.maps:
            of_maps = m.spec.map_type in (MAP_ARRAY_OF_MAPS, MAP_HASH_OF_MAPS)
            if of_maps != bool(m.inner) or (m.inner and m.inner not in names):
                raise ImageError(f"map {m.spec.name.decode()}: bad inner map {m.inner!r}")
        for p in self.programs:
            count = len(p.insns) // _INSN_BYTES
            if not p.insns or len(p.insns) % _INSN_BYTES or count > _MAX_INSNS:
                raise ImageError(f"program {p.name}: {len(p.insns)} bytes of instructions")
            for index, name in p.map_refs:
                if not 0 <= index < count or p.insns[index * _INSN_BYTES] != _LD_IMM64:
                    raise ImageError(f"program {p.name}: map reference at {index} is not a "
                                     f"64-bit load")
                if name not in names:
                    raise ImageError(f"program {p.name}: reference to unknown map {name!r}")
        for array, function in self.tail_calls:
            if array not in names or function not in functions:
                raise ImageError(f"tail call {array}[0] = {function}: unknown name")


def map_references(insns: bytes, names_by_fd: dict[int, str]) -> tuple[tuple[int, str], ...]:
    """Where ``insns`` load a map, by map name: every 64-bit immediate load
    whose source register marks a map descriptor (or a map value). One that
    names no known map makes the bytecode unusable as an image."""
    refs = []
    for index in range(len(insns) // _INSN_BYTES):
        code, registers, _offset, imm = struct.unpack_from("<BBhi", insns, index * _INSN_BYTES)
        if code == _LD_IMM64 and registers >> 4 in (_PSEUDO_MAP_FD, _PSEUDO_MAP_VALUE):
            if imm not in names_by_fd:
                raise ImageError(f"instruction {index} loads descriptor {imm}, not a map")
            refs.append((index, names_by_fd[imm]))
    return tuple(refs)


class _MapCreateAttr(ctypes.Structure):
    """The BPF_MAP_CREATE prefix of union bpf_attr (include/uapi/linux/bpf.h)."""

    _fields_ = [("map_type", ctypes.c_uint32), ("key_size", ctypes.c_uint32),
                ("value_size", ctypes.c_uint32), ("max_entries", ctypes.c_uint32),
                ("map_flags", ctypes.c_uint32), ("inner_map_fd", ctypes.c_uint32),
                ("numa_node", ctypes.c_uint32), ("map_name", ctypes.c_char * _OBJ_NAME_LEN)]


class _ProgLoadAttr(ctypes.Structure):
    """The BPF_PROG_LOAD prefix of union bpf_attr."""

    _fields_ = [("prog_type", ctypes.c_uint32), ("insn_cnt", ctypes.c_uint32),
                ("insns", ctypes.c_uint64), ("license", ctypes.c_uint64),
                ("log_level", ctypes.c_uint32), ("log_size", ctypes.c_uint32),
                ("log_buf", ctypes.c_uint64), ("kern_version", ctypes.c_uint32),
                ("prog_flags", ctypes.c_uint32), ("prog_name", ctypes.c_char * _OBJ_NAME_LEN)]


def _object_name(name: str) -> bytes:
    """The kernel's object name: 15 characters of [A-Za-z0-9_.], as bcc makes it."""
    return bytes(c if chr(c).isalnum() or c in b"_." else ord("_")
                 for c in name.encode()[:_OBJ_NAME_LEN - 1])


def _bpf(command: int, attr: ctypes.Structure) -> int:
    fd = libc().syscall(ctypes.c_long(_SYS_BPF), ctypes.c_int(command), ctypes.byref(attr),
                        ctypes.c_uint(ctypes.sizeof(attr)))
    if fd < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return int(fd)


def _create_map(spec: MapSpec, inner_fd: int) -> int:
    attr = _MapCreateAttr(map_type=spec.map_type, key_size=spec.key_size,
                          value_size=spec.leaf_size, max_entries=spec.max_entries,
                          map_flags=spec.flags, inner_map_fd=max(inner_fd, 0),
                          map_name=_object_name(spec.name.decode()))
    try:
        return _bpf(_BPF_MAP_CREATE, attr)
    except OSError as exc:
        raise OSError(exc.errno, f"creating map {spec.name.decode()}: {exc.strerror}") from None


def _load_program(program: ImageProgram, fds: dict[str, int]) -> int:
    insns = bytearray(program.insns)
    for index, name in program.map_refs:
        struct.pack_into("<i", insns, index * _INSN_BYTES + 4, fds[name])
    code = (ctypes.c_char * len(insns)).from_buffer(insns)
    license = ctypes.create_string_buffer(program.license.encode())
    log = ctypes.create_string_buffer(_LOG_BYTES)
    attr = _ProgLoadAttr(prog_type=program.prog_type, insn_cnt=len(insns) // _INSN_BYTES,
                         insns=ctypes.addressof(code), license=ctypes.addressof(license),
                         prog_name=_object_name(program.name))
    try:
        return _bpf(_BPF_PROG_LOAD, attr)
    except OSError as first:
        # Again with the verifier's log, only now: logging slows verification.
        attr.log_level, attr.log_size, attr.log_buf = 1, _LOG_BYTES, ctypes.addressof(log)
        try:
            return _bpf(_BPF_PROG_LOAD, attr)
        except OSError:
            pass
        tail = "\n".join(log.value.decode(errors="replace").strip().splitlines()[-20:])
        raise ImageError(f"program {program.name}: {first.strerror}\n{tail}") from None


def load_image(image: ProgramImage) -> LoadedProgram:
    """Create the image's maps, load its programs, fill its program arrays.
    OSError (no privilege, no memory) or ImageError (the verifier said no);
    nothing stays behind either way."""
    fds: dict[str, int] = {}
    functions: dict[str, int] = {}
    try:
        pending = list(image.maps)
        while pending:  # the maps that others are made of first
            ready = [m for m in pending if not m.inner or m.inner in fds]
            if not ready:
                raise ImageError("map of maps whose inner map is never created")
            for m in ready:
                fds[m.spec.name.decode()] = _create_map(m.spec, fds.get(m.inner, -1))
                pending.remove(m)
        for program in image.programs:
            functions[program.name] = _load_program(program, fds)
        lib = runtime()
        for array, function in image.tail_calls:
            key, value = ctypes.c_int(0), ctypes.c_int(functions[function])
            if lib.bpf_update_elem(fds[array], ctypes.byref(key), ctypes.byref(value), 0) < 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"placing {function} in {array}: {os.strerror(errno)}")
    except BaseException:
        for fd in (*fds.values(), *functions.values()):
            os.close(fd)
        raise
    return LoadedProgram({m.spec.name: (m.spec, fds[m.spec.name.decode()]) for m in image.maps},
                         {name.encode(): fd for name, fd in functions.items()})
