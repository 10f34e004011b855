#!/usr/bin/env python3
"""Generate docs/reference/serve-api.md: the HTTP API of ``toy serve``, from the app's own OpenAPI document.

Input: ``create_app(Settings(model=PLACEHOLDER_MODEL)).openapi()``, the document the server publishes
at ``/openapi.json``. No model is loaded: ``Settings`` does not look at the model file, and
``create_app`` loads the model only in its lifespan (at server startup), which building the app
and asking for its schema never runs. The page therefore depends on the code only, not on a
model file, a device or the network. The error examples on the page are real answers of that
same app, obtained in-process (Starlette's ``TestClient``, lifespan not started): a validation
error and the 503 every model route gives while no model is loaded.

What the schema lacks is kept here, and checked so that it cannot go stale silently:

- ``ROUTES``: a description and the success body of each route (the handlers have no docstrings
  and return untyped JSON). A route of the schema without an entry, or an entry without a
  route, is an error.
- ``FIELD_NOTES``: descriptions of request fields the schema describes not (key ``Model.field``,
  or ``field`` for every model that has it). A field with neither a schema description nor a
  note is an error, and so is a note that no field uses (because the field is gone, or the
  schema describes it now).
- ``STATUS_NOTES``: what each status code means for this server; a code the schema lists
  without a note is an error.
- ``ERROR_CODES``: the ``code`` values of error bodies. They are compared with the ``code="..."``
  literals (and the 404/405 code map) in ``toy_serve``'s modules (``ERROR_SOURCES``): a code
  used there but missing here, or listed here but used nowhere, is an error.

FastAPI writes the schema with null defaults left out (``exclude_none``); a field that is not
required and has no default in the schema therefore defaults to null. Output is deterministic:
fields are sorted (required first, then by name), paths by name (``/v1/*`` first), status codes
by number. ``--check`` regenerates in memory and exits 1, with a diff, when the committed page
differs.

Needs toy-serve installed (run it with ``.venv/bin/python``). Usage:
``python tools/serve_api_docs.py [--check]`` (``just api-docs``, ``just api-docs-check``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script, or loaded by path in tests
from _pages import write_or_check  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAGE = Path("docs/reference/serve-api.md")
GUIDE_LINK = "../guide/serving.md"
PLACEHOLDER_MODEL = "model.gguf"  # never opened: the app is not started
SUCCESS_PHRASES = {"Successful Response", "OK (stream)"}  # FastAPI's and toy's generic 200 descriptions


class ApiDocsError(Exception):
    pass


@dataclass(frozen=True)
class Route:
    description: str
    success: str  # the 200 body (the schema leaves it untyped)


ROUTES: dict[tuple[str, str], Route] = {
    ("GET", "/health"): Route(
        "Readiness probe. Needs no API key.",
        '`{"status": "ok"}` once the model is loaded and the engine worker runs.',
    ),
    ("GET", "/metrics"): Route(
        "Prometheus metrics of this server (all named `toy_*`; see [the guide](" + GUIDE_LINK + "#metrics)). "
        "Needs no API key.",
        "The Prometheus text exposition format, `Content-Type: text/plain; version=0.0.4; charset=utf-8`.",
    ),
    ("GET", "/v1/models"): Route(
        "The one model this server serves, as OpenAI lists models. Its `id` is `--alias`, else the model "
        "file's stem; requests may also name the model by its file name or by the path given to `toy serve`.",
        '`{"object": "list", "data": [{"id", "object": "model", "created", "owned_by": "toy", '
        '"max_model_len"}]}`; `max_model_len` (the context of one request, prompt and completion together) '
        "is there once the model is loaded.",
    ),
    ("POST", "/v1/completions"): Route(
        "OpenAI's (legacy) text completions: each prompt is continued `n` times, each continuation a "
        "sequence of its own in the continuous batch. With `echo` and `logprobs` (and `max_tokens` 0) it "
        "scores the prompt's tokens, which is what evaluation harnesses need.",
        '`{"id": "cmpl-<request id>", "object": "text_completion", "created", "model", "choices": [{"index", '
        '"text", "logprobs", "finish_reason"}], "usage": {"prompt_tokens", "completion_tokens", "total_tokens", '
        '"prompt_tokens_details": {"cached_tokens"}}}`. Choices come prompt by prompt, `n` per prompt; '
        '`finish_reason` is `"stop"` (an end-of-generation token or a stop string) or `"length"`. '
        "With `stream: true`: server-sent events, one `data: {...}` chunk per piece of text of one choice "
        "(same `id`, one element in `choices`), a chunk with the choice's `finish_reason` and empty text, "
        "with `stream_options.include_usage` a last chunk with `usage` and no choices, then `data: [DONE]`. "
        "A failure after the stream has started arrives as a chunk holding an error body, before `data: [DONE]`.",
    ),
    ("POST", "/v1/chat/completions"): Route(
        "OpenAI's chat completions: the messages are rendered with the model's own chat template "
        "(from the GGUF file) and the assistant's reply is generated, `n` times.",
        '`{"id": "chatcmpl-<request id>", "object": "chat.completion", "created", "model", "choices": '
        '[{"index", "message": {"role": "assistant", "content"}, "logprobs", "finish_reason"}], "usage"}` '
        '(`usage` as for completions; `logprobs` is `{"content": [{"token", "logprob", "bytes", '
        '"top_logprobs"}]}` when asked for, else null). With `stream: true`: `chat.completion.chunk` events, '
        'first `delta: {"role": "assistant", "content": ""}` for each choice, then `delta: {"content"}` '
        "pieces, then an empty `delta` with the `finish_reason`, an optional usage chunk, and `data: [DONE]`. "
        'With tools, a reply may hold `message.tool_calls` (`[{"id", "type": "function", "function": {"name", '
        '"arguments"}}]`, `content` null when there is no text) and `finish_reason` `"tool_calls"`; streamed, '
        'each call comes as `delta.tool_calls` items `{"index", "id", "type", "function": {"name", "arguments": '
        '""}}` then `{"index", "function": {"arguments"}}`.',
    ),
    ("POST", "/v1/embeddings"): Route(
        "One vector per input: the mean of the model's final hidden states over the input's tokens, "
        "L2-normalized unless `normalize` is false. It is a pooled language-model state, not the output of "
        "a model trained for embeddings.",
        '`{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", '
        '"usage": {"prompt_tokens", "total_tokens"}}`.',
    ),
    ("POST", "/tokenize"): Route(
        "Text to token ids with the model's tokenizer (llama.cpp's and vLLM's path, outside `/v1`).",
        '`{"tokens": [...]}`.',
    ),
    ("POST", "/detokenize"): Route(
        "Token ids to text with the model's tokenizer. An id outside the vocabulary answers 400.",
        '`{"content": "...", "prompt": "..."}` (the same text under llama.cpp\'s key and vLLM\'s).',
    ),
    ("GET", "/tokenizer_info"): Route(
        "The tokenizer's description (vLLM's endpoint): what lm-evaluation-harness's `local-completions` "
        "asks for before it tokenizes through `/tokenize`, so it needs no tokenizer of its own.",
        '`{"tokenizer_class", "bos_token", "eos_token", "unk_token", "pad_token", "chat_template", '
        '"add_bos_token", "add_eos_token", "vocab_size", "model_max_length"}` (token texts; `pad_token` is '
        "the EOS text when the model has no padding token).",
    ),
    ("POST", "/slots/{id_slot}"): Route(
        "llama-server's slot save and restore: `?action=save` writes slot `id_slot`'s tokens and K/V to a "
        "file, `?action=restore` reads one back into the slot, `?action=erase` empties it (see [the guide]("
        + GUIDE_LINK
        + "#slot-save-and-restore)). The body's `filename` is a bare name in the `--slot-save-path` folder "
        "(without the option: 501 `not_implemented`); a slot processing a request answers 409 `slot_busy`; a "
        "file of another model or KV setup answers 400 naming what differs, a missing or damaged one 400 (`param` `filename`).",
        '`{"id_slot", "filename", "n_saved", "n_written", "timings": {"save_ms"}}` (save), `{"id_slot", '
        '"filename", "n_restored", "n_read", "timings": {"restore_ms"}}` (restore), `{"id_slot", "n_erased"}` '
        "(erase; token counts and file sizes in bytes).",
    ),
    ("GET", "/v1/adapters"): Route(
        "The selectable LoRA adapters loaded (toy extension; see [the guide]("
        + GUIDE_LINK
        + "#adapters-at-run-time)): "
        "the start-up ones (`--lora NAME=PATH`) and those loaded through `POST /v1/adapters`, with how many "
        "requests use each.",
        '`{"object": "list", "data": [{"id": "<alias>:<name>", "object": "adapter", "name", "index", "file", '
        '"scale", "sha256", "bytes", "source": "startup" | "api", "loaded_at", "in_use", "status": "loaded" | '
        '"unloading"}]}` (`file` is the file name, never the path; `index` the id llama-server\'s `lora` field '
        "takes).",
    ),
    ("POST", "/v1/adapters"): Route(
        "Load a LoRA adapter file while serving (toy extension). The path must resolve, symlinks followed, "
        "inside a folder given with `--adapter-dir` (403 `path_not_allowed` otherwise, the file never opened; "
        "403 `adapter_loading_disabled` without the option); a missing file, one that is not an adapter or an "
        "adapter for another base model answers 400 naming the mismatch (`param` `path`); a name already "
        "taken 409 `adapter_exists`; more than `--max-adapters` adapters 409 `too_many_adapters`. Decoding of "
        "running requests waits for at most one step. Answers 201.",
        "The adapter's card, as `GET /v1/adapters` lists it (201 Created).",
    ),
    ("DELETE", "/v1/adapters/{name}"): Route(
        "Unload an adapter (toy extension): from now on requests naming it get 404 `model_not_found`; requests "
        "that named it before run to their end, and its memory is freed after the last of them.",
        '200 with the card and `"status": "unloaded"` when no request used it; 202 with `"status": '
        '"unloading"` and `in_use` while some still do. 404 `adapter_not_found` when no adapter has that name.',
    ),
}

# Field descriptions the schema lacks. "Model.field" applies to one model, "field" to every model with it.
FIELD_NOTES: dict[str, str] = {
    "model": "The model to use: the id `/v1/models` lists, the file name, its stem or the path given to "
    "`toy serve`, or `<alias>:<adapter>` for a selectable adapter. Null or empty means the served model; "
    "another model answers 400 `model_not_found`, an adapter that is not loaded 404 `model_not_found`.",
    "user": "Accepted and ignored.",
    "temperature": "Divides the logits before the draw; 0 means greedy (argmax).",
    "top_p": "Nucleus sampling: keep the smallest set of most likely tokens whose probability reaches p. "
    "1 = off; 0 means greedy.",
    "frequency_penalty": "Subtracts `count × value` from the logit of each token seen `count` times in the "
    "penalty window (`penalty_last_n`).",
    "presence_penalty": "Subtracts `value` from the logit of each token seen in the penalty window.",
    "seed": "Seeds the sampler: the same request with the same seed gives the same output. Choice i of n "
    "uses `seed + i`. Null or -1: a random seed.",
    "stop": "Stop strings: the text ends just before the first one generated, and `finish_reason` is "
    '`"stop"`. Matched on the decoded text, wherever token boundaries fall.',
    "n": "Choices to generate (per prompt); each is a sequence of its own. One request may create at most "
    "`min(max_batch, max_queue)` sequences (${jobs_per_request} by default), counting every prompt.",
    "stream": "Answer with server-sent events instead of one JSON body.",
    "stream_options": "Streaming options; see [StreamOptions](#streamoptions).",
    "CompletionRequest.prompt": "What to continue: a string, a list of strings (each gets its own choices), "
    "a list of token ids, or a list of token-id lists.",
    "CompletionRequest.max_tokens": "The most tokens to generate per choice. Null: the rest of the context. "
    "0: none (prompt scoring with `echo` and `logprobs`).",
    "CompletionRequest.logprobs": "Report each token's logprob and the k most likely alternatives at its "
    "position (each `top_logprobs` entry holds the top k plus the chosen token). Logprobs come from the "
    "model's raw distribution, before penalties, filters and temperature.",
    "CompletionRequest.echo": "Put the prompt before the completion in `text`. With `logprobs`, every prompt "
    "token is scored too (the first one has null: nothing precedes it).",
    "CompletionRequest.suffix": "Not supported (insertion): a non-empty string answers 400.",
    "CompletionRequest.best_of": "Accepted only when equal to `n` (no server-side ranking).",
    "ChatCompletionRequest.messages": "The conversation, rendered with the model's chat template.",
    "ChatCompletionRequest.max_tokens": "The most tokens to generate per choice. Null: the rest of the "
    "context. `max_completion_tokens` wins when both are given.",
    "ChatCompletionRequest.max_completion_tokens": "OpenAI's newer name for `max_tokens`; wins over it.",
    "ChatCompletionRequest.logprobs": "Report each generated token's logprob in `logprobs.content`.",
    "ChatCompletionRequest.top_logprobs": "Alternatives to report per token; needs `logprobs: true`.",
    "ChatMessage.role": "Who speaks: `system`, `user` or `assistant` (whatever the model's template "
    "knows); `developer` is read as `system`.",
    "ChatMessage.content": "The text, or a list of text parts joined together; null is empty text.",
    "ChatMessage.name": "Accepted and ignored.",
    "TextPart.type": "Always `text`.",
    "TextPart.text": "The part's text.",
    "StreamOptions.include_usage": "Send a last chunk with `usage` (and empty `choices`) before `data: [DONE]`.",
    "EmbeddingRequest.input": "What to embed: a string, a list of strings, a list of token ids or a list of "
    "token-id lists; one vector per item.",
    "EmbeddingRequest.encoding_format": "`float`: the vector as a list of numbers; `base64`: its "
    "little-endian float32 bytes, base64-encoded.",
    "EmbeddingRequest.dimensions": "Must equal the model's width (no truncation); anything else answers 400.",
    "TokenizeRequest.content": "The text to tokenize (vLLM's name for it, `prompt`, is accepted too).",
    "DetokenizeRequest.tokens": "The token ids to decode.",
    "ErrorResponse.error": "The error.",
    "ErrorDetail.message": "What went wrong, for a person to read.",
    "ErrorDetail.type": "`invalid_request_error`, `permission_error`, `rate_limit_error` or `server_error`.",
    "ErrorDetail.param": "The request field at fault (a dotted path such as `messages.0.content`), or null.",
    "ErrorDetail.code": "A stable code for programs (see [Error codes](#error-codes)), or null.",
}

STATUS_NOTES: dict[str, str] = {
    "200": "Success.",
    "201": "Created: the adapter is loaded.",
    "202": "Accepted: the adapter is being unloaded; requests still use it.",
    "403": "A path outside the `--adapter-dir` folders (`path_not_allowed`), or loading adapters at run time "
    "is off (`adapter_loading_disabled`).",
    "404": "No such path; an adapter that is not loaded.",
    "409": "A conflict with the server's state: a name taken (`adapter_exists`), the adapter limit "
    "(`too_many_adapters`), a slot busy (`slot_busy`).",
    "501": "Not implemented here: slot save and restore without `--slot-save-path` (`not_implemented`).",
    "400": "The request is invalid: a field fails validation (`param` names it), the body is not JSON, the "
    "`model` is another one, prompt plus `max_tokens` exceed the context, the request would create too many "
    "sequences, or it asks for something toy does not support.",
    "401": "An API key is set (`--api-key`) and the request does not carry it as `Authorization: Bearer "
    "<key>`. The answer has `WWW-Authenticate: Bearer`.",
    "413": "The body is larger than the server's limit (`Settings.max_body_bytes`, ${max_body_bytes} bytes by "
    "default).",
    "429": "The queue of sequences waiting for a cache slot is full (`--max-queue`, ${max_queue} by default). "
    "The answer has `Retry-After: 1`.",
    "500": "An unexpected failure; the message holds the request id, the server logs the traceback and "
    "goes on serving.",
    "503": "The model is still loading (`model_loading`) or failed to load, or the server is shutting down "
    "(then with `Retry-After: 1`).",
}
HEALTH_503 = '`{"status": "loading"}`, `{"status": "draining"}`, or `{"status": "error", "message": ...}`'

ERROR_CODES: dict[str, tuple[int, str, str]] = {
    "context_length_exceeded": (400, "invalid_request_error", "prompt plus `max_tokens` exceed the context"),
    "invalid_json": (
        400,
        "invalid_request_error",
        "the body is not valid JSON: a syntax error, not UTF-8, nested more than 64 levels, an integer of more "
        "than 4300 digits",
    ),
    "invalid_value": (400, "invalid_request_error", "a string holds a lone surrogate (`param` names the field)"),
    "invalid_http_request": (
        400,
        "invalid_request_error",
        "uvicorn could not parse the request (a malformed `Content-Length`, request line or header)",
    ),
    "model_not_found": (
        400,
        "invalid_request_error",
        "`model` names a model this server does not serve; 404 when it is `<alias>:<adapter>` (or `lora` names "
        "an adapter) and that adapter is not loaded",
    ),
    "path_not_allowed": (403, "permission_error", "`POST /v1/adapters`: the path is outside every `--adapter-dir`"),
    "adapter_loading_disabled": (403, "permission_error", "`POST /v1/adapters` on a server without `--adapter-dir`"),
    "adapter_not_found": (404, "invalid_request_error", "`DELETE /v1/adapters/{name}`: no adapter has that name"),
    "adapter_exists": (409, "invalid_request_error", "an adapter with that name is loaded, being loaded or unloaded"),
    "too_many_adapters": (409, "invalid_request_error", "`--max-adapters` adapters are loaded"),
    "invalid_api_key": (401, "invalid_request_error", "the API key is missing or wrong"),
    "not_found": (404, "invalid_request_error", "no such path"),
    "slot_busy": (409, "invalid_request_error", "the slot is processing a request"),
    "constraint_compilers_busy": (
        503,
        "server_error",
        "every constraint-compile place is held by compiles still running (with `Retry-After`); try again",
    ),
    "method_not_allowed": (405, "invalid_request_error", "the path exists, the method does not"),
    "request_timeout": (
        408,
        "invalid_request_error",
        "the headers (`--header-timeout`) or the body (`--body-timeout`) did not arrive in time; the connection closes",
    ),
    "request_too_large": (413, "invalid_request_error", "the body is over the size limit"),
    "queue_full": (429, "rate_limit_error", "no room in the queue; retry after `Retry-After` seconds"),
    "internal_error": (500, "server_error", "an unexpected failure (the message holds the request id)"),
    "not_implemented": (501, "server_error", "slot save/restore without `--slot-save-path`"),
    "model_loading": (503, "server_error", "the model is still loading"),
    "too_many_connections": (
        503,
        "server_error",
        "`--max-connections` are open; retry after `Retry-After` seconds (answered before the request is read)",
    ),
}
ERROR_SOURCES = ("adapters.py", "app.py", "conn.py", "guard.py", "jobs.py", "routes.py", "schemas.py", "server.py")

# Real answers of the app without a model (see the module docstring): (title, method, path, JSON body).
EXAMPLES = (
    ("A field out of range (400)", "POST", "/v1/completions", {"prompt": "Hi", "temperature": 3}),
    ("A model route before the model is loaded (503)", "POST", "/v1/completions", {"prompt": "Hi"}),
)


# ----------------------------------------------------------------------------- the schema


def build_app() -> Any:
    from toy_serve import Settings, create_app

    return create_app(Settings(model=PLACEHOLDER_MODEL))


def settings_values(app: Any) -> dict[str, str]:
    """The default settings the notes quote (``${name}`` in a note)."""
    s = app.state.toy.settings
    return {
        "max_body_bytes": str(s.max_body_bytes),
        "max_queue": str(s.max_queue),
        "jobs_per_request": str(s.jobs_per_request),
    }


def fill(text: str, values: dict[str, str]) -> str:
    """``text`` with each ``${name}`` replaced by ``values[name]``."""
    unknown = sorted(set(re.findall(r"\$\{(\w+)\}", text)) - set(values))
    if unknown:
        raise ApiDocsError(f"unknown placeholders: {unknown}")
    out = re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], text)
    if "${" in out:
        raise ApiDocsError(f"unfilled placeholder in {text!r}")
    return out


def load_schema(app: Any | None = None) -> dict[str, Any]:
    """The app's OpenAPI document (a deep copy, as plain JSON)."""
    return json.loads(json.dumps((app or build_app()).openapi()))


