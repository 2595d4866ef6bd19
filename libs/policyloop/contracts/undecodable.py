"""Why bytes do not parse as a protobuf message, naming the field: the parser's own error says
only "String field had bad UTF-8" or "Error parsing message", which a client cannot act on."""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


def decode_problem(message_class: type[Message], data: bytes) -> str | None:
    """None if `data` parses as `message_class`; otherwise what is wrong, as '<field>: <problem>'
    (the field dotted from the message's top, e.g. 'header.model'), or 'request: ...' where no
    field can be named."""
    try:
        message_class.FromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:  # upb raises DecodeError; others RuntimeError
        return _first_bad_field(message_class.DESCRIPTOR, data, "") or \
            f"request: not a valid {message_class.DESCRIPTOR.full_name} ({exc})"
    return None


def _first_bad_field(descriptor: Descriptor, data: bytes, prefix: str) -> str | None:
    """Walks the wire format: the first string that is not UTF-8, or the first field whose
    framing is broken (None when the fault is not one a field can be blamed for)."""
    at = 0
    while at < len(data):
        try:
            tag, at = _varint(data, at)
            number, wire = tag >> 3, tag & 7
            field = descriptor.fields_by_number.get(number)
            name = f"{prefix}{field.name}" if field else f"{prefix}<field {number}>"
            if wire == _VARINT:
                _, at = _varint(data, at)
            elif wire in (_FIXED64, _FIXED32):
                at += 8 if wire == _FIXED64 else 4
            elif wire == _LENGTH:
                size, at = _varint(data, at)
                value, at = data[at:at + size], at + size
                if len(value) < size:
                    return f"{name}: truncated ({len(value)} of {size} bytes)"
                problem = _bad_value(field, value, name)
                if problem:
                    return problem
            else:
                return f"{name}: wire type {wire} is not used by this API (groups)"
        except IndexError:
            return f"{prefix or 'request'}: truncated"
        if at > len(data):
            return f"{name}: truncated"
    return None


def _bad_value(field: FieldDescriptor | None, value: bytes, name: str) -> str | None:
    if field is None:
        return None
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            value.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"{name}: not valid UTF-8 (byte {exc.start}: {value[exc.start:exc.start + 1]!r}); " \
                   f"strings must be UTF-8"
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return _first_bad_field(field.message_type, value, f"{name}.")
    return None


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise IndexError("varint longer than 10 bytes")
