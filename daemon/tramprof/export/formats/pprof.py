"""Profiles as gzipped pprof protobuf (``perftools.profiles.Profile``), the format
``go tool pprof``, Pyroscope, Parca and most profile stores read.

The message classes are built at import from a ``FileDescriptorProto`` written
out below in Python, not from protoc-generated ``_pb2`` code. Generated code is
tied to the protobuf runtime it was generated for (5.26+ gencode refuses older
runtimes and newer runtimes warn on or drop old gencode), and generating it at
install time would need protoc. The descriptor API used here (``descriptor_pb2``,
a private ``DescriptorPool`` and ``GetMessageClass``) is the same on the 4.x, 5.x
and 6.x runtimes and on every backend (upb, cpp, python), and the private pool
cannot clash with another library that registers ``profile.proto`` itself.

The schema is the stable subset of github.com/google/pprof/proto/profile.proto
(fields 1-14 of Profile); field numbers must never change.
"""

from __future__ import annotations

import gzip
import re
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from tramprof.model import FrameSource, MappedFile, Profile

_F = descriptor_pb2.FieldDescriptorProto
_PACKAGE = "perftools.profiles"

# message -> (field name, number, type, repeated, message type name or "")
_SCHEMA: dict[str, tuple[tuple[str, int, int, bool, str], ...]] = {
    "Profile": (
        ("sample_type", 1, _F.TYPE_MESSAGE, True, "ValueType"),
        ("sample", 2, _F.TYPE_MESSAGE, True, "Sample"),
        ("mapping", 3, _F.TYPE_MESSAGE, True, "Mapping"),
        ("location", 4, _F.TYPE_MESSAGE, True, "Location"),
        ("function", 5, _F.TYPE_MESSAGE, True, "Function"),
        ("string_table", 6, _F.TYPE_STRING, True, ""),
        ("drop_frames", 7, _F.TYPE_INT64, False, ""),
        ("keep_frames", 8, _F.TYPE_INT64, False, ""),
        ("time_nanos", 9, _F.TYPE_INT64, False, ""),
        ("duration_nanos", 10, _F.TYPE_INT64, False, ""),
        ("period_type", 11, _F.TYPE_MESSAGE, False, "ValueType"),
        ("period", 12, _F.TYPE_INT64, False, ""),
        ("comment", 13, _F.TYPE_INT64, True, ""),
        ("default_sample_type", 14, _F.TYPE_INT64, False, ""),
    ),
    "ValueType": (
        ("type", 1, _F.TYPE_INT64, False, ""),
        ("unit", 2, _F.TYPE_INT64, False, ""),
    ),
    "Sample": (
        ("location_id", 1, _F.TYPE_UINT64, True, ""),
        ("value", 2, _F.TYPE_INT64, True, ""),
        ("label", 3, _F.TYPE_MESSAGE, True, "Label"),
    ),
    "Label": (
        ("key", 1, _F.TYPE_INT64, False, ""),
        ("str", 2, _F.TYPE_INT64, False, ""),
        ("num", 3, _F.TYPE_INT64, False, ""),
        ("num_unit", 4, _F.TYPE_INT64, False, ""),
    ),
    "Mapping": (
        ("id", 1, _F.TYPE_UINT64, False, ""),
        ("memory_start", 2, _F.TYPE_UINT64, False, ""),
        ("memory_limit", 3, _F.TYPE_UINT64, False, ""),
        ("file_offset", 4, _F.TYPE_UINT64, False, ""),
        ("filename", 5, _F.TYPE_INT64, False, ""),
        ("build_id", 6, _F.TYPE_INT64, False, ""),
        ("has_functions", 7, _F.TYPE_BOOL, False, ""),
        ("has_filenames", 8, _F.TYPE_BOOL, False, ""),
        ("has_line_numbers", 9, _F.TYPE_BOOL, False, ""),
        ("has_inline_frames", 10, _F.TYPE_BOOL, False, ""),
    ),
    "Location": (
        ("id", 1, _F.TYPE_UINT64, False, ""),
        ("mapping_id", 2, _F.TYPE_UINT64, False, ""),
        ("address", 3, _F.TYPE_UINT64, False, ""),
        ("line", 4, _F.TYPE_MESSAGE, True, "Line"),
        ("is_folded", 5, _F.TYPE_BOOL, False, ""),
    ),
    "Line": (
        ("function_id", 1, _F.TYPE_UINT64, False, ""),
        ("line", 2, _F.TYPE_INT64, False, ""),
    ),
    "Function": (
        ("id", 1, _F.TYPE_UINT64, False, ""),
        ("name", 2, _F.TYPE_INT64, False, ""),
        ("system_name", 3, _F.TYPE_INT64, False, ""),
        ("filename", 4, _F.TYPE_INT64, False, ""),
        ("start_line", 5, _F.TYPE_INT64, False, ""),
    ),
}


