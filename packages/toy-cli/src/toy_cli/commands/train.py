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
    help="Train models: from scratch, LoRA/QLoRA, full fine-tune, warm-start, preference tuning (DPO, ORPO, KTO) and "
    "GRPO; `--resume RUN_DIR` continues a stopped run.",
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


# -- preference tuning and RL (toy.train.prefrun, toy.train.grpo) -------------------------

_R = "Preference objective"
_G = "GRPO"
Adapter = Annotated[
    str | None,
    typer.Option(
        "--adapter",
        help="What is trained: lora (adapters; QLoRA on a quantized base; default) or full (every weight).",
        rich_help_panel=_F,
    ),
]
Targets = Annotated[str | None, typer.Option("--targets", help=targets_help(), rich_help_panel=_F)]
Rank = Annotated[int | None, typer.Option("--rank", "-r", help="LoRA rank (default 8).", rich_help_panel=_F)]
Alpha = Annotated[float | None, typer.Option("--alpha", help="LoRA alpha (default 16).", rich_help_panel=_F)]
Dropout = Annotated[float | None, typer.Option("--dropout", help="On the LoRA inputs (default 0).", rich_help_panel=_F)]
RsLora = Annotated[
    bool | None,
    typer.Option("--rslora/--no-rslora", help="Scale alpha/sqrt(rank) (rank-stabilized).", rich_help_panel=_F),
]
Freeze = Annotated[
    str | None,
    typer.Option(
        "--freeze", help="With --adapter full: keep these as they are: embeddings, output.", rich_help_panel=_F
    ),
]
Beta = Annotated[
    float | None,
    typer.Option("--beta", help="How strongly the policy is held to the reference (default 0.1).", rich_help_panel=_R),
]
PrefBatchSize = Annotated[
    int | None, typer.Option("--batch-size", "-b", help="Pairs (examples for kto) per micro-batch.", rich_help_panel=_P)
]
PairsArg = Annotated[
    list[Path] | None,
    typer.Argument(help='JSONL pairs: {"prompt", "chosen", "rejected"} (strings or chat messages).'),
]


def _adapted(recipe: str, adapter: str | None, targets, rank, alpha, dropout, rslora, freeze) -> dict:
    """The config keys of what a preference or RL run trains (``--adapter`` and the LoRA or full options)."""
    if adapter is not None and adapter not in ("lora", "full"):
        raise bad_input(f"--adapter {adapter!r}: lora or full")
    lora = {"lora.targets": _list(targets, "--targets"), "lora.rank": rank, "lora.alpha": alpha,
            "lora.dropout": dropout, "lora.rslora": rslora}  # fmt: skip
    given = [k for k, v in lora.items() if v is not None]
    if adapter == "full" and given:
        flag = "--" + given[0].split(".")[1]
        raise bad_input(f"{flag} is a LoRA option; this run trains every weight (--adapter full)")
    if freeze is not None and adapter != "full":
        raise bad_input("--freeze is for a full fine-tune: add --adapter full")
    return {"adapter": adapter, **lora, "freeze": _list(freeze, "--freeze")}


def _pref_run(recipe: str, config: Path | None, adapter: str | None, values: dict, quiet: bool, as_json: bool) -> None:
    """A preference or RL recipe: like ``_finetune``, with the defaults of the ``--adapter`` kind."""
    with cli_errors():
        from toy.train import config as C

        under = _project("lora")  # the project's base model, as for the lora and full recipes
        if config:
            cfg = C.load_toml(config, recipe=recipe, under=under, adapter=adapter)
        else:
            cfg = C.defaults(recipe, under, adapter=adapter)
        cfg = C.override(cfg, **values)
    from toy.train.lmrun import train

    run_training(lambda hooks: train(cfg, hooks), quiet, as_json)


