"""Convert a local Hugging Face ``ViTForImageClassification`` folder to a
toy-vit GGUF (``convert_hf``).

Inputs: ``config.json``; the weights as ``model.safetensors`` (read with the
``safetensors`` package), a sharded ``model.safetensors.index.json``, or
``pytorch_model.bin`` (read with ``torch``, ``weights_only``); and, when
present, ``preprocessor_config.json`` (``image_mean``, ``image_std``,
``do_normalize``, ``do_rescale``/``rescale_factor``, ``size``), else
ViTImageProcessor's defaults (mean = std = 0.5 per channel). Class names
come from ``id2label`` in class order, unless ``labels`` replaces them.

Tensor map (Hugging Face -> GGUF; ``vit.`` prefix optional)::

    embeddings.patch_embeddings.projection.{weight,bias} -> v.patch_embd.{weight,bias}
    embeddings.cls_token (1, 1, D)                       -> v.class_embd (D,)
    embeddings.position_embeddings (1, T, D)             -> v.position_embd.weight (T, D)
    encoder.layer.N.layernorm_before                     -> v.blk.N.ln1
    encoder.layer.N.attention.attention.{query,key,value} -> v.blk.N.attn_{q,k,v}
    encoder.layer.N.attention.output.dense               -> v.blk.N.attn_out
    encoder.layer.N.layernorm_after                      -> v.blk.N.ln2
    encoder.layer.N.intermediate.dense                   -> v.blk.N.ffn_up
    encoder.layer.N.output.dense                         -> v.blk.N.ffn_down
    layernorm                                            -> v.post_ln
    classifier                                           -> cls

Refused, with ``ConvertError`` (a ``toy.errors.BadInputError``) naming the
key: a ``model_type`` other than ``vit``; ``hidden_act`` other than
``gelu`` (the exact erf GELU toy's graph computes); non-square
``image_size``/``patch_size`` pairs; a folder without ``classifier.*``
weights (a bare ``ViTModel`` or a masked-image-modelling checkpoint: the
hint says to convert an image-classification checkpoint); a classifier,
``num_channels``, label count or position table that disagrees with the
config; a processor ``size`` other than the model's ``image_size`` or a
``rescale_factor`` other than 1/255. ``qkv_bias: false`` is accepted: the
Q, K and V biases are written as zeros (the same function). Weights a
classifier does not use (``pooler.*``, ``embeddings.mask_token``) are
skipped. Every tensor is written F32.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from toy.errors import BadInputError
from toy_vit.config import HF_MEAN, HF_NORM_EPS, HF_STD, ViTConfig, ViTConfigError


class ConvertError(BadInputError):
    """The Hugging Face folder is not a ViT classifier toy-vit converts; the
    message names the key or file."""


_BLOCK_MAP = {
    "layernorm_before": "ln1",
    "attention.attention.query": "attn_q",
    "attention.attention.key": "attn_k",
    "attention.attention.value": "attn_v",
    "attention.output.dense": "attn_out",
    "layernorm_after": "ln2",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
}
_SKIP = ("pooler.", "embeddings.mask_token")


def _json(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConvertError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConvertError(f"{path}: expected a JSON object")
    return d


def _square(cfg: Mapping[str, Any], key: str, default: int) -> int:
    v = cfg.get(key, default)
    if isinstance(v, (list, tuple)):
        if len(v) != 2 or v[0] != v[1]:
            raise ConvertError(f"config.json {key}={v!r}: toy-vit takes square images and patches only")
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConvertError(f"config.json {key}={v!r} is not a whole number")
    return v


def _load_weights(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder's weight file(s) as float32 NumPy."""
    single, index, bin_ = (
        folder / "model.safetensors",
        folder / "model.safetensors.index.json",
        folder / "pytorch_model.bin",
    )
    if single.is_file() or index.is_file():
        files = (
            [single] if single.is_file() else sorted({folder / f for f in _json(index).get("weight_map", {}).values()})
        )
        try:
            from safetensors.numpy import load_file
        except ImportError:
            load_file = None  # type: ignore[assignment]  # safetensors is optional: None reads through torch
        out: dict[str, np.ndarray] = {}
        for f in files:
            if load_file is not None:
                try:
                    out.update(load_file(str(f)))
                    continue
                except TypeError:  # bfloat16 has no NumPy dtype: read through torch
                    pass
            out.update(_torch_safetensors(f))
        return {k: np.asarray(v, np.float32) for k, v in out.items()}
    if bin_.is_file():
        torch = _torch("pytorch_model.bin")
        sd = torch.load(str(bin_), map_location="cpu", weights_only=True)
        return {k: v.detach().float().numpy() for k, v in sd.items()}
    raise ConvertError(
        f"{folder}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin",
        hint="save the model with save_pretrained(), or download the whole folder",
    )


