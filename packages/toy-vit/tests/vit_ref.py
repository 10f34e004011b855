"""The independent reference for toy-vit's tests: a seeded random Hugging
Face ``ViTForImageClassification`` saved with ``save_pretrained`` (offline:
built from a config, never downloaded), and its float32 forward in PyTorch.

``VARIANTS`` are the shapes the parity tests run: 32-px RGB images in
patches of 8 (17 tokens), width 64, 4 heads, 3 layers, 5 labels; a
1-channel 24-px model with patches of 6 and ``qkv_bias: false``; and a
non-default LayerNorm epsilon. ``SLOW_VARIANTS`` has the full vit-tiny
shape for the slow test. Weights are drawn from N(0, 0.5²) (biases and norms too),
larger than Hugging Face's init, so every tensor changes the logits
visibly and a swapped or transposed weight cannot hide.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VARIANTS = {
    "rgb32": dict(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=3,
                  num_attention_heads=4, intermediate_size=128, num_labels=5),
    "gray24": dict(image_size=24, patch_size=6, num_channels=1, hidden_size=48, num_hidden_layers=2,
                   num_attention_heads=3, intermediate_size=96, num_labels=3, qkv_bias=False),
    "eps16": dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=2, intermediate_size=64, num_labels=4, layer_norm_eps=1e-6),
}  # fmt: skip
#: the slow tests' full-size shape (vit-tiny: 224 px, patches of 16, width 192, 12 layers, 1000 labels),
#: with weights of a trained model's scale (matrices N(0, 0.05²), LayerNorm gains N(1, 0.1²), biases,
#: class token and positions N(0, 0.1²)): N(0, 0.5²) over 12 layers would saturate the softmaxes
SLOW_VARIANTS = {
    "tiny224": dict(image_size=224, patch_size=16, num_channels=3, hidden_size=192, num_hidden_layers=12,
                    num_attention_heads=3, intermediate_size=768, num_labels=1000),
}  # fmt: skip
_STD = {"tiny224": 0.05}


def make_hf_vit(folder: Path, variant: str = "rgb32", seed: int = 0, processor: dict | None = None):
    """Save a seeded random ViTForImageClassification of ``variant`` into
    ``folder`` (config.json, model.safetensors, preprocessor_config.json)
    and return the model (eval mode, float32)."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification

    kw = dict({**VARIANTS, **SLOW_VARIANTS}[variant])
    n = kw.pop("num_labels")
    cfg = ViTConfig(
        **kw,
        id2label={i: f"class_{variant}_{i}" for i in range(n)},
        label2id={f"class_{variant}_{i}": i for i in range(n)},
        hidden_act="gelu",
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = ViTForImageClassification(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if variant not in _STD:
                p.normal_(0.0, 0.5)
            elif "layernorm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.1)  # gains near 1
            else:  # matrices, biases, tokens, positions
                p.normal_(0.0, _STD[variant] if p.dim() > 1 and "embeddings" not in name else 0.1)
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    C = kw["num_channels"]
    pc = processor or {
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.485, 0.456, 0.406][:C],
        "image_std": [0.229, 0.224, 0.225][:C],
        "image_processor_type": "ViTImageProcessor",
        "resample": 2,
        "rescale_factor": 1 / 255,
        "size": {"height": kw["image_size"], "width": kw["image_size"]},
    }
    (folder / "preprocessor_config.json").write_text(json.dumps(pc))
    return model


def hf_logits(model, pixels: np.ndarray) -> np.ndarray:
    """Logits float32 (B, n_classes) of pixels float32 (B, C, H, W)."""
    import torch

    with torch.no_grad():
        return model(pixel_values=torch.from_numpy(np.ascontiguousarray(pixels, np.float32))).logits.numpy()


def random_pixels(variant: str, batch: int, seed: int = 1) -> np.ndarray:
    """Normalised-looking pixels F32 (B, C, S, S) for ``variant``."""
    kw = {**VARIANTS, **SLOW_VARIANTS}[variant]
    rng = np.random.default_rng(seed)
    S, C = kw["image_size"], kw["num_channels"]
    return rng.standard_normal((batch, C, S, S)).astype(np.float32)


__all__ = ["SLOW_VARIANTS", "VARIANTS", "hf_logits", "make_hf_vit", "random_pixels"]
