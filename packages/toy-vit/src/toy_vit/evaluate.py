"""Evaluating a ViT classifier on labelled images: ``evaluate`` -> ``Report``.

``evaluate(classifier, data, split=, batch_size=)`` runs the model over an
image folder's split (or over batches you give) and returns a ``Report``:
accuracy, top-k accuracy (k = min(5, classes)), mean NLL, per-class
precision / recall / F1 / support and the confusion matrix (counts, rows the
true class, columns the predicted one). ``Report.to_text()`` is a readable
table, ``to_json()`` the same numbers as JSON; ``plot_confusion(report,
path)`` draws the matrix to an image (matplotlib: the ``toy-vit[plot]``
extra).

Decisions:

- ``data``: an image folder path or ``toy_vit.data.ImageFolder`` (split
  ``val``, ``train`` or ``all``; the validation split is the one a training
  run with the same ``seed`` and ``val_fraction`` holds out, so
  ``toy vit eval`` on a run's data measures what the run's ``eval`` events
  did), or an iterable of batches (``toy_vit.data.ImageBatch`` or
  ``(pixels, labels)``; pixels normalised F32 ``(B, C, S, S)``, labels the
  model's class indices, an optional ``mask`` marks padding rows with 0).
- A folder's classes are matched to the model's labels by name: each class
  folder must be one of the model's labels (a subset is fine: a folder
  without some class), else ``DataError`` naming the folder and both lists.
  Images are decoded in the model's channels (grey files for an RGB model are
  replicated, as in training) at the model's size, plainly resized (no
  augmentation), through the decoded-image cache.
- The prediction is the arg-max logit (the first on ties, as ``classify``
  orders them) and top-k counts the true class among the k first of that
  order; the confusion matrix's trace over the images is the accuracy.
  (A training run's ``eval`` events count ties in favour of the true class:
  the two agree except for exactly tied logits.) NLL: float64 log-softmax
  of the float32 logits, as the training run's validation loss.
- Per-class figures follow scikit-learn's ``zero_division=0``: a class never
  predicted has precision 0, one absent from the data recall 0. The
  ``macro`` average is over the classes present in the data (support > 0);
  ``weighted`` weights them by support.
- ``to_text`` lists the classes that occur in the data or the predictions;
  it prints the confusion matrix itself for at most ``max_matrix`` (20) of
  them and the most frequent confusions otherwise. ``to_json`` always holds
  the full matrix over the model's classes.
- ``plot_confusion`` writes the file atomically (a temporary file beside it,
  then renamed): the format follows the suffix (.png, .svg, .pdf).

Errors: ``DataError`` / ``BadInputError`` (bad data, sizes or arguments),
``PlotUnavailableError`` (no matplotlib; its hint says what to install).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from toy.errors import BadInputError, DataError, PlotUnavailableError, ToyError
from toy.extras import install_command

SPLITS = ("val", "train", "all")
PLOT_FORMATS = (".png", ".svg", ".pdf")

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class ClassStats:
    label: str
    precision: float
    recall: float
    f1: float
    support: int


@dataclass
class Report:
    """The figures of one evaluation (see the module docstring).
    ``confusion`` int64 (K, K) over the model's ``labels``;
    ``predictions`` / ``targets`` int64 (N,) in image order."""

    labels: tuple[str, ...]
    confusion: np.ndarray
    accuracy: float
    top_k: int
    top_k_accuracy: float
    nll: float
    predictions: np.ndarray
    targets: np.ndarray
    split: str | None = None
    model: str | None = None
    data: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return int(self.confusion.sum())

    @property
    def support(self) -> np.ndarray:
        return self.confusion.sum(axis=1)

    def per_class(self) -> list[ClassStats]:
        """Precision, recall, F1 and support of every model class."""
        c = self.confusion.astype(np.float64)
        tp = np.diag(c)
        pred, true = c.sum(axis=0), c.sum(axis=1)
        p = np.divide(tp, pred, out=np.zeros_like(tp), where=pred > 0)
        r = np.divide(tp, true, out=np.zeros_like(tp), where=true > 0)
        f = np.divide(2 * p * r, p + r, out=np.zeros_like(tp), where=(p + r) > 0)
        return [
            ClassStats(lab, float(p[i]), float(r[i]), float(f[i]), int(true[i])) for i, lab in enumerate(self.labels)
        ]

    def averages(self) -> dict[str, dict[str, float]]:
        """``macro`` (classes present in the data) and ``weighted`` (by support)."""
        stats = [s for s in self.per_class() if s.support > 0]
        w = np.array([s.support for s in stats], np.float64)
        out = {}
        for name, weights in (("macro", np.ones_like(w)), ("weighted", w)):
            out[name] = {
                k: float(np.average([getattr(s, k) for s in stats], weights=weights)) if stats else 0.0
                for k in ("precision", "recall", "f1")
            }
        return out

    def shown(self) -> list[int]:
        """The classes that occur in the data or in the predictions."""
        c = self.confusion
        return [i for i in range(len(self.labels)) if c[i].sum() or c[:, i].sum()]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "data": self.data,
            "split": self.split,
            "images": self.n,
            "classes": len(self.labels),
            "accuracy": self.accuracy,
            "top_k": self.top_k,
            "top_k_accuracy": self.top_k_accuracy,
            "nll": self.nll,
            "per_class": [s.__dict__ for s in self.per_class()],
            **self.averages(),
            "labels": list(self.labels),
            "confusion": self.confusion.tolist(),
            **self.extra,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    def to_text(self, max_matrix: int = 20) -> str:
        lines = []
        if self.model:
            lines.append(f"model     {self.model}")
        if self.data:
            lines.append(f"data      {self.data} ({self.split or '?'} split)")
        present = int((self.support > 0).sum())
        lines.append(f"images    {self.n} in {present} classes (the model has {len(self.labels)})")
        lines.append(
            f"accuracy  {100 * self.accuracy:.2f}%   top-{self.top_k} {100 * self.top_k_accuracy:.2f}%   "
            f"mean NLL {self.nll:.4f}"
        )
        shown = self.shown()
        stats = self.per_class()
        w = max([len("weighted avg")] + [len(self.labels[i]) for i in shown])
        lines += ["", f"{'class':<{w}}  precision  recall      f1  support"]
        for i in shown:
            s = stats[i]
            lines.append(f"{s.label:<{w}}  {s.precision:9.4f}  {s.recall:6.4f}  {s.f1:6.4f}  {s.support:7d}")
        for name, a in self.averages().items():
            label = f"{name} avg"
            lines.append(f"{label:<{w}}  {a['precision']:9.4f}  {a['recall']:6.4f}  {a['f1']:6.4f}  {self.n:7d}")
        lines.append("")
        lines += self._matrix_text(shown, max_matrix)
        return "\n".join(lines)

    def _matrix_text(self, shown: list[int], max_matrix: int) -> list[str]:
        c = self.confusion
        if len(shown) > max_matrix:
            pairs = [(int(c[i, j]), i, j) for i in shown for j in shown if i != j and c[i, j]]
            pairs.sort(key=lambda t: (-t[0], t[1], t[2]))
            out = [f"most frequent confusions ({len(shown)} classes: the matrix is in --json)"]
            if not pairs:
                out.append("  none")
            for n, i, j in pairs[:15]:
                out.append(f"  {n:6d}  {self.labels[i]} -> {self.labels[j]}")
            return out
        names = [self.labels[i] for i in shown]
        short = all(len(s) <= 6 for s in names)
        heads = names if short else [str(i) for i in shown]
        rows = names if short else [f"{i} {self.labels[i]}" for i in shown]
        cw = max([len(h) for h in heads] + [len(str(int(c.max()))) if c.size else 1, 3])
        rw = max(len(r) for r in rows)
        out = ["confusion matrix (rows: true class, columns: predicted)"]
        out.append(" " * rw + "  " + " ".join(f"{h:>{cw}}" for h in heads))
        for r, i in zip(rows, shown):
            out.append(f"{r:<{rw}}  " + " ".join(f"{int(c[i, j]):>{cw}}" for j in shown))
        return out


# -- computing ------------------------------------------------------------------


def _batches(batches: Iterable) -> Iterable[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    for b in batches:
        if isinstance(b, tuple):
            if len(b) != 2:
                raise BadInputError("a batch tuple is (pixels, labels)")
            yield np.asarray(b[0]), np.asarray(b[1]), None
        elif hasattr(b, "pixels") and hasattr(b, "labels"):
            mask = getattr(b, "mask", None)
            yield np.asarray(b.pixels), np.asarray(b.labels), None if mask is None else np.asarray(mask)
        else:
            raise BadInputError(f"a batch must be an ImageBatch or (pixels, labels), got {type(b).__name__}")


def class_map(labels: Sequence[str], folder) -> np.ndarray:
    """Folder class index -> model class index (by name); ``DataError`` when
    a class folder is not one of the model's labels."""
    where = {lab: i for i, lab in enumerate(labels)}
    missing = [c for c in folder.classes if c not in where]
    if missing:

        def few(xs):
            xs = list(xs)
            return ", ".join(xs[:8]) + (f", … ({len(xs)} in all)" if len(xs) > 8 else "")

        raise DataError(
            f"{folder.root}: the data's {len(folder.classes)} classes ({few(folder.classes)}) do not match the "
            f"model's {len(labels)} ({few(labels)}): {few(missing)} not among the model's labels",
            hint="each class folder must be named after one of the model's labels "
            "(`toy vit convert --labels` names a converted model's classes)",
        )
    return np.array([where[c] for c in folder.classes], np.int64)


