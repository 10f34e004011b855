"""`toy eval`: logprobs, perplexity, compare (KL of two models), lmc, lens
(the logit lens) and cka (linear CKA between two models' layers).

Every command computes with ``toy.eval`` (the numbers are the library's),
prints its result on stdout (a table and a summary line, or ``--json``),
shows progress on stderr (a bar on a terminal, a line every few windows
otherwise) and records an ``eval`` run bundle under ``--runs-dir``
(default ``$TOY_RUNS_DIR`` or ``./runs``), whose id goes to stderr and into
the JSON. Before scoring, ``perplexity``, ``compare`` and ``lmc`` print a
line on stderr saying what they read and how many windows they score. Ctrl-C
stops at the next window: the run ends "interrupted", a line says after how
many windows and that no figure was recorded (the bundle's ``run_end`` says
"interrupted"), and the command exits 130. The runs folder is checked first (it must be a
folder toy can write into: ``toy.runs.folder.check_output_dir``), so a
``--runs-dir`` that is a file or read-only fails at once with exit 2, before
a model is loaded.

``logprobs`` and ``perplexity`` take ``--rpc HOST:PORT[,...]`` (and
``--tensor-split``): the model's layers are split between this machine and
those ``toy rpc-server``s (``toy.engine.split``), with the one-host figures
when every device runs toy's CPU kernels.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from toy_cli.ui import Batch, CLIError, Device, JsonReport, Progress, Rpc, RunsDir, TensorSplit, Threads, cli_errors

eval_app = typer.Typer(
    help="Evaluate models: logprobs, perplexity, compare two models, linear mode connectivity, the logit lens, CKA."
)

Context = Annotated[int, typer.Option("--context", "-c", help="Tokens per window (llama-perplexity's -c).")]
Stride = Annotated[
    int,
    typer.Option(
        "--stride", help="0: non-overlapping windows, second half scored; N: a window every N tokens, last N scored."
    ),
]
MaxChunks = Annotated[int | None, typer.Option("--max-chunks", help="Score at most this many windows.")]


def _check(context: int, batch: int) -> None:
    if batch < 1:
        raise CLIError(f"--batch {batch} must be >= 1", None, 2)
    if context < 4:
        raise CLIError(f"--context {context} must be at least 4", None, 2)


class _WindowProgress:
    """Windows done with the running PPL: a bar on a terminal, else a line
    every 10 % of the windows."""

    def __init__(self, label: str):
        self.label, self.bar, self.next_pct = label, Progress(), 0.0
        self.tty = sys.stderr.isatty()
        self.done, self.total = 0, 0
        self.run: Path | None = None  # the eval bundle, once it exists
        self.pending: str | None = None  # a start line printed with the first progress

    def __call__(self, done: int, total: int, ppl: float) -> None:
        self.done, self.total = done, total
        if self.pending is not None:
            self.start(self.pending)
            self.pending = None
        if self.tty:
            self.bar.update(f"{self.label} (PPL {ppl:.4f})", done, total)
            return
        if done / total >= self.next_pct or done == total:
            typer.echo(f"{self.label}: window {done}/{total}, running PPL {ppl:.4f}", err=True)
            self.next_pct = done / total + 0.1

    def close(self) -> None:
        self.bar.close()

    def start(self, what: str, defer: bool = False) -> None:
        """The line before scoring: what is read, how many windows (``defer``:
        with the first progress, when the checks that may fail come later)."""
        if defer:
            self.pending = what
        else:
            typer.echo(f"{self.label}: {what}", err=True)

    def interrupted(self) -> typer.Exit:
        """The line after Ctrl-C (the bundle, if any, ends "interrupted"); exit 130."""
        self.close()
        done = f" after {self.done} of {self.total} windows" if self.total else " before the first window"
        where = f"; {self.run} records the interruption" if self.run else ""
        typer.echo(f"{self.label}: interrupted{done}: no result was recorded{where}", err=True)
        return typer.Exit(130)


@contextmanager
def _on_interrupt(bar: _WindowProgress) -> Iterator[None]:
    """Ctrl-C inside the block: the progress's interruption line and exit 130."""
    try:
        yield
    except KeyboardInterrupt:
        raise bar.interrupted() from None


