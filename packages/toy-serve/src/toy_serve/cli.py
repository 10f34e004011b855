"""``toy serve MODEL``: run the OpenAI-compatible server under uvicorn.

Registered in the ``toy.commands`` entry-point group (toy-cli turns the
function into ``app.command("serve")``). This module imports only typer and
``toy_cli.ui`` (the options, errors and model fetch every ``toy`` command
shares) at import time: FastAPI, uvicorn and the engine are imported inside
the command, so ``toy --help`` stays fast.

Behaviour:

- Start-up checks everything it can before loading: the options, the runs
  dir (a regular file there, or a path that cannot be created, is an
  ``error:`` naming it), the model file's header and config (a malformed
  file exits 2, as in ``toy infer``), ``--ctx`` against the model's context
  and each ``--lora`` adapter. Then it binds the port itself
  (``toy_serve.conn.bind``): a port in use or a host that does not resolve
  is ``error: cannot bind HOST:PORT: ...`` (exit 2) before the model loads.
  A server that never served leaves no run bundle: the bundle is made once
  the model is loaded and the engine runs.
- Binds 127.0.0.1:8000 by default; the URL goes to stderr (uvicorn's logs
  too), stdout stays empty.
- The model loads in the background once the port is bound: /health
  answers 503 {"status": "loading"} until it is ready. A registry name that
  is not downloaded yet (smollm2-135m) is fetched first, with progress;
  a path that does not exist fails before the port is bound (exit 2).
- Connections are guarded by ``--header-timeout`` (10 s), ``--body-timeout``
  (30 s) and ``--max-connections`` (from the descriptor limit, at most
  1000); accept errors are logged once every 5 s (``toy_serve.conn``).
- SIGTERM or Ctrl-C: the server stops accepting connections, waits up to
  ``--drain-timeout`` seconds for the requests in flight, then ends what is
  left with "the server is shutting down" (a stream's last chunk is that
  error, then ``data: [DONE]``; a non-stream request gets 503), writes
  run_end with the ``abandoned`` count and exits 0. A second SIGTERM or
  Ctrl-C ends the wait at once, the same way (``toy_serve.conn.ToyUvicorn``).
- Errors follow toy's CLI conventions: bad input (both --api-key and
  --api-key-file, an unreadable or empty key file, an out-of-range option,
  a missing or malformed model, a ``--lora`` adapter that is missing, has a
  bad scale or does not fit the model, a port that cannot be bound) exits 2
  with an ``error:`` line; a model that fails to load later exits 1, or 2
  for bad input, classified as ``toy infer`` classifies it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from toy_cli.ui import (
    DEFAULT_MODEL,
    CLIError,
    Ctx,
    Device,
    Rpc,
    RunsDir,
    TensorSplit,
    Threads,
    as_cli_error,
    bad_input,
    cli_errors,
    fetch_if_missing,
    parse_lora_options,
)

# kept equal to toy_serve.settings (importing it here would import toy for every `toy` command)
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


def _read_key(api_key: str | None, api_key_file: Path | None) -> str | None:
    if api_key is not None and api_key_file is not None:
        raise bad_input("--api-key and --api-key-file are given together", "use one of them")
    if api_key_file is None:
        return api_key
    from toy.errors import BadInputError
    from toy.inputs import regular_file

    try:
        regular_file(api_key_file, "--api-key-file")  # a FIFO would block the start, /dev/zero never ends
    except BadInputError as e:
        raise bad_input(str(e), "--api-key-file names a regular file holding the key") from None
    try:
        key = api_key_file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise bad_input(f"{api_key_file}: {why}", "--api-key-file names a UTF-8 text file holding the key") from e
    if not key:
        raise bad_input(f"{api_key_file} is empty", "--api-key-file names a file holding the key")
    return key


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
    model: Annotated[str, typer.Argument(help=f"A GGUF path or a model name (e.g. {DEFAULT_MODEL}).")],
    host: Annotated[str, typer.Option("--host", help="Address to bind (0.0.0.0 exposes the server).")] = DEFAULT_HOST,
    port: Annotated[int, typer.Option("--port", help="Port to bind (0 = any free port).")] = DEFAULT_PORT,
    api_key: Annotated[
        str | None, typer.Option("--api-key", help="Require 'Authorization: Bearer KEY' on the API routes.")
    ] = None,
    api_key_file: Annotated[
        Path | None, typer.Option("--api-key-file", help="Read the API key from a file (keeps it out of ps).")
    ] = None,
    ctx: Ctx = None,
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
    device: Device = None,
    threads: Threads = None,
    rpc: Rpc = None,
    tensor_split: TensorSplit = None,
    kv_type: Annotated[
        str,
        typer.Option(
            "--kv-type",
            help="KV cache type: f16 (default) or f32 (scoring closest to `toy eval logprobs`; twice the memory).",
        ),
    ] = "f16",
    flash_attn: Annotated[
        bool,
        typer.Option(
            "--flash-attn",
            help="ggml's fused attention (as llama-server's default), in its row-invariant form: faster decode, "
            "outputs still independent of the batch.",
        ),
    ] = False,
    lora: Annotated[
        list[str] | None,
        typer.Option(
            "--lora",
            metavar="ADAPTER[:SCALE]",
            help="Apply a LoRA adapter (GGUF) scaled by SCALE (default 1); repeatable, adapters stack. "
            "NAME=ADAPTER[:SCALE] loads a selectable adapter instead, used by requests that name it "
            "(model '<alias>:NAME' or the lora field).",
        ),
    ] = None,
    adapter_dir: Annotated[
        list[Path] | None,
        typer.Option(
            "--adapter-dir",
            metavar="DIR",
            help="Let POST /v1/adapters load adapter files from DIR (a path must resolve inside it, symlinks "
            "followed); repeatable. Without it, loading adapters at run time is off.",
        ),
    ] = None,
    max_adapters: Annotated[
        int,
        typer.Option(
            "--max-adapters", help="Selectable adapters loaded at once; POST /v1/adapters answers 409 beyond."
        ),
    ] = 8,
    runs_dir: RunsDir = None,
    alias: Annotated[
        str | None, typer.Option("--alias", help="Model id in /v1/models (default: the file stem).")
    ] = None,
    drain_timeout: Annotated[
        float, typer.Option("--drain-timeout", help="Seconds shutdown waits for in-flight requests.")
    ] = 30.0,
    header_timeout: Annotated[
        float, typer.Option("--header-timeout", help="Seconds a request's headers may take (else 408, closed).")
    ] = 10.0,
    body_timeout: Annotated[
        float,
        typer.Option("--body-timeout", help="Seconds a request's body may take after its headers (else 408)."),
    ] = 30.0,
    constraint_timeout: Annotated[
        float,
        typer.Option(
            "--constraint-timeout",
            help="Seconds a request's output constraint (schema, grammar, regex, strict tools) may take to compile "
            "(else 400).",
        ),
    ] = 10.0,
    max_connections: Annotated[
        int | None,
        typer.Option(
            "--max-connections", help="Open connections at most; 503 beyond (default: from the descriptor limit)."
        ),
    ] = None,
    cache_ram: Annotated[
        int,
        typer.Option(
            "--cache-ram",
            metavar="MB",
            help="RAM for the prefix cache shared by all requests (0 turns it off); outputs stay bit-exact.",
        ),
    ] = 256,
    cache_dir: Annotated[
        Path | None,
        typer.Option("--cache-dir", help="Spill prefix-cache blocks to this folder (checksummed; survives a restart)."),
    ] = None,
    cache_disk: Annotated[
        int, typer.Option("--cache-disk", metavar="MB", help="Most the --cache-dir folder may hold.")
    ] = 2048,
    slot_save_path: Annotated[
        Path | None,
        typer.Option("--slot-save-path", help="Folder for POST /slots/{id}?action=save|restore files."),
    ] = None,
    speculative: Annotated[
        str,
        typer.Option(
            "--speculative",
            help="Default speculative decoding of requests: none, ngram (prompt lookup) or draft (needs "
            "--draft-model); a request's speculative field overrides it. Outputs stay bit-exact.",
        ),
    ] = "none",
    draft_model: Annotated[
        Path | None,
        typer.Option("--draft-model", help="A GGUF with the model's vocabulary that drafts tokens for 'draft'."),
    ] = None,
    draft_max: Annotated[
        int | None,
        typer.Option("--draft-max", metavar="K", help="Most draft tokens per step (default: ngram 8, draft 4)."),
    ] = None,
    log_level: Annotated[
        str, typer.Option("--log-level", help="uvicorn and server log level: debug, info, warning, error.")
    ] = "info",
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (completions, chat, embeddings, metrics)."""
    from toy_serve.settings import Settings

    if log_level.lower() not in ("critical", "error", "warning", "info", "debug", "trace"):
        raise bad_input(f"--log-level {log_level!r} is not a level", "debug, info, warning or error")
    from toy_serve.settings import named_spec

    key = _read_key(api_key, api_key_file)
    named = [spec for spec in lora or [] if named_spec(spec)]
    adapters = parse_lora_options([spec for spec in lora or [] if not named_spec(spec)])
    with cli_errors():
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
            kv_type=kv_type,
            flash_attn=flash_attn,
            drain_timeout=drain_timeout,
            header_timeout=header_timeout,
            body_timeout=body_timeout,
            constraint_timeout=constraint_timeout,
            max_connections=max_connections,
            cache_ram=cache_ram,
            cache_dir=None if cache_dir is None else str(cache_dir),
            cache_disk=cache_disk,
            slot_save_path=None if slot_save_path is None else str(slot_save_path),
            runs_dir=None if runs_dir is None else str(runs_dir),
            model_alias=alias,
            lora=tuple(adapters),
            adapters=tuple(named),  # type: ignore[arg-type]  # "NAME=PATH[:SCALE]" strings: Settings parses them
            adapter_dirs=tuple(str(d) for d in adapter_dir or ()),
            max_adapters=max_adapters,
            speculative=speculative,
            draft_model=None if draft_model is None else str(draft_model),
            draft_max=draft_max,
            rpc=(rpc,) if rpc else (),
            tensor_split=tensor_split,  # type: ignore[arg-type]  # "A,B" from the command line: Settings parses it
        )
        from toy import store

        _check_runs_dir(settings.runs_dir)
        fetch_if_missing(model)
        path = store.resolve_model(model)  # a missing file or unknown name fails now, before the port is bound
        _check_model(path, settings.ctx, list(adapters) + [(p, sc) for _, p, sc in settings.adapters])
        from toy_serve.conn import bind

        sock = bind(settings.host, settings.port)  # before the model loads: a port in use fails at once
    try:
        _run(settings, sock, log_level.lower())
    finally:
        sock.close()


