"""Tool calls for /v1/chat/completions: rendering the tools, forcing and parsing the calls.

The wire format inside the model's text is the Hermes/Qwen one, which
Qwen2.5's own template (and many fine-tunes) use::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Decisions:

- Rendering: when the model's chat template knows tools (its source reads a
  ``tools`` variable) the request's tools go to it as ``tools`` (OpenAI's
  ``{"type": "function", "function": {...}}`` items) and the history's
  assistant ``tool_calls`` and ``tool`` messages are passed as they are
  (arguments as objects), so the template's own syntax is used. Otherwise
  (SmolLM2's ChatML template) toy's documented default: a system block that
  lists the functions as JSON inside ``<tools></tools>`` and asks for the
  format above is put before the first system message's text (or becomes the
  system message); past calls are written into the assistant's text in that
  format and ``tool`` results become user turns
  ``<tool_response>...</tool_response>``.
- ``tool_choice``: ``"none"`` renders no tools and parses nothing (the reply
  is text, never a call); ``"auto"`` (the default when tools are given)
  renders them and parses what the model writes; ``"required"`` and a named
  function force a call with a constraint (a Lark grammar: one call, or one
  or more with ``parallel_tool_calls``, each argument object constrained to
  its function's JSON schema, numbers bounded as in ``toy.engine.constrain``;
  parameters with local ``$ref`` pointers, as pydantic writes them
  (``"$ref": "#/$defs/City"``), are moved under the call schema's own
  ``$defs`` with their pointers rewritten, see ``call_schema``).
  Under ``"auto"`` a function's ``strict: true`` constrains the reply too
  (``strict_auto``): the model may write any text, or text and then calls;
  once it writes ``<tool_call>`` the block must be a call of a given
  function whose arguments follow its schema when the function is strict
  (any object when it is not), and only further calls may follow (one call
  without ``parallel_tool_calls``). Without a strict function ``"auto"`` is
  unconstrained; a block that does not parse, or names no given function,
  stays in the text content.
- Parsing: every complete ``<tool_call>...</tool_call>`` block holding a JSON
  object with a ``name`` of a given function and an ``arguments`` object
  becomes a call (``id`` ``call_<24 hex>``, ``arguments`` re-serialized as
  compact JSON text). The text outside the blocks is the content (null when
  only whitespace); ``finish_reason`` is ``"tool_calls"`` when there is a
  call (OpenAI's), else what generation ended with.
- Streaming: text is streamed as content until ``<tool_call>`` begins; a call
  is sent when its block is complete, as two deltas in OpenAI's chunk shape
  (``{"index", "id", "type": "function", "function": {"name", "arguments":
  ""}}`` then ``{"index", "function": {"arguments": "<json>"}}``); whitespace
  between and after calls is not content. The streamed and the plain reply
  are built by the same ``ToolParser``, so they reassemble to the same message.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from typing import Any

from toy.engine.constrain import Constraint, ConstraintError, bounded_numbers

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
EMPTY_PARAMS = {"type": "object", "properties": {}}

DEFAULT_SYSTEM = (
    "You are a function calling AI model. You may call one or more functions to assist with the user query. "
    "Here are the available functions:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_knows_tools(template: Any) -> bool:
    return bool(re.search(r"\btools\b", getattr(template, "source", "") or ""))


def _arguments_obj(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def render_messages(messages: list[dict[str, Any]], tools: list[dict], native: bool) -> list[dict[str, Any]]:
    """``messages`` (plain dicts: role, content, maybe ``tool_calls``/``tool_call_id``) ready for the template,
    with ``tools`` (OpenAI items; empty: none rendered) in toy's default form unless ``native``."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        calls = m.get("tool_calls") or []
        if native:
            d: dict[str, Any] = {"role": role, "content": content}
            if calls:
                d["tool_calls"] = [
                    {"id": c.get("id"), "type": "function", "function": {
                        "name": c["function"]["name"], "arguments": _arguments_obj(c["function"]["arguments"])}}
                    for c in calls
                ]  # fmt: skip
            if m.get("tool_call_id") is not None:
                d["tool_call_id"] = m["tool_call_id"]
            out.append(d)
            continue
        if calls:
            blocks = [
                f"{OPEN}\n"
                + json.dumps({"name": c["function"]["name"], "arguments": _arguments_obj(c["function"]["arguments"])})
                + f"\n{CLOSE}"
                for c in calls
            ]
            content = "\n".join(([content] if content else []) + blocks)
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools and not native:
        block = DEFAULT_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": "system", "content": block + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