def _windows_line(n_tokens: int, whole: bool, file: Path, context: int, stride: int, max_chunks: int | None) -> str:
    """The start line; a text too short for one window is the scoring's own error, raised here."""
    from toy.eval.windows import check_layout

    n = check_layout(n_tokens, context, stride, max_chunks)
    read = f"{n_tokens} tokens {'of' if whole else 'from the start of'} {file}"
    return f"scoring {n} windows of {context} tokens ({read})"


def _check_runs_dir(runs_dir: Path | None) -> None:
    """The runs folder takes new files (else an error naming it, exit 2)."""
    from toy.runs import runs_dir as resolve
    from toy.runs.folder import check_output_dir

    check_output_dir(resolve(runs_dir), "--runs-dir" if runs_dir is not None else "runs folder")


def _load(model: str, n_ctx: int | None, batch: int, device, threads, rpc=None, tensor_split=None):
    import toy

    m = toy.load(
        model, n_ctx=n_ctx, n_batch=batch, device=device, threads=threads, rpc=rpc or (), tensor_split=tensor_split
    )
    if m.placement.split:
        typer.echo(f"{m.path.name}: {m.describe()}", err=True)
    return m


def _finish(writer, as_json: bool, payload: dict) -> None:
    typer.echo(f"run: {writer.dir}", err=True)
    if as_json:
        typer.echo(json.dumps({"run_id": writer.run_id, **payload}, indent=2))


# -- logprobs -------------------------------------------------------------------


def logprobs_cmd(
    model: Annotated[str, typer.Argument(help="A GGUF path or a model name (`toy list`).")],
    text: Annotated[str | None, typer.Argument(help="The text to score ('-' reads stdin).")] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Score this file's text instead.")] = None,
    top: Annotated[int, typer.Option("--top", "-k", help="Alternatives shown per position.")] = 5,
    device: Device = None,
    threads: Threads = None,
    rpc: Rpc = None,
    tensor_split: TensorSplit = None,
    as_json: JsonReport = False,
    runs_dir: RunsDir = None,
) -> None:
    """Per-token logprobs of a text, with each token's rank and the top-k alternatives."""
    import toy.eval as E

    if (text is None) == (file is None):
        raise CLIError("give the text to score or --file, not both", "toy eval logprobs MODEL 'some text'", 2)
    with cli_errors():
        _check_runs_dir(runs_dir)
        if file is not None:
            body = E.read_eval_text(file)
        else:
            assert text is not None  # one of the two (checked above)
            body = sys.stdin.read() if text == "-" else text
        with _load(model, None, 512, device, threads, rpc, tensor_split) as m:
            cfg = {"model": str(m.path), "file": str(file) if file else None, "top": top}
            with E.eval_run("logprobs", cfg, runs_dir, model=E.record.model_info(m)) as w:
                res = E.logprobs(m, body, top_k=top)
                w.event("eval", name="logprobs", loss=res.nll, ppl=res.ppl, tokens=res.n_scored)
    if as_json:
        return _finish(w, True, res.to_dict())
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    columns: list[tuple[str, dict[str, Any]]] = [
        ("POS", {"justify": "right"}), ("TOKEN", {}), ("LOGPROB", {"justify": "right"}),
        ("RANK", {"justify": "right"}), (f"TOP {top}", {"overflow": "fold"}),
    ]  # fmt: skip
    for col, kw in columns:
        table.add_column(col, **kw)
    for t in res.tokens:
        lp = "-" if t.logprob is None else f"{t.logprob:.4f}"
        alts = "  ".join(f"{s!r} {v:.2f}" for _, s, v in t.top)
        table.add_row(str(t.position), repr(t.text), lp, "-" if t.rank is None else str(t.rank), alts)
    Console(soft_wrap=False).print(table)
    typer.echo(f"mean NLL {res.nll:.4f} nats/token, PPL {res.ppl:.4f} over {res.n_scored} tokens")
    _finish(w, False, {})


