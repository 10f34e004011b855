"""`toy train`: training runs (from scratch; `--resume` continues any run).

Configuration: a TOML file (``--config``) validated into
``toy.train.config.TrainConfig``, then the flags given here on top; the
resolved config is what the run records. Progress (step, loss, lr, the
step unit's rate: tok/s, or img/s for an image classifier's run, ETA) goes
to stderr as a rich progress bar on a terminal, one line every few seconds
otherwise; the run folder's path is printed on stdout at the end
(``--json``: a JSON summary instead; a classifier run adds its final
``val_accuracy`` and ``val_top5``).

Stopping: the first Ctrl-C (SIGINT) or SIGTERM finishes the current step,
saves a checkpoint, writes ``run_end`` with reason "interrupted" and exits
(130 after SIGINT, 0 after SIGTERM, the polite stop a process manager
sends); ``toy train --resume RUN_DIR`` continues exactly. A stop before the
first step saves nothing (nothing was trained). A second signal while
stopping is ignored with a line; a third aborts at once (the checkpoint
being written is dropped, the last complete one stays intact).

Progress, stop signals and summary are ``toy_cli.ui.run_training``'s, which
other distributions' training commands share (``toy vit train``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from toy_cli.arch_help import arch_help, preset_help, targets_help
from toy_cli.ranks import run_ranks
from toy_cli.ui import (
    RUN_PANEL,
    JsonSummary,
    MixedCpus,
    Quiet,
    Ranks,
    RunsOut,
    Seed,
    TrainDevice,
    TrainThreads,
    bad_input,
    cli_errors,
    run_training,
)

train_app = typer.Typer(
    help="Train models: from scratch, LoRA/QLoRA, full fine-tune, warm-start; `--resume RUN_DIR` continues a stopped run.",
    no_args_is_help=False,
    invoke_without_command=True,
)

_P = RUN_PANEL
_M = "Model"
_O = "Optimizer"


@train_app.callback()
def train_main(
    ctx: typer.Context,
    resume: Annotated[
        Path | None, typer.Option("--resume", help="Continue the run in this folder from its latest checkpoint.")
    ] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="With --resume: raise the total steps.")] = None,
    ranks: Ranks = None,
    quiet: Quiet = False,
    as_json: JsonSummary = False,
) -> None:
    """Train a model. `toy train from-scratch --help` lists the options of a new run."""
    if ctx.invoked_subcommand is not None:
        if resume is not None:
            raise bad_input("--resume goes without a subcommand: toy train --resume RUN_DIR")
        run_ranks(ranks)  # `toy train --ranks N RECIPE ...`: the same as after the recipe
        return
    if resume is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(0)
    run_ranks(ranks)
    from toy.train.lmrun import resume as resume_run

    run_training(lambda hooks: resume_run(resume, hooks, steps=steps), quiet, as_json)


@train_app.command("from-scratch")
def from_scratch(
    paths: Annotated[list[Path] | None, typer.Argument(help='Text files, folders or JSONL ({"text": ...}).')] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="A TOML config file.")] = None,
    arch: Annotated[str | None, typer.Option("--arch", help=arch_help(), rich_help_panel=_M)] = None,
    preset: Annotated[
        str | None,
        typer.Option("--preset", help=preset_help(), rich_help_panel=_M),
    ] = None,
    d_model: Annotated[int | None, typer.Option("--d-model", rich_help_panel=_M)] = None,
    n_layer: Annotated[int | None, typer.Option("--layers", rich_help_panel=_M)] = None,
    n_head: Annotated[int | None, typer.Option("--heads", rich_help_panel=_M)] = None,
    n_head_kv: Annotated[int | None, typer.Option("--kv-heads", rich_help_panel=_M)] = None,
    d_ff: Annotated[int | None, typer.Option("--ffn", rich_help_panel=_M)] = None,
    tokenizer: Annotated[
        str | None, typer.Option("--tokenizer", help="Take the tokenizer of this GGUF model.", rich_help_panel=_M)
    ] = None,
    vocab_size: Annotated[
        int | None, typer.Option("--vocab-size", help="Else train a byte-level BPE of this size.", rich_help_panel=_M)
    ] = None,
    steps: Annotated[int | None, typer.Option("--steps", rich_help_panel=_P)] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", "-b", rich_help_panel=_P)] = None,
    context: Annotated[int | None, typer.Option("--context", help="Tokens per row.", rich_help_panel=_P)] = None,
    grad_accum: Annotated[int | None, typer.Option("--grad-accum", rich_help_panel=_P)] = None,
    seed: Seed = None,
    eval_every: Annotated[int | None, typer.Option("--eval-every", rich_help_panel=_P)] = None,
    save_every: Annotated[int | None, typer.Option("--save-every", rich_help_panel=_P)] = None,
    out: RunsOut = None,
    device: TrainDevice = None,
    threads: TrainThreads = None,
    lr: Annotated[float | None, typer.Option("--lr", rich_help_panel=_O)] = None,
    schedule: Annotated[
        str | None, typer.Option("--schedule", help="constant, linear, cosine or wsd.", rich_help_panel=_O)
    ] = None,
    warmup: Annotated[int | None, typer.Option("--warmup", rich_help_panel=_O)] = None,
    diagnostics: Diagnostics = None,
    diagnostics_every: DiagEvery = None,
    report_to: ReportTo = None,
    trace: Trace = None,
    ranks: Ranks = None,
    mixed_cpus: MixedCpus = None,
    quiet: Quiet = False,
    as_json: JsonSummary = False,
) -> None:
    """Train a model (llama or gpt2) from random weights on your text."""
    with cli_errors():
        from toy.train import config as C

        under = _project("from-scratch")
        cfg = C.load_toml(config, under=under) if config else C.defaults(under=under)
        cfg = C.override(
            cfg,
            **{
                "data.paths": [str(p) for p in paths] if paths else None,
                "model.arch": arch,
                "model.preset": preset,
                "model.d_model": d_model,
                "model.n_layer": n_layer,
                "model.n_head": n_head,
                "model.n_head_kv": n_head_kv,
                "model.d_ff": d_ff,
                "tokenizer.model": tokenizer,
                "tokenizer.vocab_size": vocab_size,
                "steps": steps,
                "batch_size": batch_size,
                "context": context,
                "grad_accum": grad_accum,
                "seed": seed,
                "eval_every": eval_every,
                "save_every": save_every,
                "out": str(out) if out else None,
                "device": device,
                "threads": threads,
                "optim.lr": lr,
                "optim.schedule": schedule,
                "optim.warmup": warmup,
                **_inspect(diagnostics, diagnostics_every, report_to, trace),
                "mixed_cpus": mixed_cpus,
            },
        )
    run_ranks(ranks)
    from toy.train.lmrun import train

    run_training(lambda hooks: train(cfg, hooks), quiet, as_json)


# -- fine-tuning recipes ---------------------------------------------------------

_F = "Fine-tuning"
Paths = Annotated[
    list[Path] | None, typer.Argument(help='JSONL examples: {"text"}, {"prompt","completion"} or {"messages"}.')
]
Base = Annotated[
    str | None,
    typer.Option(
        "--model", "-m", help="The base GGUF (a path or a `toy list` name; default: the project's model in toy.toml)."
    ),
]
Config = Annotated[Path | None, typer.Option("--config", "-c", help="A TOML config file.")]
MaxLen = Annotated[
    int | None,
    typer.Option("--max-length", help="Tokens per example (default: context + 1).", rich_help_panel=_F),
]
Overflow = Annotated[
    str | None,
    typer.Option("--overflow", help="Longer examples: truncate or drop (counted in the log).", rich_help_panel=_F),
]
Steps = Annotated[int | None, typer.Option("--steps", rich_help_panel=_P)]
BatchSize = Annotated[int | None, typer.Option("--batch-size", "-b", rich_help_panel=_P)]
Ctx = Annotated[int | None, typer.Option("--context", help="Tokens per row.", rich_help_panel=_P)]
Accum = Annotated[int | None, typer.Option("--grad-accum", rich_help_panel=_P)]
EvalEvery = Annotated[int | None, typer.Option("--eval-every", rich_help_panel=_P)]
SaveEvery = Annotated[int | None, typer.Option("--save-every", rich_help_panel=_P)]
Lr = Annotated[float | None, typer.Option("--lr", rich_help_panel=_O)]
Schedule = Annotated[
    str | None, typer.Option("--schedule", help="constant, linear, cosine or wsd.", rich_help_panel=_O)
]
Warmup = Annotated[int | None, typer.Option("--warmup", rich_help_panel=_O)]
_L = "Looking inside"
Diagnostics = Annotated[
    str | None,
    typer.Option(
        "--diagnostics",
        help="Per-layer diagnostics, comma-separated: grads, updates, drift, activations, nonfinite, or all.",
        rich_help_panel=_L,
    ),
]
DiagEvery = Annotated[
    int | None, typer.Option("--diagnostics-every", help="Steps between diagnostics (default 10).", rich_help_panel=_L)
]
ReportTo = Annotated[
    str | None,
    typer.Option(
        "--report-to", help="Mirror the run's events live: tensorboard, mlflow (comma-separated).", rich_help_panel=_L
    ),
]
Trace = Annotated[
    Path | None,
    typer.Option(
        "--trace", help="Write a Chrome/Perfetto trace of one training step to this file.", rich_help_panel=_L
    ),
]


def _list(text: str | None, what: str) -> list[str] | None:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise bad_input(f"{what}: give a comma-separated list")
    return items


def _inspect(diagnostics: str | None, every: int | None, report_to: str | None, trace: Path | None) -> dict:
    """The config keys of the "Looking inside" flags every recipe shares."""
    return {
        "diagnostics.kinds": _list(diagnostics, "--diagnostics"),
        "diagnostics.every": every,
        "report.to": _list(report_to, "--report-to"),
        "trace": str(trace) if trace else None,
    }


def _project(recipe: str) -> dict:
    """The training defaults of the project around the current folder
    (toy.toml: seed, device, threads; lora and full: the base model), which a
    config file and the flags override."""
    from toy.project import current

    project = current()
    return project.train_defaults(recipe) if project is not None else {}


def _finetune(
    recipe: str, config: Path | None, values: dict, quiet: bool, as_json: bool, ranks: int | None = None
) -> None:
    with cli_errors():
        from toy.train import config as C

        under = _project(recipe)
        cfg = C.load_toml(config, recipe=recipe, under=under) if config else C.defaults(recipe, under)
        cfg = C.override(cfg, **values)
    run_ranks(ranks)  # the config is valid: the ranks start (their errors would be printed once per rank)
    from toy.train.lmrun import train

    run_training(lambda hooks: train(cfg, hooks), quiet, as_json)


def _common(paths, model, max_length, overflow, steps, batch_size, context, grad_accum, seed, eval_every,
            save_every, out, device, threads, lr, schedule, warmup) -> dict:  # fmt: skip
    return {
        "data.paths": [str(p) for p in paths] if paths else None,
        "base": model,
        "data.max_length": max_length,
        "data.overflow": overflow,
        "steps": steps,
        "batch_size": batch_size,
        "context": context,
        "grad_accum": grad_accum,
        "seed": seed,
        "eval_every": eval_every,
        "save_every": save_every,
        "out": str(out) if out else None,
        "device": device,
        "threads": threads,
        "optim.lr": lr,
        "optim.schedule": schedule,
        "optim.warmup": warmup,
    }


@train_app.command("lora")
def lora_cmd(
    paths: Paths = None,
    model: Base = None,
    config: Config = None,
    targets: Annotated[
        str | None,
        typer.Option(
            "--targets",
            help=targets_help(),
            rich_help_panel=_F,
        ),
    ] = None,
    rank: Annotated[int | None, typer.Option("--rank", "-r", help="LoRA rank (default 8).", rich_help_panel=_F)] = None,
    alpha: Annotated[float | None, typer.Option("--alpha", help="LoRA alpha (default 16).", rich_help_panel=_F)] = None,
    dropout: Annotated[
        float | None, typer.Option("--dropout", help="On the LoRA inputs (default 0).", rich_help_panel=_F)
    ] = None,
    rslora: Annotated[
        bool | None,
        typer.Option("--rslora/--no-rslora", help="Scale alpha/sqrt(rank) (rank-stabilized).", rich_help_panel=_F),
    ] = None,
    max_length: MaxLen = None,
    overflow: Overflow = None,
    steps: Steps = None,
    batch_size: BatchSize = None,
    context: Ctx = None,
    grad_accum: Accum = None,
    seed: Seed = None,
    eval_every: EvalEvery = None,
    save_every: SaveEvery = None,
    out: RunsOut = None,
    device: TrainDevice = None,
    threads: TrainThreads = None,
    lr: Lr = None,
    schedule: Schedule = None,
    warmup: Warmup = None,
    diagnostics: Diagnostics = None,
    diagnostics_every: DiagEvery = None,
    report_to: ReportTo = None,
    trace: Trace = None,
    ranks: Ranks = None,
    mixed_cpus: MixedCpus = None,
    quiet: Quiet = False,
    as_json: JsonSummary = False,
) -> None:
    """LoRA (QLoRA on a quantized base): train low-rank adapters on a frozen GGUF model; checkpoints are adapters llama.cpp loads."""
    values = _common(paths, model, max_length, overflow, steps, batch_size, context, grad_accum, seed, eval_every,
                     save_every, out, device, threads, lr, schedule, warmup)  # fmt: skip
    values.update({"lora.targets": _list(targets, "--targets"), "lora.rank": rank, "lora.alpha": alpha,
                   "lora.dropout": dropout, "lora.rslora": rslora})  # fmt: skip
    values.update(_inspect(diagnostics, diagnostics_every, report_to, trace))
    values["mixed_cpus"] = mixed_cpus
    _finetune("lora", config, values, quiet, as_json, ranks)


@train_app.command("full")
def full_cmd(
    paths: Paths = None,
    model: Base = None,
    config: Config = None,
    freeze: Annotated[
        str | None,
        typer.Option(
            "--freeze", help="Keep these as they are: embeddings, output (comma-separated).", rich_help_panel=_F
        ),
    ] = None,
    max_length: MaxLen = None,
    overflow: Overflow = None,
    steps: Steps = None,
    batch_size: BatchSize = None,
    context: Ctx = None,
    grad_accum: Accum = None,
    seed: Seed = None,
    eval_every: EvalEvery = None,
    save_every: SaveEvery = None,
    out: RunsOut = None,
    device: TrainDevice = None,
    threads: TrainThreads = None,
    lr: Lr = None,
    schedule: Schedule = None,
    warmup: Warmup = None,
    diagnostics: Diagnostics = None,
    diagnostics_every: DiagEvery = None,
    report_to: ReportTo = None,
    trace: Trace = None,
    ranks: Ranks = None,
    mixed_cpus: MixedCpus = None,
    quiet: Quiet = False,
    as_json: JsonSummary = False,
) -> None:
    """Full fine-tune: every weight of a GGUF model trainable (a quantized base is dequantized to F32)."""
    values = _common(paths, model, max_length, overflow, steps, batch_size, context, grad_accum, seed, eval_every,
                     save_every, out, device, threads, lr, schedule, warmup)  # fmt: skip
    values["freeze"] = _list(freeze, "--freeze")
    values.update(_inspect(diagnostics, diagnostics_every, report_to, trace))
    values["mixed_cpus"] = mixed_cpus
    _finetune("full", config, values, quiet, as_json, ranks)


@train_app.command("warm-start")
def warm_start_cmd(
    paths: Annotated[list[Path] | None, typer.Argument(help='Text files, folders or JSONL ({"text": ...}).')] = None,
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="The donor GGUF (a path or a `toy list` name).")
    ] = None,
    config: Config = None,
    arch: Annotated[str | None, typer.Option("--arch", help=arch_help(), rich_help_panel=_M)] = None,
    preset: Annotated[
        str | None,
        typer.Option("--preset", help=preset_help(), rich_help_panel=_M),
    ] = None,
    d_model: Annotated[int | None, typer.Option("--d-model", rich_help_panel=_M)] = None,
    n_layer: Annotated[int | None, typer.Option("--layers", rich_help_panel=_M)] = None,
    n_head: Annotated[int | None, typer.Option("--heads", rich_help_panel=_M)] = None,
    n_head_kv: Annotated[int | None, typer.Option("--kv-heads", rich_help_panel=_M)] = None,
    d_ff: Annotated[int | None, typer.Option("--ffn", rich_help_panel=_M)] = None,
    copy_layers: Annotated[
        str | None,
        typer.Option(
            "--copy-layers", help="Donor blocks to copy where shapes match (default: all).", rich_help_panel=_M
        ),
    ] = None,
    project: Annotated[
        str | None, typer.Option("--project", help="Embedding of another width: pca or truncate.", rich_help_panel=_M)
    ] = None,
    steps: Steps = None,
    batch_size: BatchSize = None,
    context: Ctx = None,
    grad_accum: Accum = None,
    seed: Seed = None,
    eval_every: EvalEvery = None,
    save_every: SaveEvery = None,
    out: RunsOut = None,
    device: TrainDevice = None,
    threads: TrainThreads = None,
    lr: Lr = None,
    schedule: Schedule = None,
    warmup: Warmup = None,
    diagnostics: Diagnostics = None,
    diagnostics_every: DiagEvery = None,
    report_to: ReportTo = None,
    trace: Trace = None,
    ranks: Ranks = None,
    mixed_cpus: MixedCpus = None,
    quiet: Quiet = False,
    as_json: JsonSummary = False,
) -> None:
    """Warm-start a new (possibly smaller) model from a donor's embeddings and matching blocks, then train it on text."""
    values = _common(paths, model, None, None, steps, batch_size, context, grad_accum, seed, eval_every,
                     save_every, out, device, threads, lr, schedule, warmup)  # fmt: skip
    layers = _list(copy_layers, "--copy-layers")
    try:
        layer_ids = [int(x) for x in layers] if layers else None
    except ValueError:
        raise bad_input(f"--copy-layers {copy_layers!r}: block numbers, comma-separated") from None
    values.update({"model.arch": arch, "model.preset": preset, "model.d_model": d_model, "model.n_layer": n_layer, "model.n_head": n_head,
                   "model.n_head_kv": n_head_kv, "model.d_ff": d_ff, "warm_start.layers": layer_ids,
                   "warm_start.project": project})  # fmt: skip
    values.update(_inspect(diagnostics, diagnostics_every, report_to, trace))
    values["mixed_cpus"] = mixed_cpus
    _finetune("warm-start", config, values, quiet, as_json, ranks)


