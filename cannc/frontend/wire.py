"""The protobuf wire format, read directly where parsing would copy the weights.

A ModelProto's weights are the raw_data of its initializers: ModelProto.graph (field 7)
-> GraphProto.initializer (5) -> TensorProto.raw_data (9). Parsing copies each into a
bytes object of its own (BERT-base: 420 MB, 0.4-0.9 s here, then numpy_helper.to_array
copies it again). `strip_raw_data` finds them in the file's bytes instead and returns
the model without them, which parses in milliseconds, plus where each one lies, so
that the importer views the weights in the buffer it already holds.

Only what this needs is read: lengths, tags and nested message bounds. Anything
unusual (a second graph field, a tensor with two raw_data fields, a group) leaves the
bytes as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

MODEL_GRAPH, GRAPH_INITIALIZER, TENSOR_RAW_DATA = 7, 5, 9


def varint(b: Any, i: int, end: int) -> tuple[int, int]:
    """(value, next offset) of the varint at b[i]."""
    v = shift = 0
    while True:
        if i >= end or shift > 63:
            raise ValueError("bad varint")
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        if c < 0x80:
            return v, i
        shift += 7


def encode_varint(v: int) -> bytes:
    out = bytearray()
    while True:
        c = v & 0x7F
        v >>= 7
        if v:
            out.append(c | 0x80)
        else:
            out.append(c)
            return bytes(out)


def fields_at(b: Any, i: int, end: int) -> Iterator[tuple[int, int, Any, int, int]]:
    """(field number, wire type, value or (start, end) of a length-delimited field's
    payload, the field's first byte, the byte after it) of a message in b[i:end]."""
    while i < end:
        start = i
        tag, i = varint(b, i, end)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            v, i = varint(b, i, end)
            yield field, wire, v, start, i
        elif wire == 2:
            n, i = varint(b, i, end)
            if i + n > end:
                raise ValueError("truncated field")
            yield field, wire, (i, i + n), start, i + n
            i += n
        elif wire == 1:
            i += 8
            yield field, wire, None, start, i
        elif wire == 5:
            i += 4
            yield field, wire, None, start, i
        else:
            raise ValueError("group fields")
    if i != end:
        raise ValueError("truncated message")


def fields(b: Any, i: int, end: int) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value or (start, end)) of a message in b[i:end]."""
    for f, w, v, _, _ in fields_at(b, i, end):
        yield f, w, v


def _delimited(field: int, payload: bytes) -> bytes:
    return encode_varint(field << 3 | 2) + encode_varint(len(payload)) + payload


def strip_raw_data(b: Any, min_bytes: int) -> tuple[bytes, dict[int, tuple[int, int]]]:
    """The serialised ModelProto `b` without the raw_data of every initializer holding at
    least `min_bytes` of it, and {initializer index: (start, end) of its raw_data in b}.
    Raises ValueError for bytes that are not such a model (parse them as usual then)."""
    if not isinstance(b, bytes):
        b = memoryview(b).cast("B")       # (indexing gives ints, as bytes does)
    end = len(b)
    out: list[bytes] = []
    found: dict[int, tuple[int, int]] = {}
    graphs = 0
    for f, w, v, s, e in fields_at(b, 0, end):
        if f != MODEL_GRAPH or w != 2:
            out.append(bytes(b[s:e]))
            continue
        graphs += 1
        if graphs > 1:
            raise ValueError("more than one graph field")
        graph: list[bytes] = []
        index = 0
        for gf, gw, gv, gs, ge in fields_at(b, *v):
            if gf != GRAPH_INITIALIZER or gw != 2:
                graph.append(bytes(b[gs:ge]))
                continue
            raw = [(tv, ts, te) for tf, tw, tv, ts, te in fields_at(b, *gv)
                   if tf == TENSOR_RAW_DATA and tw == 2]
            if len(raw) == 1 and raw[0][0][1] - raw[0][0][0] >= min_bytes:
                (span, ts, te) = raw[0]
                tensor = bytes(b[gv[0]:ts]) + bytes(b[te:gv[1]])
                graph.append(_delimited(GRAPH_INITIALIZER, tensor))
                found[index] = span
            else:
                graph.append(bytes(b[gs:ge]))
            index += 1
        out.append(_delimited(MODEL_GRAPH, b"".join(graph)))
    return b"".join(out), found
