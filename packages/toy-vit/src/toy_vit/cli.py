"""``toy vit``: image classification from the command line.

A ``typer.Typer`` group registered in toy-cli's ``toy.commands`` entry-point
group (``vit = "toy_vit.cli:app"``). Subcommands:

- ``demo-data DIR``: write the bundled digits as an image folder, and
  print the command that trains on them (the ``digits`` preset);
- ``convert HF_DIR OUT.gguf``: a local Hugging Face ViTForImageClassification
  folder to a toy-vit GGUF;
- ``train DATA`` (or ``train --resume RUN``): train or fine-tune
  (``--from MODEL.gguf``) a classifier; progress, stop signals, errors and
  the summary are ``toy train``'s (``toy_cli.ui.run_training``);
- ``eval MODEL DATA``: accuracy, top-5, NLL, per-class table and confusion
  matrix (``toy_vit.evaluate``), recorded as an eval run bundle;
- ``classify MODEL IMAGE...``: the top classes of each image.

``toy describe MODEL`` already describes a ViT file (toy-vit's
``toy.architectures`` entry point), so there is no ``toy vit describe``.

Conventions (toy's): data on stdout (``--json`` for structured output),
progress and notes on stderr; bad input (a missing or corrupt file named in
the message, an image folder with an empty class or a single class, a model
whose classes or size do not fit, a GGUF that is not a ViT) is ``error: ...``
with exit 2 before anything is written; failures exit 1 (``toy_cli.ui``,
whose options, errors, progress and training run every ``toy`` command
shares). This module imports only typer and ``toy_cli.ui`` at import time:
``toy --help`` loads it to list the group.
"""

from __future__ import annotations

import json
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from toy_cli.ui import (
    RUN_PANEL,
    AsJson,
    Device,
    JsonSummary,
    MixedCpus,
    Progress,
    Quiet,
    Ranks,
    RunsDir,
    RunsOut,
    Seed,
    Threads,
    TrainDevice,
    TrainThreads,
    bad_input,
    cli_errors,
    run_training,
)

app = typer.Typer(
    name="vit",
    help="Image classification with a Vision Transformer: demo data, convert, train, eval, classify.",
    no_args_is_help=True,
)

_M, _P, _O, _F = "Model", RUN_PANEL, "Optimizer", "Fine-tuning"

# eval and classify (not toy_cli.ui's Batch: that counts tokens)
ImageBatch = Annotated[int, typer.Option("--batch-size", "-b", help="Images per forward pass.")]

# ViTTrainConfig field -> the flag that sets it (for error messages)
FLAGS = {
    "data": "DATA",
    "preset": "--preset",
    "image_size": "--image-size",
    "patch_size": "--patch-size",
    "n_channels": "--channels",
    "d_model": "--d-model",
    "n_layer": "--layers",
    "n_head": "--heads",
    "d_ff": "--ffn",
    "crop_scale": "--crop-scale",
    "steps": "--steps",
    "epochs": "--epochs",
    "batch_size": "--batch-size",
    "lr": "--lr",
    "warmup": "--warmup",
    "label_smoothing": "--label-smoothing",
    "seed": "--seed",
    "threads": "--threads",
    "device": "--device",
    "out": "--out",
    "base": "--from",
    "freeze": "--freeze",
    "flip": "--no-flip",
    "eval_every": "--eval-every",
    "save_every": "--save-every",
}


@contextmanager
def _errors():
    """toy's errors as ``error:``/``hint:`` with their exit codes; a training
    config error names the flag instead of the field."""
    from toy_vit.trainconfig import ViTTrainConfigError

    with cli_errors():
        try:
            yield
        except ViTTrainConfigError as e:
            msg = str(e)
            flag = FLAGS.get(e.field)
            if flag and msg.startswith(f"{e.field}:"):
                msg = flag + msg[len(e.field) :]
            raise bad_input(msg, e.hint) from e


def _check_file(path: Path, what: str) -> None:
    if not path.exists():
        raise bad_input(f"{path}: no such file", f"check the path of the {what}")
    if not path.is_file():
        raise bad_input(f"{path}: not a file (the {what})")


