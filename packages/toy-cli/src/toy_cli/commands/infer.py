"""`toy infer` and `toy chat`: generate text from a llama-family GGUF model.

Output rules: generated text streams to stdout as it is produced; timings
(prefill and decode tok/s, time to first token) go to stderr; ``--json``
prints one JSON object (ids, text, timings) instead of streaming. Ctrl-C
stops the current reply at the next token (a SIGINT handler sets a flag; no
exception lands in the middle of a compute): `toy infer` then exits 130
after printing what it has, `toy chat` returns to its prompt.

Structured output (`toy infer`): ``--json-schema FILE`` (a JSON schema),
``--grammar FILE`` (GBNF as llama.cpp takes it, or Lark), ``--regex TEXT``
or ``--json-mode`` (any JSON object) constrain the output token by token
(``toy.engine.constrain``); at most one of them. A file that cannot be read,
a schema that is not JSON, or one the compiler refuses exits 2 naming it.

``--speculative ngram|draft`` (`toy infer`) decodes speculatively
(``Model.generate(speculative=...)``, ``toy.engine.speculative``): prompt
lookup, or a ``--draft-model`` GGUF with the same vocabulary (``--draft-model``
alone implies ``draft``); ``--draft-max K`` caps the drafts per step. The
output is the same as without it, token for token; the timings line adds the
accepted drafts.

``--lora ADAPTER[:SCALE]`` (repeatable, both commands) applies LoRA adapters
at inference (``toy.load(..., lora=...)``; several stack). A missing file, a
scale that is not a number, or an adapter that does not fit the model exits 2
with ``error:`` and a hint, before anything is generated.

``--rpc HOST:PORT[,...]`` (both commands) splits the model's layers between
this machine and the ``toy rpc-server``s named (``--tensor-split`` sets the
shares); a line on stderr says where the layers went, and ``--json`` gives
it as ``placement``. An endpoint that cannot be used exits 1 before
anything is generated, and one lost mid-reply exits 1 with one ``error:``
line naming it (the text so far stays on stdout).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from toy_cli.ui import (
    DEFAULT_MODEL,
    Batch,
    CLIError,
    Ctx,
    Device,
    Rpc,
    TensorSplit,
    Threads,
    cli_errors,
    fetch_if_missing,
    parse_lora_options,
)

# Options shared by infer and chat (typer reads them from the signatures).
Temp = Annotated[float, typer.Option("--temperature", "--temp", help="0 = greedy.", rich_help_panel="Sampling")]
TopK = Annotated[
    int, typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).", rich_help_panel="Sampling")
]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (1 = off).", rich_help_panel="Sampling")]
MinP = Annotated[
    float,
    typer.Option("--min-p", help="Drop tokens below p x the top probability (0 = off).", rich_help_panel="Sampling"),
]
RepPen = Annotated[
    float, typer.Option("--repeat-penalty", help="llama.cpp repetition penalty (1 = off).", rich_help_panel="Sampling")
]
FreqPen = Annotated[
    float, typer.Option("--frequency-penalty", help="OpenAI frequency penalty (-2..2).", rich_help_panel="Sampling")
]
PresPen = Annotated[
    float, typer.Option("--presence-penalty", help="OpenAI presence penalty (-2..2).", rich_help_panel="Sampling")
]
PenN = Annotated[
    int,
    typer.Option(
        "--penalty-last-n", help="Tokens the penalties look back over (-1 = all).", rich_help_panel="Sampling"
    ),
]
Seed = Annotated[int | None, typer.Option("--seed", help="Same seed, same text.", rich_help_panel="Sampling")]
Stop = Annotated[
    list[str] | None, typer.Option("--stop", help="Stop at this string (repeatable).", rich_help_panel="Sampling")
]
Greedy = Annotated[bool, typer.Option("--greedy", help="Temperature 0 (argmax).", rich_help_panel="Sampling")]
IgnoreEos = Annotated[
    bool, typer.Option("--ignore-eos", help="Keep going past end-of-generation tokens.", rich_help_panel="Sampling")
]
MaxTok = Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate.")]
Flash = Annotated[bool, typer.Option("--flash-attn", help="Use flash attention.")]
KvType = Annotated[str, typer.Option("--kv-type", help="KV cache type: f16, f32, q8_0 (q8_0 needs --flash-attn).")]
System = Annotated[str | None, typer.Option("--system", help="System message (chat).")]
RawSpecial = Annotated[
    bool,
    typer.Option(
        "--special-in-content",
        help="Parse control-token text in messages (e.g. <|im_end|>) as control tokens; by default it stays text.",
    ),
]
Lora = Annotated[
    list[str] | None,
    typer.Option(
        "--lora",
        metavar="ADAPTER[:SCALE]",
        help="Apply a LoRA adapter (GGUF) scaled by SCALE (default 1); repeatable, adapters stack.",
    ),
]


def _sampling(**kw):
    """SamplingParams from the CLI flags; a bad value is an exit-2 error."""
    from toy.engine.sampling import SamplingParams

    with cli_errors():
        if kw.pop("greedy"):
            kw["temperature"] = 0.0
        kw["stop"] = tuple(kw["stop"] or ())
        return SamplingParams(**kw).validate()


def _constraint(json_schema: Path | None, grammar: Path | None, regex: str | None, json_mode: bool):
    """The Constraint the structured-output flags ask for, or None; exit 2 for a bad file or two flags."""
    from toy.engine.constrain import Constraint

    given = [n for n, v in (("--json-schema", json_schema), ("--grammar", grammar), ("--regex", regex)) if v]
    given += ["--json-mode"] if json_mode else []
    if len(given) > 1:
        raise CLIError(f"{' and '.join(given)} both constrain the output", "give one of them", 2)
    for flag, path in (("--json-schema", json_schema), ("--grammar", grammar)):
        if path is not None:
            try:
                text = _read_file(path, flag)
            except (OSError, UnicodeDecodeError) as e:
                raise CLIError(f"{flag} {path}: {e.strerror if isinstance(e, OSError) else e}", None, 2) from None
            if flag == "--grammar":
                return Constraint.grammar(text)
            try:
                return Constraint.json_schema(json.loads(text))
            except ValueError as e:
                raise CLIError(f"--json-schema {path} is not valid JSON: {e}", None, 2) from None
    if regex is not None:
        return Constraint.regex(regex)
    return Constraint.json_object() if json_mode else None


def _model(model: str | None, fallback: str | None) -> str:
    """MODEL as given, else the model of the project around the current
    folder (toy.toml's ``model``), else ``fallback``, else an exit-2 error."""
    if model is not None:
        return model
    with cli_errors():
        from toy.project import current

        project = current()
    if project is not None and project.model is not None:
        return project.model
    if fallback is not None:
        return fallback
    raise CLIError(
        "no model",
        "pass MODEL (a GGUF path or a `toy list` name), or run inside a project whose toy.toml sets model",
        2,
    )


def _load(model: str, device, threads, ctx, batch, flash_attn, kv_type, lora=None, rpc=None, tensor_split=None):
    import toy

    with cli_errors():
        fetch_if_missing(model)
        m = toy.load(
            model,
            device=device,
            threads=threads,
            n_ctx=ctx,
            n_batch=batch,
            flash_attn=flash_attn,
            kv_type=kv_type,
            lora=lora or None,
            rpc=rpc or (),
            tensor_split=tensor_split,
        )
    if m.placement.split:
        typer.echo(f"{m.path.name}: {m.describe()}", err=True)
    return m


@contextmanager
def _sigint_flag():
    """Ctrl-C sets flag['hit'] instead of raising while the block runs."""
    flag = {"hit": False}

    def handler(signum, frame):
        flag["hit"] = True

    try:
        old = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread (e.g. under a test runner thread): plain behaviour
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, old)


