"""Kernel struct field offsets from the running kernel's BTF.

The kernel headers installed here do not match the running kernel, so any
struct layout compiled from them can be wrong. The BPF program therefore
reads kernel structs only at offsets looked up here, in the kernel's own
type information (``/sys/kernel/btf/vmlinux``), and passed in as ``-D``
constants. The parsing is libbpf's (``libbpf.so.1``, which bcc depends on).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from functools import cache

VMLINUX_BTF = "/sys/kernel/btf/vmlinux"

# BTF kinds (include/uapi/linux/btf.h).
_KIND_INT = 1
_KIND_PTR = 2
_KIND_STRUCT = 4
_KIND_UNION = 5
_KIND_ENUM = 6
_KIND_TYPEDEF = 8
_KIND_VOLATILE = 9
_KIND_CONST = 10
_KIND_RESTRICT = 11
_KIND_TYPE_TAG = 18
_MODIFIERS = {_KIND_TYPEDEF, _KIND_VOLATILE, _KIND_CONST, _KIND_RESTRICT, _KIND_TYPE_TAG}


class BtfError(RuntimeError):
    """The kernel's BTF is missing, unreadable, or lacks a needed field."""


class _BtfType(ctypes.Structure):
    _fields_ = [("name_off", ctypes.c_uint32), ("info", ctypes.c_uint32),
                ("size_or_type", ctypes.c_uint32)]


class _BtfMember(ctypes.Structure):
    _fields_ = [("name_off", ctypes.c_uint32), ("type", ctypes.c_uint32),
                ("offset", ctypes.c_uint32)]


@dataclass(frozen=True)
class FieldInfo:
    """Byte offset and size of a (possibly nested) struct field."""

    offset: int
    size: int


@cache
def libbpf() -> ctypes.CDLL:
    name = ctypes.util.find_library("bpf") or "libbpf.so.1"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise BtfError(f"cannot load libbpf ({name}): {exc}; install libbpf1") from exc
    lib.btf__parse.restype = ctypes.c_void_p
    lib.btf__parse.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    lib.btf__find_by_name_kind.restype = ctypes.c_int32
    lib.btf__find_by_name_kind.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32]
    lib.btf__type_by_id.restype = ctypes.POINTER(_BtfType)
    lib.btf__type_by_id.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.btf__name_by_offset.restype = ctypes.c_char_p
    lib.btf__name_by_offset.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.btf__resolve_size.restype = ctypes.c_int64
    lib.btf__resolve_size.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.btf__free.restype = None
    lib.btf__free.argtypes = [ctypes.c_void_p]
    return lib


class KernelBtf:
    """Read-only view of one BTF file; resolves dotted field paths."""

    def __init__(self, path: str = VMLINUX_BTF) -> None:
        self._lib = libbpf()
        handle = self._lib.btf__parse(path.encode(), None)
        # libbpf 1.x returns NULL and sets errno on failure.
        if not handle:
            err = ctypes.get_errno()
            raise BtfError(f"cannot parse BTF at {path}: errno {err}; the kernel needs "
                           "CONFIG_DEBUG_INFO_BTF=y")
        self._btf = handle
        self.path = path

    def close(self) -> None:
        if self._btf:
            self._lib.btf__free(self._btf)
            self._btf = None

    def __enter__(self) -> KernelBtf:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _type(self, type_id: int) -> _BtfType:
        ptr = self._lib.btf__type_by_id(self._btf, type_id)
        if not ptr:
            raise BtfError(f"BTF type id {type_id} not found in {self.path}")
        contents: _BtfType = ptr.contents
        return contents

    def _skip_modifiers(self, type_id: int) -> int:
        for _ in range(32):
            kind = (self._type(type_id).info >> 24) & 0x1F
            if kind not in _MODIFIERS:
                return type_id
            type_id = self._type(type_id).size_or_type
        raise BtfError(f"modifier chain too long at type {type_id}")

    def _members(self, type_id: int) -> list[tuple[str, int, int]]:
        """(name, type id, bit offset) of a struct/union's members."""
        t = self._lib.btf__type_by_id(self._btf, type_id)
        info = t.contents.info
        vlen = info & 0xFFFF
        kind_flag = info >> 31
        base = ctypes.cast(t, ctypes.c_void_p).value
        assert base is not None
        members = ctypes.cast(base + ctypes.sizeof(_BtfType), ctypes.POINTER(_BtfMember))
        out = []
        for i in range(vlen):
            m = members[i]
            name = (self._lib.btf__name_by_offset(self._btf, m.name_off) or b"").decode()
            bit_offset = m.offset & 0xFFFFFF if kind_flag else m.offset
            out.append((name, m.type, bit_offset))
        return out

    def _find_member(self, type_id: int, name: str) -> tuple[int, int] | None:
        """Type id and bit offset of member ``name``, looking into anonymous members."""
        for member_name, member_type, bit_offset in self._members(type_id):
            if member_name == name:
                return member_type, bit_offset
            if not member_name:
                inner = self._skip_modifiers(member_type)
                if (self._type(inner).info >> 24) & 0x1F in (_KIND_STRUCT, _KIND_UNION):
                    found = self._find_member(inner, name)
                    if found is not None:
                        return found[0], bit_offset + found[1]
        return None

    def struct_id(self, name: str) -> int:
        type_id = self._lib.btf__find_by_name_kind(self._btf, name.encode(), _KIND_STRUCT)
        if type_id < 0:
            raise BtfError(f"struct {name} not found in {self.path}")
        return int(type_id)

    def field(self, path: str) -> FieldInfo:
        """Offset and size of ``struct.field.subfield`` (e.g. ``task_struct.thread.fsbase``)."""
        struct_name, *fields = path.split(".")
        if not fields:
            raise BtfError(f"field path {path!r} names no field")
        type_id = self.struct_id(struct_name)
        bits = 0
        for name in fields:
            type_id = self._skip_modifiers(type_id)
            found = self._find_member(type_id, name)
            if found is None:
                raise BtfError(f"{path}: no member {name!r} in this kernel's BTF")
            type_id, member_bits = found
            bits += member_bits
        if bits % 8:
            raise BtfError(f"{path} is a bitfield; it cannot be read by byte offset")
        size = self._lib.btf__resolve_size(self._btf, type_id)
        if size < 0:
            raise BtfError(f"{path}: cannot resolve the field's size")
        return FieldInfo(offset=bits // 8, size=int(size))