def _load(model: Path, threads: int | None, device: str | None):
    import toy_vit

    _check_file(model, "model (a toy-vit GGUF)")
    return toy_vit.load(model, threads=threads, device=device)


def _positive(value: int, flag: str) -> None:
    if value < 1:
        raise bad_input(f"{flag} {value} must be >= 1")


# -- demo-data -------------------------------------------------------------------


@app.command("demo-data")
def demo_data(
    folder: Annotated[Path, typer.Argument(help="The folder to write (absent or empty).")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a folder this command wrote before.")] = False,
) -> None:
    """Write the bundled handwritten digits (1,797 images, 10 classes, 32x32 grey PNGs) as an image folder."""
    with _errors():
        from toy_vit.digits import N_IMAGES, write_demo_data

        out = write_demo_data(folder, overwrite=overwrite)
    typer.echo(str(out))
    print(
        f"wrote {N_IMAGES} images of the digits 0-9 (32x32 grey PNGs, one folder per digit) to {out}", file=sys.stderr
    )
    print(f"train a classifier on them: {demo_train_command(folder)}", file=sys.stderr)


def demo_train_command(folder: Path) -> str:
    """The command ``demo-data`` suggests: the ``digits`` preset (grey input,
    8-pixel patches; see ``toy_vit.config``) and no mirror images (a
    mirrored 3 is not a 3). It reaches about 92 % validation accuracy
    (the guide, docs/guide/vit.md, shows it)."""
    return f"toy vit train {shlex.quote(str(folder))} --preset digits --steps {DEMO_STEPS} --no-flip"


DEMO_STEPS = 1000  # about a minute on two cores


# -- convert ---------------------------------------------------------------------


def _labels(text: str | None) -> list[str] | None:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",")]
    if not items or any(not t for t in items):
        raise bad_input(f"--labels {text!r}: give the class names, comma-separated, none empty")
    if len(set(items)) != len(items):
        dup = next(t for t in items if items.count(t) > 1)
        raise bad_input(f"--labels: the class name {dup!r} is given twice")
    return items


@app.command("convert")
def convert(
    hf_dir: Annotated[Path, typer.Argument(help="A local ViTForImageClassification folder (save_pretrained).")],
    out: Annotated[Path, typer.Argument(help="The GGUF file to write (atomically).")],
    labels: Annotated[
        str | None, typer.Option("--labels", help="Class names, comma-separated, in class order (replaces id2label).")
    ] = None,
) -> None:
    """Convert a Hugging Face ViT image classifier to a toy-vit GGUF file."""
    names = _labels(labels)
    if out.is_dir():
        raise bad_input(f"{out}: is a folder; give the GGUF file to write")
    with _errors():
        from toy_vit.convert import convert_hf
        from toy_vit.gguf_io import read_gguf
        from toy_vit.model import n_params

        path = convert_hf(hf_dir, out, labels=names)
        cfg, _ = read_gguf(path)
    shown = ", ".join(cfg.labels[:5]) + (", ..." if cfg.n_classes > 5 else "")
    typer.echo(str(path))
    print(
        f"converted {hf_dir}: {cfg.image_size}px images in {cfg.patch_size}px patches, {cfg.n_channels} channel(s), "
        f"width {cfg.d_model}, {cfg.n_layer} layers, {cfg.n_classes} classes ({shown}); "
        f"{n_params(cfg):,} parameters",
        file=sys.stderr,
    )


# -- train -----------------------------------------------------------------------


def _run_task(run_dir: Path) -> str | None:
    """The ``task`` a run's ``run_start`` names (None: a language-model run)."""
    try:
        with open(run_dir / "events.jsonl", "rb") as f:
            first = json.loads(f.readline() or b"{}")
    except (OSError, ValueError):
        return None  # resume says what is wrong with the folder
    return first.get("task") if isinstance(first, dict) else None


