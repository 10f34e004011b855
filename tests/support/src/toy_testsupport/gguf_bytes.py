"""A raw GGUF byte builder for reader tests, written from the format spec
(little-endian; see toy.gguf.constants' docstring) independently of toy's
GGUFWriter, so reader tests do not rely on the writer they help test.

``build(kvs, tensors)``: kvs is a list of (key, type_tag, payload_bytes);
tensors a list of (name, dims_ggml_order, type_tag, offset, data_bytes).
"""

from __future__ import annotations

import struct

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)


def s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def kv(key: str, tag: int, payload: bytes) -> tuple[str, int, bytes]:
    return (key, tag, payload)


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def arr(elem_tag: int, items: list[bytes]) -> bytes:
    return struct.pack("<IQ", elem_tag, len(items)) + b"".join(items)


def build(kvs, tensors=(), version=3, alignment=32, magic=b"GGUF", n_kv=None, n_tensors=None) -> bytes:
    out = [magic, struct.pack("<I", version)]
    out.append(struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv))
    for key, tag, payload in kvs:
        out.append(s(key) + struct.pack("<I", tag) + payload)
    for name, dims, tag, offset, _ in tensors:
        out.append(s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims))
        out.append(struct.pack("<IQ", tag, offset))
    head = b"".join(out)
    head += b"\0" * ((-len(head)) % alignment)
    data = bytearray()
    for _, _, _, offset, blob in tensors:
        if not blob:
            continue  # an info only (e.g. a forged offset): no data
        if len(data) < offset:
            data += b"\0" * (offset - len(data))
        data[offset : offset + len(blob)] = blob
    return head + bytes(data)
