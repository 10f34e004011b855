"""ggml tensors over a GGUF file's data.

On the CPU the tensors point straight into the read-only file mapping (no
copy, quantized types stay quantized); the mapping lives as long as any of
them. On another device each tensor is copied once into a device buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import toy_ggml
from toy.gguf.reader import GGUFFile


@dataclass
class BoundTensors:
    """The context holding the tensors, and the tensors by GGUF name."""

    context: toy_ggml.Context
    tensors: dict[str, toy_ggml.Tensor]
    zero_copy: bool

    def __getitem__(self, name: str) -> toy_ggml.Tensor:
        return self.tensors[name]

    def close(self) -> None:
        self.context.close()


def bind_tensors(gf: GGUFFile, runtime: toy_ggml.Runtime | None = None) -> BoundTensors:
    """Make a ggml tensor for every tensor of ``gf``: zero-copy on the CPU
    (``runtime`` None or a CPU runtime), copied to ``runtime``'s device
    otherwise."""
    ctx = toy_ggml.Context(max_tensors=len(gf.tensors) + 16)
    out: dict[str, toy_ggml.Tensor] = {}
    for info in gf.tensors.values():
        out[info.name] = ctx.tensor(info.dtype, info.shape, name=info.name)
    zero_copy = runtime is None or runtime.device == "CPU"
    if not out:
        return BoundTensors(ctx, out, zero_copy)
    if zero_copy:
        buf = toy_ggml.buffer_from_memory(gf._map)
        for info in gf.tensors.values():
            out[info.name].bind(buf, gf.data_offset + info.offset)
        buf.close()  # the context owns it now; freed with the context
    else:
        ctx.allocate(runtime)
        for info in gf.tensors.values():
            out[info.name].set_raw(gf.tensor_bytes(info.name))
    return BoundTensors(ctx, out, zero_copy)