@app.command("train")
def train_cmd(
    data: Annotated[Path | None, typer.Argument(help="An image folder: one sub-folder of images per class.")] = None,
    resume: Annotated[
        Path | None, typer.Option("--resume", help="Continue the run in this folder from its latest checkpoint.")
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            "--preset", help="vit-small32 (default), vit-tiny, vit-micro or digits (demo-data's).", rich_help_panel=_M
        ),
    ] = None,
    image_size: Annotated[
        int | None,
        typer.Option("--image-size", help="Input side in pixels (default: the preset's).", rich_help_panel=_M),
    ] = None,
    patch_size: Annotated[
        int | None, typer.Option("--patch-size", help="Patch side in pixels.", rich_help_panel=_M)
    ] = None,
    channels: Annotated[
        int | None, typer.Option("--channels", help="1 (grey) or 3 (RGB, the presets').", rich_help_panel=_M)
    ] = None,
    d_model: Annotated[int | None, typer.Option("--d-model", help="Width.", rich_help_panel=_M)] = None,
    n_layer: Annotated[int | None, typer.Option("--layers", help="Transformer blocks.", rich_help_panel=_M)] = None,
    n_head: Annotated[int | None, typer.Option("--heads", help="Attention heads.", rich_help_panel=_M)] = None,
    d_ff: Annotated[int | None, typer.Option("--ffn", help="MLP width.", rich_help_panel=_M)] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="Optimizer steps.", rich_help_panel=_P)] = None,
    epochs: Annotated[
        float | None,
        typer.Option("--epochs", help="Passes over the training images (instead of --steps).", rich_help_panel=_P),
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option("--batch-size", "-b", help="Images per step (default 32).", rich_help_panel=_P)
    ] = None,
    seed: Seed = None,
    eval_every: Annotated[
        int | None,
        typer.Option("--eval-every", help="Validate every N steps, and at the end (default 100).", rich_help_panel=_P),
    ] = None,
    save_every: Annotated[
        int | None,
        typer.Option(
            "--save-every", help="Checkpoint every N steps; 0: at the end only (default 500).", rich_help_panel=_P
        ),
    ] = None,
    crop_scale: Annotated[
        str | None,
        typer.Option("--crop-scale", help="Random crops' area fraction MIN,MAX (default 0.5,1).", rich_help_panel=_P),
    ] = None,
    no_flip: Annotated[
        bool, typer.Option("--no-flip", help="No horizontal flips (digits, text).", rich_help_panel=_P)
    ] = False,
    out: RunsOut = None,
    threads: TrainThreads = None,
    device: TrainDevice = None,
    lr: Annotated[
        float | None, typer.Option("--lr", help="Peak learning rate (default 1e-3).", rich_help_panel=_O)
    ] = None,
    warmup: Annotated[
        int | None, typer.Option("--warmup", help="Warm-up steps (default 0).", rich_help_panel=_O)
    ] = None,
    label_smoothing: Annotated[
        float | None, typer.Option("--label-smoothing", help="0 (default) to < 1.", rich_help_panel=_O)
    ] = None,
    base: Annotated[
        Path | None, typer.Option("--from", help="Fine-tune this toy-vit GGUF (its dimensions).", rich_help_panel=_F)
    ] = None,
    freeze: Annotated[
        bool,
        typer.Option("--freeze", help="With --from: train only the head and the final LayerNorm.", rich_help_panel=_F),
    ] = False,
    ranks: Ranks = None,
    mixed_cpus: MixedCpus = None,
    quiet: Quiet = False,
    as_json: JsonSummary = False,
) -> None:
    """Train a ViT classifier on an image folder (or fine-tune one, --from); --resume RUN continues a stopped run."""
    given = {
        "DATA": data, "--preset": preset, "--image-size": image_size, "--patch-size": patch_size,
        "--channels": channels, "--d-model": d_model, "--layers": n_layer, "--heads": n_head, "--ffn": d_ff,
        "--crop-scale": crop_scale, "--epochs": epochs, "--batch-size": batch_size,
        "--seed": seed, "--eval-every": eval_every, "--save-every": save_every, "--no-flip": no_flip or None,
        "--out": out, "--threads": threads, "--device": device, "--lr": lr, "--warmup": warmup,
        "--label-smoothing": label_smoothing, "--from": base, "--freeze": freeze or None,
        "--mixed-cpus": mixed_cpus,
    }  # fmt: skip
    if resume is not None:
        extra = [k for k, v in given.items() if v is not None]
        if extra:
            raise bad_input(
                f"--resume continues a run as it was configured: {', '.join(extra)} cannot go with it",
                "only --steps (a new total), --json and --quiet go with --resume",
            )
        task = _run_task(resume)
        if task is not None and task != "vit":
            raise bad_input(f"{resume}: a {task!r} run, not a toy vit run", "toy train --resume RUN resumes any run")
        if task is None and (resume / "events.jsonl").is_file():
            raise bad_input(f"{resume}: not a toy vit run (a language-model run)", f"toy train --resume {resume}")
        from toy.train.lmrun import resume as resume_run

        run_training(lambda hooks: resume_run(resume, hooks, steps=steps), quiet, as_json, "toy vit train", ranks)
        return
    if data is None:
        raise bad_input("give the image folder to train on: toy vit train DATA", "toy vit demo-data digits writes one")
    if steps is None and epochs is None:
        raise bad_input("give the length of the run: --steps N or --epochs E")
    if steps is not None and epochs is not None:
        raise bad_input("--steps and --epochs exclude each other: give one")
    if channels is not None and channels not in (1, 3):
        raise bad_input(f"--channels {channels}: 1 (grey) or 3 (RGB)")
    if base is not None and preset is not None:
        raise bad_input("--preset and --from exclude each other: a fine-tune has its base model's dimensions")
    values: dict[str, Any] = {
        "data": str(data), "preset": preset, "image_size": image_size, "patch_size": patch_size,
        "n_channels": channels, "d_model": d_model, "n_layer": n_layer, "n_head": n_head, "d_ff": d_ff,
        "crop_scale": _pair(crop_scale), "steps": steps, "epochs": epochs,
        "batch_size": batch_size, "seed": seed, "eval_every": eval_every, "save_every": save_every,
        "flip": False if no_flip else None, "out": str(out) if out else None, "threads": threads, "device": device,
        "lr": lr, "warmup": warmup, "label_smoothing": label_smoothing, "base": str(base) if base else None,
        "freeze": True if freeze else None, "mixed_cpus": mixed_cpus,
    }  # fmt: skip
    with _errors():
        from toy_vit.trainconfig import ViTTrainConfig, validate

        cfg = validate(ViTTrainConfig(**{k: v for k, v in values.items() if v is not None}))
        if base is not None:
            _check_base(base, cfg.overrides())
    from toy_vit.train import train

    run_training(lambda hooks: train(cfg, hooks), quiet, as_json, "toy vit train", ranks)


