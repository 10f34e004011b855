"""`toy data`: check fine-tuning data against a model, write the demo chat set.

``toy data check FILE --model M`` reads every line of a JSONL file of
instruction-tuning examples (``text``, ``prompt``/``completion`` or
``messages``; see docs/reference/data-formats.md) with the model's tokenizer
and chat template only (no weights are loaded), and prints, on stdout: the
first ``--show`` examples as the model will see them with the tokens that
carry loss marked (at most ``toy.train.instruct.SHOW_TOKENS`` tokens of each,
then a count of the rest), then length statistics, counts per format, the number of
examples longer than ``--max-length``, and every problem as ``line N:
reason``. It exits 0 when there is no problem, 2 otherwise (with an
``error:`` line on stderr giving the count). A file without any example
(empty, or only blank lines) is a problem, as training refuses it.
``--special-in-content`` checks with control-token text in messages parsed
(``data.special_in_content``); by default it stays text, as in training.

Decision on the marks: on a colour terminal the loss spans are bold green
(rich); when stdout is not a terminal, when ``NO_COLOR`` is set, or with
``--plain``, they are wrapped in ``[[`` and ``]]`` instead, so the marks
survive pipes, logs and tests. ``--max-length`` defaults to the model's
context length capped at 2048.

Preference data (``toy.train.prefdata``): a file whose first valid line has
``chosen`` and ``rejected`` (pairs: DPO, ORPO), ``label`` (unpaired: KTO) or
``prompt`` alone (prompts: GRPO), or any file with ``--format
pairs|unpaired|prompts``, is checked as that format instead: each sample
shows every sequence of its example (chosen and rejected; the completion
with its label; the prompt) with the completion tokens marked, the summary
counts sequences, loss tokens, labels and the prompts' other fields, and a
prompt that leaves no completion token within ``--max-length`` is a
problem. Every other file is checked as instruction-tuning data, as before.

``toy data demo-chat [OUT]`` writes the bundled chat set
(``toy.train.demodata.write_demo_chat``) and prints its path.

Conventions (docs/concepts/architecture.md): data on stdout, notes on stderr; bad input
exits 2 with ``error:``/``hint:`` lines. ``toy`` is imported inside the
commands so ``toy --help`` stays fast.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from toy_cli.ui import CLIError, JsonReport, cli_errors

data_app = typer.Typer(
    help="Fine-tuning data: check a JSONL file against a model, write the demo chat set.", no_args_is_help=True
)

MAX_LENGTH_CAP = 2048
OPEN, CLOSE = "[[", "]]"
LOSS_STYLE = "bold green"


def _load(model: str) -> tuple[object, object, int | None]:
    """The model's tokenizer, chat template and context length (metadata only)."""
    from toy.gguf import GGUFFile
    from toy.store import resolve_model
    from toy.tokenizer import Tokenizer
    from toy.tokenizer.chat import ChatTemplate

    with GGUFFile(resolve_model(model)) as f:
        md = f.metadata
        ctx = md.get(f"{md.get('general.architecture')}.context_length")
        return Tokenizer.from_gguf(md), ChatTemplate.from_gguf(md), int(ctx) if isinstance(ctx, int) else None


def _num(v: float) -> str:
    return f"{v:,}" if isinstance(v, int) else f"{v:,g}"


def _summary(report) -> list[str]:
    kinds = ", ".join(f"{k} {_num(n)}" for k, n in report.kinds.items())
    share = f"{100 * report.n_loss / report.n_tokens:.1f}%" if report.n_tokens else "-"
    ln = report.lengths
    return [
        f"file         {report.path}",
        f"examples     {_num(report.n_examples)}" + (f" ({kinds})" if kinds else ""),
        f"tokens       {_num(report.n_tokens)} total, {_num(report.n_loss)} carry loss ({share})",
        f"length       min {_num(ln['min'])}, median {_num(ln['median'])}, p95 {_num(ln['p95'])}, "
        f"max {_num(ln['max'])} tokens",
        f"over-length  {_num(report.over_length)} longer than --max-length {report.max_length} "
        "(truncated or dropped in training)",
        f"problems     {_num(len(report.problems))}",
    ]


