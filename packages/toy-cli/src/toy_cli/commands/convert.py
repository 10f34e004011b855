"""``toy convert FOLDER -o OUT.gguf``: import a Hugging Face model folder,
or (``toy convert PEFT_FOLDER --base M.gguf -o ADAPTER.gguf``) a PEFT LoRA
adapter folder (``toy_cli.commands.convert_peft``; a folder with
adapter_config.json is one).

``toy.convert.import_hf`` does the work: config.json, the safetensors
weights (one file or shards; F32, F16, BF16) and tokenizer.json become one
GGUF file as llama.cpp's converter writes it, read one tensor at a time and
written atomically (nothing at OUT on failure). ``--type`` picks the 2-D
weights' type (norms and 1-D tensors stay F32).

Output: progress on stderr; on stdout the OUT path and a one-line summary,
or with ``--json`` the whole report. A folder toy cannot import (an unknown
architecture, a missing shard, a config field it does not understand) exits
2 with ``error:`` naming the field and a hint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from toy_cli.ui import CLIError, JsonReport, Progress, cli_errors


def convert(
    folder: Annotated[
        Path, typer.Argument(metavar="FOLDER", help="A Hugging Face model folder (config.json, *.safetensors).")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", metavar="OUT", help="The GGUF file to write.")],
    dtype: Annotated[
        str, typer.Option("--type", "-t", help="Type of the 2-D weights: f32, f16, bf16 or q8_0 (norms stay F32).")
    ] = "f32",
    name: Annotated[str | None, typer.Option("--name", help="general.name (default: the folder's name).")] = None,
    base: Annotated[
        str | None,
        typer.Option("--base", metavar="MODEL", help="A PEFT adapter folder: the GGUF (or `toy list` name) it adapts."),
    ] = None,
    as_json: JsonReport = False,
) -> None:
    """Import a Hugging Face model folder (any architecture toy runs) into a GGUF file, as llama.cpp's converter
    writes it, or a PEFT LoRA adapter folder (with --base) into a llama.cpp adapter; writes OUT atomically."""
    from toy_cli.commands.convert_peft import convert_peft, is_peft_folder

    if folder.is_dir() and is_peft_folder(folder):
        convert_peft(folder, base, out)
        return
    if base is not None:
        raise CLIError(
            f"{folder}: --base is for a PEFT adapter folder (adapter_config.json), and this is not one",
            "leave out --base to import a model folder",
            2,
        )
    if not folder.is_dir():
        raise CLIError(
            f"{folder}: {'is a file' if folder.exists() else 'no such folder'}",
            "FOLDER is a Hugging Face model folder with config.json and *.safetensors",
            2,
        )
    if out.is_dir():
        raise CLIError(f"{out}: is a folder", "OUT is the file to write, e.g. model.gguf", 2)
    with cli_errors():
        from toy.convert import import_hf

        with Progress() as bar:
            report = import_hf(
                folder, out, dtype, name=name, progress=lambda done, total, _name: bar.update("converting", done, total)
            )
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        types = ", ".join(f"{n} {t}" for t, n in sorted(report.type_counts.items()))
        typer.echo(str(report.out))
        typer.echo(
            f"{report.arch}: {report.n_tensors} tensors ({types}), {report.n_params:,} parameters, "
            f"{report.bytes_out / 1e6:.1f} MB in {report.seconds:.1f} s"
            + ("; tied embeddings" if report.tied else "")
            + f"; pre-tokenizer {report.pre}"
        )


def register(app: typer.Typer) -> None:
    app.command("convert")(convert)