# -- perplexity ------------------------------------------------------------------


def perplexity_cmd(
    model: Annotated[str, typer.Argument(help="A GGUF path or a model name (`toy list`).")],
    file: Annotated[Path, typer.Argument(help='A text file, a JSONL file of {"text"} lines, or a folder.')],
    context: Context = 512,
    batch: Batch = 512,
    stride: Stride = 0,
    max_chunks: MaxChunks = None,
    device: Device = None,
    threads: Threads = None,
    rpc: Rpc = None,
    tensor_split: TensorSplit = None,
    as_json: JsonReport = False,
    runs_dir: RunsDir = None,
) -> None:
    """Perplexity of a text the way llama.cpp's llama-perplexity computes it."""
    _check(context, batch)
    bar = _WindowProgress("perplexity")
    t0 = time.monotonic()
    with _on_interrupt(bar), cli_errors():
        w, res, ids, whole = _perplexity(model, file, context, batch, stride, max_chunks, device, threads,
                                         runs_dir, bar, rpc, tensor_split)  # fmt: skip
    secs = time.monotonic() - t0
    if as_json:
        return _finish(w, True, {**res.to_dict(), "seconds": round(secs, 3)})
    typer.echo(
        f"PPL = {res.ppl:.4f} +/- {res.ppl_stderr:.5f}  (mean NLL {res.nll:.4f} nats/token, {res.n_scored} tokens "
        f"scored in {res.n_windows} windows of {context}, {len(ids)} tokens "
        f"{'in the text' if whole else 'read from the start of the text'})"
    )
    _finish(w, False, {})


def _perplexity(model, file, context, batch, stride, max_chunks, device, threads, runs_dir, bar, rpc=None,
                tensor_split=None):  # fmt: skip
    """perplexity_cmd's work: (the run writer, the result, the ids, whether they are the whole text)."""
    import toy.eval as E

    _check_runs_dir(runs_dir)
    E.check_eval_path(file)
    with _load(model, context, batch, device, threads, rpc, tensor_split) as m:
        ids, whole = E.read_eval_ids(m.tokenizer, file, E.tokens_needed(context, stride, max_chunks))
        cfg = {"model": str(m.path), "file": str(file), "context": context, "stride": stride,
               "max_chunks": max_chunks, "batch": batch}  # fmt: skip
        bar.start(_windows_line(len(ids), whole, file, context, stride, max_chunks))
        with E.eval_run("perplexity", cfg, runs_dir, model=E.record.model_info(m)) as w:
            bar.run = w.dir
            try:
                res = E.perplexity(m, ids, context=context, stride=stride, max_chunks=max_chunks, progress=bar)
            finally:
                bar.close()
            w.event("eval", name="perplexity", loss=res.nll, ppl=res.ppl, tokens=res.n_scored,
                    **{k: v for k, v in res.to_dict().items() if k not in ("nll", "ppl")})  # fmt: skip
    return w, res, ids, whole


# -- compare ---------------------------------------------------------------------


