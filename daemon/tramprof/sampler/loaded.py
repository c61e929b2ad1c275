"""A BPF program that another process compiled and loaded, used here through
its descriptors: the maps as bcc-style tables, the programs, the perf events.

The compiler child (``sampler.compiler``) runs bcc's clang and LLVM and exits;
this process never maps LLVM (merely importing bcc costs ~60 MB of RSS). What
the daemon needs of bcc afterwards is its small runtime library,
``libbcc_bpf.so.0`` (map access, perf event attachment; no LLVM), and the
table interface that ``program``, ``maps``, ``tables`` and ``drain`` use:
``get_table(name, keytype, leaftype)``, ``bpf[name]``, ``Key``/``Leaf``,
item access, iteration, per-CPU values and stack walks, with the semantics
of bcc 0.26's ``bcc/table.py``. Perf event arrays are read by
``sampler.perfring``, not by bcc's perf readers. Tables asked
for without explicit types get them from bcc's JSON type descriptions, which
the child sends along; explicit types must have the map's key and value sizes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

RUNTIME_LIBRARY = "libbcc_bpf.so.0"

# enum bpf_map_type (include/uapi/linux/bpf.h).
MAP_HASH = 1
MAP_ARRAY = 2
MAP_PROG_ARRAY = 3
MAP_PERF_EVENT_ARRAY = 4
MAP_PERCPU_HASH = 5
MAP_PERCPU_ARRAY = 6
MAP_STACK_TRACE = 7
MAP_LRU_HASH = 9
MAP_LRU_PERCPU_HASH = 10
MAP_ARRAY_OF_MAPS = 12
MAP_HASH_OF_MAPS = 13

# What bpf(2) says to batch operations it does not have: EINVAL before 5.6,
# ENOTSUPP (524) or EOPNOTSUPP for map types without them.
_NO_BATCH = (errno.EINVAL, 524, errno.EOPNOTSUPP)

# A kernel stack trace holds at most this many frames (PERF_MAX_STACK_DEPTH).
STACK_MAX_DEPTH = 127
_BPF_F_STACK_BUILD_ID = 1 << 5

@cache
def libc() -> ctypes.CDLL:
    """The C library, for the system calls it has no wrapper of (``syscall``
    returns a long)."""
    lib = ctypes.CDLL(None, use_errno=True)
    lib.syscall.restype = ctypes.c_long
    return lib


@cache
def runtime() -> ctypes.CDLL:
    """bcc's runtime library (the non-compiler half of bcc), typed."""
    lib = ctypes.CDLL(RUNTIME_LIBRARY, use_errno=True)
    c_int, c_void_p = ctypes.c_int, ctypes.c_void_p
    signatures: dict[str, tuple[Any, list[Any]]] = {
        "bpf_lookup_elem": (c_int, [c_int, c_void_p, c_void_p]),
        "bpf_update_elem": (c_int, [c_int, c_void_p, c_void_p, ctypes.c_ulonglong]),
        "bpf_delete_elem": (c_int, [c_int, c_void_p]),
        "bpf_get_first_key": (c_int, [c_int, c_void_p, ctypes.c_uint]),
        "bpf_get_next_key": (c_int, [c_int, c_void_p, c_void_p]),
        "bpf_lookup_batch": (c_int, [c_int, c_void_p, c_void_p, c_void_p, c_void_p,
                                     ctypes.POINTER(ctypes.c_uint32)]),
        "bpf_delete_batch": (c_int, [c_int, c_void_p, ctypes.POINTER(ctypes.c_uint32)]),
        "bpf_attach_perf_event": (c_int, [c_int, ctypes.c_uint32, ctypes.c_uint32,
                                          ctypes.c_uint64, ctypes.c_uint64, c_int, c_int,
                                          c_int]),
        "bpf_close_perf_event_fd": (c_int, [c_int]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
    return lib


def parse_cpu_list(text: str) -> list[int]:
    """CPU numbers of a sysfs CPU list such as ``0-3,6``."""
    cpus: list[int] = []
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def possible_cpus() -> list[int]:
    with open("/sys/devices/system/cpu/possible") as f:
        return parse_cpu_list(f.read())


def online_cpus() -> list[int]:
    with open("/sys/devices/system/cpu/online") as f:
        return parse_cpu_list(f.read())


# bcc's names of C scalar types in its JSON type descriptions.
_SCALARS: dict[str, Any] = {
    "_Bool": ctypes.c_bool,
    "char": ctypes.c_char,
    "wchar_t": ctypes.c_wchar,
    "unsigned char": ctypes.c_ubyte,
    "short": ctypes.c_short,
    "unsigned short": ctypes.c_ushort,
    "int": ctypes.c_int,
    "unsigned int": ctypes.c_uint,
    "long": ctypes.c_long,
    "unsigned long": ctypes.c_ulong,
    "long long": ctypes.c_longlong,
    "unsigned long long": ctypes.c_ulonglong,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "long double": ctypes.c_longdouble,
    "__int128": ctypes.c_int64 * 2,
    "unsigned __int128": ctypes.c_uint64 * 2,
}
_AGGREGATES = ("struct", "struct_packed", "union")


def decode_type(desc: Any) -> Any:
    """The ctypes type of a bcc JSON type description: a scalar's name, or
    ``[name, [fields...], "struct" | "struct_packed" | "union"]`` whose
    fields are ``[name, type]``, ``[name, type, [dims...]]`` (an array),
    ``[name, type, bits]`` (a bit field) or a nested aggregate."""
    if isinstance(desc, str):
        try:
            return _SCALARS[desc]
        except KeyError:
            raise ValueError(f"unknown scalar type {desc!r} in a map description") from None
    if not (isinstance(desc, list) and len(desc) >= 2 and isinstance(desc[1], list)):
        raise ValueError(f"malformed type description {desc!r}")
    anonymous: list[str] = []
    fields: list[tuple[Any, ...]] = []
    for field in desc[1]:
        if not isinstance(field, list) or len(field) not in (2, 3):
            raise ValueError(f"malformed field {field!r} in {desc[0]!r}")
        if len(field) == 2:
            fields.append((field[0], decode_type(field[1])))
        elif isinstance(field[2], list):
            element = decode_type(field[1])
            for dim in reversed(field[2]):
                element = element * int(dim)
            fields.append((field[0], element))
        elif isinstance(field[2], int):
            fields.append((field[0], decode_type(field[1]), field[2]))
        elif field[2] in _AGGREGATES:
            name = field[0] or f"__anon{len(anonymous)}"
            if not field[0]:
                anonymous.append(name)
            fields.append((name, decode_type(field)))
        else:
            raise ValueError(f"malformed field {field!r} in {desc[0]!r}")
    kind = desc[2] if len(desc) > 2 else "struct"
    if kind not in _AGGREGATES:
        raise ValueError(f"unknown aggregate kind {kind!r} of {desc[0]!r}")
    base = ctypes.Union if kind == "union" else ctypes.Structure
    namespace: dict[str, Any] = {"_anonymous_": anonymous, "_fields_": fields}
    if kind == "struct_packed":
        namespace["_pack_"] = 1
    return type(str(desc[0]), (base,), namespace)


@dataclass(frozen=True)
class MapSpec:
    """What bcc knows of one map of the compiled module."""

    name: bytes
    map_type: int
    flags: int
    max_entries: int
    key_size: int
    leaf_size: int
    key_desc: str  # bcc's JSON description of the key type
    leaf_desc: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name.decode(), "map_type": self.map_type, "flags": self.flags,
                "max_entries": self.max_entries, "key_size": self.key_size,
                "leaf_size": self.leaf_size, "key_desc": self.key_desc,
                "leaf_desc": self.leaf_desc}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MapSpec:
        return cls(name=str(data["name"]).encode(), map_type=int(data["map_type"]),
                   flags=int(data["flags"]), max_entries=int(data["max_entries"]),
                   key_size=int(data["key_size"]), leaf_size=int(data["leaf_size"]),
                   key_desc=str(data["key_desc"]), leaf_desc=str(data["leaf_desc"]))


@dataclass(frozen=True)
class Function:
    """A loaded program (bcc's ``BPF.Function``: ``name`` and ``fd``)."""

    name: bytes
    fd: int


class Table:
    """One map, by descriptor: bcc's ``TableBase`` (hash-like maps)."""

    def __init__(self, owner: LoadedProgram, spec: MapSpec, fd: int, keytype: Any,
                 leaftype: Any) -> None:
        self.bpf = owner
        self.spec = spec
        self.name = spec.name
        self.map_fd = fd
        self.ttype = spec.map_type
        self.flags = spec.flags
        self.max_entries = spec.max_entries
        self.Key = keytype
        self.Leaf = leaftype
        self._lib = runtime()

    def get_fd(self) -> int:
        return self.map_fd

    def __getitem__(self, key: Any) -> Any:
        leaf = self.Leaf()
        if self._lib.bpf_lookup_elem(self.map_fd, ctypes.byref(key), ctypes.byref(leaf)) < 0:
            raise KeyError(key)
        return leaf

    def __setitem__(self, key: Any, leaf: Any) -> None:
        if self._lib.bpf_update_elem(self.map_fd, ctypes.byref(key), ctypes.byref(leaf), 0) < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"Could not update table {self.name.decode()}: "
                                f"{os.strerror(code)}")

    def __delitem__(self, key: Any) -> None:
        if self._lib.bpf_delete_elem(self.map_fd, ctypes.byref(key)) < 0:
            raise KeyError(key)

    def __contains__(self, key: Any) -> bool:
        try:
            self[key]
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[Any]:
        key = None
        while True:
            following = self.Key()
            if key is None:
                res = self._lib.bpf_get_first_key(self.map_fd, ctypes.byref(following),
                                                  ctypes.sizeof(self.Key))
            else:
                res = self._lib.bpf_get_next_key(self.map_fd, ctypes.byref(key),
                                                 ctypes.byref(following))
            if res < 0:
                return
            key = following
            yield key

    def __len__(self) -> int:
        return sum(1 for _key in self)

    def keys(self) -> Iterator[Any]:
        return iter(self)

    def items(self) -> list[tuple[Any, Any]]:
        """(key, value) pairs; an entry deleted between the two lookups is skipped."""
        pairs = []
        for key in self:
            try:
                pairs.append((key, self[key]))
            except KeyError:
                continue
        return pairs

    def items_raw(self, chunk: int = 1024) -> list[tuple[bytes, bytes]]:
        """Every (key, value) as bytes (see ``iter_raw``)."""
        return [(key, bytes(value)) for key, value in self.iter_raw(chunk)]

    def iter_raw(self, chunk: int = 1024) -> Iterator[tuple[bytes, memoryview]]:
        """Every (key, value), ``chunk`` entries a system call
        (BPF_MAP_LOOKUP_BATCH) instead of two calls an entry; entries that
        come or go meanwhile may or may not be in it. A value is a view of
        the one buffer the chunks are read into, so reading a map of large
        values holds one chunk, not the map: it is valid until the next
        entry is asked for (copy what is kept). Without batch operations in
        the kernel (before 5.6), one entry at a time."""
        key_size, value_size = ctypes.sizeof(self.Key), ctypes.sizeof(self.Leaf)
        keys = ctypes.create_string_buffer(key_size * chunk)
        values = ctypes.create_string_buffer(value_size * chunk)
        # The position token: a bucket number for hash maps, a key for others.
        position, following = (ctypes.create_string_buffer(max(key_size, 8)) for _ in "ab")
        first = True
        while True:
            count = ctypes.c_uint32(chunk)
            result = self._lib.bpf_lookup_batch(self.map_fd, None if first else position,
                                                following, keys, values, ctypes.byref(count))
            code = ctypes.get_errno() if result < 0 else 0
            if code == errno.ENOSPC and count.value == 0:  # a hash bucket holds more
                chunk *= 2
                keys = ctypes.create_string_buffer(key_size * chunk)
                values = ctypes.create_string_buffer(value_size * chunk)
                continue
            if code and code != errno.ENOENT:
                if first and code in _NO_BATCH:
                    for key, value in self.items():
                        yield bytes(key), memoryview(bytes(value))
                    return
                raise OSError(code, f"reading table {self.name.decode()}: "
                                    f"{os.strerror(code)}")
            got = count.value
            got_keys = ctypes.string_at(keys, got * key_size)
            got_values = memoryview(values).cast("B")
            for i in range(got):
                yield (got_keys[i * key_size:(i + 1) * key_size],
                       got_values[i * value_size:(i + 1) * value_size])
            if code == errno.ENOENT:  # that was the last of them
                return
            ctypes.memmove(position, following, len(position))
            first = False

    def delete_raw(self, keys: list[bytes]) -> int:
        """Delete the entries of these keys (bytes) in one system call
        (BPF_MAP_DELETE_BATCH); keys already gone are skipped. The number
        deleted."""
        deleted = start = 0
        size = ctypes.sizeof(self.Key)
        while start < len(keys):
            batch = b"".join(keys[start:])
            count = ctypes.c_uint32(len(keys) - start)
            result = self._lib.bpf_delete_batch(self.map_fd, batch, ctypes.byref(count))
            code = ctypes.get_errno() if result < 0 else 0
            if code in _NO_BATCH and start == 0 and count.value == 0:
                for key in keys:
                    with contextlib.suppress(KeyError):
                        del self[self.Key.from_buffer_copy(key[:size])]
                        deleted += 1
                return deleted
            deleted += count.value
            if not code:
                return deleted
            if code != errno.ENOENT:
                raise OSError(code, f"deleting from table {self.name.decode()}: "
                                    f"{os.strerror(code)}")
            start += count.value + 1  # the batch stopped at a key that is gone
        return deleted

    def values(self) -> list[Any]:
        return [value for _key, value in self.items()]

    def clear(self) -> None:
        for key in list(self.keys()):
            del self[key]


