"""``toy merge BASE ADAPTER OUT``: merge LoRA adapters into a model's weights.

``toy.merge.merge_adapters`` does the work: W' = W + Σ scale · B @ A
(float64 from the dequantized W, written F32; every other tensor and all
metadata copied), optionally re-quantized with ``--type``, then the drift of
the merged file against the base with the adapters on a fixed sample.

Output: progress on stderr; on stdout the OUT path and a one-line drift
summary, or with ``--json`` the whole report. A missing file, a bad scale or
type, or an adapter that does not fit BASE exits 2 with ``error:`` and a hint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from toy_cli.ui import CLIError, JsonReport, Progress, cli_errors, parse_lora_options

_LABELS = {
    "merging": "merging the adapters",
    "quantizing": "re-quantizing",
    "checking": "checking the merge against base + adapters",
}


def _summary(report) -> list[str]:
    n = len(report.adapters)
    kind = f"re-quantized to {report.dtype}" if report.dtype else "adapted weights F32, the rest as in BASE"
    lines = [str(report.out), f"merged {n} adapter{'s' if n != 1 else ''} into {len(report.merged)} weights ({kind})"]
    d = report.drift
    if d is not None:
        lines.append(
            f"drift on {d.n_tokens} sample tokens ({'text' if d.sample == 'text' else 'seeded token ids'}): "
            f"KL mean {d.kl_mean:.3g}, max {d.kl_max:.3g}; top-1 agreement {100 * d.top1_agreement:.2f}%; "
            f"max |logit difference| {d.max_abs_logit_diff:.3g} (largest |logit| {d.max_abs_logit:.3g})"
        )
    return lines


def merge(
    base: Annotated[str, typer.Argument(metavar="BASE", help="The base model (a path or a name, see `toy list`).")],
    adapter: Annotated[Path, typer.Argument(metavar="ADAPTER", help="A LoRA adapter GGUF for BASE.")],
    out: Annotated[Path, typer.Argument(metavar="OUT", help="The merged model to write.")],
    lora_scale: Annotated[
        float, typer.Option("--lora-scale", help="Scale of ADAPTER's update (as llama.cpp's --lora-scaled).")
    ] = 1.0,
    more: Annotated[
        list[str] | None,
        typer.Option("--adapter", metavar="MORE[:SCALE]", help="Another adapter to merge too (repeatable)."),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--type",
            "-t",
            help="Re-quantize the merge: Q8_0, Q4_K, F16, ... (default: merged weights F32, rest as is).",
        ),
    ] = None,
    # not toy_cli.ui's Threads: -t is --type here
    threads: Annotated[
        int | None, typer.Option("--threads", help="CPU threads for the drift check (default: physical cores).")
    ] = None,
    as_json: JsonReport = False,
) -> None:
    """Merge LoRA adapters into BASE's weights and write OUT (a plain model llama.cpp loads), then report
    how far OUT's logits drift from BASE with the adapters applied."""
    import math

    from toy.merge import merge_adapters

    if not math.isfinite(lora_scale):
        raise CLIError(f"--lora-scale {lora_scale} is not a finite number", "for example --lora-scale 0.5", 2)
    if not adapter.is_file():
        raise CLIError(
            f"{adapter}: {'is a folder' if adapter.is_dir() else 'no such file'}",
            "ADAPTER is a LoRA adapter GGUF file; its scale is --lora-scale",
            2,
        )
    adapters = [(str(adapter), float(lora_scale))] + parse_lora_options(more)
    if out.is_dir():
        raise CLIError(f"{out}: is a folder", "OUT is the file to write, e.g. merged.gguf", 2)
    with cli_errors():
        from toy.store import resolve_model

        path = resolve_model(base)
        with Progress() as bar:
            report = merge_adapters(
                path,
                adapters,
                out,
                dtype=dtype,
                progress=lambda phase, done, total: bar.update(_LABELS.get(phase, phase), done, total),
                threads=threads,
            )
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        typer.echo("\n".join(_summary(report)))


def register(app: typer.Typer) -> None:
    app.command("merge")(merge)
