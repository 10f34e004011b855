"""GGUF in and out: the only model and checkpoint format toy uses.

- ``GGUFFile``: read (memory-mapped, validated, zero-copy tensor bytes).
- ``GGUFWriter``: write atomically.
- ``bind_tensors``: ggml tensors over a file's data without copying (CPU) or
  copied once into a device buffer (other devices).
"""

from toy.gguf.bind import BoundTensors, bind_tensors
from toy.gguf.constants import Keys, ValueType
from toy.gguf.reader import GGUFError, GGUFFile, TensorInfo, TypeInfo
from toy.gguf.writer import GGUFWriter, copy_metadata

__all__ = [
    "BoundTensors",
    "GGUFError",
    "GGUFFile",
    "GGUFWriter",
    "Keys",
    "TensorInfo",
    "TypeInfo",
    "ValueType",
    "bind_tensors",
    "copy_metadata",
]
