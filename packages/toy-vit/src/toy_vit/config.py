"""The ViT classifier's configuration: ``ViTConfig`` and its size presets.

A config is everything the graph and the preprocessing need and nothing a
run decides (no dropout, no learning rate): the image geometry
(``image_size`` square pixels of ``n_channels`` channels, cut into
``patch_size`` x ``patch_size`` patches), the encoder (``n_layer`` pre-norm
blocks of width ``d_model`` with ``n_head`` heads and an MLP of ``d_ff``),
the LayerNorm epsilon, the classes (``labels``, one name per class) and the
per-channel normalisation the model was trained with (``image_mean``,
``image_std``; pixels in [0, 1] are mapped to ``(x - mean) / std``).

Decisions:

- Images are square and the patch grid is ``image_size / patch_size`` on
  each side (Hugging Face's ``image_size`` and ``patch_size`` may be pairs;
  toy reads equal pairs only). Tokens: ``n_patches + 1`` (the class token
  first).
- ``norm_eps`` defaults to Hugging Face's ``layer_norm_eps`` default (1e-12);
  ``image_mean``/``image_std`` to ViTImageProcessor's (0.5 per channel).
- ``labels`` defaults to ``("0", "1", …)`` when only ``n_classes`` is given;
  when both are given they must agree.
- Presets (``PRESETS``; every dimension can be overridden):

  ========== ======= ===== ===== ====== ===== ===== ====================
  preset     image   patch width layers heads d_ff  parameters
  ========== ======= ===== ===== ====== ===== ===== ====================
  vit-tiny   224     16    192   12     3     768   5,717,416 (1000 cls)
  vit-small32 32     4     192   6      3     384   1,806,538 (10 cls)
  vit-micro  16      4     32    2      2     64    19,626 (10 cls)
  digits     32 grey 8     128   4      4     256   542,090 (10 cls)
  ========== ======= ===== ===== ====== ===== ===== ====================

  ``vit-tiny`` is DeiT-Tiny / ``WinKawaks/vit-tiny-patch16-224``'s shape;
  ``vit-small32`` is sized for 32-pixel images (CIFAR-10, 64 patches of
  4 x 4, d_ff = 2 x width to keep a CPU epoch short); ``vit-micro`` is for
  tests (16 patches of 4 x 4); ``digits`` is the bundled demo data's
  (``toy vit demo-data``: 8x8 digits upscaled 4x to 32x32 grey, so an
  8-pixel patch holds 2 x 2 original pixels and one channel is enough;
  ``vit-small32``'s 4-pixel RGB patches of one original pixel each stay
  near chance for hundreds of steps there).

Errors: ``ViTConfigError`` (a ``toy.errors.BadInputError``) naming the value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from toy.errors import BadInputError

#: Hugging Face's defaults (ViTConfig.layer_norm_eps, ViTImageProcessor's IMAGENET_STANDARD_*)
HF_NORM_EPS = 1e-12
HF_MEAN = 0.5
HF_STD = 0.5


class ViTConfigError(BadInputError):
    """A ViT configuration value is out of range or inconsistent; the
    message names it."""


@dataclass(frozen=True)
class ViTConfig:
    image_size: int
    patch_size: int
    n_channels: int
    d_model: int
    n_layer: int
    n_head: int
    d_ff: int
    n_classes: int
    norm_eps: float = HF_NORM_EPS
    labels: tuple[str, ...] = ()  # one name per class; () means "0", "1", …
    image_mean: tuple[float, ...] = ()  # per channel; () means 0.5 each
    image_std: tuple[float, ...] = ()
    architecture: str = field(default="vit")

    def __post_init__(self) -> None:
        for f in ("image_size", "patch_size", "n_channels", "d_model", "n_layer", "n_head", "d_ff", "n_classes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ViTConfigError(f"{f}={v!r} must be a whole number >= 1")
        if self.architecture != "vit":
            raise ViTConfigError(f"architecture={self.architecture!r}: a ViTConfig is 'vit'")
        if self.image_size % self.patch_size:
            raise ViTConfigError(
                f"image_size={self.image_size} is not a multiple of patch_size={self.patch_size}",
                hint="the image is cut into whole patches: pick a patch size that divides the image size",
            )
        if self.d_model % self.n_head:
            raise ViTConfigError(f"d_model={self.d_model} is not a multiple of n_head={self.n_head}")
        eps = self.norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < 1):
            raise ViTConfigError(f"norm_eps={eps!r} must be a number in (0, 1)")
        object.__setattr__(self, "norm_eps", float(eps))
        labels = tuple(self.labels) if self.labels else tuple(str(i) for i in range(self.n_classes))
        if len(labels) != self.n_classes:
            raise ViTConfigError(f"{len(labels)} labels for n_classes={self.n_classes}: give one name per class")
        bad = [x for x in labels if not isinstance(x, str) or not x]
        if bad:
            raise ViTConfigError(f"label {bad[0]!r}: every label must be a non-empty string")
        object.__setattr__(self, "labels", labels)
        for name, default in (("image_mean", HF_MEAN), ("image_std", HF_STD)):
            v = getattr(self, name)
            vals = tuple(float(x) for x in v) if len(v) else (default,) * self.n_channels
            if len(vals) != self.n_channels:
                raise ViTConfigError(f"{name} has {len(vals)} values for n_channels={self.n_channels}")
            if not all(math.isfinite(x) for x in vals) or (name == "image_std" and min(vals) <= 0):
                raise ViTConfigError(f"{name}={vals}: finite values" + (", each > 0" if name == "image_std" else ""))
            object.__setattr__(self, name, vals)

    # -- derived dimensions

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.grid * self.grid

    @property
    def n_tokens(self) -> int:
        """Sequence length: the class token and the patches."""
        return self.n_patches + 1

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch (C * p * p)."""
        return self.n_channels * self.patch_size * self.patch_size

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    # -- construction

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ViTConfig:
        """A preset's config with ``overrides`` (any field; ``labels``
        alone sets ``n_classes`` too)."""
        if name not in PRESETS:
            raise ViTConfigError(f"unknown ViT preset {name!r}", hint=f"presets: {', '.join(PRESETS)}")
        base = dict(PRESETS[name])
        if overrides.get("labels") is not None and "n_classes" not in overrides:
            base.pop("n_classes")
        return cls.from_dict({**base, **overrides})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ViTConfig:
        """A config from a mapping of field values (unknown keys are errors;
        ``preset`` names a base whose values the others override)."""
        d = dict(d)
        if "preset" in d:
            return cls.preset(d.pop("preset"), **d)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ViTConfigError(
                f"unknown ViT config key {unknown[0]!r}", hint=f"keys: preset, {', '.join(sorted(known))}"
            )
        if "labels" in d and d["labels"] is not None:
            d["labels"] = tuple(d["labels"])
            d.setdefault("n_classes", len(d["labels"]))
        missing = [m for m in ("image_size", "patch_size", "n_channels", "d_model", "n_layer", "n_head", "d_ff",
                               "n_classes") if m not in d]  # fmt: skip
        if missing:
            raise ViTConfigError(f"the ViT config lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in d.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def with_labels(self, labels: Sequence[str]) -> ViTConfig:
        """The same model with another set of class names (and count)."""
        labels = tuple(labels)
        return replace(self, labels=labels, n_classes=len(labels))


#: size presets (see the module docstring); n_classes is a default the data usually replaces
PRESETS: dict[str, dict[str, Any]] = {
    "vit-tiny": dict(image_size=224, patch_size=16, n_channels=3, d_model=192, n_layer=12, n_head=3, d_ff=768,
                     n_classes=1000),
    "vit-small32": dict(image_size=32, patch_size=4, n_channels=3, d_model=192, n_layer=6, n_head=3, d_ff=384,
                        n_classes=10),
    "vit-micro": dict(image_size=16, patch_size=4, n_channels=3, d_model=32, n_layer=2, n_head=2, d_ff=64,
                      n_classes=10),
    "digits": dict(image_size=32, patch_size=8, n_channels=1, d_model=128, n_layer=4, n_head=4, d_ff=256,
                   n_classes=10),
}  # fmt: skip


__all__ = ["HF_MEAN", "HF_NORM_EPS", "HF_STD", "PRESETS", "ViTConfig", "ViTConfigError"]