def _pair(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise bad_input(f"--crop-scale {text!r}: give two numbers MIN,MAX (e.g. 0.7,1)") from None
    return (lo, hi)


def _check_base(base: Path, overrides: dict[str, int]) -> None:
    """The ``--from`` file is a toy-vit GGUF whose dimensions are the ones
    given (checked before any image is decoded)."""
    from toy.gguf import GGUFFile
    from toy_vit.gguf_io import config_from_gguf

    _check_file(base, "base model (--from)")
    with GGUFFile(base) as gf:
        bcfg = config_from_gguf(gf)
    for field, v in overrides.items():
        if getattr(bcfg, field) != v:
            raise bad_input(
                f"{FLAGS[field]} {v} differs from the base model's {getattr(bcfg, field)} ({base})",
                f"a fine-tune has its base's dimensions: leave {FLAGS[field]} out",
            )


# -- eval ------------------------------------------------------------------------


@app.command("eval")
def eval_cmd(
    model: Annotated[Path, typer.Argument(help="A toy-vit GGUF (a checkpoint or a converted model).")],
    data: Annotated[Path, typer.Argument(help="An image folder named by class (the model's labels).")],
    split: Annotated[
        str, typer.Option("--split", help="val: the validation split a training run holds out; all: every image.")
    ] = "val",
    seed: Annotated[int, typer.Option("--seed", help="The split's seed: the training run's --seed.")] = 0,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Also draw the confusion matrix to this PNG (toy-vit[plot]).")
    ] = None,
    batch_size: ImageBatch = 32,
    threads: Threads = None,
    device: Device = None,
    runs_dir: RunsDir = None,
    as_json: AsJson = False,
) -> None:
    """Accuracy, top-5, mean NLL, per-class precision/recall/F1 and the confusion matrix of a model on images."""
    if split not in ("val", "all", "train"):
        raise bad_input(f"--split {split!r}: val, all or train")
    _positive(batch_size, "--batch-size")
    if seed < 0:
        raise bad_input(f"--seed {seed} must be >= 0")
    bar = Progress()
    with _errors():
        from toy.runs import runs_dir as resolve_runs
        from toy.runs.folder import check_output_dir
        from toy_vit.evaluate import check_plot_path, evaluate, plot_confusion

        if plot is not None:
            check_plot_path(plot)
        check_output_dir(resolve_runs(runs_dir), "--runs-dir" if runs_dir is not None else "runs folder")
        with _load(model, threads, device) as clf:
            try:
                report = evaluate(
                    clf,
                    data,
                    split=split,
                    batch_size=batch_size,
                    seed=seed,
                    progress=lambda p, d, t: bar.update(p, d, t),
                )
            finally:
                bar.close()
            cfg = clf.config
        run = _record(report, cfg, runs_dir, batch_size, seed)
        if plot is not None:
            plot_confusion(report, plot)
    print(f"run: {run}", file=sys.stderr)
    if plot is not None:
        print(f"confusion matrix drawn to {plot}", file=sys.stderr)
    if as_json:
        typer.echo(json.dumps({"run_id": run.name, **report.to_dict()}, indent=2, ensure_ascii=False))
    else:
        typer.echo(report.to_text())