@train_app.command("demo-corpus")
def demo_corpus(
    folder: Annotated[Path, typer.Argument(help="Folder to write the text files into.")] = Path("corpus"),
) -> None:
    """Write a small English corpus (Python's documentation topics, ~465 KB) to train on."""
    from toy.train.demodata import write_python_docs

    paths = write_python_docs(folder)
    size = sum(p.stat().st_size for p in paths)
    typer.echo(str(folder))
    print(f"wrote {len(paths)} files ({size / 1e3:.0f} KB) to {folder}", file=sys.stderr)


@train_app.command("demo-adapter")
def demo_adapter(
    out: Annotated[Path, typer.Argument(help="The adapter file to write.")] = Path("demo-lora.gguf"),
    model: Annotated[
        str, typer.Option("--model", "-m", help="The base model (a path or a `toy list` name).")
    ] = "smollm2-135m",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random matrices.")] = 20251130,
    rank: Annotated[int, typer.Option("--rank", "-r", help="LoRA rank.")] = 8,
    targets: Annotated[str, typer.Option("--targets", help="Modules to adapt, comma-separated.")] = "q,v",
) -> None:
    """Write an untrained, seeded random LoRA adapter for a model: an example file for --lora and toy merge."""
    if out.is_dir():
        raise bad_input(f"{out}: is a folder", "OUT is the adapter file to write, e.g. demo-lora.gguf")
    names = _list(targets, "--targets") or []
    with cli_errors():
        from toy.adapters.demo import random_adapter
        from toy.store import resolve_model

        base = Path(resolve_model(model))
        path = random_adapter(base, out, seed=seed, rank=rank, targets=names)
    typer.echo(str(path))
    print(f"wrote a random rank-{rank} adapter on {','.join(names)} for {base.name} "
          f"(seed {seed}; untrained: it changes the text, it teaches nothing)", file=sys.stderr)  # fmt: skip


def register(app: typer.Typer) -> None:
    app.add_typer(train_app, name="train")