def _timings_line(g) -> str:
    t = g.timings
    parts = [f"prompt {t.get('prompt_tokens', 0)} tok"]
    if t.get("prompt_cached"):
        parts[-1] += f" ({t['prompt_cached']} cached)"
    if t.get("prefill_tok_s"):
        parts.append(f"prefill {t['prefill_tok_s']:.1f} tok/s")
    if "ttft_s" in t:
        parts.append(f"first token {t['ttft_s'] * 1000:.0f} ms")
    parts.append(f"{len(g.tokens)} tok generated")
    if t.get("decode_tok_s"):
        parts.append(f"decode {t['decode_tok_s']:.1f} tok/s")
    if "draft_tokens" in t:
        parts.append(f"drafts {t['draft_accepted']}/{t['draft_tokens']} accepted")
    parts.append(f"finish: {g.finish_reason}")
    return "; ".join(parts)


def _read_file(path: Path, flag: str) -> str:
    """A text file an option names: refused (exit 2, naming it) when it is not a regular file (a FIFO would
    block, /dev/zero never ends) or holds more than ``toy.inputs.max_record_bytes()`` bytes."""
    from toy.errors import BadInputError
    from toy.inputs import max_record_bytes, regular_file

    try:
        p = regular_file(path, flag)
        limit, size = max_record_bytes(), p.stat().st_size
    except BadInputError as e:
        raise CLIError(f"{flag} {e}", e.hint or f"{flag} names a UTF-8 text file", 2) from None
    if size > limit:
        raise CLIError(
            f"{flag} {path}: {size:,} bytes, more than the {limit:,} one input may hold",
            "give a smaller file (TOY_MAX_RECORD_BYTES raises the bound)",
            2,
        )
    return p.read_text(encoding="utf-8")


