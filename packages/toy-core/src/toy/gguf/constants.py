"""GGUF format constants: value types, limits and the keys toy reads and writes.

GGUF (v2 and v3, little-endian) is:

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key: string, type: u32, value)
    n_tensors x (name: string, n_dims: u32, dims: u64[n_dims], type: u32, offset: u64)
    padding to `general.alignment` (default 32)
    tensor data (each tensor at data_start + offset, offsets aligned)

A string is a u64 byte length followed by UTF-8 bytes. An array is an element
type u32, a u64 count and the elements; arrays may nest.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Limits that keep a forged file from costing unbounded time or memory. Real
# files stay far below them (SmolLM2: 30 keys, 272 tensors, 49152-token vocab).
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 20
MAX_KEY_BYTES = 1 << 16
MAX_ARRAY_DEPTH = 8
MAX_DIMS = 4  # GGML_MAX_DIMS


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# fixed-size scalar types: struct code and NumPy dtype (little-endian)
SCALAR: dict[ValueType, tuple[str, np.dtype[Any]]] = {
    ValueType.UINT8: ("<B", np.dtype("<u1")),
    ValueType.INT8: ("<b", np.dtype("<i1")),
    ValueType.UINT16: ("<H", np.dtype("<u2")),
    ValueType.INT16: ("<h", np.dtype("<i2")),
    ValueType.UINT32: ("<I", np.dtype("<u4")),
    ValueType.INT32: ("<i", np.dtype("<i4")),
    ValueType.FLOAT32: ("<f", np.dtype("<f4")),
    ValueType.BOOL: ("<?", np.dtype("?")),
    ValueType.UINT64: ("<Q", np.dtype("<u8")),
    ValueType.INT64: ("<q", np.dtype("<i8")),
    ValueType.FLOAT64: ("<d", np.dtype("<f8")),
}

DTYPE_TO_VALUE_TYPE = {np.dtype(dt).newbyteorder("<"): vt for vt, (_, dt) in SCALAR.items()}


class Keys:
    """Metadata keys toy reads or writes (``{arch}`` is general.architecture)."""

    ARCHITECTURE = "general.architecture"
    NAME = "general.name"
    ALIGNMENT = "general.alignment"
    FILE_TYPE = "general.file_type"
    QUANT_VERSION = "general.quantization_version"

    CONTEXT_LENGTH = "{arch}.context_length"
    EMBEDDING_LENGTH = "{arch}.embedding_length"
    BLOCK_COUNT = "{arch}.block_count"
    FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"
    HEAD_COUNT = "{arch}.attention.head_count"
    HEAD_COUNT_KV = "{arch}.attention.head_count_kv"
    KEY_LENGTH = "{arch}.attention.key_length"
    VALUE_LENGTH = "{arch}.attention.value_length"
    RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"
    NORM_EPS = "{arch}.attention.layer_norm_epsilon"
    ROPE_FREQ_BASE = "{arch}.rope.freq_base"
    ROPE_DIMENSION_COUNT = "{arch}.rope.dimension_count"
    ROPE_SCALING_TYPE = "{arch}.rope.scaling.type"
    ROPE_SCALING_FACTOR = "{arch}.rope.scaling.factor"
    ROPE_SCALING_ORIG_CTX = "{arch}.rope.scaling.original_context_length"
    VOCAB_SIZE = "{arch}.vocab_size"

    TOKENIZER_MODEL = "tokenizer.ggml.model"
    TOKENIZER_PRE = "tokenizer.ggml.pre"
    TOKENS = "tokenizer.ggml.tokens"
    SCORES = "tokenizer.ggml.scores"
    TOKEN_TYPE = "tokenizer.ggml.token_type"
    MERGES = "tokenizer.ggml.merges"
    BOS_ID = "tokenizer.ggml.bos_token_id"
    EOS_ID = "tokenizer.ggml.eos_token_id"
    UNK_ID = "tokenizer.ggml.unknown_token_id"
    PAD_ID = "tokenizer.ggml.padding_token_id"
    ADD_BOS = "tokenizer.ggml.add_bos_token"
    ADD_EOS = "tokenizer.ggml.add_eos_token"
    CHAT_TEMPLATE = "tokenizer.chat_template"