class ArrayTable(Table):
    """Array-like maps: every index exists, integers are accepted as keys."""

    def _normalize(self, key: Any) -> Any:
        if isinstance(key, int):
            key = self.Key(key + len(self) if key < 0 else key)
        if not isinstance(key, ctypes._SimpleCData):
            raise IndexError("Array index must be an integer type")
        if not 0 <= key.value < len(self):
            raise IndexError("Array index out of range")
        return key

    def __len__(self) -> int:
        return self.max_entries

    def __iter__(self) -> Iterator[Any]:
        return (self.Key(i) for i in range(self.max_entries))

    def __getitem__(self, key: Any) -> Any:
        return super().__getitem__(self._normalize(key))

    def __setitem__(self, key: Any, leaf: Any) -> None:
        if isinstance(leaf, int):
            leaf = self.Leaf(leaf)
        super().__setitem__(self._normalize(key), leaf)

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(self._normalize(key))

    def clearitem(self, key: Any) -> None:
        """Zero an entry (array entries cannot be deleted)."""
        super().__setitem__(self._normalize(key), self.Leaf())


class PlainArray(ArrayTable):
    def __delitem__(self, key: Any) -> None:
        self.clearitem(key)


class _PerCpu:
    """Per-CPU values: one leaf per possible CPU, each padded to 8 bytes."""

    Leaf: Any

    def _per_cpu_leaf(self) -> None:
        self.sLeaf = self.Leaf
        self.total_cpu = len(possible_cpus())
        if ctypes.sizeof(self.sLeaf) % 8 == 0:
            self.Leaf = self.sLeaf * self.total_cpu
        elif self.sLeaf is ctypes.c_uint:
            self.Leaf = ctypes.c_uint64 * self.total_cpu
        elif self.sLeaf is ctypes.c_int:
            self.Leaf = ctypes.c_int64 * self.total_cpu
        else:
            raise ValueError("per-CPU leaves must be 8-byte aligned")

    def _widened(self, result: Any) -> Any:
        if ctypes.sizeof(self.sLeaf) % 8 == 0:
            return result
        values = (self.sLeaf * self.total_cpu)()
        for i in range(self.total_cpu):
            values[i] = result[i]
        return values