def evaluate(
    classifier,
    data,
    *,
    split: str = "val",
    batch_size: int = 32,
    seed: int = 0,
    val_fraction: float = 0.1,
    cache_dir: str | os.PathLike | None = None,
    progress: Progress | None = None,
) -> Report:
    """Evaluate ``classifier`` (a ``toy_vit.Classifier``) on ``data`` (see the
    module docstring). ``seed`` and ``val_fraction`` choose a folder's split
    (a training run's ``seed``, ``val_fraction``); ``progress(phase, done,
    total)`` is called while images are decoded ("decoding images") and
    evaluated ("evaluating")."""
    from toy_vit.data import ImageFolder, validation_batches

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise BadInputError(f"batch_size={batch_size!r} must be a whole number >= 1")
    if split not in SPLITS:
        raise BadInputError(f"split={split!r} must be one of {', '.join(SPLITS)}")
    cfg = classifier.config
    K = cfg.n_classes
    data_name = None
    remap = None
    total = None
    used_split: str | None = split  # None: batches given, no folder split
    if isinstance(data, (str, os.PathLike, ImageFolder)):
        folder = data if isinstance(data, ImageFolder) else ImageFolder(data, val_fraction=val_fraction, seed=seed)
        data_name = str(folder.root)
        remap = class_map(cfg.labels, folder)
        total = {"val": folder.n_val, "train": folder.n_train, "all": len(folder.samples)}[split]
        if total == 0:
            raise DataError(
                f"{folder.root}: no {split} images (each class needs 2 or more images for a validation split)",
                hint="evaluate every image with split 'all' (--split all)",
            )
        decode = (lambda d, t: progress("decoding images", d, t)) if progress else None
        source = validation_batches(
            folder,
            batch_size,
            cfg.image_size,
            cfg.image_mean,
            cfg.image_std,
            split=split,
            channels=cfg.n_channels,
            cache_dir=cache_dir,
            progress=decode,
        )
        batches = _batches(source)
    else:
        used_split = None
        batches = _batches(data)

    zs, ys = [], []
    done = 0
    for pixels, labels, mask in batches:
        keep = np.ones(len(labels), bool) if mask is None else np.asarray(mask) > 0
        if len(labels) != len(pixels) or len(keep) != len(pixels):
            raise BadInputError(f"a batch of {len(pixels)} images has {len(labels)} labels / {len(keep)} mask values")
        y = np.asarray(labels, np.int64)[keep]
        if remap is not None:
            y = remap[y]
        elif y.size and (y.min() < 0 or y.max() >= K):
            raise BadInputError(
                f"label {int(y.max() if y.max() >= K else y.min())} is not a class of the model (0..{K - 1})"
            )
        z = classifier.logits(np.asarray(pixels, np.float32))
        zs.append(np.asarray(z)[keep].copy())
        ys.append(y)
        done += int(keep.sum())
        if progress:
            progress("evaluating", done, total or done)
    if not ys or done == 0:
        raise BadInputError("nothing to evaluate: no images")
    z = np.concatenate(zs)
    y = np.concatenate(ys)
    return report_from_logits(z, y, cfg.labels, split=used_split, model=str(classifier.path), data=data_name)


