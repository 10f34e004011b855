"""`toy export`: write toy's files in Hugging Face's formats.

``toy export hf MODEL -o FOLDER`` writes a GGUF language model as a Hugging
Face folder (config.json, safetensors, tokenizer files,
generation_config.json) that ``transformers`` loads without GGUF
(``toy.convert.hf_export``). It prints the files written on stdout (or a
JSON report with ``--json``) and, on stderr, a note when quantized weights
were dequantized to F32 and the report's notes (a SentencePiece vocabulary's
``tokenizer.model`` left out without the ``sentencepiece`` extra). ``--shard-size`` splits the weights into numbered
safetensors shards plus an index above that many bytes (``5GB`` by default,
as transformers does).

Conventions (docs/concepts/architecture.md): data on stdout, notes on
stderr; bad input exits 2 with ``error:``/``hint:`` lines and nothing is
left at FOLDER. ``toy`` is imported inside the commands so ``toy --help``
stays fast. ``toy export peft`` (a LoRA adapter as a PEFT folder) is
``toy_cli.commands.convert_peft``'s, added to this group by ``register``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated

import typer

from toy_cli.ui import AsJson, CLIError, cli_errors

export_app = typer.Typer(
    help="Write toy's files in Hugging Face formats: a model as a folder transformers loads (`toy export hf`),\n"
    "a LoRA adapter as a PEFT folder (`toy export peft`).",
    no_args_is_help=True,
)

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a byte count -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise CLIError(f"--shard-size {text!r} is not a size", "write it as 5GB, 500MB, 2GiB or a byte count", 2)
    return int(float(m.group(1)) * _UNITS[unit])


@export_app.command("hf")
def hf(
    model: Annotated[str, typer.Argument(help="A GGUF path or a model name (see `toy list`).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The folder to write (new or empty).")],
    shard_size: Annotated[
        str, typer.Option("--shard-size", help="Split the weights into shards above this size (5GB, 500MB).")
    ] = "5GB",
    as_json: AsJson = False,
) -> None:
    """Write a GGUF model as a Hugging Face folder (config, safetensors, tokenizer, generation config).

    The weights are sharded above --shard-size; quantized weights are dequantized to F32. FOLDER must be
    new or empty, and nothing is left there on failure."""
    limit = parse_size(shard_size)
    with cli_errors():
        from toy.convert.hf_export import export_hf
        from toy.store import resolve_model

        path = resolve_model(model)
        try:
            report = export_hf(path, output, shard_bytes=limit)
        except OSError as e:
            raise CLIError(f"{output}: {e.strerror or e}", None, 1) from None
    if report.dequantized:
        typer.echo(
            f"note: {len(report.dequantized)} quantized tensor(s) were dequantized to F32 "
            f"(the folder holds the values the GGUF file computes with, not the original training weights)",
            err=True,
        )
    for note in report.notes:
        typer.echo(f"note: {note}", err=True)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    for p in report.files:
        typer.echo(str(p))
    typer.echo(f"{report.hf_class}: {report.n_tensors} tensors, {report.n_bytes / 1e6:.1f} MB", err=True)


def register(app: typer.Typer) -> None:
    from toy_cli.commands.convert_peft import register_export  # `toy export peft` (the adapters' module)

    register_export(export_app)
    app.add_typer(export_app, name="export")