def run_examples(app: Any) -> list[tuple[str, str, str, dict, int, dict]]:
    """(title, method, path, request, status, response body) of each of ``EXAMPLES``."""
    from starlette.testclient import TestClient

    out = []
    client = TestClient(app, raise_server_exceptions=True)  # not a context manager: the lifespan never runs
    for title, method, path, body in EXAMPLES:
        r = client.request(method, path, json=body)
        out.append((title, method, path, body, r.status_code, r.json()))
    return out


def source_error_codes() -> set[str]:
    """``code`` values of the error bodies ``toy_serve`` can send, from its source text."""
    import toy_serve

    pkg = Path(toy_serve.__file__).resolve().parent
    found: set[str] = set()
    for name in ERROR_SOURCES:
        text = (pkg / name).read_text(encoding="utf-8")
        found.update(re.findall(r'\bcode="([a-z_]+)"', text))
        found.update(re.findall(r'\b\d{3}:\s*"([a-z_]+)"', text))  # the 404/405 map of the HTTP handler
    return found


# ----------------------------------------------------------------------------- rendering helpers


def slug(text: str) -> str:
    """Python-Markdown's default ``toc`` slug of a heading's text (mkdocs checks every link to one)."""
    value = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def ref_name(ref: str) -> str:
    prefix = "#/components/schemas/"
    if not ref.startswith(prefix):
        raise ApiDocsError(f"unsupported $ref {ref!r}")
    return ref[len(prefix) :]