def _file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto(
        name="tramprof/pprof/profile.proto", package=_PACKAGE, syntax="proto3")
    for message_name, fields in _SCHEMA.items():
        message = file.message_type.add(name=message_name)
        for name, number, type_, repeated, type_name in fields:
            field = message.field.add(
                name=name, number=number, type=type_,
                label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
            if type_name:
                field.type_name = f".{_PACKAGE}.{type_name}"
    return file


def _message_classes() -> dict[str, Any]:
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(_file_descriptor().SerializeToString())
    get_class = getattr(message_factory, "GetMessageClass", None)
    if get_class is None:  # protobuf < 4.22 has only the (since removed) factory API
        get_class = message_factory.MessageFactory(pool).GetPrototype  # type: ignore[attr-defined]
    return {name: get_class(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))
            for name in _SCHEMA}


_CLASSES = _message_classes()

#: The ``perftools.profiles.Profile`` message class; tests decode with it.
ProfileMessage: Any = _CLASSES["Profile"]


class _Strings:
    """The profile's string table: index 0 is always the empty string."""

    def __init__(self) -> None:
        self.table: list[str] = [""]
        self._index: dict[str, int] = {"": 0}

    def __call__(self, text: str) -> int:
        index = self._index.get(text)
        if index is None:
            index = self._index[text] = len(self.table)
            self.table.append(text)
        return index


def _valid_utf8(text: str) -> str:
    """Protobuf strings must be valid UTF-8; lone surrogates become escapes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


# A shared library's file name: libc.so.6, libfoo.so, libbar-2.0.so.1.2.
_SHARED_LIBRARY = re.compile(r"\.so$|\.so[._][0-9]")

#: Prefix of Python frame names in perf maps: ``py::<qualname>:<filename>``
#: (CPython's ``-X perf`` and the trampoline runtime write the same).
PYTHON_PREFIX = "py::"


def python_name(frame: str) -> tuple[str, str] | None:
    """(qualname, file name) of a Python frame name, None for other frames.
    A qualname holds no ``:``, a file name may: the first one separates them."""
    if not frame.startswith(PYTHON_PREFIX):
        return None
    qualname, colon, filename = frame[len(PYTHON_PREFIX):].partition(":")
    if not colon or not qualname:
        return None
    return qualname, filename


class _Builder:
    """The profile's Mapping, Function and Location tables, each entry once."""

    def __init__(self, message: Any, strings: _Strings) -> None:
        self._message = message
        self._strings = strings
        self._mappings: dict[MappedFile, int] = {}
        self._functions: dict[tuple[str, str], int] = {}
        self._locations: dict[tuple[str, FrameSource | None], int] = {}
        # The same, by the source's identity: stored stacks share one object
        # per address, and hashing it by value costs several times more.
        self._by_identity: dict[tuple[str, int], int] = {}

    def location(self, frame: str, source: FrameSource | None) -> int:
        fast = (frame, id(source))
        location_id = self._by_identity.get(fast)
        if location_id is not None:
            return location_id
        key = (frame, source)
        location_id = self._locations.get(key)
        if location_id is not None:
            self._by_identity[fast] = location_id
            return location_id
        location_id = self._locations[key] = self._by_identity[fast] = len(self._locations) + 1
        location = self._message.location.add(id=location_id)
        python = python_name(frame)
        line = 0
        if source is not None:
            location.address = source.address
            if source.mapping is not None:
                location.mapping_id = self._mapping(source.mapping)
            line = source.line
        if python is not None:
            name, filename = python
        else:
            name = frame
            filename = source.file if source is not None else ""
        function_id = self._function(name, frame, filename)
        location.line.add(function_id=function_id, line=line)
        return location_id

    def _function(self, name: str, system_name: str, filename: str) -> int:
        key = (system_name, filename)
        function_id = self._functions.get(key)
        if function_id is None:
            function_id = self._functions[key] = len(self._functions) + 1
            strings = self._strings
            self._message.function.add(
                id=function_id, name=strings(_valid_utf8(name) or "[empty]"),
                system_name=strings(_valid_utf8(system_name) or "[empty]"),
                filename=strings(_valid_utf8(filename)))
        return function_id

    def _mapping(self, mapped: MappedFile) -> int:
        mapping_id = self._mappings.get(mapped)
        if mapping_id is None:
            mapping_id = self._mappings[mapped] = len(self._mappings) + 1
        return mapping_id

    def add_mappings(self) -> None:
        """The Mapping table, the main executable first: tools take the first
        mapping for the profiled program (``File:`` in pprof's reports). It is
        the first that is neither a shared library nor bracketed (pprof's own
        guess when it converts perf data)."""
        mappings = list(self._mappings.items())
        main = next((i for i, (mapped, _) in enumerate(mappings)
                     if not mapped.path.startswith("[")
                     and _SHARED_LIBRARY.search(mapped.path) is None), 0)
        if mappings:
            mappings.insert(0, mappings.pop(main))
        for mapped, mapping_id in mappings:
            self._message.mapping.add(
                id=mapping_id, memory_start=mapped.start, memory_limit=mapped.end,
                file_offset=mapped.file_offset,
                filename=self._strings(_valid_utf8(mapped.path)),
                build_id=self._strings(mapped.build_id),
                # Named already: tools must not look the binaries up again
                # unless asked to (go tool pprof -symbolize=force).
                has_functions=True)


