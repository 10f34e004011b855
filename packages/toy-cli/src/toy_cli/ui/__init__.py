"""The toolkit of ``toy`` commands: public API for toy-cli and its command plugins.

Every built-in command module (``toy_cli.commands``) and the commands that
other distributions register in the ``toy.commands`` entry-point group
(``toy serve``, ``toy vit``) use it, so that they look and fail alike:

- errors (``toy_cli.ui.errors``): ``CLIError`` and ``bad_input``; the
  ``cli_errors()`` block that turns toy's errors into CLI errors with the
  exit code of their type; ``as_cli_error``, ``report`` and
  ``handle_error``, the classification and the ``error:``/``hint:`` lines;
- progress on stderr (``toy_cli.ui.progress``): ``Progress``;
- model arguments (``toy_cli.ui.inputs``): ``DEFAULT_MODEL``,
  ``fetch_if_missing`` (the first use of a registry model downloads it),
  ``parse_lora_options`` (``--lora ADAPTER[:SCALE]``);
- the shared options (``toy_cli.ui.options``): ``Device``, ``Threads``,
  ``Ctx``, ``Batch``, ``AsJson``, ``JsonReport``, ``RunsDir`` and a
  training run's ``TrainDevice``, ``TrainThreads``, ``Seed``, ``RunsOut``,
  ``Quiet``, ``JsonSummary``, ``Ranks``, ``MixedCpus``;
- training commands (``toy_cli.ui.training``): ``run_training``, what
  ``toy train`` does around a run (progress, stop signals, errors, summary).

Invariants: importing ``toy_cli.ui`` imports typer and the standard library
only, never ``toy``, ``toy_ggml``, numpy or rich (``toy --help`` stays
fast; a test checks what a fresh ``toy --help`` imports). The conventions it
implements are on the architecture page (docs/concepts/architecture.md).
"""

from toy_cli.ui.errors import (
    BAD_INPUT,
    FAILURE,
    CLIError,
    as_cli_error,
    bad_input,
    cli_errors,
    handle_error,
    report,
    set_verbose,
)
from toy_cli.ui.inputs import DEFAULT_MODEL, fetch_if_missing, parse_lora_options
from toy_cli.ui.options import (
    RUN_PANEL,
    AsJson,
    Batch,
    Ctx,
    Device,
    JsonReport,
    JsonSummary,
    MixedCpus,
    Quiet,
    Ranks,
    Rpc,
    RunsDir,
    RunsOut,
    Seed,
    TensorSplit,
    Threads,
    TrainDevice,
    TrainThreads,
)
from toy_cli.ui.progress import Progress
from toy_cli.ui.training import TrainingProgress, run_training, stop_signals

__all__ = [
    "BAD_INPUT",
    "DEFAULT_MODEL",
    "FAILURE",
    "RUN_PANEL",
    "AsJson",
    "Batch",
    "CLIError",
    "Ctx",
    "Device",
    "JsonReport",
    "JsonSummary",
    "MixedCpus",
    "Progress",
    "Quiet",
    "Ranks",
    "Rpc",
    "RunsDir",
    "RunsOut",
    "Seed",
    "TensorSplit",
    "Threads",
    "TrainDevice",
    "TrainThreads",
    "TrainingProgress",
    "as_cli_error",
    "bad_input",
    "cli_errors",
    "fetch_if_missing",
    "handle_error",
    "parse_lora_options",
    "report",
    "run_training",
    "set_verbose",
    "stop_signals",
]