class PerCpuArray(_PerCpu, ArrayTable):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._per_cpu_leaf()

    def getvalue(self, key: Any) -> Any:
        """The value of every possible CPU."""
        return self._widened(ArrayTable.__getitem__(self, key))

    def __getitem__(self, key: Any) -> Any:
        return self.getvalue(key)

    def __delitem__(self, key: Any) -> None:
        self.clearitem(key)


class PerCpuHash(_PerCpu, Table):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._per_cpu_leaf()

    def getvalue(self, key: Any) -> Any:
        return self._widened(Table.__getitem__(self, key))

    def __getitem__(self, key: Any) -> Any:
        return self.getvalue(key)


class StackTrace(Table):
    """Kernel stack traces by stack id."""

    def walk(self, stack_id: int) -> Iterator[int]:
        """The instruction pointers of one stack, innermost first."""
        if self.flags & _BPF_F_STACK_BUILD_ID:
            raise ValueError("build-id stack traces are not supported")
        stack = self[self.Key(stack_id)]
        for i in range(STACK_MAX_DEPTH):
            ip = int(stack.ip[i])
            if ip == 0:
                return
            yield ip

    def clear(self) -> None:
        """Like bcc: stack trace maps are emptied by deleting ids one by one."""


class PerfEventArray(ArrayTable):
    """A perf event array: its entries are perf event descriptors, one a CPU
    (``sampler.perfring`` opens and reads them)."""


