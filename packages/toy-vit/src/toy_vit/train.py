"""Training a ViT classifier on an image folder: the model the engine
trains, the run, and resuming it.

``train(cfg, hooks)`` starts a run (``ViTTrainConfig``), ``resume(run_dir,
hooks, steps=)`` continues one (``toy.train.lmrun.resume``, which dispatches
a checkpoint whose state says ``"task": "vit"`` to ``resume_task`` through
the ``toy.train_tasks`` entry point). The step loop, its events, stopping,
divergence and I/O errors are ``toy.train.steploop.StepRun``'s; the
engine (loss, backward, clipping, AdamW, accumulation, label smoothing) is
``toy.train.stepgraph.TrainEngine``'s. This module gives them:

- ``ViTTrainModel``: the engine's ``TrainModel`` for a ``ViTConfig``. Its
  feed (``PatchFeed``) has one logits row per image (context 1): inputs
  ``patches`` F32 (B, T, C·p·p) (``toy_vit.model.patchify`` of a batch's
  pixels) and ``keep`` F32 (B, 1) (the batch's ``loss_mask``); the logits
  (B, n_classes) are multiplied by ``keep``, so a padded row reaches no
  gradient. Batches are ``ClassBatch`` (pixels, targets = labels,
  loss_mask). ``frozen`` tensors are bound and used, not trained;
  ``lora`` adds A (r, in), B (out, r) on the chosen projections of every
  block (``toy_vit.model.forward``'s ``lora`` terms, scale alpha / r, the
  names ``<W>.lora_a`` / ``<W>.lora_b`` as in ``toy.train.lora``).
- ``ViTRun``: the run. Set-up: the ``ImageFolder`` and its split, the
  decoded-image cache (``hooks.phase("decoding images", done, total)``),
  the starting weights, the engine; ``unit = "images"``.

Decisions:

- Initial weights (from scratch), seeded ``default_rng(seed)``, drawn in
  ``toy_vit.model.params`` order, by kind as ``toy.train.model.init_params``
  does for language models (that function asks toy's architecture registry,
  where the ViT is not): matrices N(0, 0.02²), ``residual`` projections
  (attn_out, ffn_down) N(0, (0.02/sqrt(2·n_layer))²), ``position`` (the
  position embedding and the class token) N(0, 0.01²), norm gains 1,
  shifts and biases 0.
- ``base`` (``--from``): the model's dimensions, epsilon, mean and std are
  the base's (a dimension override that differs is refused, naming the
  field). When the base's labels are the data's classes (same names, same
  order) its head is kept; otherwise (another count, or other names) the
  head is replaced by a new seeded one (N(0, 0.02²) from
  ``default_rng([seed, 1])``, bias 0) and a ``note`` event says so.
  A fine-tune also evaluates at step 0 (the base's validation figures).
- ``freeze``: only the head (``cls.*``) and the final LayerNorm
  (``v.post_ln.*``) are trained, everything else is the base's, bound and
  frozen: a linear probe whose features may rescale. LoRA: the base frozen,
  the LoRA matrices (A ~ U(±1/sqrt(in)), B = 0, ``toy.train.lora.init_lora``
  with the run's seed) and the head trained (a head must learn the
  classes; PEFT's ``modules_to_save=["classifier"]``). A fine-tune records
  the base's sha256 and resuming refuses a base that changed: the frozen
  tensors are read from it again.
- Checkpoints: the model file is a ViT classifier ``toy_vit.load`` opens
  (``toy_vit.gguf_io``'s metadata: labels, image size, mean and std), with
  ``toy.train.run_id`` and ``toy.train.step``; with LoRA its weights are
  the merged ``W + s·B·A`` (float64 product rounded to F32) and the file
  also holds the ``<W>.lora_a``/``lora_b`` tensors (readers ignore extra
  tensors) and ``toy.train.lora.{rank,alpha,targets}``. The state adds
  ``task`` "vit", the config, the resolved ``ViTConfig`` (``model``), the
  image stream's cursor, the RNG state, ``images_seen`` and the base's sha256.
- Evaluation: every ``eval_every`` steps and at the end, the validation
  split plainly resized, through a forward graph of its own over the
  engine's parameters (batch_size images a compute, the last batch
  padded): an ``eval`` event with name "val", ``loss`` (mean NLL, float64
  log-softmax of the F32 logits), ``accuracy``, ``top5`` (top-min(5, n)
  accuracy) and ``images``; a note with the figures.
- ``run_start`` records ``task`` "vit", the model dims, ``n_params`` (the
  model's), ``n_trainable`` (the engine's), the data (root, classes, train
  and validation counts per class, ignored files) and the base.
- Several ranks (``mpiexec -n N toy vit train``, ``toy.train.distributed``):
  every rank reads the same folder and draws every micro-batch of a step
  (``batch_size x grad_accum x N`` images, augmented in the one-process
  order); the engine trains this rank's block and sums the gradients in
  rank order, so N ranks with ``grad_accum`` 1 are bit for bit one process
  with ``grad_accum`` N. Before anything is decoded the ranks compare their
  config, the listing of their image folders (relative names and sizes:
  reading every image on every rank would cost as much as decoding) and
  the base model (``file_digest``), and their ggml CPU variants
  (``mixed_cpus``); a difference stops every rank before a run folder
  exists. Rank 0 alone writes the run; every rank evaluates (the loop is
  the same everywhere). ``epochs`` count the images of all ranks, and the
  state records ``ranks`` and ``global_micro_batches`` so a resume on
  another number of ranks keeps the images per step (``regroup``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

import toy_ggml
from toy.errors import BadInputError
from toy.train import checkpoint
from toy.train import distributed as dist
from toy.train.stepgraph import ParamSpec, TrainEngine
from toy.train.steploop import Hooks, RunResult, StepRun, bundle_error, rank_hooks
from toy_vit.config import ViTConfig
from toy_vit.model import forward, graph_size, params, patchify
from toy_vit.trainconfig import LORA_TARGETS, ViTTrainConfig, ViTTrainConfigError, from_dict, to_dict, validate

F32 = toy_ggml.GGMLType.F32
HEAD = ("cls.weight", "cls.bias")
FREEZE_TRAINED = ("v.post_ln.weight", "v.post_ln.bias", *HEAD)  # what a freeze run trains
TASK = "vit"


# -- the model the engine trains ------------------------------------------------


@dataclass
class ClassBatch:
    """One micro-batch: pixels F32 (B, C, H, W) normalised, ``targets``
    int (B,) class indices, ``loss_mask`` F32 (B,) (0: a padding row)."""

    pixels: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray

    @classmethod
    def of(cls, b) -> ClassBatch:
        """From a ``toy_vit.data.ImageBatch``."""
        return cls(b.pixels, np.asarray(b.labels, np.int32), np.asarray(b.mask, np.float32))


@dataclass
class PatchInputs:
    batch: int
    patches: toy_ggml.Tensor  # F32 (B, T, K)
    keep: toy_ggml.Tensor  # F32 (B, 1)


class PatchFeed:
    """The classifier's inputs (see the module docstring)."""

    def __init__(self, cfg: ViTConfig):
        self.cfg = cfg

    def rows(self, batch: int, context: int) -> int:
        if context != 1:
            raise ValueError(f"context={context}: a classifier batch is images x 1")
        return batch

    def make(self, ctx: toy_ggml.Context, batch: int, context: int) -> PatchInputs:
        self.rows(batch, context)
        c = self.cfg
        return PatchInputs(
            batch,
            ctx.tensor(F32, (batch, c.n_tokens, c.patch_dim), name="patches"),
            ctx.tensor(F32, (batch, 1), name="keep"),
        )

    def upload(self, inputs: PatchInputs, batch) -> None:
        p = patchify(batch.pixels, self.cfg)  # BadInputError for a wrong shape or non-finite pixels
        if p.shape[0] != inputs.batch:
            raise ValueError(f"a batch of {p.shape[0]} images, the engine was built for {inputs.batch}")
        keep = np.asarray(batch.loss_mask, np.float32).reshape(-1)
        inputs.patches.set(p)
        inputs.keep.set((keep > 0).astype(np.float32).reshape(-1, 1))