def num(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, int) and v >= 2**53 and v & (v - 1) == 0:
        return f"2^{v.bit_length() - 1}"  # 2**63 (seeds): JSON carries it as a float
    return str(v)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _members(s: dict) -> list[dict]:
    return s["anyOf"] if "anyOf" in s else [s]


def type_of(s: dict) -> str:
    """A JSON schema's type in words: `string`, array of `integer`, [ChatMessage](#chatmessage), ..."""
    if "$ref" in s:
        name = ref_name(s["$ref"])
        return f"[{name}](#{slug(name)})"
    if "anyOf" in s:
        return " or ".join(dict.fromkeys(type_of(m) for m in s["anyOf"]))
    if "const" in s:
        return f"`{json.dumps(s['const'])}`"
    if "enum" in s:
        return " or ".join(f"`{json.dumps(v)}`" for v in s["enum"])
    t = s.get("type")
    if t == "array":
        return f"array of {type_of(s['items'])}" if "items" in s else "`array`"
    if t == "object":
        extra = s.get("additionalProperties")
        return f"object of {type_of(extra)}" if isinstance(extra, dict) else "`object`"
    if t is None:
        return "any"
    return f"`{t}`"


def _bounds(s: dict) -> str | None:
    lo_key = "minimum" if "minimum" in s else "exclusiveMinimum" if "exclusiveMinimum" in s else None
    hi_key = "maximum" if "maximum" in s else "exclusiveMaximum" if "exclusiveMaximum" in s else None
    if lo_key and hi_key:
        left = "[" if lo_key == "minimum" else "("
        right = "]" if hi_key == "maximum" else ")"
        return f"in {left}{num(s[lo_key])}, {num(s[hi_key])}{right}"
    if lo_key:
        return f"{'>=' if lo_key == 'minimum' else '>'} {num(s[lo_key])}"
    if hi_key:
        return f"{'<=' if hi_key == 'maximum' else '<'} {num(s[hi_key])}"
    return None


