"""What each training recipe sets up: tokenizer, data, model, starting
values and how a checkpoint's model file is written.

- ``from-scratch``: a tokenizer trained on the corpus (or taken from a
  model), text packed into windows (``toy.train.data``), random weights
  (``toy.train.model``), checkpoints with llama.cpp metadata; any registered architecture
  (``model.arch``).
- ``lora``: the base GGUF (``base``) bound zero-copy and frozen — quantized
  weights stay quantized (QLoRA) — plus LoRA parameters
  (``toy.train.lora``); instruction data (``toy.train.instruct``); each
  checkpoint's model file is the adapter (``toy.adapters``), which
  llama.cpp's ``--lora`` and ``toy infer --lora`` load.
- ``full``: every weight of the base trainable, from an F32 copy
  (quantized tensors are dequantized, and the run says so in a ``note``
  event and the log); ``freeze`` keeps the embedding and/or the output head
  as they are (bound from the file, not trained). Instruction data.
  Checkpoints are full models carrying the base's metadata (tokenizer, chat
  template, architecture keys) with F32 weights.
- ``dpo``, ``orpo``, ``kto`` (preference tuning, ``toy.train.prefrun``)
  and ``grpo`` (``toy.train.grpo``): the lora or the full set-up, as
  ``adapter`` says, on the recipe's own data (``setup(..., data=)``:
  preference pairs, labelled examples, prompts) instead of instruction
  JSONL; the checkpoints are the same adapters or full models.
- ``warm-start``: a new model of the configured shape whose token embedding
  comes from a donor (``base``) — projected onto the new width when the
  widths differ — and whose blocks are the donor's where every tensor's
  shape matches (``warm_start.layers`` picks which), the rest random as
  from scratch; the donor's tokenizer; text data as from scratch.

The fine-tuning recipes record the base file's sha256 in the checkpoint
state, and resuming refuses a base that changed (the run could not continue
exactly).

Embedding projection (warm-start, donor width D, new width d): ``pca``
projects the donor's embedding rows onto its top d principal directions
(rows centred, SVD) and rescales to the init's standard deviation times
the donor's per-column spread; ``truncate`` keeps the first d columns. When
d > D the extra columns stay random.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from toy import models, store
from toy.adapters import save_adapter
from toy.errors import BadInputError, ToyError
from toy.gguf import GGUFFile, GGUFWriter, TypeInfo, ValueType, bind_tensors, copy_metadata
from toy.tokenizer import ChatTemplate, Tokenizer
from toy.train.checkpoint import tokenizer_metadata_of
from toy.train.config import PREF_RECIPES, TrainConfig
from toy.train.instruct import InstructData, load_examples
from toy.train.lora import LoraTrain, adapted_weights, init_lora
from toy.train.model import ArchTrain, init_params


@dataclass
class Setup:
    tokenizer: Any
    tok_meta: dict[str, Any]  # tokenizer.* keys ((value, TypeInfo) pairs) for model checkpoints
    tok_source: str
    data: Any  # PackedData or InstructData (the same interface)
    data_info: dict[str, Any]
    model_cfg: Any  # the architecture's config (toy.models)
    train_model: Any  # TrainModel
    params: dict[str, np.ndarray]  # starting values
    start: dict[str, Any]  # recipe-specific run_start fields
    write_model: Callable[[Path, dict[str, np.ndarray], int, str], None] | None = None
    state: dict[str, Any] = field(default_factory=dict)  # recipe facts for the checkpoint state
    notes: list[str] = field(default_factory=list)
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for c in reversed(self.closers):
            c()
        self.closers.clear()


def _open_base(cfg: TrainConfig, ckpt_state: dict | None):
    assert cfg.base is not None  # validate(): every recipe but from-scratch has a base
    path = Path(store.resolve_or_fetch(cfg.base))
    sha = store.sha256_file(path)
    if ckpt_state is not None and ckpt_state.get("base_sha256") not in (None, sha):
        raise BadInputError(
            f"{path}: the base model changed since the run started (sha256 differs)",
            hint="resume with the same base file the run was started with",
        )
    return path, sha, GGUFFile(path)


def _instruct_data(cfg: TrainConfig, tokenizer, template) -> tuple[Any, dict[str, Any]]:
    if not cfg.data.paths:
        raise BadInputError("no training data: give JSONL files (data.paths)")
    max_length = cfg.data.max_length or cfg.context + 1
    examples, stats = load_examples(
        cfg.data.paths,
        tokenizer,
        template,
        max_length=max_length,
        overflow=cfg.data.overflow,
        special_in_content=cfg.data.special_in_content,
    )
    if not examples:
        raise BadInputError("no usable example in the training data")
    data = InstructData(examples, cfg.context, val_fraction=cfg.data.val_fraction, seed=cfg.seed)
    info = {
        "examples": stats.n_examples,
        "kinds": stats.kinds,
        "tokens": stats.n_tokens,
        "loss_tokens": stats.n_loss,
        "lengths": stats.lengths,
        "max_length": max_length,
        "truncated": stats.truncated,
        "dropped": stats.dropped + stats.no_loss,
        "train_windows": data.n_train,
        "val_windows": data.n_val,
    }
    return data, info


def data_note(info: dict[str, Any]) -> str:
    """The log line of a fine-tuning run's data: what was read, and what was
    truncated or dropped (never silent). A loader that words its own line
    gives it as ``info["note"]``."""
    if isinstance(info.get("note"), str):
        return info["note"]
    kinds = ", ".join(f"{k} {n}" for k, n in info["kinds"].items())
    return (
        f"data: {info['examples']} examples used ({kinds} read), {info['loss_tokens']:,} of {info['tokens']:,} "
        f"tokens carry loss; longer than {info['max_length']} tokens: {info['truncated']} truncated, "
        f"{info['dropped']} dropped; {info['train_windows']} training rows, {info['val_windows']} validation rows"
    )


def _base_tokenizer(gf):
    meta = tokenizer_metadata_of(gf)
    if "tokenizer.ggml.tokens" not in meta:
        raise ToyError(f"{gf.path}: has no tokenizer")
    return Tokenizer.from_gguf(gf.metadata), ChatTemplate.from_gguf(gf.metadata), meta


def _check_context(cfg: TrainConfig, model_cfg) -> None:
    if model_cfg.context_length and cfg.context > model_cfg.context_length:
        raise BadInputError(f"context={cfg.context} exceeds the base model's context length {model_cfg.context_length}")


@dataclass
class _Base:
    """A fine-tuning run's base: the open file, its config, tokenizer and the
    run's instruction data, its tensors bound on the runtime."""

    path: Path
    sha: str
    gf: Any
    model_cfg: Any
    tokenizer: Any
    meta: dict[str, Any]
    data: Any
    info: dict[str, Any]
    bound: Any
    closers: list[Callable[[], None]]

    def close(self) -> None:
        for c in reversed(self.closers):
            c()


