"""ViT classifiers as GGUF files: metadata keys, reading and writing.

Layout (``general.architecture = "vit"``; every tensor F32, NumPy shapes as
``toy_vit.model.params`` lists them, names in llama.cpp's vision style)::

    general.architecture               string   "vit"
    general.name                       string
    vit.image_size                     uint32   square input side, pixels
    vit.patch_size                     uint32   square patch side, pixels
    vit.num_channels                   uint32
    vit.embedding_length               uint32   d_model
    vit.block_count                    uint32   n_layer
    vit.attention.head_count           uint32
    vit.feed_forward_length            uint32   d_ff
    vit.attention.layer_norm_epsilon   float32
    vit.num_classes                    uint32
    vit.labels                         [string] one per class, in class order
    vit.image_mean                     [float32] one per channel
    vit.image_std                      [float32] one per channel

The block count, width, head count, MLP width and epsilon keys have
llama.cpp's names (so toy's model card reads them as for any model); the
image keys are toy's. The patch-embedding weight keeps the Conv2d weight's
4-D shape (D, C, p, p): the graph views it as (D, C·p·p).

Writing goes through ``toy.gguf.GGUFWriter`` (atomic: a temporary file
renamed into place). Reading goes through ``toy.gguf.GGUFFile`` (a
read-only memory map): ``config_from_metadata`` checks every key (present,
a whole number where one is expected, array lengths) and every tensor
(present, F32, its shape), and raises ``ViTFileError`` (a
``toy.models.UnsupportedModelError``, so a ``toy.errors.BadInputError``)
naming the first key or tensor that is wrong. Tensors a file has beyond the
model's are ignored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from toy.models import UnsupportedModelError, validate
from toy_vit.config import ViTConfig, ViTConfigError

ARCH = "vit"

#: ViTConfig field -> metadata key (whole numbers, stored as uint32)
INT_KEYS = {
    "image_size": "vit.image_size",
    "patch_size": "vit.patch_size",
    "n_channels": "vit.num_channels",
    "d_model": "vit.embedding_length",
    "n_layer": "vit.block_count",
    "n_head": "vit.attention.head_count",
    "d_ff": "vit.feed_forward_length",
    "n_classes": "vit.num_classes",
}
EPS_KEY = "vit.attention.layer_norm_epsilon"
LABELS_KEY = "vit.labels"
MEAN_KEY, STD_KEY = "vit.image_mean", "vit.image_std"

#: bounds of the whole-number keys (``toy.models.validate``: far above any real model, checked before a
#: value sizes a loop or a shape)
_BOUNDS = {
    "image_size": validate.LIMITS["width"],
    "patch_size": validate.LIMITS["width"],
    "n_channels": 4096,
    "d_model": validate.LIMITS["width"],
    "n_layer": validate.LIMITS["layers"],
    "n_head": validate.LIMITS["heads"],
    "d_ff": validate.LIMITS["width"],
    "n_classes": validate.LIMITS["vocab"],
}
# tensor name suffix -> the symbol of each axis, for the shape check's messages (``_sources``)
_AXES = {
    "v.patch_embd.weight": ("d", "channels", "patch", "patch"),
    "v.patch_embd.bias": ("d",),
    "v.class_embd": ("d",),
    "v.position_embd.weight": ("tokens", "d"),
    "ffn_up.weight": ("ff", "d"),
    "ffn_up.bias": ("ff",),
    "ffn_down.weight": ("d", "ff"),
    "cls.weight": ("classes", "d"),
    "cls.bias": ("classes",),
}


class ViTFileError(UnsupportedModelError):
    """A file is not a ViT classifier toy-vit can run; the message names the
    key or tensor."""


def metadata(cfg: ViTConfig, name: str = "vit") -> dict[str, Any]:
    """The GGUF metadata of a model of this config (key -> value or
    ``(value, TypeInfo)``)."""
    from toy.gguf.constants import ValueType
    from toy.gguf.reader import TypeInfo

    u32 = TypeInfo(ValueType.UINT32)
    out: dict[str, Any] = {"general.architecture": ARCH, "general.name": name}
    out.update({key: (int(getattr(cfg, f)), u32) for f, key in INT_KEYS.items()})
    out[EPS_KEY] = (float(cfg.norm_eps), TypeInfo(ValueType.FLOAT32))
    out[LABELS_KEY] = list(cfg.labels)
    out[MEAN_KEY] = np.asarray(cfg.image_mean, np.float32)
    out[STD_KEY] = np.asarray(cfg.image_std, np.float32)
    return out


def _f32(v) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it
    (1e-12 reads back as 1e-12, not 9.99999996e-13), so configs round-trip."""
    return float(str(np.float32(v)))


def _whole(metadata: Mapping[str, Any], key: str) -> int:
    if key not in metadata:
        raise ViTFileError(f"the vit model lacks metadata key {key!r}")
    v = metadata[key]
    if isinstance(v, (bool, str, bytes)) or not isinstance(v, (int, np.integer)):
        raise ViTFileError(f"metadata {key!r} is {v!r}, not a whole number")
    return int(v)


def _floats(metadata: Mapping[str, Any], key: str, n: int) -> tuple[float, ...]:
    if key not in metadata:
        raise ViTFileError(f"the vit model lacks metadata key {key!r}")
    v = metadata[key]
    arr = np.asarray(v) if not isinstance(v, (str, bytes)) else np.asarray([])
    if arr.ndim != 1 or arr.dtype.kind not in "fiu" or len(arr) != n:
        raise ViTFileError(f"metadata {key!r} must be {n} numbers (one per channel), got {v!r}")
    return tuple(_f32(x) for x in arr)


