"""The options that several ``toy`` commands share, declared once.

Each is a ``typing.Annotated`` alias that typer reads from a command's
signature (``device: Device = None``); the default stays in the signature.
Commands of other distributions (``toy serve``, ``toy vit``) use the same
ones, so a flag is spelled, abbreviated and explained the same everywhere.

Invariants: a flag keeps one meaning across commands; where a command's
flag means something else (``toy merge --threads`` has no ``-t``, which is
its ``--type``; ``toy vit``'s ``--batch-size`` counts images) it keeps a
declaration of its own. A training run's options (``toy train``'s recipes,
``toy vit train``) sit in the "Run" help panel and say the training
defaults (a run's device is the CPU unless told, a model's is picked
automatically).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

RUN_PANEL = "Run"  # the help panel of a training run's settings

# -- commands that load a model --------------------------------------------------

Device = Annotated[str | None, typer.Option("--device", help="cpu, cuda0, ... (default: TOY_DEVICE, else auto).")]
Threads = Annotated[
    int | None,
    typer.Option("--threads", "-t", help="CPU threads (default: physical cores, fewer while the machine is busy)."),
]
Ctx = Annotated[
    int | None, typer.Option("--ctx", help="Context tokens per sequence (default: the model's, at most 4096).")
]
Batch = Annotated[int, typer.Option("--batch", "-b", help="Tokens per forward pass (the prefill micro-batch).")]
RPC_PANEL = "Split across hosts"
Rpc = Annotated[
    str | None,
    typer.Option(
        "--rpc",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="Add the devices of these `toy rpc-server`s: the layers are split between this machine and them "
        "(unauthenticated: reach them over loopback, an SSH tunnel or a private network).",
        rich_help_panel=RPC_PANEL,
    ),
]
TensorSplit = Annotated[
    str | None,
    typer.Option(
        "--tensor-split",
        metavar="A,B[,...]",
        help="The share of the layers of each device, this machine's first, then each --rpc device "
        "(default: by free memory).",
        rich_help_panel=RPC_PANEL,
    ),
]

# -- output ------------------------------------------------------------------------

AsJson = Annotated[bool, typer.Option("--json", help="Print JSON.")]
JsonReport = Annotated[bool, typer.Option("--json", help="Print the report as JSON.")]
RunsDir = Annotated[
    Path | None,
    typer.Option(
        "--runs-dir", help="The runs folder (default: $TOY_RUNS_DIR, else the project's in toy.toml, else ./runs)."
    ),
]

# -- training runs ----------------------------------------------------------------

TrainDevice = Annotated[
    str | None,
    typer.Option(
        "--device",
        help="cpu, cuda0, ... (default: TOY_DEVICE, else the project's in toy.toml, else cpu).",
        rich_help_panel=RUN_PANEL,
    ),
]
TrainThreads = Annotated[
    int | None,
    typer.Option(
        "--threads",
        "-t",
        help="CPU threads (default: TOY_THREADS, else the project's in toy.toml, else physical cores, "
        "fewer while the machine is busy).",
        rich_help_panel=RUN_PANEL,
    ),
]
RANKS_PANEL = "Processes"
Ranks = Annotated[
    int | None,
    typer.Option(
        "--ranks",
        help="Train on N processes of this machine: mpiexec starts them (needs the distributed extra of toy-cli).",
        rich_help_panel=RANKS_PANEL,
    ),
]
MixedCpus = Annotated[
    str | None,
    typer.Option(
        "--mixed-cpus",
        help="Ranks on different ggml CPU variants: refuse (default: stop, naming the variant to use) or allow "
        "(train; the bits then differ from a one-process run).",
        rich_help_panel=RANKS_PANEL,
    ),
]
Seed = Annotated[
    int | None,
    typer.Option(
        "--seed",
        help="Seed of everything random in the run: initial weights, data split and order, ... "
        "(default: the project's seed in toy.toml, else 0).",
        rich_help_panel=RUN_PANEL,
    ),
]
RunsOut = Annotated[
    Path | None,
    typer.Option(
        "--out",
        help="Runs folder (default: $TOY_RUNS_DIR, else the project's in toy.toml, else ./runs).",
        rich_help_panel=RUN_PANEL,
    ),
]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")]
JsonSummary = Annotated[bool, typer.Option("--json", help="Print a JSON summary.")]