def _print_body(s: dict, styled: bool) -> None:
    """One sequence's segments, then a count of the tokens not shown."""
    if styled:
        from rich.console import Console
        from rich.text import Text

        text = Text()
        for seg, loss in s["segments"]:
            text.append(seg, style=LOSS_STYLE if loss else None)
        Console(highlight=False, soft_wrap=True).print(text, end="" if text.plain.endswith("\n") else "\n")
    else:
        body = "".join(f"{OPEN}{seg}{CLOSE}" if loss else seg for seg, loss in s["segments"])
        typer.echo(body, nl=not body.endswith("\n"))
    hidden = s["n_tokens"] - s.get("shown_tokens", s["n_tokens"])
    if hidden > 0:
        typer.echo(f"… {hidden:,} more tokens not shown")


def _head(text: str, styled: bool) -> None:
    if styled:
        from rich.console import Console
        from rich.text import Text

        Console(highlight=False, soft_wrap=True).print(Text(text, style="bold"))
    else:
        typer.echo(text)


def _print_samples(samples: list[dict], styled: bool) -> None:
    for i, s in enumerate(samples, 1):
        _head(
            f"── example {i}: line {s['line']}, {s['kind']}, {s['n_tokens']} tokens, {s['n_loss']} carry loss", styled
        )
        _print_body(s, styled)
        typer.echo("")


def _print_pref_samples(report, styled: bool) -> None:
    for i, s in enumerate(report.samples, 1):
        _head(f"── example {i}: line {s['line']}, {report.format} ({s['style']})", styled)
        for side in s["sides"]:
            label = "" if "label" not in s else f" ({'desirable' if s['label'] else 'undesirable'})"
            typer.echo(f"{side['name']}{label}: {side['n_tokens']} tokens, {side['n_loss']} carry loss")
            _print_body(side, styled)
        typer.echo("")


def _pref_summary(report) -> list[str]:
    styles = ", ".join(f"{k} {_num(n)}" for k, n in report.styles.items())
    share = f"{100 * report.n_loss / report.n_tokens:.1f}%" if report.n_tokens else "-"
    ln = report.lengths
    per = {"pairs": "2 sequences (chosen, rejected) each", "unpaired": "1 sequence each", "prompts": "prompts only"}
    lines = [
        f"file         {report.path}",
        f"format       {report.format or '-'}" + (f" ({per[report.format]})" if report.format in per else ""),
        f"examples     {_num(report.n_examples)}" + (f" ({styles})" if styles else ""),
    ]
    if report.format == "unpaired":
        lines.append(f"labels       {_num(report.n_desirable)} desirable, {_num(report.n_undesirable)} undesirable")
    if report.format == "prompts":
        lines.append(f"fields       {', '.join(report.fields) or '-'} (passed to the reward functions)")
    prompts = report.format == "prompts"
    lines += [
        f"tokens       {_num(report.n_tokens)} in prompts, none carry loss (the rollouts' completions will)"
        if prompts
        else f"tokens       {_num(report.n_tokens)} total, {_num(report.n_loss)} carry loss ({share})",
        f"length       min {_num(ln['min'])}, median {_num(ln['median'])}, p95 {_num(ln['p95'])}, "
        f"max {_num(ln['max'])} tokens per {'prompt' if prompts else 'sequence'}",
    ]
    if not prompts:
        lines.append(
            f"over-length  {_num(report.over_length)} longer than --max-length {report.max_length} "
            "(completion truncated in training)"
        )
    return [*lines, f"problems     {_num(len(report.problems))}"]