#: a fine-tuning run's data: ``(cfg, tokenizer, chat template) -> (data, info)``; ``data`` has
#: ``n_train``, ``n_val``, ``batch(rows)`` and ``check_batch(batch_size)`` (``InstructData``'s interface),
#: ``info`` is run_start's "data" (its "note", if any, the data's log line: ``data_note``)
DataLoader = Callable[[TrainConfig, Any, Any], tuple[Any, dict[str, Any]]]


def _data_for(cfg: TrainConfig) -> DataLoader:
    """The recipe's data: instruction JSONL (lora, full), preference pairs
    or labelled examples (``toy.train.prefrun.pref_data``: dpo, orpo, kto)."""
    if cfg.recipe in PREF_RECIPES:
        from toy.train.prefrun import pref_data

        return pref_data
    return _instruct_data


def _prepare(cfg: TrainConfig, runtime, ckpt_state: dict | None, data_fn: DataLoader | None = None) -> _Base:
    path, sha, gf = _open_base(cfg, ckpt_state)
    closers: list[Callable[[], None]] = [gf.close]
    try:
        model_cfg = models.config_from_gguf(gf)
        _check_context(cfg, model_cfg)
        tokenizer, template, meta = _base_tokenizer(gf)
        data, info = (data_fn or _data_for(cfg))(cfg, tokenizer, template)
        bound = bind_tensors(gf, runtime)
        closers.append(bound.close)
    except BaseException:
        for c in reversed(closers):
            c()
        raise
    return _Base(path, sha, gf, model_cfg, tokenizer, meta, data, info, bound, closers)


# -- lora -------------------------------------------------------------------------


