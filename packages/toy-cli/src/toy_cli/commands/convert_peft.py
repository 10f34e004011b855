"""PEFT LoRA adapters in and out of toy (``toy.convert.peft``).

- ``convert_peft(folder, base, output)``: what ``toy convert FOLDER --base
  M.gguf -o ADAPTER.gguf`` runs when FOLDER holds ``adapter_config.json``
  (``is_peft_folder``; toy_cli.commands.convert dispatches).
- ``export_peft_command``: ``toy export peft ADAPTER.gguf [--base M.gguf] -o
  FOLDER``, a subcommand of the ``toy export`` group
  (``register_export(export_app)`` adds it there).

Conventions (docs/concepts/architecture.md): the path written on stdout,
notes on stderr; bad input (a refused adapter: DoRA, modules_to_save, a
target outside the blocks, a mismatch with the base) exits 2 with
``error:``/``hint:`` lines and nothing is left at the output. ``toy`` is
imported inside the commands so ``toy --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from toy_cli.ui import CLIError, cli_errors

__all__ = ["convert_peft", "export_peft_command", "is_peft_folder", "register_export"]


def is_peft_folder(folder: Path) -> bool:
    """Whether ``folder`` is a PEFT adapter folder (it holds adapter_config.json)."""
    return (Path(folder) / "adapter_config.json").is_file()


def convert_peft(folder: Path, base: str | None, output: Path) -> Path:
    """Import the PEFT adapter in ``folder`` for the model ``base`` into the adapter GGUF ``output``;
    prints the path written. CLIError (exit 2) when ``base`` is missing or the adapter is refused."""
    if not base:
        raise CLIError(
            f"{folder} is a PEFT adapter: converting it needs the model it adapts",
            "add --base MODEL.gguf (the GGUF of the model the adapter was trained on)",
            2,
        )
    if output.is_dir():
        raise CLIError(f"{output}: is a folder", "-o is the adapter file to write, e.g. adapter.gguf", 2)
    with cli_errors():
        from toy.convert.peft import import_peft
        from toy.store import resolve_model

        path = resolve_model(base)
        try:
            out = import_peft(folder, path, output)
        except OSError as e:
            raise CLIError(f"{output}: {e.strerror or e}", None, 1) from None
    typer.echo(str(out))
    return out


def export_peft_command(
    adapter: Annotated[Path, typer.Argument(metavar="ADAPTER", help="A LoRA adapter GGUF.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The PEFT folder to write (new or empty).")],
    base: Annotated[
        str | None,
        typer.Option("--base", help="The adapter's base model: checked, and required for llama's attn_q/attn_k."),
    ] = None,
    base_model: Annotated[
        str | None,
        typer.Option("--base-model", help="The Hugging Face model id or folder to record as base_model_name_or_path."),
    ] = None,
) -> None:
    """Write a LoRA adapter GGUF as a PEFT folder that peft's PeftModel.from_pretrained loads.

    The folder holds adapter_config.json and adapter_model.safetensors; --base checks the adapter against its
    model and is required for llama adapters of attn_q/attn_k (llama.cpp's Q/K row order is undone)."""
    if not adapter.is_file():
        raise CLIError(f"{adapter}: no such file", "ADAPTER is a LoRA adapter GGUF file", 2)
    with cli_errors():
        from toy.convert.peft import export_peft
        from toy.store import resolve_model

        path = resolve_model(base) if base else None
        try:
            out = export_peft(adapter, output, base=path, base_model=base_model)
        except OSError as e:
            raise CLIError(f"{output}: {e.strerror or e}", None, 1) from None
    typer.echo(str(out / "adapter_config.json"))
    typer.echo(str(out / "adapter_model.safetensors"))


def register_export(export_app: typer.Typer) -> None:
    """Add ``peft`` to the ``toy export`` group."""
    export_app.command("peft")(export_peft_command)
