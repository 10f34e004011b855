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
sends); ``toy train --resume RUN_DIR`` continues exactly. A second Ctrl-C
aborts at once (the last checkpoint stays intact).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from toy_cli.commands.models import _errors

train_app = typer.Typer(
    help="Train models: from scratch, LoRA/QLoRA, full fine-tune, warm-start; `--resume RUN_DIR` continues a stopped run.",
    no_args_is_help=False,
    invoke_without_command=True,
)

_P = "Run"
_M = "Model"
_O = "Optimizer"


@contextmanager
def _stop_signals():
    """Yield a dict whose "signal" is set by the first SIGINT/SIGTERM; a
    second SIGINT raises KeyboardInterrupt."""
    state: dict = {"signal": None}

    def handler(signum, _frame):
        if state["signal"] is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        state["signal"] = signum
        print("\nstopping after this step (saving a checkpoint)...", file=sys.stderr)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield state
    finally:
        for s, h in old.items():
            signal.signal(s, h)


_UNITS = {"tokens": "tok", "images": "img"}  # short names of the step units in progress lines


class _Bar:
    """Training progress on stderr."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.bar = None
        self.task = None
        self.phases: dict[str, int] = {}
        self.last_line = 0.0
        self.first: tuple[float, int] | None = None  # (time, step) of the first step seen

    def _ensure(self):
        if self.bar is None and self.tty and not self.quiet:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self.bar.start()
        return self.bar

    def phase(self, label: str, done: int, total: int) -> None:
        bar = self._ensure()
        if bar is None:
            return
        if label not in self.phases:
            self.phases[label] = bar.add_task(label, total=total or None, info="")
        bar.update(self.phases[label], completed=done, total=total or None)

    def note(self, text: str) -> None:
        if self.quiet:
            return
        bar = self._ensure()
        if bar is not None:
            bar.console.print(text)
        else:
            print(text, file=sys.stderr)

    def progress(self, ev: dict) -> None:
        if self.quiet:
            return
        # a step event counts its task's unit: tokens (tokens_per_s), images (images_per_s), ...
        unit = next((k[: -len("_per_s")] for k in ev if k.endswith("_per_s")), None)
        rate = f" {ev[f'{unit}_per_s']:,.0f} {_UNITS.get(unit, unit)}/s" if unit else ""
        info = f"loss {ev['loss']:.4f} lr {ev['lr']:.2e}{rate}"
        bar = self._ensure()
        if bar is not None:
            if self.task is None:
                self.task = bar.add_task("train", total=ev["total"], info=info)
            bar.update(self.task, completed=ev["step"], info=info)
            return
        now = time.monotonic()
        if self.first is None:
            self.first = (now, ev["step"])
        if now - self.last_line >= 5 or ev["step"] == ev["total"]:
            self.last_line = now
            t0, s0 = self.first
            eta = ""
            if ev["step"] > s0:  # from this process's own pace (a resumed run starts later)
                left = (ev["total"] - ev["step"]) * (now - t0) / (ev["step"] - s0)
                eta = f" eta {int(left // 60)}:{int(left % 60):02d}"
            print(f"step {ev['step']}/{ev['total']} {info}{eta}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _val_metrics(result) -> dict:
    """``val_accuracy`` / ``val_top5`` of a classifier run: its last "val"
    eval event, when it is at the final step (read from the end of
    events.jsonl); {} for a language-model run or when there is none."""
    if result.val_loss is None:
        return {}
    try:
        with open(Path(result.run_dir) / "events.jsonl", "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and ev.get("kind") == "eval" and ev.get("name") == "val":
            if ev.get("step") != result.final_step:
                return {}
            return {f"val_{k}": ev[k] for k in ("accuracy", "top5") if isinstance(ev.get(k), (int, float))}
    return {}


def _finish(result, as_json: bool, sig, quiet: bool = False) -> None:
    metrics = _val_metrics(result)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "run_id": result.run_id,
                    "run_dir": str(result.run_dir),
                    "reason": result.reason,
                    "final_step": result.final_step,
                    "final_loss": result.final_loss,
                    "val_loss": result.val_loss,
                    **metrics,
                    "checkpoint": str(result.checkpoint) if result.checkpoint else None,
                }
            )
        )
    else:
        typer.echo(str(result.run_dir))
        if not quiet:
            loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "-"
            acc = metrics.get("val_accuracy")
            print(
                f"{result.reason} at step {result.final_step}: loss {loss}"
                + (f", validation loss {result.val_loss:.4f}" if result.val_loss is not None else "")
                + (f", validation accuracy {100 * acc:.2f}%" if acc is not None else "")
                + (f"; checkpoint {result.checkpoint}" if result.checkpoint else ""),
                file=sys.stderr,
            )
    if result.reason == "interrupted" and sig == signal.SIGINT:
        raise typer.Exit(130)


def _run(fn, quiet: bool, as_json: bool):
    from toy.train.loop import Hooks

    bar = _Bar(quiet)
    with _errors(), _stop_signals() as st:
        hooks = Hooks(
            progress=bar.progress, note=bar.note, should_stop=lambda: st["signal"] is not None, phase=bar.phase
        )
        try:
            result = fn(hooks)
        finally:
            bar.close()
    _finish(result, as_json, st["signal"], quiet)


@train_app.callback()
def train_main(
    ctx: typer.Context,
    resume: Annotated[
        Path | None, typer.Option("--resume", help="Continue the run in this folder from its latest checkpoint.")
    ] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="With --resume: raise the total steps.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary.")] = False,
) -> None:
    """Train a model. `toy train from-scratch --help` lists the options of a new run."""
    if ctx.invoked_subcommand is not None:
        if resume is not None:
            from toy_cli.main import CLIError

            raise CLIError("--resume goes without a subcommand: toy train --resume RUN_DIR", code=2)
        return
    if resume is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(0)
    from toy.train.loop import resume as resume_run

    _run(lambda hooks: resume_run(resume, hooks, steps=steps), quiet, as_json)


@train_app.command("from-scratch")
def from_scratch(
    paths: Annotated[list[Path] | None, typer.Argument(help='Text files, folders or JSONL ({"text": ...}).')] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="A TOML config file.")] = None,
    arch: Annotated[
        str | None, typer.Option("--arch", help="Architecture family: llama (default) or gpt2.", rich_help_panel=_M)
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            "--preset", help="tiny, small or smollm2-135m (llama); tiny, small or gpt2-124m (gpt2).", rich_help_panel=_M
        ),
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
    seed: Annotated[int | None, typer.Option("--seed", rich_help_panel=_P)] = None,
    eval_every: Annotated[int | None, typer.Option("--eval-every", rich_help_panel=_P)] = None,
    save_every: Annotated[int | None, typer.Option("--save-every", rich_help_panel=_P)] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Runs folder (default: $TOY_RUNS_DIR, else ./runs).", rich_help_panel=_P),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option("--device", help="cpu, cuda0, ... (default: TOY_DEVICE, else cpu).", rich_help_panel=_P),
    ] = None,
    threads: Annotated[int | None, typer.Option("--threads", "-t", rich_help_panel=_P)] = None,
    lr: Annotated[float | None, typer.Option("--lr", rich_help_panel=_O)] = None,
    schedule: Annotated[
        str | None, typer.Option("--schedule", help="constant, linear, cosine or wsd.", rich_help_panel=_O)
    ] = None,
    warmup: Annotated[int | None, typer.Option("--warmup", rich_help_panel=_O)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary.")] = False,
) -> None:
    """Train a model (llama or gpt2) from random weights on your text."""
    with _errors():
        from toy.train import config as C

        cfg = C.load_toml(config) if config else C.TrainConfig()
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
            },
        )
    from toy.train.loop import train

    _run(lambda hooks: train(cfg, hooks), quiet, as_json)


# -- fine-tuning recipes ---------------------------------------------------------

_F = "Fine-tuning"
Paths = Annotated[
    list[Path] | None, typer.Argument(help='JSONL examples: {"text"}, {"prompt","completion"} or {"messages"}.')
]
Base = Annotated[str | None, typer.Option("--model", "-m", help="The base GGUF (a path or a `toy list` name).")]
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
Batch = Annotated[int | None, typer.Option("--batch-size", "-b", rich_help_panel=_P)]
Ctx = Annotated[int | None, typer.Option("--context", help="Tokens per row.", rich_help_panel=_P)]
Accum = Annotated[int | None, typer.Option("--grad-accum", rich_help_panel=_P)]
Seed = Annotated[int | None, typer.Option("--seed", rich_help_panel=_P)]
EvalEvery = Annotated[int | None, typer.Option("--eval-every", rich_help_panel=_P)]
SaveEvery = Annotated[int | None, typer.Option("--save-every", rich_help_panel=_P)]
Out = Annotated[
    Path | None, typer.Option("--out", help="Runs folder (default: $TOY_RUNS_DIR, else ./runs).", rich_help_panel=_P)
]
Device = Annotated[
    str | None, typer.Option("--device", help="cpu, cuda0, ... (default: TOY_DEVICE, else cpu).", rich_help_panel=_P)
]
Threads = Annotated[int | None, typer.Option("--threads", "-t", rich_help_panel=_P)]
Lr = Annotated[float | None, typer.Option("--lr", rich_help_panel=_O)]
Schedule = Annotated[
    str | None, typer.Option("--schedule", help="constant, linear, cosine or wsd.", rich_help_panel=_O)
]
Warmup = Annotated[int | None, typer.Option("--warmup", rich_help_panel=_O)]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print a JSON summary.")]


def _list(text: str | None, what: str) -> list[str] | None:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        from toy_cli.main import CLIError

        raise CLIError(f"{what}: give a comma-separated list", code=2)
    return items


def _finetune(recipe: str, config: Path | None, values: dict, quiet: bool, as_json: bool) -> None:
    with _errors():
        from toy.train import config as C

        cfg = C.load_toml(config, recipe=recipe) if config else C.defaults(recipe)
        cfg = C.override(cfg, **values)
    from toy.train.loop import train

    _run(lambda hooks: train(cfg, hooks), quiet, as_json)


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
            help="Modules to adapt: llama q,k,v,o,gate,up,down (default q,k,v,o); gpt2 qkv,o,up,down (default qkv,o).",
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
    batch_size: Batch = None,
    context: Ctx = None,
    grad_accum: Accum = None,
    seed: Seed = None,
    eval_every: EvalEvery = None,
    save_every: SaveEvery = None,
    out: Out = None,
    device: Device = None,
    threads: Threads = None,
    lr: Lr = None,
    schedule: Schedule = None,
    warmup: Warmup = None,
    quiet: Quiet = False,
    as_json: AsJson = False,
) -> None:
    """LoRA (QLoRA on a quantized base): train low-rank adapters on a frozen GGUF model; checkpoints are adapters llama.cpp loads."""
    values = _common(paths, model, max_length, overflow, steps, batch_size, context, grad_accum, seed, eval_every,
                     save_every, out, device, threads, lr, schedule, warmup)  # fmt: skip
    values.update({"lora.targets": _list(targets, "--targets"), "lora.rank": rank, "lora.alpha": alpha,
                   "lora.dropout": dropout, "lora.rslora": rslora})  # fmt: skip
    _finetune("lora", config, values, quiet, as_json)


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
    batch_size: Batch = None,
    context: Ctx = None,
    grad_accum: Accum = None,
    seed: Seed = None,
    eval_every: EvalEvery = None,
    save_every: SaveEvery = None,
    out: Out = None,
    device: Device = None,
    threads: Threads = None,
    lr: Lr = None,
    schedule: Schedule = None,
    warmup: Warmup = None,
    quiet: Quiet = False,
    as_json: AsJson = False,
) -> None:
    """Full fine-tune: every weight of a GGUF model trainable (a quantized base is dequantized to F32)."""
    values = _common(paths, model, max_length, overflow, steps, batch_size, context, grad_accum, seed, eval_every,
                     save_every, out, device, threads, lr, schedule, warmup)  # fmt: skip
    values["freeze"] = _list(freeze, "--freeze")
    _finetune("full", config, values, quiet, as_json)


@train_app.command("warm-start")
def warm_start_cmd(
    paths: Annotated[list[Path] | None, typer.Argument(help='Text files, folders or JSONL ({"text": ...}).')] = None,
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="The donor GGUF (a path or a `toy list` name).")
    ] = None,
    config: Config = None,
    arch: Annotated[
        str | None, typer.Option("--arch", help="Architecture family: llama (default) or gpt2.", rich_help_panel=_M)
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            "--preset", help="tiny, small or smollm2-135m (llama); tiny, small or gpt2-124m (gpt2).", rich_help_panel=_M
        ),
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
    batch_size: Batch = None,
    context: Ctx = None,
    grad_accum: Accum = None,
    seed: Seed = None,
    eval_every: EvalEvery = None,
    save_every: SaveEvery = None,
    out: Out = None,
    device: Device = None,
    threads: Threads = None,
    lr: Lr = None,
    schedule: Schedule = None,
    warmup: Warmup = None,
    quiet: Quiet = False,
    as_json: AsJson = False,
) -> None:
    """Warm-start a new (possibly smaller) model from a donor's embeddings and matching blocks, then train it on text."""
    values = _common(paths, model, None, None, steps, batch_size, context, grad_accum, seed, eval_every,
                     save_every, out, device, threads, lr, schedule, warmup)  # fmt: skip
    layers = _list(copy_layers, "--copy-layers")
    try:
        layer_ids = [int(x) for x in layers] if layers else None
    except ValueError:
        from toy_cli.main import CLIError

        raise CLIError(f"--copy-layers {copy_layers!r}: block numbers, comma-separated", code=2) from None
    values.update({"model.arch": arch, "model.preset": preset, "model.d_model": d_model, "model.n_layer": n_layer, "model.n_head": n_head,
                   "model.n_head_kv": n_head_kv, "model.d_ff": d_ff, "warm_start.layers": layer_ids,
                   "warm_start.project": project})  # fmt: skip
    _finetune("warm-start", config, values, quiet, as_json)


@train_app.command("demo-corpus")
def demo_corpus(
    folder: Annotated[Path, typer.Argument(help="Folder to write the text files into.")] = Path("corpus"),
) -> None:
    """Write a small English corpus (Python's documentation topics, ~465 KB) to train on."""
    from toy.train.corpus import write_python_docs

    paths = write_python_docs(folder)
    size = sum(p.stat().st_size for p in paths)
    typer.echo(str(folder))
    print(f"wrote {len(paths)} files ({size / 1e3:.0f} KB) to {folder}", file=sys.stderr)


def register(app: typer.Typer) -> None:
    app.add_typer(train_app, name="train")


# what the training commands of other distributions reuse (`toy vit train`):
# run_training(fn, quiet, as_json) runs fn(hooks) with this progress bar, the
# stop signals and the error mapping, then prints the summary as `toy train` does
run_training = _run
stop_signals = _stop_signals