def setup(cfg: TrainConfig, runtime, ckpt_state: dict | None, data: DataLoader | None = None) -> Setup:
    """The set-up of a fine-tuning recipe: ``setup_lora`` or ``setup_full``
    (the lora and full recipes by name; the preference and RL recipes by
    ``cfg.adapter``); ``data`` replaces the recipe's data loader."""
    kind = cfg.recipe if cfg.recipe in ("lora", "full") else cfg.adapter
    return (setup_lora if kind == "lora" else setup_full)(cfg, runtime, ckpt_state, data=data)


def setup_lora(cfg: TrainConfig, runtime, ckpt_state: dict | None, *, data: DataLoader | None = None) -> Setup:
    b = _prepare(cfg, runtime, ckpt_state, data)
    path, sha, gf, model_cfg, closers = b.path, b.sha, b.gf, b.model_cfg, b.closers
    tokenizer, meta, data, info = b.tokenizer, b.meta, b.data, b.info
    try:
        model = LoraTrain(
            model_cfg,
            b.bound.tensors,
            cfg.lora,
            runtime=runtime,
            batch=cfg.batch_size,
            context=cfg.context,
            seed=cfg.seed,
        )
        closers.append(model.close)
    except BaseException:
        b.close()
        raise
    lc = model.settings  # the targets resolved for this architecture
    targets = lc.targets
    assert targets is not None  # resolved() names them
    types = sorted({gf.tensors[w].dtype.name for w in adapted_weights(model_cfg, targets)})
    arch = model_cfg.architecture

    def write(p: Path, values: dict[str, np.ndarray], step: int, run_id: str) -> None:
        save_adapter(
            p,
            architecture=arch,
            pairs=model.adapter_pairs(values),
            alpha=lc.alpha,
            rank=lc.rank,
            rslora=lc.rslora,
            targets=list(targets),
            dropout=lc.dropout,
            base=path.name,
            name=f"toy LoRA {run_id} step {step}",
        )

    start = {
        "base": {"path": str(path), "sha256": sha, "weight_types": types, "n_params": gf.n_params},
        "lora": {**vars(lc), "scale": lc.scale},
        "model": _dims(model_cfg),
    }
    return Setup(
        tokenizer, meta, f"model:{path}", data, info, model_cfg, model, init_lora(model.shapes, cfg.seed), start,
        write, {"base_sha256": sha}, [data_note(info)], closers,
    )  # fmt: skip


# -- full -------------------------------------------------------------------------


def setup_full(cfg: TrainConfig, runtime, ckpt_state: dict | None, *, data: DataLoader | None = None) -> Setup:
    b = _prepare(cfg, runtime, ckpt_state, data)
    path, sha, gf, model_cfg, closers = b.path, b.sha, b.gf, b.model_cfg, b.closers
    tokenizer, meta, data, info = b.tokenizer, b.meta, b.data, b.info
    try:
        arch = models.language_model_of(model_cfg)
        infos = arch.params(model_cfg)
        shapes = {n: p.shape for n, p in infos.items()}
        frozen_names: set[str] = set()
        if "embeddings" in cfg.freeze:  # token (and learned position) embeddings
            frozen_names |= {n for n, p in infos.items() if p.kind in ("embedding", "position")}
        if "output" in cfg.freeze:  # the head's weight (the embedding itself when tied)
            frozen_names.add(arch.output_weight(model_cfg))
        frozen_names &= set(shapes)
        frozen = {n: b.bound.tensors[n] for n in sorted(frozen_names)}
        trainable = [n for n in shapes if n not in frozen]
        quantized = sorted({gf.tensors[n].dtype.name for n in trainable if gf.tensors[n].dtype.name not in ("F32",)})
        params = {n: np.array(gf.tensor_to_float(n), np.float32) for n in trainable}
    except BaseException:
        b.close()
        raise
    notes = [data_note(info)]
    if quantized:
        notes.append(
            f"full fine-tune: {', '.join(quantized)} weights of {path.name} dequantized to a trainable F32 copy "
            f"({sum(int(np.prod(shapes[n])) for n in trainable) * 4 / 2**20:.0f} MiB)"
        )
    extra = [n for n in gf.tensors if n not in params]  # frozen and non-trained tensors (e.g. rope_freqs)

    def write(p: Path, values: dict[str, np.ndarray], step: int, run_id: str) -> None:
        w = GGUFWriter(p)
        copy_metadata(gf, w, skip={"general.file_type", "toy.train.run_id", "toy.train.step"})
        w.add("general.file_type", 0, TypeInfo(ValueType.UINT32))
        w.add("toy.train.run_id", run_id)
        w.add("toy.train.step", int(step))
        for name in gf.tensors:
            arr = values[name] if name in values else gf.tensor_to_float(name)
            w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
        w.write()

    start = {
        "base": {"path": str(path), "sha256": sha, "dequantized": quantized, "n_params": gf.n_params},
        "frozen": sorted(frozen),
        "untrained_tensors": extra,
        "model": _dims(model_cfg),
    }
    return Setup(
        tokenizer, meta, f"model:{path}", data, info, model_cfg, ArchTrain(model_cfg, frozen=frozen), params, start,
        write, {"base_sha256": sha}, notes, closers,
    )  # fmt: skip


