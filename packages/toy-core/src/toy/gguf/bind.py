"""ggml tensors over a GGUF file's data.

On the CPU the tensors point straight into the read-only file mapping (no
copy, quantized types stay quantized); the mapping lives as long as any of
them. On another device each tensor is copied once into a device buffer.

A model split across devices (``toy.engine.split``) passes ``device_of``:
each tensor then goes to the device it names, the local ones as above and
each other device's in one context of its own, allocated there as weights
(so the scheduler runs the products on the device that holds the weight)
and filled once from the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import toy_ggml
from toy.gguf.reader import GGUFFile, TensorInfo


@dataclass
class BoundTensors:
    """The context holding the tensors, and the tensors by GGUF name."""

    context: toy_ggml.Context
    tensors: dict[str, toy_ggml.Tensor]
    zero_copy: bool
    #: the contexts of the tensors on other devices than the runtime's primary one (a split model)
    remote: list[toy_ggml.Context] = field(default_factory=list)

    def __getitem__(self, name: str) -> toy_ggml.Tensor:
        return self.tensors[name]

    def close(self) -> None:
        for ctx in self.remote:
            ctx.close()
        self.remote.clear()
        self.context.close()


def bind_tensors(
    gf: GGUFFile, runtime: toy_ggml.Runtime | None = None, device_of: Callable[[str], str | None] | None = None
) -> BoundTensors:
    """Make a ggml tensor for every tensor of ``gf``: zero-copy on the CPU
    (``runtime`` None or a CPU runtime), copied to ``runtime``'s device
    otherwise. ``device_of`` (a split model): the backend name of ``runtime``
    that holds each tensor by GGUF name (None or the primary's: as above)."""
    primary = "" if runtime is None else runtime.backends[0]
    where: dict[str, list[TensorInfo]] = {}
    for info in gf.tensors.values():
        dev = device_of(info.name) if device_of is not None else None
        where.setdefault(dev or primary, []).append(info)
    ctx = toy_ggml.Context(max_tensors=len(where.get(primary, ())) + 16)
    out: dict[str, toy_ggml.Tensor] = {}
    for info in where.get(primary, ()):
        out[info.name] = ctx.tensor(info.dtype, info.shape, name=info.name)
    split = len(where) > 1 or primary not in where
    zero_copy = runtime is None or runtime.device == "CPU"
    bound = BoundTensors(ctx, out, zero_copy)
    try:
        if out and zero_copy:
            # a split model's local weights are marked as weights: the scheduler then runs their ops here
            # (unmarked, it would run the head on a remote device and send it the head's weights every step)
            buf = toy_ggml.buffer_from_memory(gf._map, weights=split)
            for info in where[primary]:
                out[info.name].bind(buf, gf.data_offset + info.offset)
            buf.close()  # the context owns it now; freed with the context
        elif out:
            ctx.allocate(runtime, weights=split)
            for info in where[primary]:
                out[info.name].set_raw(gf.tensor_bytes(info.name))
        for dev, infos in where.items():
            if dev == primary:
                continue
            rctx = toy_ggml.Context(max_tensors=len(infos) + 16)
            bound.remote.append(rctx)
            for info in infos:
                out[info.name] = rctx.tensor(info.dtype, info.shape, name=info.name)
            rctx.allocate(runtime, device=dev, weights=True)
            for info in infos:
                out[info.name].set_raw(gf.tensor_bytes(info.name))
    except BaseException:
        bound.close()
        raise
    return bound