def _range(lo: Any, hi: Any, unit: str) -> str | None:
    def units(n: Any) -> str:
        return unit if num(n) == "1" else unit + "s"

    if lo is not None and hi is not None:
        return f"{num(lo)} to {num(hi)} {units(hi)}"
    if lo is not None:
        return f"at least {num(lo)} {units(lo)}"
    if hi is not None:
        return f"at most {num(hi)} {units(hi)}"
    return None


def constraints_of(s: dict) -> str:
    """The constraints of one (non-union) schema, in words."""
    parts = [p for p in (_bounds(s), _range(s.get("minLength"), s.get("maxLength"), "character")) if p]
    if s.get("type") == "array":
        if items := _range(s.get("minItems"), s.get("maxItems"), "item"):
            parts.append(items)
        inner = constraints_of(s["items"]) if isinstance(s.get("items"), dict) else ""
        if inner:
            parts.append(f"each {inner}")
    if "enum" in s and len(s["enum"]) > 1:
        parts.append("one of " + ", ".join(f"`{json.dumps(v)}`" for v in s["enum"]))
    return ", ".join(parts)


def constraints(s: dict) -> str:
    """Constraints of a field; for a union, per member (`string`: ...; array of `string`: ...)."""
    members = [m for m in _members(s) if m.get("type") != "null"]
    if len(members) == 1:
        return constraints_of(members[0])
    out = [f"{type_of(m)}: {c}" for m in members if (c := constraints_of(m))]
    return "; ".join(out)