def _run(settings, sock, level: str) -> None:
    """Serve on the bound ``sock`` until a signal (or a model that fails to load: its CLI error)."""
    import copy

    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    from toy_serve.app import create_app
    from toy_serve.conn import ToyUvicorn, protocol_class

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    logger = logging.getLogger("toy_serve")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if level == "trace" else level.upper())

    app = create_app(settings)
    log_config = copy.deepcopy(LOGGING_CONFIG)  # uvicorn's own format, but the access log goes to stderr too
    for h in log_config.get("handlers", {}).values():
        if h.get("stream") == "ext://sys.stdout":
            h["stream"] = "ext://sys.stderr"
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=port,
        log_level=level,
        log_config=log_config,
        http=protocol_class(settings),
        lifespan="on",
    )
    server = ToyUvicorn(config, app.state.toy)
    fatal: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        server.should_exit = True

    app.state.toy.on_fatal = on_fatal
    shown = f"[{settings.host}]" if ":" in settings.host else settings.host
    with_lora = "".join(f" + LoRA {Path(p).name}×{sc:g}" for p, sc in settings.lora)
    typer.echo(f"toy serve: {settings.alias}{with_lora} on http://{shown}:{port}/v1 (loading the model…)", err=True)
    try:
        with _Quiet():
            server.run(sockets=[sock])
    finally:
        logger.removeHandler(handler)
    if fatal:
        raise _load_error(fatal[0])