def encode_pprof(profile: Profile) -> bytes:
    """The profile as a gzipped pprof message with samples and CPU time per stack.

    Sample locations are leaf first, as pprof expects; values are
    ``[samples, samples * period_ns]`` (period 1e9/frequency ns); labels
    carry ``pid``, ``comm`` (the thread's name), ``process`` and the
    profile's per-process labels (``container_id``, ``pod_uid``).

    Frames whose code is known (``Stack.sources``) get a Location with their
    address and Mapping (file, offsets, build id; the kernel as
    ``[kernel.kallsyms]``), so tools can re-symbolize and find lines from
    DWARF (``go tool pprof -symbolize=local:force``). Python frames
    (``py::qualname:file``) become Function ``qualname`` in ``file``, the
    whole perf map name kept as its system name; they carry no line (perf
    map names have none) unless a jitdump gave one. Other frames keep their
    name. Marker frames and stacks without sources get one address-less
    Location per name.

    Compressed at gzip level 1, as Go's ``runtime/pprof`` writes its
    profiles: for a busy node's minute (1.1-2 MB raw) 10-24 ms instead of
    34-88 ms at level 6, for ~5% more bytes (``benchmarks/bench_export.py``).
    """
    classes = _CLASSES
    strings = _Strings()
    message = classes["Profile"]()
    value_type = classes["ValueType"]
    message.sample_type.append(value_type(type=strings("samples"), unit=strings("count")))
    message.sample_type.append(value_type(type=strings("cpu"), unit=strings("nanoseconds")))
    message.period_type.type = strings("cpu")
    message.period_type.unit = strings("nanoseconds")
    message.period = profile.period_ns
    message.time_nanos = profile.start_ns
    message.duration_nanos = profile.duration_ns
    message.default_sample_type = strings("cpu")

    builder = _Builder(message, strings)
    pid_key, comm_key, process_key = strings("pid"), strings("comm"), strings("process")
    label = classes["Label"]
    period = profile.period_ns
    process_labels: dict[int, list[Any]] = {}
    for pid, extra in profile.process_labels.items():
        process_labels[pid] = [label(key=strings(key), str=strings(_valid_utf8(value)))
                               for key, value in sorted(extra.items()) if value]
    # The labels of each (pid, thread name, process name), made once: a
    # window has thousands of stacks from a few hundred of them.
    labels_of: dict[tuple[int, str, str], list[Any]] = {}
    add_sample = message.sample.add
    for stack in profile.stacks:
        frames = stack.frames
        sources = stack.sources if len(stack.sources) == len(frames) else (None,) * len(frames)
        location_ids = [builder.location(frames[i], sources[i])
                        for i in range(len(frames) - 1, -1, -1)]
        who = (stack.pid, stack.comm, stack.process)
        labels = labels_of.get(who)
        if labels is None:
            labels = labels_of[who] = [
                label(key=pid_key, num=stack.pid),
                label(key=comm_key, str=strings(_valid_utf8(stack.comm))),
                label(key=process_key, str=strings(_valid_utf8(stack.process))),
                *process_labels.get(stack.pid, ())]
        add_sample(location_id=location_ids,
                   value=[stack.count, stack.count * period], label=labels)
    builder.add_mappings()
    message.string_table.extend(strings.table)
    return gzip.compress(message.SerializeToString(), compresslevel=1, mtime=0)