def default_of(name: str, prop: dict, required: set[str]) -> str:
    if name in required:
        return "*required*"
    if "default" in prop:
        return f"`{json.dumps(prop['default'])}`"
    return "`null`"  # FastAPI leaves null defaults out of the document


class Notes:
    """FIELD_NOTES with a record of which notes were used (an unused note is an error)."""

    def __init__(self) -> None:
        self.used: set[str] = set()

    def description(self, model: str, field: str, prop: dict) -> str:
        if prop.get("description"):
            return prop["description"]
        for key in (f"{model}.{field}", field):
            if key in FIELD_NOTES:
                self.used.add(key)
                return FIELD_NOTES[key]
        raise ApiDocsError(f"{model}.{field} has no description in the schema and no entry in FIELD_NOTES")

    def check(self) -> None:
        unused = sorted(set(FIELD_NOTES) - self.used)
        if unused:
            raise ApiDocsError(
                f"FIELD_NOTES entries no field uses (the field is gone or the schema describes it now): {unused}"
            )


def field_table(name: str, schema: dict, notes: Notes) -> list[str]:
    props = schema.get("properties", {})
    required = set(schema.get("required", []))
    rows = ["| field | type | default | constraints | description |", "|---|---|---|---|---|"]
    for field in sorted(props, key=lambda f: (f not in required, f)):
        p = props[field]
        desc = notes.description(name, field, p)
        rows.append(
            f"| `{field}` | {cell(type_of(p))} | {cell(default_of(field, p, required))} "
            f"| {cell(constraints(p))} | {cell(desc)} |"
        )
    return rows