def _load_error(e: BaseException) -> Exception:
    """The CLI error for a model that failed to load: exit 2 for bad input (a malformed GGUF, a value out
    of range), 1 for other failures, classified as ``toy infer`` does (``toy_cli.ui.as_cli_error``)."""
    err = as_cli_error(e)
    if err is None:  # not a toy error: a failure
        return CLIError(f"could not load the model: {e}", getattr(e, "hint", None))
    return CLIError(f"could not load the model: {e}", err.hint, err.code)


def _check_runs_dir(runs_dir: str | None) -> None:
    """The runs dir must be a folder, or creatable: checked before anything is loaded or bound."""
    from toy.errors import BadInputError
    from toy.runs.writer import runs_dir as resolve

    root = resolve(runs_dir)
    hint = "--runs-dir (or $TOY_RUNS_DIR) names a folder for the run bundle; it is created when missing"
    p = root
    while not p.exists() and p != p.parent:  # the nearest part of the path that exists
        p = p.parent
    if p.exists() and not p.is_dir():
        what = "is not a folder" if p == root else f"cannot be created: {p} is not a folder"
        raise BadInputError(f"runs dir {root} {what}", hint=hint)
    if p.exists() and not os.access(p, os.W_OK | os.X_OK):
        raise BadInputError(f"runs dir {root}: {p} is not writable", hint=hint)


def _check_model(path, ctx: int | None, adapters) -> None:
    """What ``toy.load`` checks before the weights (the header, the config, the tokenizer and chat
    template: a file toy cannot run exits 2, as in ``toy infer``), ``--ctx`` against the model's context
    and each adapter against the model, before the port is bound. Costs ~0.6 s for SmolLM2's tokenizer."""
    from toy import models
    from toy.adapters import check_lora
    from toy.engine.generate import DEFAULT_MAX_CTX
    from toy.errors import BadInputError
    from toy.gguf import GGUFFile
    from toy.tokenizer import ChatTemplate, Tokenizer

    with GGUFFile(path) as gf:
        cfg = models.config_from_gguf(gf)
        Tokenizer.from_gguf(gf.metadata)
        ChatTemplate.from_gguf(gf.metadata)
        limit = cfg.context_length or DEFAULT_MAX_CTX
        if ctx is not None and ctx > limit:
            raise BadInputError(
                f"--ctx {ctx} is more than the model's context length {limit}", hint=f"use --ctx {limit} or less"
            )
        if adapters:
            from toy.adapters import load_adapter

            for p, _ in adapters:
                check_lora(load_adapter(p), gf)


__all__ = ["serve"]