def lora_weights(cfg: ViTConfig, targets) -> list[str]:
    """The adapted weights' names, block by block, in target order."""
    return [f"v.blk.{i}.{LORA_TARGETS[t]}.weight" for i in range(cfg.n_layer) for t in targets]


def lora_shapes(cfg: ViTConfig, rank: int, targets) -> dict[str, tuple[int, int]]:
    """``<W>.lora_a`` (r, in), ``<W>.lora_b`` (out, r) of every adapted weight."""
    shapes = params(cfg)
    out = {}
    for w in lora_weights(cfg, targets):
        o, i = shapes[w].shape
        out[f"{w}.lora_a"] = (rank, i)
        out[f"{w}.lora_b"] = (o, rank)
    return out


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class ViTTrainModel:
    """``TrainModel`` of a ViT classifier. ``frozen``: GGUF name -> bound
    ggml tensor (used, not trained); every other tensor of
    ``toy_vit.model.params`` is a parameter, plus the LoRA matrices of
    ``lora``. ``row_invariant``: see ``toy_vit.model.forward``."""

    def __init__(
        self,
        cfg: ViTConfig,
        frozen: Mapping[str, toy_ggml.Tensor] | None = None,
        lora: LoraSpec | None = None,
        row_invariant: bool = False,
    ):
        self.cfg, self.frozen, self.lora = cfg, dict(frozen or {}), lora
        self.row_invariant = row_invariant
        self.gemm = not row_invariant  # the engine's graphs use toy's CPU GEMM where it can
        self.n_vocab = cfg.n_classes
        self.feed = PatchFeed(cfg)
        unknown = sorted(set(self.frozen) - set(params(cfg)))
        if unknown:
            raise ValueError(f"frozen tensor {unknown[0]!r} is not a ViT tensor")
        self.lora_shapes = lora_shapes(cfg, lora.rank, lora.targets) if lora else {}

    def param_specs(self) -> list[ParamSpec]:
        out = [ParamSpec(n, p.shape, p.kind) for n, p in params(self.cfg).items() if n not in self.frozen]
        return out + [ParamSpec(n, s, "matrix") for n, s in self.lora_shapes.items()]

    def lora_terms(self, params_: Mapping[str, toy_ggml.Tensor]) -> dict[str, list] | None:
        if not self.lora:
            return None
        s = self.lora.scale
        return {
            w: [(params_[f"{w}.lora_a"], params_[f"{w}.lora_b"], s, None)]
            for w in lora_weights(self.cfg, self.lora.targets)
        }

    def logits(self, ctx, params_: Mapping[str, toy_ggml.Tensor], inputs: PatchInputs, training: bool = True):
        weights = {**self.frozen, **params_} if self.frozen else params_
        z = forward(
            ctx,
            self.cfg,
            weights,
            inputs.patches,
            inputs.batch,
            lora=self.lora_terms(params_),
            row_invariant=self.row_invariant,
        )
        return ctx.mul(z, inputs.keep)  # (B, n_classes); a padded row is 0 and passes no gradient on

    def merged(self, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's tensors with the LoRA products merged in: ``values``
        holds every model tensor and the LoRA matrices."""
        out = {n: values[n] for n in params(self.cfg)}
        if self.lora:
            s = self.lora.scale
            for w in lora_weights(self.cfg, self.lora.targets):
                a = np.asarray(values[f"{w}.lora_a"], np.float64)
                b = np.asarray(values[f"{w}.lora_b"], np.float64)
                out[w] = (np.asarray(values[w], np.float64) + s * (b @ a)).astype(np.float32)
        return out


def init_params(cfg: ViTConfig, seed: int, std: float = 0.02) -> dict[str, np.ndarray]:
    """Seeded starting values by kind (see the module docstring)."""
    rng = np.random.default_rng(seed)
    stds = {"matrix": std, "embedding": std, "residual": std / math.sqrt(2 * cfg.n_layer), "position": 0.01}
    out: dict[str, np.ndarray] = {}
    for name, p in params(cfg).items():
        if p.kind == "norm":
            out[name] = np.ones(p.shape, np.float32)
        elif p.kind in ("bias", "norm_bias"):
            out[name] = np.zeros(p.shape, np.float32)
        else:
            out[name] = (rng.standard_normal(p.shape) * stds[p.kind]).astype(np.float32)
    return out


def new_head(cfg: ViTConfig, seed: int) -> dict[str, np.ndarray]:
    """A fresh head for ``cfg``'s classes: N(0, 0.02²) from ``default_rng([seed, 1])``, bias 0."""
    rng = np.random.default_rng([seed, 1])
    return {
        "cls.weight": (rng.standard_normal((cfg.n_classes, cfg.d_model)) * 0.02).astype(np.float32),
        "cls.bias": np.zeros(cfg.n_classes, np.float32),
    }


def bind_arrays(runtime, arrays: Mapping[str, np.ndarray]):
    """(context, name -> tensor): ``arrays`` as F32 tensors on ``runtime``
    (the caller closes the context)."""
    ctx = toy_ggml.Context(max_tensors=len(arrays) + 4)
    ts = {n: ctx.tensor(F32, np.shape(a), name=f"frozen.{n}") for n, a in arrays.items()}
    ctx.allocate(runtime)
    for n, a in arrays.items():
        ts[n].set(np.ascontiguousarray(a, np.float32))
    return ctx, ts


# -- the run ----------------------------------------------------------------------


class _Stream:
    """``ImageBatchStream`` as the step loop's stream of ``ClassBatch``."""

    def __init__(self, inner):
        self.inner = inner

    def next(self) -> ClassBatch:
        return ClassBatch.of(self.inner.next())

    @property
    def epoch(self) -> float:
        return self.inner.epoch

    def state(self) -> dict:
        return self.inner.state()


def _base_path(cfg: ViTTrainConfig) -> Path:
    assert cfg.base is not None  # called for a fine-tune only
    p = Path(cfg.base).expanduser()
    if not p.is_file():
        raise ViTTrainConfigError("base", f"{p}: no such file (a ViT classifier GGUF)")
    return p


def _runtime(cfg: ViTTrainConfig, world: dist.World) -> toy_ggml.Runtime:
    """``cfg.threads`` as given, else the physical cores, as many per step as
    the load leaves room for; ranks sharing a host share its cores unless
    the launcher bound each to its share (no bit depends on the thread count)."""
    n, adaptive = dist.rank_threads(cfg.threads, world)
    device = toy_ggml.device_name(cfg.device or os.environ.get("TOY_DEVICE") or "cpu")  # "cuda": the first CUDA device
    return toy_ggml.Runtime(device, threads=n, adaptive=adaptive)


def folder_digest(root: str | os.PathLike[str]) -> str:
    """A fingerprint of an image folder: the relative names and sizes of
    its files (not their contents: see the module docstring)."""
    import hashlib

    base = Path(root)
    h = hashlib.sha256()
    if not base.is_dir():
        return "missing"
    for f in sorted(p for p in base.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(base).as_posix()}\0{f.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


def check_ranks(cfg: ViTTrainConfig, world: dist.World) -> tuple[dict[str, Any], str | None]:
    """On several ranks, before anything is decoded or written: the same
    config, image folders and base model on every rank, and their CPU
    variants. Returns what ``run_start`` records as ``world`` and the
    warning to note when ``mixed_cpus`` "allow" let different variants
    through; ``RankMismatchError`` otherwise."""
    base = [cfg.base] if cfg.base and Path(cfg.base).is_file() else []
    dist.check_inputs(world, to_dict(cfg), base)  # settings, and the base model's size and the sha256 of its ends
    folders = {k: folder_digest(v) for k, v in (("data", cfg.data), ("val_dir", cfg.val_dir)) if v}
    every = world.allgather(folders, "comparing the ranks' image folders")
    for r, f in enumerate(every):
        diff = [k for k in sorted(set(f) | set(every[0])) if f.get(k) != every[0].get(k)]
        if diff:
            where = ", ".join(f"{k} {getattr(cfg, k)}" for k in diff)
            raise dist.RankMismatchError(
                f"rank {r} ({world.hosts[r]}) sees other images than rank 0 ({world.hosts[0]}) in {where} "
                "(file names or sizes differ)",
                hint="give every rank the same image folders, at the same paths",
            )
    return dist.world_facts(world, cfg.mixed_cpus)


class ViTRun(StepRun):
    unit = "images"
    _frozen_ctx: toy_ggml.Context | None
    _eval: tuple[toy_ggml.Context, toy_ggml.Context, toy_ggml.Graph, PatchInputs, toy_ggml.Tensor] | None

    def __init__(
        self,
        cfg: ViTTrainConfig,
        hooks: Hooks,
        resume_from: Path | None = None,
        ckpt: checkpoint.Resumable | None = None,
        lock=None,
        notes: list[str] | None = None,
        world: dist.World | None = None,
    ):
        from toy.runs import RunWriter, runs_dir
        from toy.runs.folder import RunLock
        from toy_vit.data import Augment, DataError, ImageBatchStream, ImageFolder

        self.hooks, self.lock = hooks, lock
        self.world = world = world or dist.World()
        st = ckpt.state if ckpt else {}
        notes = list(notes or [])
        world_info: dict[str, Any] = {}  # what run_start (or resume) records of several ranks
        if world.distributed:
            world_info, warning = check_ranks(cfg, world)
            if warning:
                notes.append(warning)
        folder = self.folder = ImageFolder(cfg.data, val_fraction=cfg.val_fraction, seed=cfg.seed, val_dir=cfg.val_dir)
        classes = tuple(folder.classes)
        if folder.n_val == 0:
            notes.append("no validation images (val_fraction 0): no eval events")
        if not cfg.steps:  # epochs -> steps: the recorded config says steps (epochs 0)
            per = cfg.batch_size * cfg.grad_accum * world.size
            n = max(1, math.ceil(cfg.epochs * folder.n_train / per))
            notes.append(f"{cfg.epochs:g} epoch(s) of {folder.n_train} training images = {n} steps of {per} images")
            cfg = dataclasses.replace(cfg, steps=n, epochs=0.0)
        self.cfg = cfg
        start: dict[str, Any] = {"world": world_info} if world_info else {}  # run_start's extra fields
        self.base_sha = None
        base_values: dict[str, np.ndarray] = {}
        if cfg.base:
            from toy.store import sha256_file
            from toy_vit.gguf_io import read_gguf

            bpath = _base_path(cfg)
            self.base_sha = sha256_file(bpath)
            if ckpt is not None and st.get("base_sha256") not in (None, self.base_sha):
                raise BadInputError(
                    f"{bpath}: the base model changed since the run started (sha256 differs)",
                    hint="resume with the same base file the run was started with",
                )
            bcfg, base_values = read_gguf(bpath)
            for k, v in cfg.overrides().items():
                if getattr(bcfg, k) != v:
                    raise ViTTrainConfigError(k, f"{v} differs from the base model's {getattr(bcfg, k)} ({bpath})")
            start["base"] = {"path": str(bpath), "sha256": self.base_sha, "labels": list(bcfg.labels)}
        if ckpt is not None:
            vcfg = _recorded_model(ckpt)
            if vcfg.labels != classes:
                raise DataError(
                    f"{folder.root}: its classes ({', '.join(classes)}) are not the run's "
                    f"({', '.join(vcfg.labels)}): the data changed"
                )
            self.head = st.get("head", "new")
        elif cfg.base:
            vcfg = bcfg
            if bcfg.labels == classes:
                self.head = "kept"
            else:
                self.head = "replaced"
                vcfg = bcfg.with_labels(classes)
                was = f"{bcfg.n_classes} classes" if bcfg.n_classes != len(classes) else "other class names"
                notes.append(
                    f"the base's head ({was}: {', '.join(bcfg.labels[:6])}{' ...' if bcfg.n_classes > 6 else ''}) "
                    f"is replaced by a new one for the data's {len(classes)} classes"
                )
                base_values.update(new_head(vcfg, cfg.seed))
        else:
            vcfg = ViTConfig.preset(cfg.preset, **cfg.overrides(), labels=classes)
            self.head = "new"
        self.model_cfg = vcfg

        # which tensors train; where every value comes from
        if cfg.freeze:
            trained = set(FREEZE_TRAINED)
        elif cfg.lora_rank:
            trained = set(HEAD)
        else:
            trained = set(params(vcfg))
        frozen_names = [n for n in params(vcfg) if n not in trained]
        lora = LoraSpec(cfg.lora_rank, cfg.lora_alpha, tuple(cfg.lora_targets)) if cfg.lora_rank else None
        if ckpt is not None:
            values = ckpt.params
        elif cfg.base:
            values = dict(base_values)
            if lora:
                from toy.train.lora import init_lora

                values.update(init_lora(lora_shapes(vcfg, lora.rank, lora.targets), cfg.seed))
        else:
            values = init_params(vcfg, cfg.seed)
        # frozen tensors: the base's (a fine-tune's checkpoint holds LoRA-merged weights)
        self.frozen_values = {n: base_values[n] for n in frozen_names}

        self.runtime = _runtime(cfg, world)
        self._frozen_ctx = self._eval = None
        try:
            self._frozen_ctx, frozen = bind_arrays(self.runtime, self.frozen_values)
            self.model = ViTTrainModel(vcfg, frozen, lora)
            specs = self.model.param_specs()
            self.rng = np.random.default_rng(cfg.seed)
            if ckpt is not None:  # a state that checksums pass may still not be this run's (edited, copied)
                checkpoint.check_state(ckpt, specs, counters=("images_seen",))
                checkpoint.restore_rng(ckpt, self.rng)
            self.engine = TrainEngine(
                self.model,
                {s.name: values[s.name] for s in specs},
                self.runtime,
                cfg.optim,
                batch=cfg.batch_size,
                context=1,
                accum=cfg.grad_accum,
                label_smoothing=cfg.label_smoothing,
                world=world,
            )
        except BaseException:
            self._close_own()
            raise
        if ckpt:
            self.engine.load_state({s.name: values[s.name] for s in specs}, ckpt.optimizer, ckpt.step)
        try:
            on_phase = hooks.phase
            phase = (lambda d, t: on_phase("decoding images", d, t)) if on_phase else None
            aug = (
                Augment(scale=cast("tuple[float, float]", tuple(cfg.crop_scale)), flip=0.5 if cfg.flip else 0.0)
                if cfg.augment
                else None
            )
            self.stream = _Stream(
                ImageBatchStream(
                    folder,
                    cfg.batch_size,
                    cfg.seed,
                    vcfg.image_size,
                    vcfg.image_mean,
                    vcfg.image_std,
                    augment=aug,
                    channels=vcfg.n_channels,
                    cache_dir=cfg.cache_dir,
                    progress=phase,
                    state=st.get("data"),
                )
            )
        except BaseException:
            self.engine.close()
            self._close_own()
            raise
        self.seen = int(st.get("images_seen", 0))
        self.n_params = int(sum(math.prod(p.shape) for p in params(vcfg).values()))
        self.n_trainable = int(sum(math.prod(s.shape) for s in self.engine.specs))
        data_info = {
            "root": str(folder.root),
            "classes": list(classes),
            "train_images": folder.n_train,
            "val_images": folder.n_val,
            "train_per_class": folder.class_counts("train"),
            "val_per_class": folder.class_counts("val"),
            "ignored_files": len(folder.ignored),
        }
        try:
            if not world.is_root:
                pass  # rank 0 writes the run: below, this rank learns its folder
            elif ckpt:
                assert resume_from is not None  # a checkpoint comes with the run folder it resumes
                self.writer = RunWriter.reopen(resume_from)
                self.writer.event(
                    "resume",
                    from_step=ckpt.step,
                    checkpoint=ckpt.model_path.name,
                    **({"world": world_info} if world_info else {}),
                )
            else:
                self.writer = RunWriter(
                    "train",
                    to_dict(cfg),
                    root=cfg.out,
                    task=TASK,
                    model=vcfg.to_dict(),
                    n_params=self.n_params,
                    n_trainable=self.n_trainable,
                    data=data_info,
                    head=self.head,
                    fine_tune="freeze" if cfg.freeze else ("lora" if lora else ("full" if cfg.base else None)),
                    **start,
                )
                self.lock = RunLock(self.writer.dir)
            self.share_run_folder()
            self.notes(notes)
        except BaseException as e:
            self.close()
            if self.lock is not None:
                self.lock.release()
            if world.distributed and world.is_root and not hasattr(self, "writer"):
                self.share_run_folder()  # the other ranks wait for the run folder: there is none
            if isinstance(e, OSError):
                raise bundle_error(e, ckpt is not None, e.filename or (resume_from or runs_dir(cfg.out))) from e
            raise
        self.init_counters(ckpt)
        self.per_step = cfg.batch_size * cfg.grad_accum * world.size
        self.eval_at_start = bool(cfg.base)

    # -------------------------------------------------------------- evaluation

    def _eval_graph(self):
        if self._eval is None:
            B, c = self.cfg.batch_size, self.model_cfg
            cin = toy_ggml.Context(max_tensors=8)
            inputs = self.model.feed.make(cin, B, 1)
            cin.allocate(self.runtime)
            inputs.keep.set(np.ones((B, 1), np.float32))
            n_lora = len(self.model.lora_shapes) // 2
            size = graph_size(c, n_lora) + 16
            ops = toy_ggml.Context(max_tensors=size)
            try:
                out = self.model.logits(ops, self.engine.params, inputs, training=False).set_output()
                graph = toy_ggml.Graph(ops, size=max(2048, 2 * size)).build_forward(out)
            except BaseException:
                ops.close()
                cin.close()
                raise
            self._eval = (cin, ops, graph, inputs, out)
        return self._eval

    def val_logits(self):
        """(logits float32 (n_val, n_classes), labels) of the validation split."""
        from toy_vit.data import validation_batches

        cfg, c = self.cfg, self.model_cfg
        _cin, _ops, graph, inputs, out = self._eval_graph()
        zs, ys = [], []
        total = -(-self.folder.n_val // cfg.batch_size)
        if cfg.eval_batches:
            total = min(total, cfg.eval_batches)
        batches = validation_batches(
            self.folder,
            cfg.batch_size,
            c.image_size,
            c.image_mean,
            c.image_std,
            channels=c.n_channels,
            cache_dir=cfg.cache_dir,
            max_batches=cfg.eval_batches or None,
        )
        for i, b in enumerate(batches):
            inputs.patches.set(patchify(b.pixels, c))
            self.runtime.allocate(graph)
            self.runtime.compute(graph)
            keep = b.mask > 0
            zs.append(out.numpy()[keep].copy())
            ys.append(np.asarray(b.labels)[keep])
            self.eval_progress(i + 1, total)  # the step-0 evaluation's progress and stop (StepRun)
        return np.concatenate(zs), np.concatenate(ys).astype(np.int64)

    def evaluate(self) -> float | None:
        if self.folder.n_val == 0:
            return None
        z, y = self.val_logits()
        z64 = z.astype(np.float64)
        z64 -= z64.max(axis=1, keepdims=True)
        logp = z64 - np.log(np.exp(z64).sum(axis=1, keepdims=True))
        n = len(y)
        loss = float(-logp[np.arange(n), y].mean())
        k = min(5, z.shape[1])
        # a class counts as predicted when fewer than k classes score strictly higher (ties favour the truth)
        higher = (z > z[np.arange(n), y][:, None]).sum(axis=1)
        acc = float(np.mean(higher == 0))
        top5 = float(np.mean(higher < k))
        self.last_val = loss
        step = self.engine.step
        self.writer.event("eval", step=step, name="val", loss=loss, accuracy=acc, top5=top5, images=n)
        if self.hooks.note:
            self.hooks.note(
                f"step {step}: validation loss {loss:.4f}, accuracy {100 * acc:.2f}% (top-{k} {100 * top5:.2f}%), "
                f"{n} images"
            )
        return loss

    # -------------------------------------------------------------- checkpoints

    def state(self) -> dict[str, Any]:
        return {
            "task": TASK,
            "config": to_dict(self.cfg),
            "model": self.model_cfg.to_dict(),
            "data": self.stream.state(),
            "rng": self.rng.bit_generator.state,
            "images_seen": self.seen,
            "base_sha256": self.base_sha,
            "head": self.head,
            "ranks": self.world.size,
            "global_micro_batches": self.cfg.grad_accum * self.world.size,
        }

    def write_model(self, path: Path, values: dict[str, np.ndarray], step: int, run_id: str) -> None:
        from toy.gguf import GGUFWriter
        from toy_vit.gguf_io import metadata

        allv = {**self.frozen_values, **values}
        w = GGUFWriter(path)
        for k, v in metadata(self.model_cfg, f"toy vit {run_id} step {step}").items():
            if isinstance(v, tuple):
                w.add(k, v[0], v[1])
            else:
                w.add(k, v)
        w.add("toy.train.run_id", run_id)
        w.add("toy.train.step", int(step))
        lora = self.model.lora
        if lora:
            w.add("toy.train.lora.rank", int(lora.rank))
            w.add("toy.train.lora.alpha", float(lora.alpha))
            w.add("toy.train.lora.targets", list(lora.targets))
        for name, a in self.model.merged(allv).items():
            w.add_tensor(name, np.ascontiguousarray(a, np.float32))
        for name in self.model.lora_shapes:
            w.add_tensor(name, np.ascontiguousarray(values[name], np.float32))
        w.write()

    def checkpoint_kwargs(self) -> dict[str, Any]:
        return {"cfg": None, "tokenizer_metadata": {}, "write_model": self.write_model}

    # -------------------------------------------------------------- lifetime

    def _close_own(self) -> None:
        if self._eval is not None:
            self._eval[1].close()
            self._eval[0].close()
            self._eval = None
        if self._frozen_ctx is not None:
            self._frozen_ctx.close()
            self._frozen_ctx = None
        self.runtime.close()

    def close(self) -> None:
        if self._eval is not None:
            self._eval[1].close()
            self._eval[0].close()
            self._eval = None
        self.engine.close()
        self._close_own()


# -- public entry points -----------------------------------------------------------


def train(cfg: ViTTrainConfig, hooks: Hooks | None = None) -> RunResult:
    """Train (or fine-tune, with ``base``) a ViT classifier as ``cfg``
    says; ``data`` and ``base`` are recorded absolute, so ``resume`` works
    from any folder."""
    from toy.runs import runs_dir
    from toy.runs.folder import check_output_dir

    world = dist.World.from_env()  # first: a rank that fails after this ends every rank (the CLI aborts MPI)
    cfg = validate(cfg)
    if world.is_root:  # rank 0 alone writes the run folder
        check_output_dir(runs_dir(cfg.out), "runs folder (out)")  # before the images are decoded
    absolute: dict[str, Any] = {"data": str(Path(cfg.data).expanduser().absolute())}
    if cfg.base:
        absolute["base"] = str(Path(cfg.base).expanduser().absolute())
    if cfg.val_dir:
        absolute["val_dir"] = str(Path(cfg.val_dir).expanduser().absolute())
    if cfg.cache_dir:
        absolute["cache_dir"] = str(Path(cfg.cache_dir).expanduser().absolute())
    return ViTRun(dataclasses.replace(cfg, **absolute), rank_hooks(hooks or Hooks(), world), world=world).run()


def resume(run_dir: str | Path, hooks: Hooks | None = None, *, steps: int | None = None) -> RunResult:
    """Continue a ViT run from its latest checkpoint (``toy.train.lmrun.resume``:
    ``steps`` may raise the total)."""
    from toy.train.lmrun import resume as _resume

    return _resume(run_dir, hooks, steps=steps)


def _recorded_model(ckpt: checkpoint.Resumable) -> ViTConfig:
    """The model config a checkpoint records (``model`` in its state);
    one that does not validate is ``checkpoint.CheckpointStateError``."""
    from toy_vit.config import ViTConfigError

    d = ckpt.state.get("model")
    try:
        if not isinstance(d, dict):
            raise ViTConfigError("expected an object of ViT config fields")
        return ViTConfig.from_dict(d)
    except (ViTConfigError, TypeError, ValueError) as e:
        raise checkpoint.CheckpointStateError(
            ckpt.state_path, f"the model config it records (model in toy.state.json) is invalid: {e}", "model"
        ) from None


def resume_task(run_dir, hooks, *, lock, ckpt, notes, steps, world: dist.World | None = None) -> RunResult:
    """The ``toy.train_tasks`` entry point ``vit``: continue the run whose
    checkpoint ``ckpt`` ``toy.train.lmrun.resume`` opened; takes over ``lock``
    (rank 0's: the other ranks of a run on several hold none). ``world``: the
    ranks (default: the world this process was launched into; on another
    number of ranks than the checkpoint's, ``grad_accum`` is regrouped)."""
    try:
        if world is None:
            world = dist.World.from_env()
        try:
            cfg = from_dict(ckpt.state.get("config"))
        except BadInputError as e:
            raise checkpoint.config_error(ckpt, e) from None
        if steps is not None:
            cfg = validate(dataclasses.replace(cfg, steps=steps))
        accum, note = dist.regroup(world, cfg.grad_accum, ckpt.state)
        cfg = dataclasses.replace(cfg, grad_accum=accum)
        notes = [*(notes or []), *([note] if note else [])]
        if ckpt.step >= cfg.steps:
            raise checkpoint.CheckpointError(
                f"{run_dir}: already at step {ckpt.step} of {cfg.steps}", hint="pass --steps N with a larger N to go on"
            )
        run = ViTRun(cfg, hooks or Hooks(), resume_from=Path(run_dir), ckpt=ckpt, lock=lock, notes=notes, world=world)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return run.run()


__all__ = [
    "ClassBatch",
    "LoraSpec",
    "PatchFeed",
    "ViTTrainModel",
    "ViTRun",
    "ViTTrainConfig",
    "init_params",
    "lora_shapes",
    "new_head",
    "resume",
    "resume_task",
    "train",
]