def report_from_logits(
    logits: np.ndarray,
    targets: np.ndarray,
    labels: Sequence[str],
    *,
    split: str | None = None,
    model: str | None = None,
    data: str | None = None,
) -> Report:
    """The report of logits float (N, K) against targets int (N,)."""
    z = np.asarray(logits)
    y = np.asarray(targets, np.int64)
    n, K = z.shape
    order = np.argsort(-z, axis=1, kind="stable")
    pred = order[:, 0].astype(np.int64)
    k = min(5, K)
    topk = float(np.mean((order[:, :k] == y[:, None]).any(axis=1)))
    z64 = z.astype(np.float64)
    z64 = z64 - z64.max(axis=1, keepdims=True)
    logp = z64 - np.log(np.exp(z64).sum(axis=1, keepdims=True))
    nll = float(-logp[np.arange(n), y].mean())
    confusion = np.zeros((K, K), np.int64)
    np.add.at(confusion, (y, pred), 1)
    return Report(
        labels=tuple(labels),
        confusion=confusion,
        accuracy=float(np.mean(pred == y)),
        top_k=k,
        top_k_accuracy=topk,
        nll=nll,
        predictions=pred,
        targets=y,
        split=split,
        model=model,
        data=data,
    )


# -- plotting --------------------------------------------------------------------


