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
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from tramprof.model import Profile

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


def encode_pprof(profile: Profile) -> bytes:
    """The profile as a gzipped pprof message with samples and CPU time per stack.

    Each distinct frame name gets one Function and one Location (address 0,
    no mapping: the names are already resolved). Sample locations are leaf
    first, as pprof expects; values are ``[samples, samples * period_ns]``;
    labels carry ``pid``, ``comm`` (thread) and ``process``.
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

    location_ids: dict[str, int] = {}
    pid_key, comm_key, process_key = strings("pid"), strings("comm"), strings("process")
    label = classes["Label"]
    period = profile.period_ns
    for stack in profile.stacks:
        ids = []
        for frame in reversed(stack.frames):
            location_id = location_ids.get(frame)
            if location_id is None:
                location_id = location_ids[frame] = len(location_ids) + 1
                message.function.add(id=location_id,
                                     name=strings(_valid_utf8(frame) or "[empty]"))
                location = message.location.add(id=location_id)
                location.line.add(function_id=location_id)
            ids.append(location_id)
        message.sample.add(
            location_id=ids, value=[stack.count, stack.count * period],
            label=[label(key=pid_key, num=stack.pid),
                   label(key=comm_key, str=strings(_valid_utf8(stack.comm))),
                   label(key=process_key, str=strings(_valid_utf8(stack.process)))])
    message.string_table.extend(strings.table)
    return gzip.compress(message.SerializeToString(), compresslevel=6, mtime=0)
