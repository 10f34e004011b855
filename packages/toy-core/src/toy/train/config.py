"""Training configuration: dataclasses, size presets, TOML loading.

A config file is TOML; its top-level keys are the fields of ``TrainConfig``
and its tables ``[model]``, ``[data]``, ``[tokenizer]``, ``[optim]`` the
fields of the nested dataclasses. Unknown keys and wrong types are errors
(``ConfigError``, naming the key). CLI flags override file values
(``override``); the resolved config (``to_dict``) is what a run records in
``config.json`` and in its checkpoints, and what ``--resume`` reads back.

Size presets belong to the architecture (``model.arch``: ``llama``, the
default, or ``gpt2``; each module's ``PRESETS``); the vocabulary comes from
the tokenizer. The llama presets:

- ``tiny``: d 128, 4 layers, 4 heads (2 KV), FFN 352: about 0.9M parameters
  with a 1024-token vocabulary; for tests and the tutorial (seconds);
- ``small``: d 384, 6 layers, 6 heads (2 KV), FFN 1024: about 12.6M with an
  8192-token vocabulary;
- ``smollm2-135m``: SmolLM2-135M's shape (d 576, 30 layers, 9 heads, 3 KV,
  FFN 1536, RoPE base 100000); 135M with its 49152-token vocabulary.

All presets tie the output head to the token embedding.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# a version test rather than try/except ImportError, which mypy (checking as Python 3.10) can follow
if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from toy import models
from toy.errors import BadInputError, ConfigError  # ConfigError lives in toy.errors; re-exported here
from toy.inputs import regular_file
from toy.train.optim import OptimConfig


@dataclass
class ModelShape:
    arch: str = "llama"  # an architecture family of toy.models (llama, gpt2)
    preset: str | None = "tiny"
    d_model: int | None = None
    n_layer: int | None = None
    n_head: int | None = None
    n_head_kv: int | None = None
    d_ff: int | None = None
    head_dim: int | None = None  # default d_model / n_head
    rope_base: float | None = None
    norm_eps: float = 1e-5
    tied_output: bool = True


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)
    val_fraction: float = 0.05
    block_causal: bool = True  # packed documents do not attend to each other
    cache_dir: str | None = None  # default: <toy home>/cache/tokens
    # fine-tuning recipes (JSONL examples, toy.train.instruct):
    max_length: int | None = None  # tokens per example (default and upper bound: context + 1)
    overflow: str = "truncate"  # what to do with a longer example: truncate | drop
    special_in_content: bool = False  # parse control-token text inside "messages" as control tokens


#: training recipes: from random weights, or from a GGUF base
RECIPES = ("from-scratch", "lora", "full", "warm-start")


@dataclass
class LoraConfig:
    targets: list[str] | None = None  # None: the architecture's default (llama: q,k,v,o; gpt2: qkv,o)
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    rslora: bool = False  # scale alpha / sqrt(rank) instead of alpha / rank

    def validate(self) -> LoraConfig:
        """Checks what needs no model: targets must be modules of some
        architecture (``resolved`` checks them against the model's)."""
        if self.targets is not None:
            known = models.lora_target_names()
            bad = [t for t in self.targets if t not in known]
            if bad or not self.targets:
                raise ConfigError(
                    f"lora.targets {self.targets!r}: each must be one of {', '.join(known)}"
                    + (f" ({bad[0]!r} is not)" if bad else " (none given; leave it out for the architecture's default)")
                )
            if len(set(self.targets)) != len(self.targets):
                raise ConfigError(f"lora.targets {self.targets!r} repeats a module")
        if self.rank < 1:
            raise ConfigError(f"lora.rank={self.rank} must be >= 1")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ConfigError(f"lora.alpha={self.alpha} must be > 0")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout={self.dropout} must be in [0, 1)")
        return self

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def resolved(self, model_cfg) -> LoraConfig:
        """A copy with the targets named (the architecture's default when
        None), each checked against the architecture's ``lora_targets``."""
        arch = models.language_model_of(model_cfg)
        targets = list(self.targets) if self.targets is not None else list(arch.lora_default)
        known = arch.lora_targets(model_cfg)
        bad = [t for t in targets if t not in known]
        if bad:
            raise ConfigError(
                f"lora.targets: {bad[0]!r} is not a module of {model_cfg.architecture} models",
                hint=f"{model_cfg.architecture} modules: {', '.join(known)}",
            )
        return dataclasses.replace(self, targets=targets).validate()


@dataclass
class WarmStartConfig:
    layers: list[int] | None = None  # donor blocks copied where shapes match (None: every such block)
    project: str = "pca"  # embeddings of another width: pca (top principal directions) | truncate


@dataclass
class TokenizerConfig:
    model: str | None = None  # take the tokenizer of this GGUF model (path or name)
    vocab_size: int = 1024  # else train a byte-level BPE of this size on the corpus


#: what ``diagnostics.kinds`` can name (``toy.train.diagnostics``; "all": every one)
DIAGNOSTICS = ("grads", "updates", "drift", "activations", "nonfinite")
#: where ``report.to`` can mirror a run's events (``toy.runs.report``)
REPORT_TO = ("tensorboard", "mlflow")


@dataclass
class DiagnosticsConfig:
    kinds: list[str] = field(default_factory=list)  # of DIAGNOSTICS (or ["all"]); empty: off
    every: int = 10  # a diagnostics event every this many steps


@dataclass
class ReportConfig:
    to: list[str] = field(default_factory=list)  # of REPORT_TO; empty: events.jsonl only
    tensorboard_dir: str | None = None  # default: <run folder>/tensorboard
    mlflow_uri: str | None = None  # default: a SQLite store, <runs folder>/mlflow.db (toy.runs.report)
    mlflow_experiment: str = "toy"


@dataclass
class TrainConfig:
    recipe: str = "from-scratch"  # one of RECIPES
    base: str | None = None  # lora, full: the model fine-tuned; warm-start: the donor (path or name)
    lora: LoraConfig = field(default_factory=LoraConfig)
    freeze: list[str] = field(default_factory=list)  # full: "embeddings" and/or "output" stay as they are
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    model: ModelShape = field(default_factory=ModelShape)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    seed: int = 0
    steps: int = 1000
    batch_size: int = 8
    context: int = 128
    grad_accum: int = 1
    eval_every: int = 100  # 0: only at the end
    eval_batches: int = 8  # validation batches per evaluation (0: all)
    save_every: int = 500  # 0: only at the end
    keep_checkpoints: int = 3  # newest checkpoints kept (0: all)
    sample_every: int = 0  # 0: a sample at each save
    sample_prompt: str = ""  # empty: the start of the first validation window
    sample_tokens: int = 32
    device: str | None = None  # None: $TOY_DEVICE, else the CPU
    threads: int | None = None  # default: physical cores
    out: str | None = None  # runs folder (default: $TOY_RUNS_DIR, else the project's (toy.toml), else ./runs)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    trace: str | None = None  # a Chrome/Perfetto trace of step ``trace_step`` is written to this file
    trace_step: int = 2  # the step traced (the first one also builds and allocates its graphs)
    # several ranks on different ggml CPU variants: "refuse" (stop, naming the variant to start every rank
    # with) or "allow" (train; the bits then depend on which rank computed what: toy.train.distributed)
    mixed_cpus: str = "refuse"


def _check_type(key: str, value: Any, hint: Any) -> Any:
    """Coerce/validate ``value`` against a (simple) annotation."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(key, value, inner[0])
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_check_type(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported value {value!r}")


def _build(cls, data: dict[str, Any], prefix: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a table")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key '{prefix}{unknown[0]}'", hint=f"known keys here: {', '.join(sorted(fields))}")
    kw = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kw[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            kw[name] = _check_type(f"{prefix}{name}", value, hint)
    return cls(**kw)


#: defaults that differ by recipe (fine-tuning a pretrained model wants a
#: smaller learning rate than training from random weights, and longer rows)
RECIPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "lora": {"optim": {"lr": 1e-3}, "batch_size": 4, "context": 256},
    "full": {"optim": {"lr": 2e-5}, "batch_size": 4, "context": 256},
}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def from_dict(data: dict[str, Any]) -> TrainConfig:
    """A validated TrainConfig from nested plain data (TOML, JSON)."""
    return validate(_build(TrainConfig, data))


def defaults(recipe: str = "from-scratch", under: dict[str, Any] | None = None) -> TrainConfig:
    """The default config of a recipe (``RECIPE_DEFAULTS`` over the dataclass
    defaults, then ``under``: nested values such as a project's, see
    ``toy.project.Project.train_defaults``)."""
    if recipe not in RECIPES:
        raise ConfigError(f"recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    # not validated: a fine-tuning recipe's base comes later (``override`` validates)
    return _build(TrainConfig, _merge(_merge({"recipe": recipe}, RECIPE_DEFAULTS.get(recipe, {})), under or {}))


def load_toml(path: str | Path, recipe: str | None = None, under: dict[str, Any] | None = None) -> TrainConfig:
    """A config file over the defaults of ``recipe`` (default: the file's
    ``recipe`` key, else from-scratch) and ``under`` (nested values between
    the defaults and the file: a project's); a file naming another recipe is
    an error."""
    p = Path(path)
    try:
        regular_file(p)  # a FIFO would block the read, /dev/zero never ends
    except BadInputError as e:
        raise ConfigError(f"cannot read config {e}", e.hint) from None
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read config {p}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    named = data.get("recipe")
    if recipe is not None and named is not None and named != recipe:
        raise ConfigError(f"{p}: recipe = {named!r}, but this command trains {recipe!r}")
    r = recipe or named or "from-scratch"
    if not isinstance(r, str) or r not in RECIPES:
        raise ConfigError(f"{p}: recipe {r!r} is not one of {', '.join(RECIPES)}")
    base = _merge(_merge({"recipe": r}, RECIPE_DEFAULTS.get(r, {})), under or {})
    cfg = _build(TrainConfig, _merge(base, data))
    # a fine-tuning file may leave ``base`` to the command line: ``override``
    # and ``train`` validate the final config
    return validate(cfg) if cfg.recipe == "from-scratch" or cfg.base else cfg


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def override(cfg: TrainConfig, **values: Any) -> TrainConfig:
    """A copy with dotted keys replaced (``{"optim.lr": 1e-3, "steps": 10}``);
    None values are ignored (an unset CLI flag)."""
    data = to_dict(cfg)
    for key, value in values.items():
        if value is None:
            continue
        *path, last = key.split(".")
        node = data
        for part in path:
            node = node[part]
        node[last] = value
    return from_dict(data)


def resolve_shape(shape: ModelShape) -> dict[str, Any]:
    """The model dimensions: the preset's values overridden by explicit ones."""
    if shape.arch not in models.families():
        raise ConfigError(f"model.arch {shape.arch!r} is not one of {', '.join(models.families())}")
    presets = models.get_language_model(shape.arch).presets
    base: dict[str, Any] = {}
    if shape.preset is not None:
        if shape.preset not in presets:
            raise ConfigError(
                f"model.preset {shape.preset!r} is not one of {', '.join(presets)}"
                + (f" (the {shape.arch} presets)" if shape.arch != "llama" else "")
            )
        base.update(presets[shape.preset])
    for k in ("d_model", "n_layer", "n_head", "n_head_kv", "d_ff", "head_dim", "rope_base"):
        v = getattr(shape, k)
        if v is not None:
            base[k] = v
    missing = [k for k in ("d_model", "n_layer", "n_head", "d_ff") if base.get(k) is None]
    if missing:
        raise ConfigError(f"model.{missing[0]} is needed (no preset gives it)")
    base.setdefault("n_head_kv", base["n_head"])
    base.setdefault("rope_base", 10000.0)
    if not base.get("head_dim"):
        if base["d_model"] % base["n_head"]:
            raise ConfigError(f"model.d_model={base['d_model']} is not a multiple of n_head={base['n_head']}")
        base["head_dim"] = base["d_model"] // base["n_head"]
    for k in ("d_model", "n_layer", "n_head", "n_head_kv", "d_ff", "head_dim"):
        if base[k] < 1:
            raise ConfigError(f"model.{k}={base[k]} must be >= 1")
    if base["n_head"] % base["n_head_kv"]:
        raise ConfigError(f"model.n_head={base['n_head']} is not a multiple of n_head_kv={base['n_head_kv']}")
    base["norm_eps"] = shape.norm_eps
    base["tied_output"] = shape.tied_output
    return base


def validate(cfg: TrainConfig) -> TrainConfig:
    checks = [
        (cfg.steps >= 1, f"steps={cfg.steps} must be >= 1"),
        (cfg.batch_size >= 1, f"batch_size={cfg.batch_size} must be >= 1"),
        (cfg.context >= 2, f"context={cfg.context} must be >= 2"),
        (cfg.grad_accum >= 1, f"grad_accum={cfg.grad_accum} must be >= 1"),
        (cfg.eval_every >= 0, f"eval_every={cfg.eval_every} must be >= 0"),
        (cfg.eval_batches >= 0, f"eval_batches={cfg.eval_batches} must be >= 0"),
        (cfg.save_every >= 0, f"save_every={cfg.save_every} must be >= 0"),
        (cfg.keep_checkpoints >= 0, f"keep_checkpoints={cfg.keep_checkpoints} must be >= 0"),
        (cfg.sample_every >= 0, f"sample_every={cfg.sample_every} must be >= 0"),
        (cfg.sample_tokens >= 0, f"sample_tokens={cfg.sample_tokens} must be >= 0"),
        (cfg.threads is None or cfg.threads >= 1, f"threads={cfg.threads} must be >= 1"),
        (0 <= cfg.data.val_fraction < 1, f"data.val_fraction={cfg.data.val_fraction} must be in [0, 1)"),
        (cfg.tokenizer.vocab_size >= 257, f"tokenizer.vocab_size={cfg.tokenizer.vocab_size} must be >= 257"),
    ]
    checks += [
        (cfg.recipe in RECIPES, f"recipe {cfg.recipe!r} is not one of {', '.join(RECIPES)}"),
        (cfg.recipe == "from-scratch" or bool(cfg.base), f"recipe {cfg.recipe!r} needs a base model (base)"),
        (cfg.data.overflow in ("truncate", "drop"), f'data.overflow={cfg.data.overflow!r}: "truncate" or "drop"'),
        (
            cfg.data.max_length is None or 2 <= cfg.data.max_length <= cfg.context + 1,
            f"data.max_length={cfg.data.max_length} must be between 2 and context + 1 = {cfg.context + 1}",
        ),
        (
            all(f in ("embeddings", "output") for f in cfg.freeze),
            f'freeze {cfg.freeze!r}: each is "embeddings" or "output"',
        ),
        (
            cfg.warm_start.project in ("pca", "truncate"),
            f'warm_start.project={cfg.warm_start.project!r}: "pca" or "truncate"',
        ),
        (
            all(k in DIAGNOSTICS or k == "all" for k in cfg.diagnostics.kinds),
            f"diagnostics.kinds {cfg.diagnostics.kinds!r}: each is one of {', '.join(DIAGNOSTICS)} (or all)",
        ),
        (cfg.diagnostics.every >= 1, f"diagnostics.every={cfg.diagnostics.every} must be >= 1"),
        (
            all(t in REPORT_TO for t in cfg.report.to) and len(set(cfg.report.to)) == len(cfg.report.to),
            f"report.to {cfg.report.to!r}: each is one of {', '.join(REPORT_TO)}, once",
        ),
        (cfg.trace_step >= 1, f"trace_step={cfg.trace_step} must be >= 1"),
        (cfg.mixed_cpus in ("refuse", "allow"), f'mixed_cpus={cfg.mixed_cpus!r}: "refuse" or "allow"'),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    if cfg.recipe == "lora":
        cfg.lora.validate()
    try:
        cfg.optim.validate()
    except BadInputError as e:
        raise ConfigError(f"optim.{e}") from None
    dims = resolve_shape(cfg.model)
    arch = models.get_language_model(cfg.model.arch)
    arch.train_config(dims, 2, max(2, cfg.context))  # the architecture's own checks
    return cfg


__all__ = [
    "DIAGNOSTICS",
    "RECIPES",
    "REPORT_TO",
    "ConfigError",
    "DataConfig",
    "DiagnosticsConfig",
    "ReportConfig",
    "LoraConfig",
    "WarmStartConfig",
    "ModelShape",
    "TokenizerConfig",
    "TrainConfig",
    "defaults",
    "from_dict",
    "load_toml",
    "override",
    "resolve_shape",
    "to_dict",
    "validate",
]