def compare_cmd(
    model_a: Annotated[str, typer.Argument(help="The reference model (e.g. F32).")],
    model_b: Annotated[str, typer.Argument(help="The model judged against it (e.g. its quantization).")],
    file: Annotated[Path, typer.Argument(help='A text file, a JSONL file of {"text"} lines, or a folder.')],
    context: Context = 512,
    batch: Batch = 512,
    stride: Stride = 0,
    max_chunks: MaxChunks = None,
    device: Device = None,
    threads: Threads = None,
    as_json: JsonReport = False,
    runs_dir: RunsDir = None,
) -> None:
    """KL divergence of B's next-token distribution from A's, top-1 agreement and both perplexities."""
    import toy.eval as E

    _check(context, batch)
    bar = _WindowProgress("compare")
    with _on_interrupt(bar), cli_errors():
        _check_runs_dir(runs_dir)
        E.check_eval_path(file)
        with _load(model_a, context, batch, device, threads) as a, _load(model_b, context, batch, device, threads) as b:
            ids, whole = E.read_eval_ids(a.tokenizer, file, E.tokens_needed(context, stride, max_chunks))
            cfg = {"model": str(a.path), "model_b": str(b.path), "file": str(file), "context": context,
                   "stride": stride, "max_chunks": max_chunks}  # fmt: skip
            bar.start(_windows_line(len(ids), whole, file, context, stride, max_chunks) + ", through both models")
            with E.eval_run(
                "compare", cfg, runs_dir, model=E.record.model_info(a), model_b=E.record.model_info(b)
            ) as w:
                bar.run = w.dir
                try:
                    res = E.compare(a, b, ids, context=context, stride=stride, max_chunks=max_chunks, progress=bar)
                finally:
                    bar.close()
                d = res.to_dict()
                w.event("eval", name="compare", loss=res.nll_b, ppl=res.ppl_b, tokens=res.n_scored,
                        **{k: v for k, v in d.items() if k not in ("n_scored",)})  # fmt: skip
    if as_json:
        return _finish(w, True, d)
    p = res.kl_percentiles
    rows = [
        ("tokens scored", f"{res.n_scored} ({res.n_windows} windows of {context})"),
        ("KL(A||B) mean", f"{res.kl_mean:.6f} +/- {res.kl_stderr:.6f} nats"),
        ("KL median / p90 / p95 / p99 / max", f"{p['p50']:.6f} / {p['p90']:.6f} / {p['p95']:.6f} / {p['p99']:.6f} / {p['max']:.6f}"),
        ("top-1 agreement", f"{100 * res.top1_agreement:.2f} %"),
        ("PPL A", f"{res.ppl_a:.4f}"),
        ("PPL B", f"{res.ppl_b:.4f}  (B/A {res.ppl_ratio:.4f})"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        typer.echo(f"{k:<{width}}  {v}")
    _finish(w, False, {})


# -- lmc -------------------------------------------------------------------------


def _lmc_ids(ckpt: Path, file: Path, limit: int | None) -> list[int] | str:
    """The eval ids by the first checkpoint's tokenizer (``lmc`` checks that both have it), read no further
    than ``limit`` needs; the whole text when the checkpoint has no tokenizer (``lmc`` then says so)."""
    import toy.eval as E
    from toy import ToyError
    from toy.tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_file(ckpt)
    except ToyError:  # lmc reports a checkpoint without a usable tokenizer in its own words
        return E.read_eval_text(file)
    return E.read_eval_ids(tok, file, limit)[0].tolist()


def lmc_cmd(
    ckpt_a: Annotated[Path, typer.Argument(help="The first checkpoint (GGUF).")],
    ckpt_b: Annotated[Path, typer.Argument(help="The second checkpoint, same architecture and shapes.")],
    file: Annotated[Path, typer.Argument(help='A text file, a JSONL file of {"text"} lines, or a folder.')],
    alphas: Annotated[
        str, typer.Option("--alphas", help="Comma-separated interpolation points.")
    ] = "0,0.25,0.5,0.75,1",
    context: Context = 512,
    stride: Stride = 0,
    max_chunks: MaxChunks = None,
    device: Device = None,
    threads: Threads = None,
    as_json: JsonReport = False,
    runs_dir: RunsDir = None,
) -> None:
    """Linear mode connectivity: the loss of (1-a)*A + a*B for each a."""
    import toy.eval as E

    _check(context, 1)
    bar = _WindowProgress("lmc")
    with _on_interrupt(bar), cli_errors():
        points = E.parse_alphas(alphas)
        _check_runs_dir(runs_dir)
        E.check_eval_path(file)
        text = _lmc_ids(ckpt_a, file, E.tokens_needed(context, stride, max_chunks))
        cfg = {"model": str(ckpt_a), "model_b": str(ckpt_b), "file": str(file), "alphas": points,
               "context": context, "stride": stride, "max_chunks": max_chunks}  # fmt: skip
        n_tok = len(text) if isinstance(text, list) else None
        what = f"{len(points)} interpolation points, each over the windows of {context} tokens of {file}"
        bar.start(f"scoring {what}" + (f" ({n_tok} tokens)" if n_tok is not None else ""), defer=True)
        with E.eval_run("lmc", cfg, runs_dir) as w:
            bar.run = w.dir
            try:
                res = E.lmc(ckpt_a, ckpt_b, text, points, context=context, stride=stride, max_chunks=max_chunks,
                            device=device, threads=threads, progress=bar)  # fmt: skip
            finally:
                bar.close()
            for p in res.points:
                w.event("eval", name=f"lmc@{p.alpha:g}", alpha=p.alpha, loss=p.nll, ppl=p.ppl, nll_stderr=p.nll_stderr,
                        tokens=res.n_scored)  # fmt: skip
            w.event("eval", name="lmc", barrier=res.barrier, tokens=res.n_scored)
    if as_json:
        return _finish(w, True, res.to_dict())
    typer.echo(f"{'alpha':>8}  {'loss':>10}  {'ppl':>10}")
    for p in res.points:
        typer.echo(f"{p.alpha:>8g}  {p.nll:>10.4f}  {p.ppl:>10.4f}")
    if res.barrier is not None:
        typer.echo(f"barrier: {res.barrier:.4f} nats above the straight line between the end points")
    _finish(w, False, {})


# -- lens and cka ----------------------------------------------------------------

TextOpt = Annotated[str | None, typer.Option("--text", "-t", help="The text to read ('-' reads stdin).")]
FileOpt = Annotated[Path | None, typer.Option("--file", "-f", help="Read this file's text instead.")]
LENS_COLUMNS = 8  # positions a terminal table shows (--positions picks them; --json has all)
MaxTokens = Annotated[
    int,
    typer.Option("--max-tokens", "-n", help="Read at most this many tokens of the text (and the model's context)."),
]


def _limit(max_tokens: int, *models) -> int:
    """--max-tokens within every model's context (else exit 2)."""
    from toy.eval.lens import context_limit

    if max_tokens < 1:
        raise CLIError(f"--max-tokens {max_tokens} must be >= 1", None, 2)
    return min([max_tokens, *(context_limit(m) for m in models)])


@contextmanager
def _stop_on_interrupt(label: str) -> Iterator[None]:
    """Ctrl-C: a line saying nothing was recorded (the bundle, if any, ends "interrupted"), exit 130."""
    try:
        yield
    except KeyboardInterrupt:
        typer.echo(f"{label}: interrupted: no result was recorded", err=True)
        raise typer.Exit(130) from None


def _cut_note(n_read: int, n_text: int) -> None:
    if n_read < n_text:
        typer.echo(f"reading the first {n_read} of the text's {n_text} tokens (--max-tokens, context)", err=True)


def _lens_text(text: str | None, file: Path | None, usage: str) -> str:
    """The text of ``--text`` or ``--file`` (exactly one)."""
    import toy.eval as E

    if (text is None) == (file is None):
        raise CLIError("give --text or --file (one of them)", usage, 2)
    if file is not None:
        with cli_errors():
            return E.read_eval_text(file)
    assert text is not None
    return sys.stdin.read() if text == "-" else text


def _load_for_inside(model: str, lora: list[str] | None, device, threads):
    """A model for the lens or CKA: its whole context, the adapters applied."""
    import toy
    from toy.gguf import GGUFFile
    from toy_cli.ui import parse_lora_options

    adapters = parse_lora_options(lora)
    with cli_errors():
        if Path(model).is_file():
            with GGUFFile(model) as gf:
                if gf.metadata.get("general.type") == "adapter":
                    from toy.errors import BadInputError

                    raise BadInputError(
                        f"{model} is a LoRA adapter, not a model",
                        hint="pass the base model and the adapter with --lora (--lora-a / --lora-b for cka)",
                    )
        return toy.load(model, device=device, threads=threads, lora=adapters or None)


def _cell(top: list[tuple[int, str, float]], kl: float) -> str:
    lines = [f"{_short(s)} {p:.2f}" for _, s, p in top]
    return "\n".join([*lines, f"KL {kl:.3f}"])


def _short(s: str, n: int = 10) -> str:
    r = repr(s)
    return r if len(r) <= n else r[: n - 1] + "…"


def lens_cmd(
    model: Annotated[str, typer.Argument(help="A GGUF path or a model name (`toy list`).")],
    text: TextOpt = None,
    file: FileOpt = None,
    top: Annotated[int, typer.Option("--top", "-k", help="Tokens shown per layer and position.")] = 3,
    positions: Annotated[
        str | None,
        typer.Option(
            "--positions", "-p", help="Positions to read: e.g. 0,3,5-7,-1 (default: the last 8; all in --json)."
        ),
    ] = None,
    lora: Annotated[
        list[str] | None,
        typer.Option("--lora", metavar="ADAPTER[:SCALE]", help="Apply a LoRA adapter (GGUF); repeatable."),
    ] = None,
    max_tokens: MaxTokens = 512,
    device: Device = None,
    threads: Threads = None,
    as_json: JsonReport = False,
    runs_dir: RunsDir = None,
) -> None:
    """The logit lens: each layer's residual stream through the final norm and head, per position
    (top tokens and KL(final || layer))."""
    import toy.eval as E
    from toy.eval.lens import parse_positions, text_ids

    body = _lens_text(text, file, "toy eval lens MODEL --text 'some text'")
    if top < 0:
        raise CLIError(f"--top {top} must be >= 0", None, 2)
    with cli_errors():
        _check_runs_dir(runs_dir)
    with _stop_on_interrupt("lens"), _load_for_inside(model, lora, device, threads) as m, cli_errors():
        ids = text_ids(m, body)
        n = _limit(max_tokens, m)
        _cut_note(n, len(ids))
        ids = ids[:n]
        n = len(ids)
        if positions is None and not as_json:
            pos = list(range(max(0, n - LENS_COLUMNS), n))
        else:
            pos = parse_positions(positions, n)
        cfg = {"model": str(m.path), "file": str(file) if file else None, "top": top, "positions": pos,
               "max_tokens": max_tokens, "lora": [str(x) for x in lora or ()]}  # fmt: skip
        with E.eval_run("lens", cfg, runs_dir, model=E.record.model_info(m)) as w:
            res = E.logit_lens(m, ids, top_k=top, positions=pos)
            for li in range(res.n_layer):
                kls = [p.layers[li].kl for p in res.positions]
                w.event("eval", name=f"lens@{li}", layer=li, kl_mean=sum(kls) / len(kls), tokens=n)
    if as_json:
        return _finish(w, True, res.to_dict())
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=False)
    fits = max(1, (console.width - 8) // 11) if console.is_terminal else LENS_COLUMNS  # a cell is ~10 wide
    shown = res.positions[-min(LENS_COLUMNS, fits) :]
    if not console.is_terminal:
        console = Console(soft_wrap=False, width=max(console.width, 8 + 11 * len(shown)))
    table = Table(box=None, pad_edge=False, header_style="bold", show_lines=True)
    table.add_column("LAYER", justify="right", no_wrap=True, min_width=6)
    for p in shown:
        nxt = "" if p.next_text is None else f"\n→ {_short(p.next_text)}"
        table.add_column(f"{p.position} {_short(p.text)}{nxt}", no_wrap=True)
    for li in range(res.n_layer):
        table.add_row(f"blk.{li}", *[_cell(p.layers[li].top, p.layers[li].kl) for p in shown])
    console.print(table)
    if len(shown) < len(res.positions) or (positions is None and len(res.positions) < n):
        typer.echo(
            f"showing {len(shown)} of the text's {n} positions ({shown[0].position}..{shown[-1].position}): "
            "--positions picks them, --json has every one",
            err=True,
        )
    typer.echo(f"KL(final || layer) in nats; {n} tokens, {res.n_layer} layers; the last layer's lens is the output")
    _finish(w, False, {})


def cka_cmd(
    model_a: Annotated[str, typer.Argument(help="The first model or checkpoint (GGUF path or `toy list` name).")],
    model_b: Annotated[str, typer.Argument(help="The second; same tokenizer (layer counts may differ).")],
    text: TextOpt = None,
    file: FileOpt = None,
    lora_a: Annotated[
        list[str] | None, typer.Option("--lora-a", metavar="ADAPTER[:SCALE]", help="A LoRA adapter for A; repeatable.")
    ] = None,
    lora_b: Annotated[
        list[str] | None, typer.Option("--lora-b", metavar="ADAPTER[:SCALE]", help="A LoRA adapter for B; repeatable.")
    ] = None,
    max_tokens: MaxTokens = 512,
    device: Device = None,
    threads: Threads = None,
    as_json: JsonReport = False,
    runs_dir: RunsDir = None,
) -> None:
    """Linear CKA between every layer of A and every layer of B on one text."""
    import toy.eval as E

    body = _lens_text(text, file, "toy eval cka A B --text 'some text'")
    with cli_errors():
        _check_runs_dir(runs_dir)
    with (
        _stop_on_interrupt("cka"),
        _load_for_inside(model_a, lora_a, device, threads) as a,
        _load_for_inside(model_b, lora_b, device, threads) as b,
        cli_errors(),
    ):
        from toy.eval.lens import text_ids

        limit, n_text = _limit(max_tokens, a, b), len(text_ids(a, body))
        _cut_note(min(limit, n_text), n_text)
        cfg = {"model": str(a.path), "model_b": str(b.path), "file": str(file) if file else None,
               "max_tokens": max_tokens, "lora_a": [str(x) for x in lora_a or ()],
               "lora_b": [str(x) for x in lora_b or ()]}  # fmt: skip
        with E.eval_run("cka", cfg, runs_dir, model=E.record.model_info(a), model_b=E.record.model_info(b)) as w:
            res = E.layer_cka(a, b, body, max_tokens=limit)
            d = res.to_dict()
            w.event("eval", name="cka", tokens=res.n_tokens, matrix=d["matrix"], diagonal=d["diagonal"])
    if as_json:
        return _finish(w, True, d)
    na, nb = res.matrix.shape

    def fmt(v: float) -> str:
        return "  nan" if v != v else f"{v:.3f}"

    if nb <= 12:
        typer.echo("A \\ B  " + " ".join(f"{f'blk.{j}':>6}" for j in range(nb)))
        for i in range(na):
            typer.echo(f"{f'blk.{i}':<7}  " + " ".join(f"{fmt(v):>6}" for v in res.matrix[i]))
    else:
        typer.echo(f"{'A':<7}  {'same B':>7}  {'best B':>8}  {'CKA':>6}")
        for i in range(na):
            row = res.matrix[i]
            j = int(row.argmax()) if (row == row).any() else 0
            same = fmt(row[i]) if i < nb else "-"
            typer.echo(f"{f'blk.{i}':<7}  {same:>7}  {f'blk.{j}':>8}  {fmt(row[j]):>6}")
    diag = res.diagonal
    mean = f"; mean CKA of layer i with layer i: {sum(diag) / len(diag):.4f}" if diag else ""
    typer.echo(f"linear CKA over {res.n_tokens} tokens, {na} layers of A x {nb} of B{mean}")
    _finish(w, False, {})


eval_app.command("logprobs")(logprobs_cmd)
eval_app.command("perplexity")(perplexity_cmd)
eval_app.command("compare")(compare_cmd)
eval_app.command("lmc")(lmc_cmd)
eval_app.command("lens")(lens_cmd)
eval_app.command("cka")(cka_cmd)


def register(app: typer.Typer) -> None:
    app.add_typer(eval_app, name="eval")
