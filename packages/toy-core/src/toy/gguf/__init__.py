"""GGUF in and out: the only model and checkpoint format toy uses.

- ``GGUFFile``: read (memory-mapped, validated, zero-copy tensor bytes).
- ``GGUFWriter``: write atomically.
- ``quantize_model``: convert a model between weight types (``toy quantize``).
- ``bind_tensors``: ggml tensors over a file's data without copying (CPU) or
  copied once into a device buffer (other devices).
"""

from toy.gguf.bind import BoundTensors, bind_tensors
from toy.gguf.constants import Keys, ValueType
from toy.gguf.convert import QuantizeReport, quantize_model
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
    "QuantizeReport",
    "bind_tensors",
    "copy_metadata",
    "quantize_model",
]