@train_app.command("dpo")
def dpo_cmd(
    paths: PairsArg = None,
    model: Base = None,
    config: Config = None,
    adapter: Adapter = None,
    beta: Beta = None,
    loss: Annotated[
        str | None,
        typer.Option(
            "--loss",
            help="sigmoid (DPO, default), ipo, robust (with --label-smoothing) or hinge.",
            rich_help_panel=_R,
        ),
    ] = None,
    label_smoothing: Annotated[
        float | None,
        typer.Option(
            "--label-smoothing", help="Robust DPO: the assumed share of flipped pairs, in [0, 0.5).", rich_help_panel=_R
        ),
    ] = None,
    targets: Targets = None,
    rank: Rank = None,
    alpha: Alpha = None,
    dropout: Dropout = None,
    rslora: RsLora = None,
    freeze: Freeze = None,
    max_length: MaxLen = None,
    overflow: Overflow = None,
    steps: Steps = None,
    batch_size: PrefBatchSize = None,
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
    quiet: Quiet = False,
    as_json: JsonSummary = False,
) -> None:
    """DPO: prefer the chosen completion over the rejected one, against the frozen base as reference (LoRA, QLoRA or full)."""
    values = _common(paths, model, max_length, overflow, steps, batch_size, context, grad_accum, seed, eval_every,
                     save_every, out, device, threads, lr, schedule, warmup)  # fmt: skip
    values.update(_adapted("dpo", adapter, targets, rank, alpha, dropout, rslora, freeze))
    values.update({"pref.beta": beta, "pref.loss_type": loss, "pref.label_smoothing": label_smoothing})
    values.update(_inspect(diagnostics, diagnostics_every, report_to, trace))
    _pref_run("dpo", config, adapter, values, quiet, as_json)


@train_app.command("orpo")
def orpo_cmd(
    paths: PairsArg = None,
    model: Base = None,
    config: Config = None,
    adapter: Adapter = None,
    lam: Annotated[
        float | None,
        typer.Option(
            "--lambda", help="Weight of the odds-ratio term next to the SFT loss (default 0.1).", rich_help_panel=_R
        ),
    ] = None,
    targets: Targets = None,
    rank: Rank = None,
    alpha: Alpha = None,
    dropout: Dropout = None,
    rslora: RsLora = None,
    freeze: Freeze = None,
    max_length: MaxLen = None,
    overflow: Overflow = None,
    steps: Steps = None,
    batch_size: PrefBatchSize = None,
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
    quiet: Quiet = False,
    as_json: JsonSummary = False,
) -> None:
    """ORPO: SFT on the chosen completions plus an odds-ratio preference term; no reference model (LoRA, QLoRA or full)."""
    values = _common(paths, model, max_length, overflow, steps, batch_size, context, grad_accum, seed, eval_every,
                     save_every, out, device, threads, lr, schedule, warmup)  # fmt: skip
    values.update(_adapted("orpo", adapter, targets, rank, alpha, dropout, rslora, freeze))
    values["pref.orpo_lambda"] = lam
    values.update(_inspect(diagnostics, diagnostics_every, report_to, trace))
    _pref_run("orpo", config, adapter, values, quiet, as_json)


@train_app.command("kto")
def kto_cmd(
    paths: Annotated[
        list[Path] | None,
        typer.Argument(
            help='JSONL examples: {"prompt", "completion", "label": true|false} (strings or chat messages).'
        ),
    ] = None,
    model: Base = None,
    config: Config = None,
    adapter: Adapter = None,
    beta: Beta = None,
    desirable_weight: Annotated[
        float | None,
        typer.Option("--desirable-weight", help="Loss weight of desirable examples (default 1).", rich_help_panel=_R),
    ] = None,
    undesirable_weight: Annotated[
        float | None,
        typer.Option(
            "--undesirable-weight", help="Loss weight of undesirable examples (default 1).", rich_help_panel=_R
        ),
    ] = None,
    targets: Targets = None,
    rank: Rank = None,
    alpha: Alpha = None,
    dropout: Dropout = None,
    rslora: RsLora = None,
    freeze: Freeze = None,
    max_length: MaxLen = None,
    overflow: Overflow = None,
    steps: Steps = None,
    batch_size: PrefBatchSize = None,
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
    quiet: Quiet = False,
    as_json: JsonSummary = False,
) -> None:
    """KTO: learn from completions labelled desirable or undesirable (unpaired), against the frozen base as reference."""
    values = _common(paths, model, max_length, overflow, steps, batch_size, context, grad_accum, seed, eval_every,
                     save_every, out, device, threads, lr, schedule, warmup)  # fmt: skip
    values.update(_adapted("kto", adapter, targets, rank, alpha, dropout, rslora, freeze))
    values.update({"pref.beta": beta, "pref.desirable_weight": desirable_weight,
                   "pref.undesirable_weight": undesirable_weight})  # fmt: skip
    values.update(_inspect(diagnostics, diagnostics_every, report_to, trace))
    _pref_run("kto", config, adapter, values, quiet, as_json)