def _read_prompt(prompt: str | None, prompt_opt: str | None, prompt_file: Path | None) -> str:
    given = [p for p in (prompt, prompt_opt) if p is not None]
    if prompt_file is not None:
        try:
            given.append(_read_file(prompt_file, "--prompt-file"))
        except (OSError, UnicodeDecodeError) as e:
            why = (
                e.strerror
                if isinstance(e, OSError) and e.strerror
                else f"not UTF-8 text ({e.reason})"
                if isinstance(e, UnicodeDecodeError)
                else e
            )
            raise CLIError(f"{prompt_file}: {why}", "--prompt-file names a UTF-8 text file", 2) from e
    if len(given) > 1:
        raise CLIError("the prompt is given twice", "use one of PROMPT, --prompt or --prompt-file", 2)
    if given and prompt_file is None:
        return given[0]
    if not given and not sys.stdin.isatty():
        given.append(sys.stdin.read())
    if given:
        # one trailing newline from a file or a pipe (`echo text | toy infer`) is not part of the prompt
        return given[0][:-1] if given[0].endswith("\n") else given[0]
    raise CLIError("no prompt", "pass PROMPT, --prompt TEXT, --prompt-file FILE or pipe text to stdin", 2)


def infer(
    model: Annotated[
        str | None,
        typer.Argument(
            help=f"A GGUF path or a model name (e.g. {DEFAULT_MODEL}); inside a project, default: its model "
            "(toy.toml), with the prompt given by --prompt, --prompt-file or stdin.",
            show_default=False,
        ),
    ] = None,
    prompt: Annotated[str | None, typer.Argument(help="The prompt (else --prompt, --prompt-file or stdin).")] = None,
    prompt_opt: Annotated[str | None, typer.Option("--prompt", "-p", help="The prompt.")] = None,
    prompt_file: Annotated[
        Path | None, typer.Option("--prompt-file", "-f", help="Read the prompt from a file.")
    ] = None,
    chat: Annotated[
        bool, typer.Option("--chat", help="Send the prompt as a user message through the chat template.")
    ] = False,
    system: System = None,
    special_in_content: RawSpecial = False,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-tokens", "-n", help="Most tokens to generate (default 256, or what the context has room for)."
        ),
    ] = None,
    temperature: Temp = 0.8,
    top_k: TopK = 40,
    top_p: TopP = 0.95,
    min_p: MinP = 0.05,
    repeat_penalty: RepPen = 1.0,
    frequency_penalty: FreqPen = 0.0,
    presence_penalty: PresPen = 0.0,
    penalty_last_n: PenN = 64,
    seed: Seed = None,
    stop: Stop = None,
    greedy: Greedy = False,
    ignore_eos: IgnoreEos = False,
    logprobs: Annotated[
        int | None, typer.Option("--logprobs", help="With --json: each token's logprob and N alternatives.")
    ] = None,
    json_schema: Annotated[
        Path | None,
        typer.Option("--json-schema", help="Output JSON that follows this JSON schema file.", rich_help_panel="Output"),
    ] = None,
    grammar: Annotated[
        Path | None,
        typer.Option(
            "--grammar", help="Output text this grammar file accepts (GBNF or Lark).", rich_help_panel="Output"
        ),
    ] = None,
    regex: Annotated[
        str | None, typer.Option("--regex", help="Output text this regex matches in full.", rich_help_panel="Output")
    ] = None,
    json_mode: Annotated[
        bool, typer.Option("--json-mode", help="Output one JSON object.", rich_help_panel="Output")
    ] = False,
    device: Device = None,
    threads: Threads = None,
    ctx: Ctx = None,
    batch: Batch = 512,
    flash_attn: Flash = False,
    kv_type: KvType = "f16",
    lora: Lora = None,
    speculative: Annotated[
        str,
        typer.Option(
            "--speculative",
            help="Speculative decoding: none, ngram (prompt lookup) or draft (with --draft-model); the output "
            "is the same token for token, only faster when drafts are accepted.",
        ),
    ] = "none",
    draft_model: Annotated[
        Path | None,
        typer.Option("--draft-model", help="A GGUF with this model's vocabulary that drafts (--speculative draft)."),
    ] = None,
    draft_max: Annotated[
        int | None,
        typer.Option("--draft-max", metavar="K", help="Most draft tokens per step (default: ngram 8, draft 4)."),
    ] = None,
    rpc: Rpc = None,
    tensor_split: TensorSplit = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (ids, text, timings).")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No timings on stderr.")] = False,
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace", metavar="FILE", help="After the reply, write a Chrome/Perfetto trace of one decode step here."
        ),
    ] = None,
) -> None:
    """Generate text from a prompt, streaming it to stdout (timings on stderr)."""
    params = _sampling(
        max_tokens=256 if max_tokens is None else max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repeat_penalty=repeat_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        penalty_last_n=penalty_last_n,
        seed=seed,
        stop=stop,
        greedy=greedy,
        ignore_eos=ignore_eos,
        logprobs=logprobs,
    )
    params = dataclasses.replace(params, constraint=_constraint(json_schema, grammar, regex, json_mode))
    text = _read_prompt(prompt, prompt_opt, prompt_file)
    if system is not None and not chat:
        raise CLIError("--system needs --chat", "add --chat to use the chat template", 2)
    if special_in_content and not chat:
        raise CLIError("--special-in-content needs --chat", "a plain prompt's control tokens are always parsed", 2)
    if logprobs is not None and not as_json:
        raise CLIError("--logprobs needs --json", "add --json to get each token's logprobs", 2)
    if draft_model is not None and speculative == "none":
        speculative = "draft"
    if speculative not in ("none", "ngram", "draft"):
        raise CLIError(f"--speculative {speculative!r} is not a kind", "none, ngram or draft", 2)
    if speculative == "draft" and draft_model is None:
        raise CLIError("--speculative draft needs --draft-model", "give a GGUF with the same tokenizer", 2)
    spec: dict | None = None
    if speculative != "none":
        spec = {"type": speculative, **({"k": draft_max} if draft_max is not None else {})}
        if draft_model is not None:
            spec["model"] = draft_model
    adapters = parse_lora_options(lora)
    m = _load(_model(model, None), device, threads, ctx, batch, flash_attn, kv_type, adapters, rpc, tensor_split)
    try:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        with cli_errors():
            ids = m.prompt_ids(messages, special_in_content) if chat else m.prompt_ids(text)
            if max_tokens is None and len(ids) < m.n_ctx:
                # the default budget shrinks to fit a small context (e.g. a checkpoint
                # trained with 128-token windows); an explicit -n is kept as asked
                params = dataclasses.replace(params, max_tokens=min(params.max_tokens, m.n_ctx - len(ids)))
            stream = m.stream(ids, params, speculative=spec)
        with _sigint_flag() as flag:
            for chunk in stream:
                if not as_json:
                    sys.stdout.write(chunk)
                    sys.stdout.flush()
                if flag["hit"]:
                    stream.close()
                    break
        g = stream.result
        if as_json:
            out = {"model": str(m.path), "prompt_ids": ids, **g.to_dict()}
            if m.adapters:
                out["lora"] = [{"path": p, "scale": sc} for p, sc in m.adapters]
            if m.placement.split:
                out["placement"] = m.placement.to_dict()
            typer.echo(json.dumps(out, ensure_ascii=False))
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()
        if not quiet:
            typer.echo(_timings_line(g), err=True)
        if flag["hit"]:
            raise typer.Exit(130)
        if trace is not None:  # one more decode step, after the prompt and the reply, every node timed
            from toy.trace import trace_decode

            with cli_errors():
                tr = trace_decode(m, [*ids, *g.tokens])
                tr.write(trace)
            typer.echo(f"trace: {trace} (one decode step, {tr.n_nodes} nodes)", err=True)
    finally:
        m.close()


