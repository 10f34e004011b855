"""``toy serve MODEL``: run the OpenAI-compatible server under uvicorn.

Registered in the ``toy.commands`` entry-point group (toy-cli turns the
function into ``app.command("serve")``). This module imports only typer and
the settings at import time: FastAPI, uvicorn and the engine are imported
inside the command, so ``toy --help`` stays fast.

Behaviour:

- Binds 127.0.0.1:8000 by default; the URL goes to stderr (uvicorn's logs
  too), stdout stays empty.
- The model loads in the background once the port is bound: /health
  answers 503 {"status": "loading"} until it is ready. A registry name that
  is not downloaded yet (smollm2-135m) is fetched first, with progress;
  a path that does not exist fails before the port is bound (exit 2).
- SIGTERM or Ctrl-C: uvicorn stops accepting connections and waits up to
  ``--drain-timeout`` seconds for in-flight requests, then the app's
  shutdown drains the engine and writes run_end; the exit code is 0. A
  second Ctrl-C forces the exit.
- Errors follow toy's CLI conventions: bad input (both --api-key and
  --api-key-file, an unreadable or empty key file, an out-of-range option,
  a missing model, a ``--lora`` adapter that is missing, has a bad scale or
  does not fit the model) exits 2 with an ``error:`` line; a model that
  fails to load exits 1 (2 for bad input).
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

# kept equal to toy_serve.settings (importing it here would import toy for every `toy` command)
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


def _cli_error(message: str, hint: str | None = None, code: int = 2) -> Exception:
    from toy_cli.main import CLIError

    return CLIError(message, hint=hint, code=code)


def _read_key(api_key: str | None, api_key_file: Path | None) -> str | None:
    if api_key is not None and api_key_file is not None:
        raise _cli_error("--api-key and --api-key-file are given together", "use one of them")
    if api_key_file is None:
        return api_key
    try:
        key = api_key_file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise _cli_error(f"{api_key_file}: {why}", "--api-key-file names a UTF-8 text file holding the key") from e
    if not key:
        raise _cli_error(f"{api_key_file} is empty", "--api-key-file names a file holding the key")
    return key


def _check_adapters(model_path, adapters) -> None:
    """Each adapter read and checked against the model (AdapterError), before the port is bound."""
    from toy.engine.generate import check_lora
    from toy.gguf import GGUFFile
    from toy.train.adapter import load_adapter

    with GGUFFile(model_path) as gf:
        for path, _ in adapters:
            check_lora(load_adapter(path), gf)


class _Quiet:
    """SIGTERM/SIGINT handlers that do nothing, installed around uvicorn's run: uvicorn re-raises the
    signal that stopped it once it has shut down gracefully, and that must not kill us (exit code 0)."""

    def __enter__(self) -> _Quiet:
        self.old = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.old[sig] = signal.signal(sig, lambda signum, frame: None)
            except ValueError:  # not the main thread (tests): uvicorn does not capture signals there either
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)


def serve(
    model: Annotated[str, typer.Argument(help="A GGUF path or a model name (e.g. smollm2-135m).")],
    host: Annotated[str, typer.Option("--host", help="Address to bind (0.0.0.0 exposes the server).")] = DEFAULT_HOST,
    port: Annotated[int, typer.Option("--port", help="Port to bind (0 = any free port).")] = DEFAULT_PORT,
    api_key: Annotated[
        str | None, typer.Option("--api-key", help="Require 'Authorization: Bearer KEY' on the API routes.")
    ] = None,
    api_key_file: Annotated[
        Path | None, typer.Option("--api-key-file", help="Read the API key from a file (keeps it out of ps).")
    ] = None,
    ctx: Annotated[
        int | None, typer.Option("--ctx", help="Context tokens per sequence (default: the model's, at most 4096).")
    ] = None,
    parallel: Annotated[int, typer.Option("--parallel", help="Sequences decoded together (cache slots).")] = 4,
    max_queue: Annotated[
        int,
        typer.Option(
            "--max-queue", help="Sequences waiting for a slot before 429 (a request with n=k takes k places)."
        ),
    ] = 64,
    prefill_chunk: Annotated[
        int,
        typer.Option(
            "--prefill-chunk", help="Most prompt tokens prefilled per engine step (bounds the stall of streams)."
        ),
    ] = 128,
    max_body_bytes: Annotated[
        int, typer.Option("--max-body-bytes", help="Larger request bodies are refused with 413 (at least 1024).")
    ] = 1_000_000,
    max_batch: Annotated[
        int, typer.Option("--max-batch", help="Most jobs (prompts x n, embedding inputs) one request may create.")
    ] = 64,
    device: Annotated[
        str | None, typer.Option("--device", help="cpu, cuda0, ... (default: TOY_DEVICE, else auto).")
    ] = None,
    threads: Annotated[
        int | None, typer.Option("--threads", "-t", help="CPU threads (default: physical cores).")
    ] = None,
    lora: Annotated[
        list[str] | None,
        typer.Option(
            "--lora",
            metavar="ADAPTER[:SCALE]",
            help="Apply a LoRA adapter (GGUF) scaled by SCALE (default 1); repeatable, adapters stack.",
        ),
    ] = None,
    runs_dir: Annotated[
        str | None, typer.Option("--runs-dir", help="Where the run bundle goes (default: $TOY_RUNS_DIR or ./runs).")
    ] = None,
    alias: Annotated[
        str | None, typer.Option("--alias", help="Model id in /v1/models (default: the file stem).")
    ] = None,
    drain_timeout: Annotated[
        float, typer.Option("--drain-timeout", help="Seconds shutdown waits for in-flight requests.")
    ] = 30.0,
    log_level: Annotated[
        str, typer.Option("--log-level", help="uvicorn and server log level: debug, info, warning, error.")
    ] = "info",
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (completions, chat, embeddings, metrics)."""
    from toy_cli.commands.infer import _fetch_if_missing, parse_lora_options
    from toy_cli.commands.models import _errors
    from toy_serve.settings import Settings

    if log_level.lower() not in ("critical", "error", "warning", "info", "debug", "trace"):
        raise _cli_error(f"--log-level {log_level!r} is not a level", "debug, info, warning or error")
    key = _read_key(api_key, api_key_file)
    adapters = parse_lora_options(lora)
    with _errors():
        settings = Settings(
            model=model,
            host=host,
            port=port,
            api_key=key,
            ctx=ctx,
            parallel=parallel,
            max_queue=max_queue,
            prefill_chunk=prefill_chunk,
            max_body_bytes=max_body_bytes,
            max_batch=max_batch,
            device=device,
            threads=threads,
            drain_timeout=drain_timeout,
            runs_dir=runs_dir,
            model_alias=alias,
            lora=tuple(adapters),
        )
        from toy import store

        _fetch_if_missing(model)
        path = store.resolve_model(model)  # a missing file or unknown name fails now, before the port is bound
        if adapters:
            _check_adapters(path, adapters)
    import uvicorn

    from toy_serve.app import create_app

    level = log_level.lower()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    logger = logging.getLogger("toy_serve")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if level == "trace" else level.upper())

    app = create_app(settings)
    import copy

    from uvicorn.config import LOGGING_CONFIG

    log_config = copy.deepcopy(LOGGING_CONFIG)  # uvicorn's own format, but the access log goes to stderr too
    for handler in log_config.get("handlers", {}).values():
        if handler.get("stream") == "ext://sys.stdout":
            handler["stream"] = "ext://sys.stderr"
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=level,
        log_config=log_config,
        timeout_graceful_shutdown=settings.drain_timeout or 0.001,  # 0 would mean "wait forever" to uvicorn
        lifespan="on",
    )
    server = uvicorn.Server(config)
    fatal: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        server.should_exit = True

    app.state.toy.on_fatal = on_fatal
    shown = f"[{settings.host}]" if ":" in settings.host else settings.host
    with_lora = "".join(f" + LoRA {Path(p).name}×{sc:g}" for p, sc in settings.lora)
    typer.echo(
        f"toy serve: {settings.alias}{with_lora} on http://{shown}:{settings.port}/v1 (loading the model…)", err=True
    )
    try:
        with _Quiet():
            server.run()
    finally:
        logger.removeHandler(handler)
    if fatal:
        from toy.errors import BadInputError

        e = fatal[0]
        raise _cli_error(
            f"could not load the model: {e}", getattr(e, "hint", None), 2 if isinstance(e, BadInputError) else 1
        )


__all__ = ["serve"]