@train_app.command("grpo")
def grpo_cmd(
    paths: Annotated[
        list[Path] | None,
        typer.Argument(help='JSONL prompts: {"prompt": text or chat messages, ...fields the rewards read}.'),
    ] = None,
    model: Base = None,
    config: Config = None,
    reward: Annotated[
        list[str] | None,
        typer.Option(
            "--reward",
            help="A reward function (repeatable): exact_answer[=REGEX], regex=PATTERN, json[=SCHEMA], length=N, "
            "or module:function.",
            rich_help_panel=_G,
        ),
    ] = None,
    reward_weight: Annotated[
        list[float] | None,
        typer.Option(
            "--reward-weight", help="One weight per --reward, in order (default: 1 each).", rich_help_panel=_G
        ),
    ] = None,
    group: Annotated[
        int | None, typer.Option("--group", help="Completions sampled per prompt (default 8).", rich_help_panel=_G)
    ] = None,
    max_new_tokens: Annotated[
        int | None,
        typer.Option("--max-new-tokens", help="A completion's token budget (default 64).", rich_help_panel=_G),
    ] = None,
    temperature: Annotated[
        float | None, typer.Option("--temperature", help="Sampling temperature (default 1).", rich_help_panel=_G)
    ] = None,
    top_p: Annotated[
        float | None, typer.Option("--top-p", help="Nucleus sampling (default 1: off).", rich_help_panel=_G)
    ] = None,
    top_k: Annotated[
        int | None, typer.Option("--top-k", help="Top-k sampling (default 0: off).", rich_help_panel=_G)
    ] = None,
    beta: Annotated[
        float | None,
        typer.Option("--beta", help="KL penalty to the reference (default 0: none).", rich_help_panel=_G),
    ] = None,
    epsilon: Annotated[
        float | None, typer.Option("--epsilon", help="Clip range (default 0.2).", rich_help_panel=_G)
    ] = None,
    epsilon_high: Annotated[
        float | None,
        typer.Option("--epsilon-high", help="Upper clip range (default: --epsilon).", rich_help_panel=_G),
    ] = None,
    iterations: Annotated[
        int | None,
        typer.Option("--iterations", help="Optimizer steps per rollout batch (default 1).", rich_help_panel=_G),
    ] = None,
    loss: Annotated[
        str | None,
        typer.Option(
            "--loss", help="dapo (default), grpo, bnpo or dr_grpo: the loss normalization.", rich_help_panel=_G
        ),
    ] = None,
    scale_rewards: Annotated[
        str | None,
        typer.Option(
            "--scale-rewards",
            help="Advantages divided by the std of: group (default), batch, none.",
            rich_help_panel=_G,
        ),
    ] = None,
    mask_truncated: Annotated[
        bool | None,
        typer.Option(
            "--mask-truncated/--no-mask-truncated",
            help="Completions cut at --max-new-tokens carry no loss.",
            rich_help_panel=_G,
        ),
    ] = None,
    adapter: Adapter = None,
    targets: Targets = None,
    rank: Rank = None,
    alpha: Alpha = None,
    dropout: Dropout = None,
    rslora: RsLora = None,
    freeze: Freeze = None,
    max_length: MaxLen = None,
    overflow: Overflow = None,
    steps: Steps = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            "--batch-size",
            "-b",
            help="Completions per micro-batch (a multiple of --group, with --grad-accum).",
            rich_help_panel=_P,
        ),
    ] = None,
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
    quiet: Quiet = False,
    as_json: JsonSummary = False,
) -> None:
    """GRPO: sample completions of each prompt from the policy, score them with reward functions, reinforce the better ones."""
    values = _common(paths, model, max_length, overflow, steps, batch_size, context, grad_accum, seed, eval_every,
                     save_every, out, device, threads, lr, schedule, warmup)  # fmt: skip
    values.update(_adapted("grpo", adapter, targets, rank, alpha, dropout, rslora, freeze))
    values.update({"grpo.rewards": reward or None, "grpo.reward_weights": reward_weight or None, "grpo.group": group,
                   "grpo.max_new_tokens": max_new_tokens, "grpo.temperature": temperature, "grpo.top_p": top_p,
                   "grpo.top_k": top_k, "grpo.beta": beta, "grpo.epsilon": epsilon,
                   "grpo.epsilon_high": epsilon_high, "grpo.iterations": iterations, "grpo.loss_type": loss,
                   "grpo.scale_rewards": scale_rewards, "grpo.mask_truncated": mask_truncated})  # fmt: skip
    values.update(_inspect(diagnostics, diagnostics_every, report_to, trace))
    _pref_run("grpo", config, adapter, values, quiet, as_json)


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
