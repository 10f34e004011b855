"""The wire format: OpenAI-shaped request models, errors and response pieces.

Request models are pydantic v2 models with OpenAI's field names; FastAPI
validates bodies against them (and publishes them in /openapi.json).

Decisions:

- Unknown fields are ignored (``extra="ignore"``): the official clients and
  tools send fields toy has no use for (``user``, ``metadata``, ...). Fields
  that would change the result and that toy cannot honour (``suffix``,
  ``best_of`` != n, the legacy ``functions``/``function_call``) are refused
  with 400 instead of being silently dropped.
- Structured output (completions and chat): ``response_format``
  (``{"type": "text"}``, ``{"type": "json_object"}``, or ``{"type":
  "json_schema", "json_schema": {"name", "schema", "strict"}}``, OpenAI's
  shapes; the schema is always enforced, ``strict`` or not), llama.cpp's
  ``json_schema`` (a schema) and ``grammar`` (GBNF, or Lark) fields, and
  ``regex`` (toy extension). At most one of them per request (400
  otherwise). The output is constrained token by token
  (``toy.engine.constrain``); a schema, grammar or regex that cannot be
  compiled is a 400 naming the field and the compiler's message.
- ``logit_bias`` (completions and chat): token ids as decimal strings (the
  JSON keys OpenAI's clients send) -> a number in [-100, 100], added to that
  token's logit before the penalties and filters (``toy.engine.sampling``).
  A key that is not a token id of the model, or a bias out of range, is a
  400 naming ``logit_bias``. The bias does not change reported logprobs,
  which are the model's own (as for the penalties).
- Tool calls (``tools``, ``tool_choice``, ``parallel_tool_calls``, a
  message's ``tool_calls``, ``tool`` messages with ``tool_call_id``) follow
  OpenAI's shapes; how they are rendered, forced and parsed is in
  ``toy_serve.tools``. A named ``tool_choice`` must name a given function,
  ``required`` or a named choice needs ``tools``, function names are unique,
  and a forced call cannot be combined with another output constraint (400
  naming the field). The legacy ``functions`` and ``function_call`` fields
  are refused with 400 (use ``tools``); null, ``[]`` and ``"none"`` are
  accepted as asking for nothing.
- Types are strict (``"0.5"`` is not a number, ``1`` is not a boolean, an
  int is a valid float, an integral float such as ``2.0`` is a valid int as
  JSON Schema says) and NaN/inf are refused: wrong types are the client's
  bug and answer 400 naming the field. Empty prompts, inputs and stop
  strings are refused by the schema itself (``min_length``), so
  /openapi.json states the real constraints.
- Sampling defaults are OpenAI's, not llama.cpp's: temperature 1, top_p 1,
  and the toy extensions off (``top_k`` 0, ``min_p`` 0,
  ``repetition_penalty`` 1). ``penalty_last_n`` (extension, default 64 as
  in toy) is the window the penalties look back over (prompt included).
- temperature 0, or top_p 0, means greedy. ``seed`` -1 means "random"
  (llama.cpp's convention). With a seed, choice i of n uses ``seed + i`` so
  the n choices differ but the request is reproducible.
- ``max_tokens``: completions default to 16 (OpenAI); chat defaults to the
  rest of the context (``max_completion_tokens`` wins over ``max_tokens``);
  an explicit null means the rest of the context. 0 is allowed (scoring).
- ``logprobs`` (completions) and ``top_logprobs`` (chat) go up to 20. In
  the legacy completions shape each ``top_logprobs`` dict holds the top k
  plus the chosen token ("up to logprobs+1 elements", as OpenAI documents).
- A token's text in logprobs is its bytes as UTF-8; a token that is only
  part of a UTF-8 sequence is written ``bytes:\\xNN...`` (OpenAI's legacy
  convention); the chat shape also carries the raw ``bytes``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from toy.engine import constrain
from toy.engine.constrain import Constraint
from toy.engine.sampling import SamplingParams
from toy.tokenizer.chat import ROLE_PATTERN

MAX_N = 8
MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_STOP_CHARS = 1024  # characters in one stop string (matching is linear, but a request stays small)
MAX_ITEMS = 4096  # prompts, inputs, messages per request (the jobs bound is Settings.max_batch)
MAX_IDS = 1_000_000  # token ids in one list (the context bounds them further)
Text = Annotated[str, Field(min_length=1)]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0)]
Ids = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_IDS)]
Prompt = Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_ITEMS)] | Ids
Prompt |= Annotated[list[Ids], Field(min_length=1, max_length=MAX_ITEMS)]
# What a union field must be, for the 400 message (pydantic lists one error per union member otherwise).
UNION_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "input": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": f"a string of 1 to {MAX_STOP_CHARS} characters, a list of at most {MAX_STOP} such strings, or null",
    "content": "a string or a list of {'type': 'text', 'text': ...} parts",
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        """JSON Schema calls 1.0 an integer (and some clients write ints so): in the integer fields an
        integral float becomes an int; any other float still fails the strict int check."""
        ints = _int_fields(cls)
        if not isinstance(data, dict) or not ints:
            return data
        return {k: int(v) if k in ints and isinstance(v, float) and v.is_integer() else v for k, v in data.items()}


@functools.cache
def _int_fields(cls: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for name, f in cls.model_fields.items() if f.annotation in (int, int | None))


class StreamOptions(_Model):
    include_usage: bool = False


class JSONSchemaFormat(_Model):
    name: str = Field("response", max_length=64, description="A name for the schema (not used by toy).")
    description: str | None = Field(None, description="What the response is (not used by toy).")
    schema_: dict[str, Any] | bool = Field(
        True, alias="schema", description="The JSON schema the output follows (absent: any JSON value)."
    )
    strict: bool | None = Field(None, description="Accepted; toy always enforces the schema.")


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text: free output; json_object: one JSON object; json_schema: JSON following json_schema."
    )
    json_schema: JSONSchemaFormat | None = Field(None, description='Required when type is "json_schema".')


class LoraRef(_Model):
    id: int = Field(ge=0, description="The adapter's index in /v1/models' `lora` list (llama-server's form).")
    scale: float | None = Field(None, description="0 leaves the adapter out; else it must be its loaded scale.")


class Speculative(_Model):
    """toy extension: speculative decoding for one request; the output is the same as without it, token for token."""

    type: Literal["none", "ngram", "draft"] = Field(
        "ngram",
        description="none: plain decoding; ngram: prompt lookup (drafts copied from the prompt and text so far); "
        "draft: the server's --draft-model drafts.",
    )
    n: int | None = Field(None, ge=1, le=16, description="ngram: the longest n-gram matched (default 3).")
    n_min: int | None = Field(None, ge=1, le=16, description="ngram: the shortest n-gram matched (default 1).")
    k: int | None = Field(
        None, ge=1, le=64, description="The most draft tokens per step (default: --draft-max, else ngram 8, draft 4)."
    )


class _Sampling(_Model):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # None or "" -> the served model
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, ge=0, le=1)
    top_k: int = Field(0, ge=0, description="toy extension: keep the k most likely tokens (0 = off)")
    min_p: float = Field(0.0, ge=0, le=1, description="toy extension: min-p filter (0 = off)")
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10, description="toy extension: llama.cpp repeat penalty")
    penalty_last_n: int = Field(64, ge=-1, description="toy extension: penalty window (-1 = whole context)")
    seed: int | None = Field(None, ge=-1)  # reduced modulo 2**63 (an exact upper bound would be published as a float)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="toy extension: generate past end-of-generation tokens")
    logit_bias: dict[str, float] | None = Field(
        None,
        description="Token id (a decimal string) -> a bias in [-100, 100], added to that token's logit before "
        "the penalties and filters (greedy too). Logprobs stay the model's own. An id outside the vocabulary "
        "answers 400.",
    )
    response_format: ResponseFormat | None = Field(
        None, description='{"type": "text" | "json_object" | "json_schema"}; the output is constrained to it'
    )
    json_schema: dict[str, Any] | None = Field(
        None, description="llama.cpp extension: a JSON schema the output follows"
    )
    grammar: str | None = Field(
        None, min_length=1, description="llama.cpp extension: a GBNF (or Lark) grammar the output follows"
    )
    regex: str | None = Field(None, min_length=1, description="toy extension: a regex the whole output matches")
    lora: str | list[LoraRef] | None = Field(
        None,
        description="A selectable adapter (`toy serve --lora NAME=PATH`) for this request: its name, or "
        'llama-server\'s `[{"id", "scale"}]` (at most one with a non-zero scale). `model: "<model>:<name>"` '
        "does the same.",
    )
    speculative: Speculative | None = Field(
        None,
        description="toy extension: speculative decoding (default: the server's --speculative). Outputs are "
        "exactly those of plain decoding; the response reports the drafts in timings (draft_n, draft_n_accepted) "
        "and usage.completion_tokens_details.",
    )
    user: str | None = None  # ignored

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None  # refused when non-empty
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # accepted only when equal to n


class TextPart(_Model):
    type: Literal["text"]
    text: str


class FunctionDef(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="The function's name.")
    description: str | None = Field(None, description="What the function does (shown to the model).")
    parameters: dict[str, Any] | None = Field(None, description="The arguments' JSON schema (default: no arguments).")
    strict: bool | None = Field(
        None,
        description=(
            "true: under tool_choice auto, a call the model writes must follow this function's schema "
            "(a forced call always does)."
        ),
    )


class Tool(_Model):
    type: Literal["function"] = Field(description='Always "function".')
    function: FunctionDef = Field(description="The function: name, description, parameters.")


class NamedFunction(_Model):
    name: str = Field(description="A function of `tools`.")


class NamedToolChoice(_Model):
    type: Literal["function"] = Field(description='Always "function".')
    function: NamedFunction = Field(description="The function to call.")


class ToolCallFunction(_Model):
    name: str = Field(description="The function called.")
    arguments: str = Field(description="The arguments, as JSON text.")


class MessageToolCall(_Model):
    id: str | None = Field(None, description="The call's id (a `tool` message answers it by `tool_call_id`).")
    type: Literal["function"] = Field("function", description='Always "function".')
    function: ToolCallFunction = Field(description="The function called and its arguments.")


class ChatMessage(_Model):
    role: str = Field(min_length=1, max_length=64, pattern=f"^{ROLE_PATTERN.pattern}$")  # as the template checks
    content: str | list[TextPart] | None = None
    name: str | None = None  # ignored
    tool_calls: list[MessageToolCall] | None = Field(
        None, max_length=128, description="An assistant message's tool calls (the history of a conversation)."
    )
    tool_call_id: str | None = Field(None, description="A `tool` message: the id of the call it answers.")
    function_call: Any = Field(None, description="Legacy (use `tool_calls`): not null answers 400.")

    def plain(self) -> dict[str, Any]:
        """``{"role", "content"}`` (plus ``tool_calls``/``tool_call_id`` when set) for the chat template:
        text parts joined, "developer" read as "system"."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        d: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_ITEMS)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description='"none": no call; "auto" (the default with tools): the model decides; "required": at least '
        "one call; a named function: a call of it. Forced calls are constrained to the functions' schemas.",
    )
    parallel_tool_calls: bool = Field(True, description="Whether a reply may hold more than one call.")
    functions: list[Any] | None = Field(None, description="Legacy (use `tools`): non-empty answers 400.")
    function_call: Any = Field(None, description='Legacy (use `tool_choice`): anything but null or "none" answers 400.')

    @property
    def tool_mode(self) -> str:
        """none, auto, required or named (what tool_choice comes to with these tools)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class EmbeddingRequest(_Model):
    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # must equal the model's width (no truncation)
    normalize: bool = Field(True, description="toy extension: L2-normalize the vector")
    user: str | None = None


class TokenizeRequest(_Model):
    model: str | None = None
    # llama.cpp's name; vLLM's "prompt" is accepted too (when both are given, content wins)
    content: str = Field(validation_alias=AliasChoices("content", "prompt"))
    # vLLM's name "add_special_tokens" is accepted too (lm-evaluation-harness sends it)
    add_special: bool | None = Field(
        None,
        validation_alias=AliasChoices("add_special", "add_special_tokens"),
        description="add BOS/EOS; null = as the model's file says",
    )


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=MAX_IDS)


class AdapterLoadRequest(_Model):
    """``POST /v1/adapters``: load a LoRA adapter file while serving (toy extension)."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="The name requests use (model '<alias>:<name>' or the lora field): 1-64 letters, digits, "
        "'_', '-' or '.'.",
    )
    path: str = Field(
        min_length=1,
        max_length=4096,
        description="The adapter GGUF; it must resolve (symlinks followed) inside a folder given with "
        "--adapter-dir. A relative path is looked up in those folders, in order.",
    )
    scale: float = Field(1.0, description="The user scale its terms are applied with (as --lora NAME=PATH:SCALE).")