def chat_cmd(
    model: Annotated[
        str | None,
        typer.Argument(
            help=f"A GGUF path or a model name (default: the project's model in toy.toml, else {DEFAULT_MODEL}).",
            show_default=False,
        ),
    ] = None,
    system: System = None,
    special_in_content: RawSpecial = False,
    max_tokens: MaxTok = 512,
    temperature: Temp = 0.8,
    top_k: TopK = 40,
    top_p: TopP = 0.95,
    min_p: MinP = 0.05,
    repeat_penalty: RepPen = 1.0,
    frequency_penalty: FreqPen = 0.0,
    presence_penalty: PresPen = 0.0,
    penalty_last_n: PenN = 64,
    seed: Seed = None,
    stop: Stop = None,
    greedy: Greedy = False,
    device: Device = None,
    threads: Threads = None,
    ctx: Ctx = None,
    batch: Batch = 512,
    flash_attn: Flash = False,
    kv_type: KvType = "f16",
    lora: Lora = None,
    rpc: Rpc = None,
    tensor_split: TensorSplit = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No timings after each reply.")] = False,
) -> None:
    """Chat with a model in the terminal. /reset starts over, /exit (or Ctrl-D) leaves,
    Ctrl-C stops the current reply. The KV cache is kept between turns."""
    params = _sampling(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repeat_penalty=repeat_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        penalty_last_n=penalty_last_n,
        seed=seed,
        stop=stop,
        greedy=greedy,
        ignore_eos=False,
        logprobs=None,
    )
    adapters = parse_lora_options(lora)
    m = _load(
        _model(model, DEFAULT_MODEL), device, threads, ctx, batch, flash_attn, kv_type, adapters, rpc, tensor_split
    )
    interactive = sys.stdin.isatty()
    try:
        session = m.chat(system=system, special_in_content=special_in_content)
        if interactive:
            with_lora = "".join(f" + {Path(p).name}×{sc:g}" for p, sc in m.adapters)
            typer.echo(
                f"{m.path.name}{with_lora} — /reset to start over, /exit to leave, Ctrl-C stops a reply", err=True
            )
        while True:
            try:
                line = input("> " if interactive else "")
            except EOFError:
                break
            except KeyboardInterrupt:
                typer.echo("\n(/exit to leave)", err=True)
                continue
            cmd = line.strip()
            if not cmd:
                continue
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/reset":
                session.reset()
                typer.echo("(conversation reset)", err=True)
                continue
            if cmd.startswith("/"):
                typer.echo(f"unknown command {cmd.split()[0]} (/reset, /exit)", err=True)
                continue
            with cli_errors():
                try:
                    stream = session.send(line, sampling=params)
                except Exception as e:
                    from toy.engine.llm import ContextOverflowError

                    if isinstance(e, ContextOverflowError):
                        typer.echo(f"error: {e} — /reset to start a new conversation", err=True)
                        continue
                    raise
            with _sigint_flag() as flag:
                for chunk in stream:
                    sys.stdout.write(chunk)
                    sys.stdout.flush()
                    if flag["hit"]:
                        stream.close()
                        break
            sys.stdout.write("\n")
            sys.stdout.flush()
            if flag["hit"]:
                typer.echo("(reply stopped)", err=True)
            if not quiet and stream.result is not None:
                typer.echo(_timings_line(stream.result), err=True)
    finally:
        m.close()


def register(app: typer.Typer) -> None:
    app.command("infer")(infer)
    app.command("chat")(chat_cmd)