def _record(report, cfg, runs_dir, batch_size: int, seed: int) -> Path:
    """An eval run bundle with the report's headline figures (written once
    they are known; the per-class table and the matrix are ``--json``'s)."""
    from toy.eval.record import eval_run

    config = {"model": report.model, "data": report.data, "split": report.split, "batch_size": batch_size, "seed": seed}
    model = {"path": report.model, "architecture": "vit", "image_size": cfg.image_size, "d_model": cfg.d_model,
             "n_layer": cfg.n_layer, "n_classes": cfg.n_classes}  # fmt: skip
    with eval_run("vit", config, runs_dir, model=model) as w:
        w.event(
            "eval",
            name=report.split or "batches",
            loss=report.nll,
            accuracy=report.accuracy,
            top5=report.top_k_accuracy,
            top_k=report.top_k,
            images=report.n,
        )
    return w.dir


# -- classify --------------------------------------------------------------------


@app.command("classify")
def classify_cmd(
    model: Annotated[Path, typer.Argument(help="A toy-vit GGUF.")],
    images: Annotated[list[Path], typer.Argument(help="Image files (PNG, JPEG, WebP, BMP).")],
    top_k: Annotated[int, typer.Option("--top-k", "-k", help="Classes shown per image.")] = 5,
    batch_size: ImageBatch = 32,
    threads: Threads = None,
    device: Device = None,
    as_json: AsJson = False,
) -> None:
    """The most probable classes of each image (batched); nothing is printed unless every image decodes."""
    _positive(top_k, "--top-k")
    _positive(batch_size, "--batch-size")
    for p in images:
        _check_file(p, "image")
    with _errors(), _load(model, threads, device) as clf:
        results = clf.classify([str(p) for p in images], top_k=top_k, batch_size=batch_size)
        path, k = str(clf.path), min(top_k, clf.config.n_classes)
    if as_json:
        out = {
            "model": path,
            "top_k": k,
            "images": [
                {"image": str(p), "predictions": [{"label": lab, "probability": pr} for lab, pr in r]}
                for p, r in zip(images, results)
            ],
        }
        typer.echo(json.dumps(out, indent=2, ensure_ascii=False))
        return
    for p, r in zip(images, results):
        typer.echo(f"{p}: " + ", ".join(f"{lab} {100 * pr:.2f}%" for lab, pr in r))


__all__ = ["app"]