def refs_in(s: Any) -> set[str]:
    """Names of the component schemas ``s`` refers to, directly or not."""
    if isinstance(s, dict):
        found = {ref_name(s["$ref"])} if "$ref" in s else set()
        for v in s.values():
            found |= refs_in(v)
        return found
    if isinstance(s, list):
        return set().union(*(refs_in(v) for v in s)) if s else set()
    return set()


def closure(names: set[str], components: dict) -> set[str]:
    todo, seen = list(names), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        if n not in components:
            raise ApiDocsError(f"$ref to a schema the document lacks: {n}")
        seen.add(n)
        todo += refs_in(components[n]) - seen
    return seen


def path_key(path: str) -> tuple[bool, str]:
    return (not path.startswith("/v1/"), path)


def operations(schema: dict) -> list[tuple[str, str, dict]]:
    ops = []
    for path in sorted(schema.get("paths", {}), key=path_key):
        for method in sorted(schema["paths"][path]):
            ops.append((method.upper(), path, schema["paths"][path][method]))
    return ops


def response_body(resp: dict) -> str:
    content = resp.get("content") or {}
    parts = []
    for media in sorted(content):
        s = content[media].get("schema") or {}
        what = type_of(s) if s else "JSON" if media == "application/json" else "text"
        parts.append(f"`{media}`: {what}")
    return "; ".join(parts) or "JSON"