_TABLE_CLASSES: dict[int, type[Table]] = {
    MAP_HASH: Table,
    MAP_LRU_HASH: Table,
    MAP_HASH_OF_MAPS: Table,
    MAP_ARRAY: PlainArray,
    MAP_PROG_ARRAY: ArrayTable,
    MAP_ARRAY_OF_MAPS: ArrayTable,
    MAP_PERF_EVENT_ARRAY: PerfEventArray,
    MAP_PERCPU_HASH: PerCpuHash,
    MAP_LRU_PERCPU_HASH: PerCpuHash,
    MAP_PERCPU_ARRAY: PerCpuArray,
    MAP_STACK_TRACE: StackTrace,
}


class LoadedProgram:
    """The daemon's handle on a loaded module: bcc's ``BPF`` object minus
    the compiler. Owns every descriptor it was given; ``cleanup`` detaches
    the perf events and closes everything."""

    def __init__(self, maps: dict[bytes, tuple[MapSpec, int]],
                 functions: dict[bytes, int]) -> None:
        self._maps = dict(maps)
        self.funcs = {name: Function(name, fd) for name, fd in functions.items()}
        self.tables: dict[bytes, Table] = {}
        self.open_perf_events: dict[tuple[int, int], dict[int, int]] = {}
        self._lib = runtime()

    def map_names(self) -> list[bytes]:
        return list(self._maps)

    def get_table(self, name: bytes | str, keytype: Any = None, leaftype: Any = None) -> Table:
        """A new table object on map ``name``; types not given are bcc's."""
        key = name if isinstance(name, bytes) else name.encode()
        try:
            spec, fd = self._maps[key]
        except KeyError:
            raise KeyError(key) from None
        if keytype is None:
            keytype = decode_type(json.loads(spec.key_desc))
        if leaftype is None:
            leaftype = decode_type(json.loads(spec.leaf_desc))
        for what, ctype, size in (("key", keytype, spec.key_size),
                                  ("value", leaftype, spec.leaf_size)):
            if ctypes.sizeof(ctype) != size:
                raise ValueError(f"map {key.decode()}: the {what} type {ctype.__name__} is "
                                 f"{ctypes.sizeof(ctype)} bytes, the map's {what}s {size}")
        cls = _TABLE_CLASSES.get(spec.map_type)
        if cls is None:
            raise ValueError(f"map {key.decode()}: map type {spec.map_type} is not supported")
        return cls(self, spec, fd, keytype, leaftype)

    def __getitem__(self, name: bytes) -> Any:
        if name not in self.tables:
            self.tables[name] = self.get_table(name)
        return self.tables[name]

    def attach_perf_event(self, ev_type: int, ev_config: int, fn_name: bytes,
                          sample_period: int = 0, sample_freq: int = 0, pid: int = -1,
                          cpu: int = -1, group_fd: int = -1) -> None:
        """Run program ``fn_name`` on a perf event on one CPU, or on each
        online CPU; all or nothing."""
        program = self.funcs[fn_name]
        opened: dict[int, int] = {}
        try:
            for each in [cpu] if cpu >= 0 else online_cpus():
                fd = self._lib.bpf_attach_perf_event(program.fd, ev_type, ev_config,
                                                     sample_period, sample_freq, pid, each,
                                                     group_fd)
                if fd < 0:
                    code = ctypes.get_errno() or errno.EIO
                    raise OSError(code, f"Failed to attach BPF to perf event on CPU {each}: "
                                        f"{os.strerror(code)}")
                opened[each] = fd
        except OSError:
            for fd in opened.values():
                self._lib.bpf_close_perf_event_fd(fd)
            raise
        self.open_perf_events[(ev_type, ev_config)] = opened

    def detach_perf_event(self, ev_type: int, ev_config: int) -> None:
        for fd in self.open_perf_events.pop((ev_type, ev_config)).values():
            self._lib.bpf_close_perf_event_fd(fd)

    def cleanup(self) -> None:
        """Detach the perf events, close every map and program descriptor
        (the kernel unloads what nothing else holds)."""
        for event in list(self.open_perf_events):
            self.detach_perf_event(*event)
        self.tables.clear()
        for function in self.funcs.values():
            os.close(function.fd)
        self.funcs.clear()
        for _spec, fd in self._maps.values():
            os.close(fd)
        self._maps.clear()