# -- warm-start -------------------------------------------------------------------


def project_embedding(donor: np.ndarray, width: int, how: str, std: float, rng) -> np.ndarray:
    """Donor embedding rows (V, D) onto ``width`` columns (see the module docstring)."""
    V, D = donor.shape
    out = (rng.standard_normal((V, width)) * std).astype(np.float32)
    k = min(width, D)
    if how == "truncate":
        out[:, :k] = donor[:, :k]
        return out
    x = donor.astype(np.float64)
    x = x - x.mean(axis=0, keepdims=True)
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    proj = x @ vt[:k].T  # (V, k): coordinates along the top-k principal directions
    spread = proj.std(axis=0, keepdims=True)
    spread[spread == 0] = 1.0
    out[:, :k] = (proj / spread * donor.std()).astype(np.float32)
    return out


def warm_start_params(cfg: TrainConfig, model_cfg, gf, seed: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Starting values: random (as from scratch), then the donor's embedding
    (projected) and the donor's blocks where every tensor's shape matches."""
    donor_cfg = models.config_from_gguf(gf)
    arch = models.of(model_cfg)
    if models.of(donor_cfg) is not arch:
        raise BadInputError(
            f"the donor is a {donor_cfg.architecture} model, the new model {model_cfg.architecture}",
            hint=f"train the new model with --arch {models.of(donor_cfg).family}",
        )
    if donor_cfg.n_vocab != model_cfg.n_vocab:
        raise BadInputError(f"the donor's vocabulary has {donor_cfg.n_vocab} tokens, the new model {model_cfg.n_vocab}")
    params = init_params(model_cfg, seed)
    infos = arch.params(model_cfg)
    rng = np.random.default_rng([seed, 1])
    how = ""
    for name in (n for n, p in infos.items() if p.kind == "embedding"):
        emb = gf.tensor_to_float(name)
        std = float(params[name].std()) or 0.02
        if emb.shape == params[name].shape:
            params[name] = np.array(emb, np.float32)
            how = "copied"
        else:
            params[name] = project_embedding(emb, model_cfg.d_model, cfg.warm_start.project, std, rng)
            how = f"projected {emb.shape[1]} -> {model_cfg.d_model} ({cfg.warm_start.project})"
    positions = {}
    for name in (n for n, p in infos.items() if p.kind == "position"):  # learned positions: the first rows
        donor = gf.tensor_to_float(name) if name in gf.tensors else None
        rows, width = params[name].shape
        if donor is not None and donor.shape[1] == width and donor.shape[0] >= rows:
            params[name] = np.array(donor[:rows], np.float32)
            positions[name] = "copied"
        else:
            positions[name] = "random (the donor's do not fit)"
    layers = cfg.warm_start.layers
    if layers is None:
        layers = list(range(min(model_cfg.n_layer, donor_cfg.n_layer)))
    copied, skipped = [], []
    new_shapes = {n: p.shape for n, p in infos.items()}
    for i in layers:
        if not 0 <= i < min(model_cfg.n_layer, donor_cfg.n_layer):
            raise BadInputError(f"warm_start.layers: block {i} does not exist in both models")
        names = [n for n in new_shapes if n.startswith(f"blk.{i}.")]
        if all(n in gf.tensors and tuple(gf.tensors[n].shape) == new_shapes[n] for n in names):
            for n in names:
                params[n] = np.array(gf.tensor_to_float(n), np.float32)
            copied.append(i)
        else:
            skipped.append(i)
    info: dict[str, Any] = {"embedding": how, "blocks_copied": copied, "blocks_skipped_shape": skipped}
    if positions:
        info["positions"] = positions
    return params, info


def _dims(model_cfg) -> dict[str, Any]:
    return dataclasses.asdict(model_cfg)


__all__ = ["Setup", "project_embedding", "setup_full", "setup_lora", "warm_start_params"]