def response_meaning(method: str, path: str, code: str, resp: dict) -> str:
    desc = resp.get("description", "")
    if code == "200":
        route = ROUTES[(method, path)]
        return route.success
    if path == "/health" and code == "503":
        return f"{desc[:1].upper()}{desc[1:]}: {HEALTH_503}." if desc else HEALTH_503
    if code not in STATUS_NOTES:
        raise ApiDocsError(f"{method} {path} documents status {code}, which STATUS_NOTES lacks")
    return STATUS_NOTES[code]


# ----------------------------------------------------------------------------- the page


def render(
    schema: dict, examples: list[tuple[str, str, str, dict, int, dict]], codes: set[str], values: dict[str, str]
) -> str:
    """The page. ``examples``: ``run_examples``; ``codes``: ``source_error_codes``; ``values``: ``settings_values``."""
    components = schema.get("components", {}).get("schemas", {})
    ops = operations(schema)
    keys = {(m, p) for m, p, _ in ops}
    if missing := sorted(keys - set(ROUTES)):
        raise ApiDocsError(f"routes without an entry in ROUTES: {missing}")
    if extra := sorted(set(ROUTES) - keys):
        raise ApiDocsError(f"ROUTES entries the schema does not have: {extra}")
    if missing := sorted(codes - set(ERROR_CODES)):
        raise ApiDocsError(f"error codes toy_serve uses that ERROR_CODES lacks: {missing}")
    if extra := sorted(set(ERROR_CODES) - codes):
        raise ApiDocsError(f"ERROR_CODES entries toy_serve no longer uses: {extra}")
    notes = Notes()
    info = schema.get("info", {})
    out = [
        "# Server API (toy serve)",
        "",
        "<!-- Generated by tools/serve_api_docs.py: do not edit; run `just api-docs`. -->",
        "",
        "Generated by `tools/serve_api_docs.py` (run `just api-docs`; `just api-docs-check` fails when this page "
        f"is stale) from the OpenAPI {schema.get('openapi', '?')} document that the `toy serve` app publishes at "
        f"`/openapi.json` (title `{info.get('title', '?')}`). The tool builds the app without loading a model, so "
        "the page follows the code alone. How to run the server and use it from curl, the OpenAI client and "
        f"evaluation harnesses: [Serving]({GUIDE_LINK}).",
        "",
        "- Request bodies are JSON objects: send `Content-Type: application/json`. Fields the server does not "
        "know are ignored; fields it knows but cannot honour are refused with 400.",
        '- Types are strict: `"0.5"` is not a number and `1` is not a boolean, but an integral number such as '
        "`2.0` is a valid integer. NaN and infinities are refused.",
        "- **default**: *required* fields have none. Where the document gives no default, the default is `null` "
        "(FastAPI leaves null defaults out of `/openapi.json`).",
        "- **description**: the schema's own where it has one; otherwise a note kept in the tool, which fails "
        "when a field has neither.",
        "- Every response carries an `x-request-id` header; the same id is in a completion's `id`, in 500 "
        "messages and in the server's run bundle.",
        "",
        "## Endpoints",
        "",
        "| method | path | summary | API key |",
        "|---|---|---|---|",
    ]
    for method, path, op in ops:
        key = "needed when set" if "401" in op.get("responses", {}) else "never"
        anchor = slug(f"{method} {path}")
        out.append(f"| {method} | [`{path}`](#{anchor}) | {cell(op.get('summary', ''))} | {key} |")
    out += [
        "",
        "`GET /openapi.json` serves the document this page is made from (no API key needed). Any other path "
        "answers 404 `not_found`, another method on a known path 405 `method_not_allowed`, both in the "
        "[error shape](#errors).",
    ]
    for method, path, op in ops:
        route = ROUTES[(method, path)]
        out += ["", f"## {method} {path}", ""]
        if op.get("summary"):
            out += [f"**{op['summary']}.** {op.get('description') or route.description}"]
        else:
            out += [op.get("description") or route.description]
        body = op.get("requestBody")
        if body:
            content = body.get("content", {})
            for media in sorted(content):
                s = content[media].get("schema", {})
                refs = [m["$ref"] for m in s.get("anyOf", []) if "$ref" in m]  # an optional body: Model | None
                name = ref_name(s["$ref"]) if "$ref" in s else ref_name(refs[0]) if len(refs) == 1 else None
                need = "required" if body.get("required") else "optional"
                out += ["", f"### Request body: {name or type_of(s)}", ""]
                out += [f"`{media}`, {need}."]
                if name is not None:
                    out += ["", *field_table(name, components[name], notes)]
        out += ["", "### Responses", "", "| status | body | meaning |", "|---|---|---|"]
        responses = op.get("responses", {})
        for code in sorted(responses, key=int):
            resp = responses[code]
            meaning = response_meaning(method, path, code, resp)
            out.append(f"| {code} | {cell(response_body(resp))} | {cell(meaning)} |")

    bodies = {
        ref_name(c["schema"]["$ref"])
        for _, _, op in ops
        for c in op.get("requestBody", {}).get("content", {}).values()
        if "$ref" in c.get("schema", {})
    }
    errors = closure({"ErrorResponse"}, components) if "ErrorResponse" in components else set()
    nested = sorted(closure(bodies, components) - bodies - errors)
    if nested:
        out += ["", "## Shared schemas", "", "Objects that appear inside the request bodies above."]
        for name in nested:
            s = components[name]
            out += ["", f"### {name}", ""]
            if s.get("description"):
                out += [s["description"], ""]
            out += field_table(name, s, notes)

    out += [
        "",
        "## Errors",
        "",
        "Every error, whatever its status, has OpenAI's shape: a JSON object with one field, `error`. The "
        "exceptions are `/health`, which answers 503 with its `status` object, and the `/metrics` text.",
    ]
    for name in sorted(errors, key=lambda n: (n != "ErrorResponse", n)):
        out += ["", f"### {name}", "", *field_table(name, components[name], notes)]
    out += [
        "",
        "### Error codes",
        "",
        "`code` is null for most 400s (a field that fails validation: `param` names it) and for the 503s of a "
        "model that failed to load or a server shutting down. The other values:",
        "",
        "| code | status | type | meaning |",
        "|---|---|---|---|",
    ]
    for code, (status, typ, meaning) in sorted(ERROR_CODES.items(), key=lambda kv: (kv[1][0], kv[0])):
        out.append(f"| `{code}` | {status} | `{typ}` | {cell(meaning)} |")
    out += [
        "",
        "### Examples",
        "",
        "Real answers of the app, obtained by the tool in-process with no model loaded:",
    ]
    for title, method, path, request, status, response in examples:
        out += [
            "",
            f"{title}: `{method} {path}` with `{json.dumps(request)}` answers {status}:",
            "",
            "```json",
            json.dumps(response, indent=2),
            "```",
        ]
    notes.check()
    out.append("")
    return fill("\n".join(out), values)


def generate() -> str:
    app = build_app()
    return render(load_schema(app), run_examples(app), source_error_codes(), settings_values(app))


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed page is stale")
    args = ap.parse_args(argv)
    try:
        text = generate()
    except ApiDocsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return write_or_check(root, PAGE, text, args.check, "serve_api_docs", "api-docs")


if __name__ == "__main__":
    sys.exit(main())