def check_plot_path(path: str | os.PathLike) -> Path:
    """``path`` if it names a file a plot can be written to (a known suffix,
    an existing folder) and matplotlib imports; else the error, before any
    work is done."""
    out = Path(path)
    if out.suffix.lower() not in PLOT_FORMATS:
        raise BadInputError(f"{out}: the plot's format follows its suffix: {', '.join(PLOT_FORMATS)}")
    if out.is_dir():
        raise BadInputError(f"{out}: is a folder; give the image file to write")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise BadInputError(f"{parent}: no such folder (for {out})")
    if not os.access(parent, os.W_OK):
        raise BadInputError(f"{parent}: not writable (for {out})")
    _matplotlib()
    return out


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotUnavailableError(
            f"plotting the confusion matrix needs matplotlib ({e})", hint=install_command("plot")
        ) from e
    return Figure, FigureCanvasAgg


def plot_confusion(report: Report, path: str | os.PathLike, *, dpi: int = 120) -> Path:
    """Draw ``report``'s confusion matrix (the classes ``to_text`` shows) to
    ``path`` (written atomically); returns the path."""
    out = check_plot_path(path)
    Figure, FigureCanvasAgg = _matplotlib()
    from matplotlib.ticker import MaxNLocator

    shown = report.shown()
    c = report.confusion[np.ix_(shown, shown)]
    n = len(shown)
    side = min(14.0, max(4.0, 0.45 * n + 2.5))
    fig = Figure(figsize=(side + 1.0, side), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    im = ax.imshow(c, cmap="Blues", interpolation="nearest")
    bar = fig.colorbar(im, ax=ax, shrink=0.8, label="images")
    bar.ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts: whole numbers
    if n <= 40:
        names = [report.labels[i] for i in shown]
        ax.set_xticks(range(n), names, rotation=90 if max(map(len, names)) > 3 else 0)
        ax.set_yticks(range(n), names)
    if n <= 20:
        hi = c.max() if c.size else 0
        for i in range(n):
            for j in range(n):
                if c[i, j]:
                    ax.text(j, i, str(int(c[i, j])), ha="center", va="center", fontsize=8,
                            color="white" if c[i, j] > hi / 2 else "black")  # fmt: skip
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(
        f"accuracy {100 * report.accuracy:.2f}% ({report.n} images"
        + (f", {report.split} split" if report.split else "")
        + ")"
    )
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        fig.savefig(tmp, format=out.suffix.lower()[1:], dpi=dpi)
        os.replace(tmp, out)
    except OSError as e:
        raise ToyError(f"{out}: cannot write the plot: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out


__all__ = [
    "ClassStats",
    "PlotUnavailableError",
    "Report",
    "check_plot_path",
    "class_map",
    "evaluate",
    "plot_confusion",
    "report_from_logits",
]