def config_from_metadata(metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> ViTConfig:
    """The config of a ViT file from its metadata and ``{name: TensorInfo}``
    (see the module docstring for what is checked)."""
    from toy_vit.model import params

    a = metadata.get("general.architecture")
    if a != ARCH:
        raise ViTFileError(
            f"general.architecture = {a!r}: architecture {a!r} is not vit",
            hint="toy-vit runs ViT classifiers written by toy vit",
        )
    dims: dict[str, Any] = {f: _whole(metadata, key) for f, key in INT_KEYS.items()}  # ViTConfig(**dims)
    for f, key in INT_KEYS.items():
        if f != "n_layer" and not 1 <= dims[f] <= _BOUNDS[f]:
            raise ViTFileError(f"{key} = {dims[f]} is out of range: expected 1..{_BOUNDS[f]}")
    # before params(cfg) builds a list per declared block: the count must be the blocks the file holds
    validate.check_blocks(INT_KEYS["n_layer"], dims["n_layer"], tensors, prefix="v.", error=ViTFileError)
    eps = metadata.get(EPS_KEY)
    if eps is None:
        raise ViTFileError(f"the vit model lacks metadata key {EPS_KEY!r}")
    if isinstance(eps, (bool, str, bytes)) or not isinstance(eps, (int, float, np.floating)):
        raise ViTFileError(f"metadata {EPS_KEY!r} is {eps!r}, not a number")
    labels = metadata.get(LABELS_KEY)
    if labels is None:
        raise ViTFileError(f"the vit model lacks metadata key {LABELS_KEY!r}")
    if isinstance(labels, (str, bytes)) or not all(isinstance(x, str) for x in labels):
        raise ViTFileError(f"metadata {LABELS_KEY!r} must be an array of strings")
    labels = tuple(labels)
    if len(labels) != dims["n_classes"]:
        raise ViTFileError(f"metadata {LABELS_KEY!r} has {len(labels)} names for vit.num_classes={dims['n_classes']}")
    C = max(dims["n_channels"], 0)
    try:
        cfg = ViTConfig(
            **dims,
            norm_eps=_f32(eps),
            labels=labels,
            image_mean=_floats(metadata, MEAN_KEY, C),
            image_std=_floats(metadata, STD_KEY, C),
        )
    except ViTConfigError as e:
        named = {**INT_KEYS, "norm_eps": EPS_KEY}
        keys = [k for f, k in named.items() if f"{f}=" in str(e)]  # the keys of the fields it names
        raise ViTFileError(f"the vit metadata is inconsistent ({', '.join(keys)}): {e}", hint=e.hint) from None
    spec = params(cfg)
    validate.check_shapes(ARCH, spec, tensors, _sources(cfg), _AXES, error=ViTFileError)
    for name in spec:
        t = tensors[name]
        if t.dtype.name != "F32":
            raise ViTFileError(f"tensor {name!r} is {t.dtype.name}; toy-vit reads F32 tensors only")
    return cfg


def _sources(cfg: ViTConfig) -> dict[str, tuple[str, int | None]]:
    """The metadata keys the tensor shapes are made of (``toy.models.validate.check_shapes``)."""
    return {
        "d": (INT_KEYS["d_model"], cfg.d_model),
        "ff": (INT_KEYS["d_ff"], cfg.d_ff),
        "channels": (INT_KEYS["n_channels"], cfg.n_channels),
        "patch": (INT_KEYS["patch_size"], cfg.patch_size),
        "tokens": (f"({INT_KEYS['image_size']} / {INT_KEYS['patch_size']})² + 1", cfg.n_tokens),
        "classes": (INT_KEYS["n_classes"], cfg.n_classes),
    }


def config_from_gguf(gf) -> ViTConfig:
    """The config of an open ``toy.gguf.GGUFFile``."""
    return config_from_metadata(gf.metadata, gf.tensors)


def write_gguf(path: str | os.PathLike, cfg: ViTConfig, tensors: Mapping[str, np.ndarray], name: str = "vit") -> Path:
    """Write a ViT classifier: ``tensors`` holds every name of
    ``toy_vit.model.params(cfg)`` with its shape (stored F32, in ``params``
    order); ``ValueError`` naming a missing, extra or misshapen tensor."""
    from toy.gguf import GGUFWriter
    from toy_vit.model import params

    spec = params(cfg)
    extra = sorted(set(tensors) - set(spec))
    if extra:
        raise ValueError(f"write_gguf: tensor {extra[0]!r} is not a vit tensor")
    w = GGUFWriter(path)
    for key, v in metadata(cfg, name).items():
        if isinstance(v, tuple):
            w.add(key, v[0], v[1])
        else:
            w.add(key, v)
    for tname, p in spec.items():
        if tname not in tensors:
            raise ValueError(f"write_gguf: tensor {tname!r} is missing")
        arr = np.asarray(tensors[tname])
        if arr.shape != p.shape:
            raise ValueError(f"write_gguf: tensor {tname!r} has shape {arr.shape}, the config needs {p.shape}")
        w.add_tensor(tname, np.ascontiguousarray(arr, dtype=np.float32))
    return w.write()


def read_gguf(path: str | os.PathLike) -> tuple[ViTConfig, dict[str, np.ndarray]]:
    """The config and a float32 copy of every model tensor of a ViT file."""
    from toy.gguf import GGUFFile
    from toy_vit.model import params

    with GGUFFile(path) as gf:
        cfg = config_from_gguf(gf)
        arrays = {n: gf.tensor_to_float(n) for n in params(cfg)}
    return cfg, arrays


__all__ = [
    "EPS_KEY",
    "INT_KEYS",
    "LABELS_KEY",
    "MEAN_KEY",
    "STD_KEY",
    "ViTFileError",
    "config_from_gguf",
    "config_from_metadata",
    "metadata",
    "read_gguf",
    "write_gguf",
]