class SlotRequest(_Model):
    """``POST /slots/{id_slot}?action=save|restore``: the slot file (llama-server's API)."""

    filename: str | None = Field(
        None,
        max_length=255,
        description="A bare file name inside the folder given with --slot-save-path (no path separators, no '..').",
    )


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error body (documented in /openapi.json)."""

    error: ErrorDetail


# -- errors


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_TYPE_NAMES = {"str", "int", "float", "bool", "none", "dict", "list"}


def _is_tag(part: object) -> bool:
    """Whether a loc entry is a union-member tag pydantic adds (``str``, ``list[constrained-int]``,
    ``TextPart``), not a field name (those are lowercase identifiers) or an index."""
    return isinstance(part, str) and ("[" in part or "-" in part or part in _TYPE_NAMES or part[:1].isupper())


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """400 for a pydantic/FastAPI validation error list. ``param`` is the dotted path of the error without
    union-member tags (``prompt.list[constrained-int].0`` -> ``prompt.0``). For a union field, an error that
    is not a type mismatch (the value had the member's type but broke a constraint) is the one reported;
    when every member's type mismatched, the message says what the field must be."""
    if not errors:
        return APIError(400, "invalid request body")
    if errors[0].get("type") == "json_invalid":
        loc = errors[0].get("loc", ())
        where = f" at character {loc[1]}" if len(loc) > 1 else ""
        return APIError(400, f"the request body is not valid JSON (parse error{where})", code="invalid_json")
    field = tuple(errors[0].get("loc", ())[:2])
    same = [e for e in errors if tuple(e.get("loc", ())[:2]) == field]
    e = next((x for x in same if not str(x.get("type", "")).endswith("_type")), errors[0])
    loc = list(e.get("loc", ()))
    loc = loc[1:] if loc[:1] in (["body"], ["query"], ["path"]) else loc  # a path or query parameter: its name
    path: list[str] = []
    for part in loc:
        if _is_tag(part):
            hint = UNION_HINTS.get(path[-1] if path else "")
            if hint and str(e.get("type", "")).endswith("_type"):
                return APIError(400, f"{'.'.join(path)} must be {hint}", param=".".join(path))
            continue
        path.append(str(part))
    if not path:
        return APIError(400, "the request body must be a JSON object (Content-Type: application/json)")
    param = ".".join(path)
    return APIError(400, f"{param}: {e.get('msg', 'invalid value')}", param=param)


_API_NAME = {"repeat_penalty": "repetition_penalty", "stop_tokens": "stop"}  # toy's SamplingParams -> the API


def param_of(
    field: str | None,
    request: type[BaseModel] | None,
    default: str | None = None,
    logprobs_field: str = "logprobs",
) -> str | None:
    """The ``param`` for a toy error's ``field`` (``toy.errors.BadInputError.field``, in toy's names): its
    first part translated to the API's name (``repeat_penalty`` -> ``repetition_penalty``, ``logprobs`` ->
    ``logprobs_field``), kept when ``request`` (the endpoint's request model) has such a field; otherwise
    ``default``, the endpoint's input field (no field, ``prompt`` on chat, an engine-internal name)."""
    if field is None or request is None:
        return default
    head, dot, rest = field.partition(".")
    head = _API_NAME.get(head, head)
    if head == "logprobs":
        head = logprobs_field
    return head + dot + rest if head in request.model_fields else default


def refuse_unsupported(req: _Sampling) -> None:
    """400 for options toy cannot honour (see the module docstring)."""
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise APIError(400, "suffix (insertion) is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of must equal n (server-side ranking is not supported)", param="best_of")
    if isinstance(req, ChatCompletionRequest):
        _check_tools(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")


def _check_tools(req: ChatCompletionRequest) -> None:
    """400 for tool fields that cannot be honoured (see the module docstring)."""
    if req.functions:
        raise APIError(400, "functions is the legacy form of tools; send tools instead", param="functions")
    if req.function_call is not None and req.function_call != "none":
        raise APIError(400, "function_call is the legacy form of tool_choice; send tool_choice", param="function_call")
    for i, m in enumerate(req.messages):
        if m.function_call is not None:
            raise APIError(
                400, f"messages.{i}.function_call is legacy; send tool_calls", param=f"messages.{i}.function_call"
            )
    names = [t.function.name for t in req.tools or []]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise APIError(400, f"tools: the function {dup!r} is given twice", param="tools")
    forced = req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice)
    if forced and not req.tools:
        raise APIError(400, "tool_choice asks for a call but no tools are given", param="tool_choice")
    if isinstance(req.tool_choice, NamedToolChoice) and req.tool_choice.function.name not in names:
        msg = f"tool_choice names {req.tool_choice.function.name!r}, which is not one of the tools"
        raise APIError(400, msg, param="tool_choice")
    other = req.response_format is not None and req.response_format.type != "text"
    constrained = other or req.json_schema is not None or req.grammar is not None or req.regex is not None
    if forced and constrained:
        raise APIError(400, "a forced tool call and another output constraint cannot be combined", param="tool_choice")
    if req.tool_mode == "auto" and constrained and any(t.function.strict for t in req.tools or []):
        msg = "a strict function (its calls are constrained) and another output constraint cannot be combined"
        raise APIError(400, msg, param="tools")


def speculative_of(req: _Sampling) -> dict[str, Any] | None:
    """The request's ``speculative`` field as ``toy.engine.speculative.parse_speculative`` takes it (None: the
    server's default)."""
    return None if req.speculative is None else req.speculative.model_dump(exclude_none=True)


def adapter_of(req: _Sampling, from_model: str | None, adapters: Any) -> str | None:
    """The selectable adapter a request asks for (by ``model`` suffix and/or ``lora``), or None.
    ``adapters``: (name, path, scale) by engine index, None where an unloaded adapter left a hole. A name
    that is not loaded is a 404 ``model_not_found`` (as after ``DELETE /v1/adapters/{name}``)."""
    names = [a[0] for a in adapters if a is not None]
    field: str | None = None
    if isinstance(req.lora, str):
        field = req.lora
        if field not in names:
            known = ", ".join(names) or "this server has none"
            msg = f"lora: no adapter named {field!r} is loaded ({known})"
            raise APIError(404, msg, param="lora", code="model_not_found")
    elif req.lora:
        used = [r for r in req.lora if r.scale is None or r.scale != 0]
        if len(used) > 1:
            raise APIError(400, "lora: one adapter per request (the others with scale 0)", param="lora")
        for r in used:
            if r.id >= len(adapters) or adapters[r.id] is None:
                raise APIError(400, f"lora: no adapter with id {r.id} ({len(names)} loaded)", param="lora")
            name, _, scale = adapters[r.id]
            if r.scale is not None and r.scale != scale:
                msg = f"lora: adapter {r.id} ({name}) is applied at its loaded scale {scale:g}, not {r.scale:g}"
                raise APIError(400, msg, param="lora")
            field = name
    if from_model is not None and field is not None and from_model != field:
        raise APIError(400, f"model names adapter {from_model!r} but lora names {field!r}", param="lora")
    return from_model if from_model is not None else field


def constraint(req: _Sampling, tokenizer: Any, limits: constrain.ConstraintLimits | None = None) -> Constraint | None:
    """The request's output constraint, compiled once (``toy.engine.constrain.prepare``: guarded, under
    ``limits``; 400 naming the field), or None. The constraint returned carries the compiled matcher, which
    each choice's sampler copies, and names the field in its later errors (``origin``)."""
    given: list[tuple[str, Any]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        given.append(("response_format", Constraint.json_object))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError(400, "response_format: type json_schema needs a json_schema object", param="response_format")
        given.append(("response_format.json_schema.schema", lambda: Constraint.json_schema(rf.json_schema.schema_)))
    if req.json_schema is not None:
        given.append(("json_schema", lambda: Constraint.json_schema(req.json_schema)))
    if req.grammar is not None:
        given.append(("grammar", lambda: Constraint.grammar(req.grammar)))
    if req.regex is not None:
        given.append(("regex", lambda: Constraint.regex(req.regex)))
    if not given:
        return None
    if len(given) > 1:
        names = " and ".join(n for n, _ in given)
        raise APIError(400, f"{names} both constrain the output; give one of them", param=given[1][0])
    field, make = given[0]
    try:
        return constrain.prepare(dataclasses.replace(make(), origin=field), tokenizer, limits)
    except constrain.ConstraintError as e:
        raise APIError(400, f"{field}: {e}" + (f" ({e.hint})" if e.hint else ""), param=field) from None


def sampling_params(
    req: _Sampling, *, max_tokens: int, logprobs: int | None, index: int = 0, constraint: Constraint | None = None
) -> SamplingParams:
    """toy's SamplingParams for choice ``index`` of ``req`` (validated: SamplingError names the field)."""
    greedy = req.temperature == 0 or req.top_p == 0
    seed = None if req.seed is None or req.seed < 0 else (req.seed + index) % 2**63
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(
        temperature=0.0 if greedy else float(req.temperature),
        top_k=req.top_k,
        top_p=float(req.top_p) if req.top_p > 0 else 1.0,
        min_p=float(req.min_p),
        repeat_penalty=float(req.repetition_penalty),
        frequency_penalty=float(req.frequency_penalty),
        presence_penalty=float(req.presence_penalty),
        penalty_last_n=req.penalty_last_n,
        seed=seed,
        max_tokens=max_tokens,
        stop=stop,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        logit_bias=logit_bias(req.logit_bias),
        constraint=constraint,
    ).validate()


MAX_TOKEN_ID_DIGITS = 18  # far above any vocabulary; Python refuses int() of more than 4300 digits


def _shown(key: str, limit: int = 40) -> str:
    """A request's key as an error message quotes it: at most ``limit`` characters of it."""
    return repr(key) if len(key) <= limit else f"{key[:limit]!r}… ({len(key)} characters)"


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """The request's ``logit_bias`` as (token id, bias) pairs; 400 for a key that is not a decimal id
    (or has more than ``MAX_TOKEN_ID_DIGITS`` digits after its leading zeros: no vocabulary is that large)."""
    out = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            msg = f"logit_bias: key {_shown(key)} is not a token id (a decimal integer)"
            raise APIError(400, msg, param="logit_bias")
        digits = key.lstrip("0") or "0"  # int() refuses more than 4300 digits, leading zeros included
        if len(digits) > MAX_TOKEN_ID_DIGITS:
            msg = f"logit_bias: key {_shown(key)} is not a token id of this model (too large)"
            raise APIError(400, msg, param="logit_bias")
        out.append((int(digits), float(value)))
    return tuple(out)


# -- response pieces


def token_text(tokenizer: Any, token_id: int) -> str:
    """A token's text for logprobs: its UTF-8 bytes, or ``bytes:\\xNN`` when they are not whole characters."""
    piece = tokenizer.token_to_piece(int(token_id))
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def finite(v: float | None) -> float | None:
    """A logprob safe for JSON: -inf (a masked token) becomes -9999.0, as OpenAI reports it."""
    return v if v is None or math.isfinite(v) else -9999.0


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    u: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


class LegacyLogprobs:
    """Builds the completions ``logprobs`` object token by token; ``text_offset`` is each token's start in
    the choice text (an incremental decoder keeps it exact across multi-byte characters)."""

    def __init__(self, tokenizer: Any, start: int = 0):
        self.tok = tokenizer
        self.decoder = tokenizer.incremental_decoder()
        self.pos = start
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float | None] | None] = []  # None: not finite (JSON null)
        self.text_offset: list[int] = []

    def add(self, token_id: int, logprob: float | None, top: Any) -> None:
        text = token_text(self.tok, token_id)
        self.tokens.append(text)
        self.token_logprobs.append(finite(logprob))
        if logprob is None:
            self.top_logprobs.append(None)
        else:
            d: dict[str, float | None] = {}
            for i, v in top or ():
                d.setdefault(token_text(self.tok, i), finite(float(v)))
            d.setdefault(text, finite(float(logprob)))
            self.top_logprobs.append(d)
        self.text_offset.append(self.pos)
        self.pos += len(self.decoder.feed(int(token_id)))

    def take(self, since: int = 0) -> dict[str, list]:
        """The entries from index ``since`` on (a stream sends each token's once)."""
        return {
            "tokens": self.tokens[since:],
            "token_logprobs": self.token_logprobs[since:],
            "top_logprobs": self.top_logprobs[since:],
            "text_offset": self.text_offset[since:],
        }


def chat_logprob(tokenizer: Any, token_id: int, logprob: float, top: Any) -> dict[str, Any]:
    """One entry of the chat ``logprobs.content`` list."""

    def one(i: int, v: float) -> dict[str, Any]:
        return {
            "token": token_text(tokenizer, i),
            "logprob": finite(float(v)),
            "bytes": list(tokenizer.token_to_piece(i)),
        }

    return {**one(token_id, logprob), "top_logprobs": [one(int(i), v) for i, v in top or ()]}


__all__ = [
    "APIError",
    "AdapterLoadRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "EmbeddingRequest",
    "ErrorResponse",
    "FunctionDef",
    "JSONSchemaFormat",
    "LoraRef",
    "adapter_of",
    "MessageToolCall",
    "NamedToolChoice",
    "LegacyLogprobs",
    "SlotRequest",
    "StreamOptions",
    "TextPart",
    "TokenizeRequest",
    "Tool",
    "chat_logprob",
    "param_of",
    "ResponseFormat",
    "constraint",
    "refuse_unsupported",
    "sampling_params",
    "token_text",
    "usage",
    "validation_error",
]
