"""The configuration of a ViT training run: ``ViTTrainConfig``.

One flat dataclass, JSON-serialisable with ``dataclasses.asdict`` (tuples
become lists), read back with ``from_dict`` (unknown keys and wrong types
are refused) and checked with ``validate``. A run records the resolved
config (``steps`` filled in from ``epochs``, ``data`` absolute) in
``config.json``, ``run_start`` and every checkpoint; resuming reads it back.

Fields and defaults (see the dataclass for the list):

- data: ``data`` (an image folder, ``toy_vit.data.ImageFolder``),
  ``val_dir`` (an explicit validation folder), ``val_fraction`` 0.1,
  ``cache_dir`` (the decoded-image cache; default under TOY_HOME);
- model: ``preset`` ("vit-small32"; ``toy_vit.config.PRESETS``) and the
  dimension overrides ``image_size``, ``patch_size``, ``n_channels``,
  ``d_model``, ``n_layer``, ``n_head``, ``d_ff`` (None: the preset's, or the
  base's); the class count always comes from the data;
- length: ``steps`` or ``epochs`` (exactly one > 0; epochs are resolved to
  ``ceil(epochs * n_train / (batch_size * grad_accum))`` steps when the run
  starts, and the recorded config then says those steps and epochs 0),
  ``batch_size`` 32, ``grad_accum`` 1;
- optimizer: ``lr`` 1e-3, ``min_lr`` 0, ``warmup`` 0 steps, ``schedule``
  "cosine" (``toy.train.optim``), ``weight_decay`` 0.05 (matrices only),
  ``beta1`` 0.9, ``beta2`` 0.999 (DeiT's), ``grad_clip`` 1.0 (0: off),
  ``label_smoothing`` 0;
- augmentation (training images only): ``augment`` True (False: images
  plainly resized), ``crop_scale`` (0.5, 1.0) (RandomResizedCrop's area
  fraction), ``flip`` True (horizontal flips with probability 0.5; turn it
  off for digits and text);
- the run: ``seed`` 0 (initial weights, split, order, augmentation),
  ``threads`` (default: the physical cores), ``device`` (default
  ``TOY_DEVICE``, else cpu), ``out`` (the runs folder), ``eval_every`` 100,
  ``eval_batches`` 0 (all), ``save_every`` 500 (0: at the end only),
  ``keep_checkpoints`` 3 (0: all);
- several ranks (``mpiexec -n N toy vit train``, ``--ranks N``):
  ``mixed_cpus`` "refuse" (ranks on different ggml CPU variants stop
  before training, naming the variant to start every rank with) or "allow"
  (they train, with a warning note: the bits then differ from a one-process
  run); ``batch_size`` and ``grad_accum`` are per rank;
- fine-tuning: ``base`` (a ViT GGUF to start from, ``--from``), ``freeze``
  (train only the head and the final LayerNorm), ``lora_rank`` (0: off),
  ``lora_alpha`` 16, ``lora_targets`` ("q", "k", "v", "out"). ``freeze`` and
  LoRA need ``base`` and exclude each other.

Errors: ``ViTTrainConfigError`` (a ``toy.errors.BadInputError``), whose
message starts with the field's name and which carries it as ``field``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

from toy.errors import BadInputError
from toy.train.optim import SCHEDULES, OptimConfig

#: LoRA target -> the adapted projection's GGUF stem in each block
LORA_TARGETS = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "out": "attn_out", "up": "ffn_up", "down": "ffn_down"}
#: what ranks on different ggml CPU variants do (``toy.train.distributed.check_cpu_variants``)
MIXED_CPUS = ("refuse", "allow")
DIMS = ("image_size", "patch_size", "n_channels", "d_model", "n_layer", "n_head", "d_ff")


class ViTTrainConfigError(BadInputError):
    """A training config value is wrong; ``field`` names it."""

    field: str  # always set (BadInputError's may be None)

    def __init__(self, field: str, message: str, hint: str | None = None):
        super().__init__(f"{field}: {message}", hint, field=field)


@dataclass(frozen=True)
class ViTTrainConfig:
    data: str = ""
    val_dir: str | None = None
    val_fraction: float = 0.1
    cache_dir: str | None = None
    preset: str = "vit-small32"
    image_size: int | None = None
    patch_size: int | None = None
    n_channels: int | None = None
    d_model: int | None = None
    n_layer: int | None = None
    n_head: int | None = None
    d_ff: int | None = None
    steps: int = 0
    epochs: float = 0.0
    batch_size: int = 32
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 0.0
    warmup: int = 0
    schedule: str = "cosine"
    weight_decay: float = 0.05
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = 1.0
    label_smoothing: float = 0.0
    augment: bool = True
    crop_scale: tuple[float, float] = (0.5, 1.0)
    flip: bool = True
    seed: int = 0
    threads: int | None = None
    device: str | None = None
    out: str | None = None
    eval_every: int = 100
    eval_batches: int = 0
    save_every: int = 500
    keep_checkpoints: int = 3
    base: str | None = None
    freeze: bool = False
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("q", "k", "v", "out")
    mixed_cpus: str = "refuse"

    # what toy.train.steploop.StepRun reads besides the fields
    @property
    def optim(self) -> OptimConfig:
        return OptimConfig(
            lr=self.lr,
            min_lr=self.min_lr,
            schedule=self.schedule,
            warmup=self.warmup,
            beta1=self.beta1,
            beta2=self.beta2,
            weight_decay=self.weight_decay,
            grad_clip=self.grad_clip,
        )

    @property
    def sample_every(self) -> int:
        return 0  # a classifier has no samples

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    def overrides(self) -> dict[str, int]:
        """The dimension overrides that are set."""
        return {d: getattr(self, d) for d in DIMS if getattr(self, d) is not None}


# -- reading and checking -----------------------------------------------------

_KINDS: dict[str, tuple[str, bool]] = {}  # field -> (base type, optional), from the annotations
for _f in fields(ViTTrainConfig):
    _ann = str(_f.type)
    _KINDS[_f.name] = (_ann.split("|")[0].split("[")[0].strip(), "None" in _ann)


def _typed(name: str, v: Any) -> Any:
    kind, optional = _KINDS[name]
    if v is None:
        if optional:
            return None
        raise ViTTrainConfigError(name, "must be given (not null)")
    if kind == "int":
        if isinstance(v, bool) or not isinstance(v, int):
            raise ViTTrainConfigError(name, f"{v!r} is not a whole number")
    elif kind == "float":
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ViTTrainConfigError(name, f"{v!r} is not a number")
        v = float(v)
    elif kind == "bool":
        if not isinstance(v, bool):
            raise ViTTrainConfigError(name, f"{v!r} is not true or false")
    elif kind == "str":
        if not isinstance(v, str):
            raise ViTTrainConfigError(name, f"{v!r} is not a string")
    elif kind == "tuple":
        if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
            raise ViTTrainConfigError(name, f"{v!r} is not a list")
        v = tuple(v)
    return v


def from_dict(d: dict[str, Any]) -> ViTTrainConfig:
    """A validated config from plain data (JSON, TOML, a run's record);
    unknown keys are refused."""
    if not isinstance(d, dict):
        raise ViTTrainConfigError("config", f"expected a mapping of fields, got {type(d).__name__}")
    unknown = sorted(set(d) - set(_KINDS))
    if unknown:
        raise ViTTrainConfigError(unknown[0], "unknown key", hint=f"keys: {', '.join(sorted(_KINDS))}")
    return validate(ViTTrainConfig(**{k: _typed(k, v) for k, v in d.items()}))


def to_dict(cfg: ViTTrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def validate(cfg: ViTTrainConfig) -> ViTTrainConfig:
    """``cfg`` if every field is in range (types too), else
    ``ViTTrainConfigError`` naming the first wrong field."""
    from toy_vit.config import PRESETS

    for f in fields(cfg):
        _typed(f.name, getattr(cfg, f.name))

    def bad(field: str, msg: str, hint: str | None = None):
        raise ViTTrainConfigError(field, msg, hint)

    if not cfg.data:
        bad("data", "no training data: give an image folder (one sub-folder per class)")
    if cfg.preset not in PRESETS:
        bad("preset", f"unknown ViT preset {cfg.preset!r}", hint=f"presets: {', '.join(PRESETS)}")
    for d in DIMS:
        v = getattr(cfg, d)
        if v is not None and v < 1:
            bad(d, f"{v} must be >= 1 (or unset: the preset's)")
    if cfg.steps < 0:
        bad("steps", f"{cfg.steps} must be >= 0")
    if not (math.isfinite(cfg.epochs) and cfg.epochs >= 0):
        bad("epochs", f"{cfg.epochs} must be >= 0")
    if (cfg.steps > 0) == (cfg.epochs > 0):
        bad("steps", "give either steps or epochs (exactly one of them > 0)")
    for name in ("batch_size", "grad_accum"):
        if getattr(cfg, name) < 1:
            bad(name, f"{getattr(cfg, name)} must be >= 1")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        bad("lr", f"{cfg.lr} must be a positive number")
    if not 0 <= cfg.min_lr <= cfg.lr:
        bad("min_lr", f"{cfg.min_lr} must be in [0, lr={cfg.lr}]")
    if cfg.warmup < 0:
        bad("warmup", f"{cfg.warmup} must be >= 0")
    if cfg.schedule not in SCHEDULES:
        bad("schedule", f"{cfg.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if not (math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0):
        bad("weight_decay", f"{cfg.weight_decay} must be >= 0")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(cfg, name) < 1:
            bad(name, f"{getattr(cfg, name)} must be in [0, 1)")
    if not (math.isfinite(cfg.grad_clip) and cfg.grad_clip >= 0):
        bad("grad_clip", f"{cfg.grad_clip} must be >= 0 (0 turns clipping off)")
    if not 0 <= cfg.label_smoothing < 1:
        bad("label_smoothing", f"{cfg.label_smoothing} must be in [0, 1)")
    if not 0 <= cfg.val_fraction < 1:
        bad("val_fraction", f"{cfg.val_fraction} must be in [0, 1)")
    if len(cfg.crop_scale) != 2 or not all(isinstance(x, (int, float)) for x in cfg.crop_scale):
        bad("crop_scale", f"{cfg.crop_scale!r} must be two numbers (min, max)")
    lo, hi = cfg.crop_scale
    if not 0 < lo <= hi <= 1:
        bad("crop_scale", f"{cfg.crop_scale!r} must satisfy 0 < min <= max <= 1")
    if cfg.seed < 0:
        bad("seed", f"{cfg.seed} must be >= 0")
    if cfg.threads is not None and cfg.threads < 1:
        bad("threads", f"{cfg.threads} must be >= 1")
    for name in ("eval_every", "eval_batches", "save_every", "keep_checkpoints", "lora_rank"):
        if getattr(cfg, name) < 0:
            bad(name, f"{getattr(cfg, name)} must be >= 0")
    if not (math.isfinite(cfg.lora_alpha) and cfg.lora_alpha > 0):
        bad("lora_alpha", f"{cfg.lora_alpha} must be a positive number")
    if not cfg.lora_targets:
        bad("lora_targets", "name at least one target")
    for t in cfg.lora_targets:
        if not isinstance(t, str) or t not in LORA_TARGETS:
            bad("lora_targets", f"{t!r} is not one of {', '.join(LORA_TARGETS)}")
    if len(set(cfg.lora_targets)) != len(cfg.lora_targets):
        bad("lora_targets", f"{list(cfg.lora_targets)} names a target twice")
    if cfg.mixed_cpus not in MIXED_CPUS:
        bad("mixed_cpus", f"{cfg.mixed_cpus!r} is not one of {', '.join(MIXED_CPUS)}")
    if cfg.freeze and cfg.lora_rank:
        bad("freeze", "freeze and LoRA exclude each other (LoRA already freezes the base and trains the head)")
    if (cfg.freeze or cfg.lora_rank) and not cfg.base:
        what = "freeze" if cfg.freeze else "lora_rank"
        bad(what, "needs a base model to fine-tune (base, --from)")
    return cfg


__all__ = [
    "DIMS",
    "LORA_TARGETS",
    "MIXED_CPUS",
    "ViTTrainConfig",
    "ViTTrainConfigError",
    "from_dict",
    "to_dict",
    "validate",
]