@data_app.command("check")
def check_cmd(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="The JSONL file to check.")],
    model: Annotated[
        str, typer.Option("--model", "-m", help="A GGUF path or a model name: its tokenizer and chat template.")
    ],
    max_length: Annotated[
        int | None,
        typer.Option("--max-length", help="Count examples longer than this (default: the model's context, ≤ 2048)."),
    ] = None,
    show: Annotated[int, typer.Option("--show", help="Print this many examples with their loss marked.")] = 3,
    plain: Annotated[bool, typer.Option("--plain", help=f"Mark loss spans with {OPEN} {CLOSE}, no colour.")] = False,
    as_json: JsonReport = False,
    special_in_content: Annotated[
        bool,
        typer.Option(
            "--special-in-content",
            help="Parse control-token text inside messages as control tokens (data.special_in_content).",
        ),
    ] = False,
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            help="Check as preference data: pairs (DPO, ORPO), unpaired (KTO) or prompts (GRPO). "
            "Default: detected from the first line.",
        ),
    ] = None,
) -> None:
    """Check fine-tuning data: the loss-carrying tokens of the first examples, lengths, formats, problems."""
    if fmt is not None and fmt not in ("pairs", "unpaired", "prompts"):
        raise CLIError(f"--format must be pairs, unpaired or prompts (got {fmt!r})", None, 2)
    if show < 0:
        raise CLIError(f"--show must be 0 or more (got {show})", None, 2)
    if max_length is not None and max_length < 2:
        raise CLIError(f"--max-length must be at least 2 (got {max_length})", None, 2)
    with cli_errors():
        from toy.inputs import regular_file
        from toy.train.instruct import check_file
        from toy.train.prefdata import check_pref_file, detect_file

        regular_file(file)  # before the model is read: a FIFO or /dev/zero is refused at once
        fmt = fmt or detect_file(file)
        tokenizer, template, ctx = _load(model)
        if max_length is None:
            max_length = min(ctx, MAX_LENGTH_CAP) if ctx else MAX_LENGTH_CAP
        report: Any
        kw: dict[str, Any] = {"max_length": max_length, "show": show, "special_in_content": special_in_content}
        if fmt:
            report = check_pref_file(file, tokenizer, template, format=fmt, **kw)
        else:
            report = check_file(file, tokenizer, template, **kw)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2, ensure_ascii=False))
    else:
        styled = not plain and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        if fmt:
            _print_pref_samples(report, styled)
            lines = _pref_summary(report)
        else:
            _print_samples(report.samples, styled)
            lines = _summary(report)
        lines += [f"line {n}: {reason}" if n else reason for n, reason in report.problems]
        typer.echo("\n".join(lines))
    if report.problems:
        n = len(report.problems)
        raise CLIError(
            f"{n} problem{'s' if n != 1 else ''} in {file}",
            "fix the lines listed (line N: reason); blank lines are skipped",
            2,
        )


@data_app.command("demo-chat")
def demo_chat_cmd(
    out: Annotated[Path, typer.Argument(metavar="OUT.jsonl", help="The file to write.")] = Path("demo_chat.jsonl"),
    n: Annotated[int, typer.Option("--n", help="Number of conversations.")] = 600,
    seed: Annotated[int, typer.Option("--seed", help="Same seed, same file.")] = 0,
) -> None:
    """Write the bundled chat set (messages JSONL: sums, conversions, word games, a fixed signature)."""
    if n < 1:
        raise CLIError(f"--n must be at least 1 (got {n})", None, 2)
    if out.is_dir():
        raise CLIError(f"{out}: is a folder", "OUT is the file to write, e.g. demo_chat.jsonl", 2)
    with cli_errors():
        from toy.train.demodata import write_demo_chat

        try:
            path = write_demo_chat(out, n=n, seed=seed)
        except OSError as e:
            raise CLIError(f"{out}: cannot write: {e.strerror or e}", None, 1) from e
    typer.echo(f"wrote {n} conversations (seed {seed})", err=True)
    typer.echo(str(path))


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