# keywords whose value is a map of name -> subschema (a name may be any string, "$ref" or "enum" too)
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# keywords whose value is data, not a schema: a "$ref" key inside is not a reference
_DATA = frozenset({"enum", "const", "default", "examples"})


def relocate(schema: Any, base: str) -> Any:
    """``schema`` as it reads when moved to the JSON pointer ``base`` (``#/$defs/tool0``) of a larger
    document: every local ``$ref`` (``#``, ``#/$defs/City``, ``#/properties/a``, at any depth, in its own
    ``$defs``/``definitions`` too) is prefixed with ``base``, so it names the same place after the move.
    Other references (``#anchor``, remote URIs) and data (``enum``, ``const``, ``default``, ``examples``)
    are left as they are."""
    if isinstance(schema, list):
        return [relocate(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = base + v[1:]
        elif k in _DATA:
            out[k] = v
        elif k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: relocate(sub, base) for name, sub in v.items()}
        else:
            out[k] = relocate(v, base)
    return out


def call_schema(tools: list[dict], strict_only: bool = False) -> dict[str, Any]:
    """The JSON schema of one call to any of ``tools`` (``strict_only``: the arguments of a function
    without ``strict`` are any object). A function's parameters that refer to themselves (``$ref``:
    pydantic's ``#/$defs/City``, a recursive ``#``) move to ``#/$defs/tool<N>`` of the call schema (N its
    index in ``tools``, so two functions' ``City`` never clash), their references rewritten by
    ``relocate``, and ``arguments`` refers to them there; parameters without references stay inline."""
    options, defs = [], {}
    for i, t in enumerate(tools):
        f = t["function"]
        params = f.get("parameters") or EMPTY_PARAMS
        if strict_only and not f.get("strict"):
            params = {"type": "object"}
        args = bounded_numbers(params)
        key = f"tool{i}"
        moved = relocate(args, f"#/$defs/{key}")
        if moved != args:  # it holds a local reference: resolve it where the parameters now live
            defs[key], args = moved, {"$ref": f"#/$defs/{key}"}
        options.append({
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": args},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })  # fmt: skip
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**({"$defs": defs} if defs else {}), **schema, "x-guidance": {"whitespace_flexible": False}}


def forced_call(tools: list[dict], parallel: bool) -> Constraint:
    """A constraint that makes the reply one call (or, with ``parallel``, one or more) of ``tools``."""
    call = f'call: "{OPEN}\\n" %json {json.dumps(call_schema(tools))} "\\n{CLOSE}"'
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return Constraint.grammar(f"{start}\n{call}\n")


def strict_auto(tools: list[dict], parallel: bool) -> Constraint | None:
    """Under ``tool_choice: "auto"``: None when no function is ``strict``; else a constraint that lets the
    model write text, or text and then calls (one, or several with ``parallel``) whose arguments follow
    the strict functions' schemas. The text before a call is a lazy lexeme ending at ``<tool_call>``."""
    if not any(t["function"].get("strict") for t in tools):
        return None
    body = f'call: "\\n" %json {json.dumps(call_schema(tools, strict_only=True))} "\\n{CLOSE}"'
    more = f' ("\\n" "{OPEN}" call)*' if parallel else ""
    lines = [
        f"start: text | text_then_call call{more}",
        "text: /(?s:.*)/",
        f'text_then_call[stop="{OPEN}"]: /(?s:.*)/',
        body,
    ]
    return Constraint.grammar("\n".join(lines) + "\n")


def blame(tools: list[dict], used: list[dict], compile_schema: Callable[[dict], Any]) -> tuple[str, str] | None:
    """After the call grammar over ``used`` failed to compile: ``(field, message)`` for the first function
    of ``used`` (in ``tools`` order) whose ``parameters`` do not compile on their own as a JSON schema
    (``compile_schema(parameters)`` raises ``ConstraintError``): ``field`` is ``tools.N.function.parameters``
    (N its index in ``tools``), ``message`` names it and says why, in terms of the schema the client sent
    (never toy's call grammar). None when each compiles alone. Any other exception of ``compile_schema``
    (a spent time budget) propagates."""
    for i, t in enumerate(tools):
        params = t["function"].get("parameters")
        if not any(u is t for u in used) or not isinstance(params, dict):
            continue
        try:
            compile_schema(params)
        except ConstraintError as e:
            where = f"tools.{i}.function.parameters"
            hint = f" ({e.hint})" if e.hint else ""
            return where, f"{where} (function {t['function']['name']!r}): {e}{hint}"
    return None


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolParser:
    """Splits generated text into content and tool calls as it arrives: ``feed(text)`` and ``finish()``
    return deltas, each ``("content", text)`` or ``("call", {"name", "arguments"})``."""

    def __init__(self, names: set[str]):
        self.names = names
        self.buf = ""
        self.in_call = False
        self.calls: list[dict[str, str]] = []
        self.content: list[str] = []
        self.ws = ""  # whitespace held back: content only if more text follows (never around calls)
        self.block_ws = ""  # the whitespace before the open block

    def _content(self, text: str) -> list[tuple[str, Any]]:
        """Emit ``text`` as content, holding back its trailing whitespace (dropped if a call follows)."""
        body = text.rstrip()
        if not body:
            self.ws += text
            return []
        out, self.ws = self.ws + body, text[len(body) :]
        self.content.append(out)
        return [("content", out)]

    def _block(self, body: str) -> list[tuple[str, Any]]:
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or obj.get("name") not in self.names or not isinstance(args, dict):
            return self._content(f"{self.block_ws}{OPEN}{body}{CLOSE}")  # not a call of a given function: text
        call = {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False, separators=(",", ":"))}
        self.calls.append(call)
        return [("call", call)]

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        out: list[tuple[str, Any]] = []
        while True:
            if self.in_call:
                end = self.buf.find(CLOSE)
                if end < 0:
                    return out
                out += self._block(self.buf[:end])
                self.block_ws = ""
                self.buf, self.in_call = self.buf[end + len(CLOSE) :], False
                continue
            start = self.buf.find(OPEN)
            if start >= 0:
                out += self._content(self.buf[:start])
                self.block_ws, self.ws = self.ws, ""  # kept only if the block turns out not to be a call
                self.buf, self.in_call = self.buf[start + len(OPEN) :], True
                continue
            keep = next(
                (k for k in range(min(len(OPEN) - 1, len(self.buf)), 0, -1) if OPEN.startswith(self.buf[-k:])), 0
            )
            out += self._content(self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep :]
            return out

    def finish(self) -> list[tuple[str, Any]]:
        rest = (self.block_ws + OPEN if self.in_call else "") + self.buf
        self.buf, self.in_call = "", False
        out = self._content(rest)
        if self.ws and self.content and not self.calls:  # plain text keeps its trailing whitespace
            self.content.append(self.ws)
            out.append(("content", self.ws))
        self.ws = ""
        return out

    def message_content(self) -> str | None:
        text = "".join(self.content)
        return text if text.strip() else None


__all__ = [
    "CLOSE",
    "NAME_RE",
    "OPEN",
    "ToolParser",
    "blame",
    "call_schema",
    "forced_call",
    "new_call_id",
    "relocate",
    "render_messages",
    "template_knows_tools",
]