def _torch(what: str):
    try:
        import torch
    except ImportError:
        raise ConvertError(
            f"reading {what} needs PyTorch",
            hint="pip install torch (or save the model as safetensors and pip install safetensors)",
        ) from None
    return torch


def _torch_safetensors(path: Path) -> dict[str, np.ndarray]:
    _torch(path.name)  # safetensors.torch needs it
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ConvertError(
            f"reading {path.name} needs the safetensors package", hint="pip install safetensors"
        ) from None
    return {k: v.float().numpy() for k, v in load_file(str(path)).items()}


def _processor(folder: Path, image_size: int, C: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(image_mean, image_std) from preprocessor_config.json, or the defaults."""
    path = folder / "preprocessor_config.json"
    if not path.is_file():
        return (HF_MEAN,) * C, (HF_STD,) * C
    pc = _json(path)
    size = pc.get("size")
    sides = (size, size)
    if isinstance(size, dict):
        sides = (size.get("height"), size.get("width"))
        if "shortest_edge" in size and sides == (None, None):
            sides = (size["shortest_edge"],) * 2
    if size is not None and sides != (image_size, image_size):
        raise ConvertError(f"preprocessor_config.json size={size!r} differs from the model's image_size {image_size}")
    if pc.get("do_rescale", True) and not math.isclose(float(pc.get("rescale_factor", 1 / 255)), 1 / 255):
        raise ConvertError(f"preprocessor_config.json rescale_factor={pc['rescale_factor']!r}: toy-vit takes 1/255")
    if not pc.get("do_normalize", True):
        return (0.0,) * C, (1.0,) * C

    def per_channel(key: str, default: float) -> tuple[float, ...]:
        v = pc.get(key, default)
        v = [v] * C if isinstance(v, (int, float)) else list(v)
        if len(v) != C:
            raise ConvertError(f"preprocessor_config.json {key} has {len(v)} values for num_channels={C}")
        return tuple(float(x) for x in v)

    return per_channel("image_mean", HF_MEAN), per_channel("image_std", HF_STD)


def hf_config(folder: str | os.PathLike, labels: Sequence[str] | None = None) -> ViTConfig:
    """The ``ViTConfig`` of a Hugging Face ViT folder (config.json and
    preprocessor_config.json), checked as the module docstring says."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ConvertError(f"{folder}: no config.json", hint="point at a folder made by save_pretrained()")
    hc = _json(folder / "config.json")
    if hc.get("model_type") != "vit":
        raise ConvertError(f"config.json model_type={hc.get('model_type')!r}: toy-vit converts 'vit' models")
    act = hc.get("hidden_act", "gelu")
    if act != "gelu":
        raise ConvertError(f"config.json hidden_act={act!r}: toy-vit's graph computes 'gelu' (the exact erf form) only")
    image_size, patch = _square(hc, "image_size", 224), _square(hc, "patch_size", 16)
    C = hc.get("num_channels", 3)
    if "id2label" in hc and labels is None:
        id2 = {int(k): str(v) for k, v in hc["id2label"].items()}
        if sorted(id2) != list(range(len(id2))):
            raise ConvertError(f"config.json id2label keys {sorted(id2)} are not 0..{len(id2) - 1}")
        labels = [id2[i] for i in range(len(id2))]
    mean, std = _processor(folder, image_size, C)
    try:
        return ViTConfig(
            image_size=image_size,
            patch_size=patch,
            n_channels=C,
            d_model=hc.get("hidden_size", 768),
            n_layer=hc.get("num_hidden_layers", 12),
            n_head=hc.get("num_attention_heads", 12),
            d_ff=hc.get("intermediate_size", 3072),
            n_classes=len(labels) if labels else hc.get("num_labels", 2),
            norm_eps=hc.get("layer_norm_eps", HF_NORM_EPS),
            labels=tuple(labels or ()),
            image_mean=mean,
            image_std=std,
        )
    except ViTConfigError as e:
        raise ConvertError(f"config.json: {e}", hint=e.hint) from None


def hf_tensors(cfg: ViTConfig, sd: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The GGUF tensors of a Hugging Face state dict (names as in the module
    docstring); ``ConvertError`` naming a missing or misshapen weight."""
    from toy_vit.model import params

    sd = {k.removeprefix("vit."): v for k, v in sd.items() if not k.removeprefix("vit.").startswith(_SKIP)}
    if "classifier.weight" not in sd:
        raise ConvertError(
            "the checkpoint has no classifier.weight (a ViTModel or masked-image-modelling checkpoint)",
            hint="convert a ViTForImageClassification checkpoint (fine-tune one first with transformers, "
            "or train one with toy vit train)",
        )
    D, T = cfg.d_model, cfg.n_tokens

    def take(key: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        if key not in sd:
            raise ConvertError(f"the checkpoint lacks weight {key!r}")
        a = np.asarray(sd[key], np.float32)
        if shape is not None and a.shape != shape:
            raise ConvertError(f"weight {key!r} has shape {a.shape}, config.json implies {shape}")
        return a

    out = {
        "v.patch_embd.weight": take("embeddings.patch_embeddings.projection.weight"),
        "v.patch_embd.bias": take("embeddings.patch_embeddings.projection.bias"),
        "v.class_embd": take("embeddings.cls_token", (1, 1, D)).reshape(D),
        "v.position_embd.weight": take("embeddings.position_embeddings", (1, T, D)).reshape(T, D),
    }
    qkv_bias = "encoder.layer.0.attention.attention.query.bias" in sd
    for i in range(cfg.n_layer):
        for hf, name in _BLOCK_MAP.items():
            out[f"v.blk.{i}.{name}.weight"] = take(f"encoder.layer.{i}.{hf}.weight")
            bias = f"encoder.layer.{i}.{hf}.bias"
            if not qkv_bias and name in ("attn_q", "attn_k", "attn_v"):
                out[f"v.blk.{i}.{name}.bias"] = np.zeros(D, np.float32)  # qkv_bias: false
            else:
                out[f"v.blk.{i}.{name}.bias"] = take(bias)
    out["v.post_ln.weight"], out["v.post_ln.bias"] = take("layernorm.weight"), take("layernorm.bias")
    out["cls.weight"], out["cls.bias"] = take("classifier.weight"), take("classifier.bias")
    if out["cls.weight"].shape[0] != cfg.n_classes:
        raise ConvertError(
            f"classifier.weight has {out['cls.weight'].shape[0]} rows for {cfg.n_classes} labels",
            hint="labels (id2label, or the labels given) must name every class of the head",
        )
    for name, p in params(cfg).items():
        if out[name].shape != p.shape:
            raise ConvertError(f"weight for {name!r} has shape {out[name].shape}, config.json implies {p.shape}")
    extra = sorted(k for k in sd if not k.startswith(("embeddings.", "encoder.layer.", "layernorm.", "classifier.")))
    if extra:
        raise ConvertError(f"the checkpoint has weight {extra[0]!r}, which a ViT classifier does not have")
    return out


def convert_hf(hf_dir: str | os.PathLike, out_path: str | os.PathLike, labels: Sequence[str] | None = None) -> Path:
    """Write the GGUF of a local Hugging Face ViTForImageClassification
    folder to ``out_path`` (atomically); ``labels`` replaces id2label.
    Returns the path written."""
    from toy_vit.gguf_io import write_gguf

    folder = Path(hf_dir)
    if not folder.is_dir():
        raise ConvertError(f"{folder}: not a folder", hint="give the folder save_pretrained() wrote")
    cfg = hf_config(folder, labels)
    tensors = hf_tensors(cfg, _load_weights(folder))
    name = _json(folder / "config.json").get("_name_or_path") or folder.name
    return write_gguf(out_path, cfg, tensors, name=str(name) or "vit")


__all__ = ["ConvertError", "convert_hf", "hf_config", "hf_tensors"]
