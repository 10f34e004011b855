"""Training configuration: dataclasses, size presets, TOML loading.

A config file is TOML; its top-level keys are the fields of ``TrainConfig``
and its tables ``[model]``, ``[data]``, ``[tokenizer]``, ``[optim]``,
``[lora]``, ``[pref]`` (the preference objectives: ``PrefConfig``),
``[grpo]`` (``GRPOConfig``) the
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
RECIPES = ("from-scratch", "lora", "full", "warm-start", "dpo", "orpo", "kto", "grpo")
#: the preference-tuning recipes (``toy.train.prefrun``): pairs (dpo, orpo) or labelled examples (kto)
PREF_RECIPES = ("dpo", "orpo", "kto")
#: the recipes that fine-tune a GGUF base with LoRA (QLoRA) or every weight (``adapter``)
FINETUNE_RECIPES = ("lora", "full", *PREF_RECIPES, "grpo")
#: what ``adapter`` can name, and the recipes it applies to (the preference and RL recipes)
ADAPTERS = ("lora", "full")
ADAPTED_RECIPES = (*PREF_RECIPES, "grpo")
#: ``pref.loss_type`` of DPO (``toy.train.objectives.DPOLoss``)
DPO_LOSSES = ("sigmoid", "ipo", "robust", "hinge")


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
class PrefConfig:
    """The preference objectives' hyper-parameters (``toy.train.objectives``;
    TRL's names and defaults): ``beta`` (DPO, KTO: the strength of the
    reference's pull), ``loss_type`` and ``label_smoothing`` (DPO),
    ``orpo_lambda`` (ORPO: the weight of the odds-ratio term), and KTO's
    weights of desirable and undesirable examples."""

    beta: float = 0.1
    loss_type: str = "sigmoid"  # dpo: sigmoid | ipo | robust | hinge
    label_smoothing: float = 0.0  # dpo (robust): the assumed share of flipped labels, in [0, 0.5)
    orpo_lambda: float = 0.1  # orpo
    desirable_weight: float = 1.0  # kto
    undesirable_weight: float = 1.0  # kto

    def validate(self) -> PrefConfig:
        if not math.isfinite(self.beta) or self.beta <= 0:
            raise ConfigError(f"pref.beta={self.beta} must be > 0")
        if self.loss_type not in DPO_LOSSES:
            raise ConfigError(f"pref.loss_type={self.loss_type!r}: one of {', '.join(DPO_LOSSES)}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"pref.label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        if self.label_smoothing and self.loss_type != "robust":
            raise ConfigError(
                f"pref.label_smoothing applies to the robust loss only, not {self.loss_type!r} (as in TRL)",
                hint="set pref.loss_type = robust, or leave label_smoothing at 0",
            )
        if not math.isfinite(self.orpo_lambda) or self.orpo_lambda < 0:
            raise ConfigError(f"pref.orpo_lambda={self.orpo_lambda} must be >= 0")
        for k in ("desirable_weight", "undesirable_weight"):
            v = getattr(self, k)
            if not math.isfinite(v) or v <= 0:
                raise ConfigError(f"pref.{k}={v} must be > 0")
        return self


#: ``grpo.loss_type`` (``toy.train.objectives.GRPOLoss``) and ``grpo.scale_rewards`` (TRL's names)
GRPO_LOSSES = ("dapo", "grpo", "bnpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")


@dataclass
class GRPOConfig:
    """GRPO's settings (``toy.train.grpo``; TRL's GRPOConfig names where it
    has them). A step's ``batch_size * grad_accum`` rows are completions,
    ``group`` of them per prompt; ``rewards`` names the reward functions
    (``toy.train.rewards``: a built-in ``NAME`` or ``NAME=ARG``, or
    ``module:function``), ``reward_weights`` one weight each (None: 1.0)."""

    group: int = 8  # completions per prompt (>= 2)
    max_new_tokens: int = 64  # a completion's budget (prompt + this must fit the context)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    epsilon: float = 0.2  # the clip range's lower side
    epsilon_high: float | None = None  # its upper side (None: epsilon)
    iterations: int = 1  # optimizer steps per rollout batch (TRL's num_iterations)
    beta: float = 0.0  # the KL penalty to the reference (0: none, TRL's default)
    loss_type: str = "dapo"  # of GRPO_LOSSES
    scale_rewards: str = "group"  # of SCALE_REWARDS
    mask_truncated: bool = False  # completions cut at max_new_tokens carry no loss
    rewards: list[str] = field(default_factory=list)
    reward_weights: list[float] | None = None
    rollout_slots: int = 0  # sequences decoded at once (0: min(rows per step, 32))

    def validate(self) -> GRPOConfig:
        checks = [
            (self.group >= 2, f"grpo.group={self.group} must be >= 2"),
            (self.max_new_tokens >= 1, f"grpo.max_new_tokens={self.max_new_tokens} must be >= 1"),
            (
                math.isfinite(self.temperature) and self.temperature > 0,
                f"grpo.temperature={self.temperature} must be > 0",
            ),
            (0 < self.top_p <= 1, f"grpo.top_p={self.top_p} must be in (0, 1]"),
            (self.top_k >= 0, f"grpo.top_k={self.top_k} must be >= 0"),
            (0 <= self.min_p < 1, f"grpo.min_p={self.min_p} must be in [0, 1)"),
            (math.isfinite(self.epsilon) and self.epsilon >= 0, f"grpo.epsilon={self.epsilon} must be >= 0"),
            (
                self.epsilon_high is None or (math.isfinite(self.epsilon_high) and self.epsilon_high >= 0),
                f"grpo.epsilon_high={self.epsilon_high} must be >= 0",
            ),
            (self.iterations >= 1, f"grpo.iterations={self.iterations} must be >= 1"),
            (math.isfinite(self.beta) and self.beta >= 0, f"grpo.beta={self.beta} must be >= 0"),
            (self.loss_type in GRPO_LOSSES, f"grpo.loss_type={self.loss_type!r}: one of {', '.join(GRPO_LOSSES)}"),
            (
                self.scale_rewards in SCALE_REWARDS,
                f"grpo.scale_rewards={self.scale_rewards!r}: one of {', '.join(SCALE_REWARDS)}",
            ),
            (bool(self.rewards), "grpo.rewards: name at least one reward function (--reward)"),
            (
                self.reward_weights is None or len(self.reward_weights) == len(self.rewards),
                f"grpo.reward_weights: {len(self.reward_weights or [])} weight(s) for {len(self.rewards)} reward(s)",
            ),
            (
                all(math.isfinite(w) for w in self.reward_weights or []),
                f"grpo.reward_weights {self.reward_weights!r}: each must be a finite number",
            ),
            (self.rollout_slots >= 0, f"grpo.rollout_slots={self.rollout_slots} must be >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        return self


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
    base: str | None = None  # lora, full, dpo, orpo, kto, grpo: the model fine-tuned; warm-start: the donor
    # dpo, orpo, kto, grpo: what is trained: "lora" (adapters; QLoRA on a quantized base) or "full" (every weight)
    adapter: str = "lora"
    lora: LoraConfig = field(default_factory=LoraConfig)
    pref: PrefConfig = field(default_factory=PrefConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
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
#: smaller learning rate than training from random weights, and longer rows);
#: ``"<recipe>+full"``: what differs when such a recipe trains every weight
#: (``adapter = "full"``).
#:
#: The preference recipes (batch_size counts pairs for dpo and orpo: 4 pairs
#: are 8 rows): a full fine-tune takes TRL's default learning rate of
#: DPOConfig, ORPOConfig and KTOConfig, 1e-6; LoRA takes 5e-5 — LoRA wants a
#: larger rate than a full fine-tune (its updates pass through the small B·A
#: product, which starts at zero), and 5e-5 is a twentieth of toy's SFT LoRA
#: rate (1e-3): a preference loss is a difference of two sequences' summed
#: log-probabilities, whose gradients are several times an SFT step's, and
#: DPO drifts (both sequences' likelihoods fall) at SFT-like rates. On
#: SmolLM2-135M-Instruct with rank 16, 5e-5 moves held-out preference
#: accuracy within a few dozen steps (docs/guide/preference-tuning.md).
_PREF_DEFAULTS: dict[str, Any] = {"optim": {"lr": 5e-5}, "batch_size": 4, "context": 256}
RECIPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "lora": {"optim": {"lr": 1e-3}, "batch_size": 4, "context": 256},
    "full": {"optim": {"lr": 2e-5}, "batch_size": 4, "context": 256},
    **{r: _PREF_DEFAULTS for r in PREF_RECIPES},
    **{f"{r}+full": {"optim": {"lr": 1e-6}} for r in PREF_RECIPES},
    # grpo: batch_size counts completions (8: one group of TRL's default 8 generations); the LoRA rate is a
    # starting point, not measured on a long run; full: TRL's GRPOConfig default
    "grpo": {"optim": {"lr": 1e-5}, "batch_size": 8, "context": 256},
    "grpo+full": {"optim": {"lr": 1e-6}},
}


def recipe_defaults(recipe: str, adapter: str | None = None) -> dict[str, Any]:
    """``RECIPE_DEFAULTS`` of ``recipe`` (nested), with its ``+full`` entry
    over them when ``adapter`` is "full"."""
    out = RECIPE_DEFAULTS.get(recipe, {})
    if adapter == "full":
        out = _merge(out, RECIPE_DEFAULTS.get(f"{recipe}+full", {}))
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def from_dict(data: dict[str, Any]) -> TrainConfig:
    """A validated TrainConfig from nested plain data (TOML, JSON)."""
    return validate(_build(TrainConfig, data))


def defaults(
    recipe: str = "from-scratch", under: dict[str, Any] | None = None, *, adapter: str | None = None
) -> TrainConfig:
    """The default config of a recipe (``RECIPE_DEFAULTS`` over the dataclass
    defaults, then ``under``: nested values such as a project's, see
    ``toy.project.Project.train_defaults``). ``adapter`` (the preference
    recipes: "lora" or "full") picks that kind's defaults and is set."""
    if recipe not in RECIPES:
        raise ConfigError(f"recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    adapter = adapter or (under or {}).get("adapter")
    base = _merge({"recipe": recipe}, recipe_defaults(recipe, adapter))
    if adapter is not None:
        base["adapter"] = adapter
    # not validated: a fine-tuning recipe's base comes later (``override`` validates)
    return _build(TrainConfig, _merge(base, under or {}))


def load_toml(
    path: str | Path, recipe: str | None = None, under: dict[str, Any] | None = None, *, adapter: str | None = None
) -> TrainConfig:
    """A config file over the defaults of ``recipe`` (default: the file's
    ``recipe`` key, else from-scratch) and ``under`` (nested values between
    the defaults and the file: a project's); a file naming another recipe is
    an error. The defaults are those of ``adapter`` (a flag), else of the
    file's ``adapter`` key."""
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
    kind = adapter or data.get("adapter") or (under or {}).get("adapter")
    base = _merge(_merge({"recipe": r}, recipe_defaults(r, kind if isinstance(kind, str) else None)), under or {})
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
        (cfg.adapter in ADAPTERS, f'adapter={cfg.adapter!r}: "lora" or "full"'),
        (
            cfg.adapter == "lora" or cfg.recipe in ADAPTED_RECIPES,
            f"adapter={cfg.adapter!r} is for the recipes {', '.join(ADAPTED_RECIPES)}, not {cfg.recipe!r}",
        ),
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
    if cfg.recipe == "lora" or (cfg.recipe in ADAPTED_RECIPES and cfg.adapter == "lora"):
        cfg.lora.validate()
    if cfg.recipe in PREF_RECIPES:
        cfg.pref.validate()
    if cfg.recipe == "grpo":
        cfg.grpo.validate()
    try:
        cfg.optim.validate()
    except BadInputError as e:
        raise ConfigError(f"optim.{e}") from None
    dims = resolve_shape(cfg.model)
    arch = models.get_language_model(cfg.model.arch)
    arch.train_config(dims, 2, max(2, cfg.context))  # the architecture's own checks
    return cfg


__all__ = [
    "ADAPTED_RECIPES",
    "ADAPTERS",
    "DIAGNOSTICS",
    "DPO_LOSSES",
    "FINETUNE_RECIPES",
    "GRPO_LOSSES",
    "PREF_RECIPES",
    "RECIPES",
    "RECIPE_DEFAULTS",
    "REPORT_TO",
    "SCALE_REWARDS",
    "ConfigError",
    "DataConfig",
    "DiagnosticsConfig",
    "ReportConfig",
    "LoraConfig",
    "GRPOConfig",
    "PrefConfig",
    "WarmStartConfig",
    "ModelShape",
    "TokenizerConfig",
    "TrainConfig",
    "defaults",
    "from_dict",
    "load_toml",
    "override",
    "recipe_defaults",
    "resolve_shape",
    "to_dict",
    "validate",
]
