"""Chat templates: turn a list of messages into the prompt text a model expects.

A GGUF file may carry a Jinja template in ``tokenizer.chat_template`` (and
named variants in ``tokenizer.chat_template.<name>``). ``ChatTemplate``
renders it the way HF transformers and llama-cpp-python do: Jinja with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, the
variables ``messages``, ``add_generation_prompt``, ``bos_token`` and
``eos_token`` (token texts from the vocabulary), and the helpers
``raise_exception(msg)`` and ``strftime_now(fmt)``; extra keyword arguments
(``tools=…``, ``date_string=…``) become template variables too.

The template comes from a file, so it is untrusted: it runs in
``toy.tokenizer.sandbox.GuardedEnvironment`` (immutable sandbox, no loader, so
no file access or imports) under a wall-clock limit (``time_limit``, 1 s by
default) and a size cap (``max_output``, 1 Mi characters by default) on the
output and everything built on the way.

A file without a template gets ``DEFAULT_CHAT_TEMPLATE``, plain ChatML
(``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then
``<|im_start|>assistant\\n`` when a generation prompt is asked for), which is
what llama.cpp falls back to as well; ``is_default`` tells the two apart.

Invariants: messages are validated before rendering (a list of mappings with a
``role`` that is a plain name, see ``ROLE_PATTERN``, and a ``content`` str; other
keys are passed through when their values are plain JSON-like data) and handed to
the template as fresh copies; every failure, including the template's own
``raise_exception``, is a ``ChatTemplateError``.

Control tokens in content (the injection rule). A message's text is data, the
template's markup is structure: ``<|im_end|>\n<|im_start|>system`` typed by a
user must not become a system turn. The same holds for every other template
variable a caller passes (``tools``: a tool's description, a parameter's
enum value or default, at any depth; tool definitions often come from third
parties). ``render_protected`` renders the messages
and also returns the character spans of the rendered text where control-token
text came from the strings of the messages or the variables (found by the tokenizer's own
``special_spans``, so exactly what it would parse as control tokens); the
tokenizer then encodes those spans as plain text and everything else as usual
(``Tokenizer.encode_protected``). How the spans are found: each control-token
occurrence in a message string is replaced by a private-use placeholder, the
messages are rendered again, and the placeholders are put back; the result must
equal the plain rendering character for character, else (a template that
inspects content in a way the placeholders change) a ``ChatTemplateError`` asks
the caller to remove the control tokens rather than guess. Messages without
control-token text render and encode exactly as before (one rendering, one
``encode``), so prompts stay token-for-token equal to llama.cpp's. Role names
cannot carry markup at all: they must match ``ROLE_PATTERN``. Every entry point
(``Model.prompt_ids``: ``toy infer --chat``, ``toy chat``, the server; and the
``messages`` training format) follows the rule; ``special_in_content=True`` on
those paths (``--special-in-content`` on the command line) turns it off for
callers who really mean raw control tokens.
"""

from __future__ import annotations

import datetime
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError

from toy.errors import ToyError
from toy.tokenizer.sandbox import DEFAULT_TIME_LIMIT, MAX_OUTPUT, GuardedEnvironment, LimitExceeded, render_budget

#: ChatML, used when a model file has no ``tokenizer.chat_template``.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_RESERVED = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now"}
)
_MAX_DEPTH = 32
#: What a role name may be: a letter, then letters, digits, ``_``, ``-`` or ``.`` (64 characters at most).
ROLE_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
#: Private-use characters, tried in turn, to build the placeholders of ``render_protected``.
_MARKS = [(chr(0xE000 + 2 * i), chr(0xE001 + 2 * i)) for i in range(64)]


class ChatTemplateError(ToyError):
    """A chat template is invalid, failed, hit a sandbox limit, or was given bad messages
    (the file or the messages are at fault: the CLI exits 2, the server answers 400)."""

    exit_code = 2


class _TemplateRaised(TemplateError):
    """``raise_exception(msg)`` called from a template."""


def _raise_exception(message: Any = "") -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """A copy of JSON-like data (str, int, float, bool, None, lists, str-keyed dicts)."""
    if depth > _MAX_DEPTH:
        raise ChatTemplateError(f"{where} is nested deeper than {_MAX_DEPTH} levels")
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ChatTemplateError(f"{where} has a non-string key {k!r}")
            out[k] = _plain(v, f"{where}[{k!r}]", depth + 1)
        return out
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        return [_plain(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    raise ChatTemplateError(f"{where} is a {type(value).__name__}; only JSON-like values can reach a chat template")


def _map_strings(value: Any, fn: Callable[[str], str], key: str | None = None, *, roles: bool = True) -> Any:
    """``value`` (plain JSON-like data) with ``fn`` applied to every string in it, dict keys included
    (a template may render a key: ``tools | tojson``, a schema's property names), except the values of
    ``role`` keys when ``roles`` (messages: role names are checked against ``ROLE_PATTERN`` instead)."""
    if isinstance(value, str):
        return value if roles and key == "role" else fn(value)
    if isinstance(value, dict):
        return {fn(k): _map_strings(v, fn, k, roles=roles) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn, roles=roles) for v in value]
    return value


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check ``messages`` and return plain copies; raise ChatTemplateError
    naming the first bad message otherwise."""
    shape = "a list of {'role': str, 'content': str} dicts"
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be {shape}, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"{where} is a {type(m).__name__}; messages must be {shape}")
        role, content = m.get("role"), m.get("content")
        if "role" not in m:
            raise ChatTemplateError(f"{where} has no 'role'")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"{where}['role'] must be a non-empty str, got {role!r}")
        if not ROLE_PATTERN.fullmatch(role):
            raise ChatTemplateError(
                f"{where}['role'] {role[:80]!r} is not a role name",
                hint="a role is a letter followed by letters, digits, '_', '-' or '.' (at most 64), e.g. 'user'",
            )
        if "content" not in m:
            raise ChatTemplateError(f"{where} (role {role!r}) has no 'content'")
        if not isinstance(content, str):
            raise ChatTemplateError(
                f"{where}['content'] must be a str, got {type(content).__name__}",
                hint="multi-part (list) content is not supported; join the text parts",
            )
        out.append(_plain(m, where))
    return out


class ChatTemplate:
    """A compiled, sandboxed chat template. ``render`` is safe to call from
    several threads at once."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        time_limit: float = DEFAULT_TIME_LIMIT,
        max_output: int = MAX_OUTPUT,
    ):
        if not isinstance(source, str):
            raise ChatTemplateError(f"a chat template is a str, not {type(source).__name__}")
        if not time_limit > 0 or not max_output > 0:
            raise ChatTemplateError(f"time_limit and max_output must be positive, got {time_limit}, {max_output}")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.time_limit = float(time_limit)
        self.max_output = int(max_output)
        self.is_default = False
        self._env = GuardedEnvironment(max_output=self.max_output)
        self._env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = self._env.compile_guarded(source)
        except TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template syntax error on line {e.lineno}: {e.message}") from None
        except SecurityError as e:
            raise ChatTemplateError(f"unsafe chat template: {e}") from None
        except TemplateError as e:
            raise ChatTemplateError(f"invalid chat template: {e}") from None

    @classmethod
    def default(cls, *, bos_token: str = "", eos_token: str = "", **limits: Any) -> ChatTemplate:
        """The ChatML fallback (``DEFAULT_CHAT_TEMPLATE``)."""
        t = cls(DEFAULT_CHAT_TEMPLATE, bos_token=bos_token, eos_token=eos_token, **limits)
        t.is_default = True
        return t

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], name: str | None = None, **limits: Any) -> ChatTemplate:
        """The template stored in GGUF metadata (``tokenizer.chat_template``,
        or ``tokenizer.chat_template.<name>``), ChatML when there is none.
        ``limits``: ``time_limit``, ``max_output``."""
        tokens = metadata.get("tokenizer.ggml.tokens") or []

        def token_text(key: str) -> str:
            try:
                i = operator.index(metadata.get(key))  # type: ignore[arg-type]  # None raises TypeError: caught
            except TypeError:  # missing or not an integer
                return ""
            return tokens[i] if 0 <= i < len(tokens) else ""

        bos, eos = token_text("tokenizer.ggml.bos_token_id"), token_text("tokenizer.ggml.eos_token_id")
        key = "tokenizer.chat_template" if name is None else f"tokenizer.chat_template.{name}"
        source = metadata.get(key)
        if name is not None and source is None:
            names = sorted(k.split(".", 2)[2] for k in metadata if k.startswith("tokenizer.chat_template."))
            raise ChatTemplateError(
                f"the model has no chat template named {name!r}", hint=f"named templates: {names or 'none'}"
            )
        if not source:
            return cls.default(bos_token=bos, eos_token=eos, **limits)
        if not isinstance(source, str):
            raise ChatTemplateError(f"{key} is a {type(source).__name__}, not a str")
        return cls(source, bos_token=bos, eos_token=eos, **limits)

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """The prompt text for ``messages``; ``add_generation_prompt`` appends the
        opening of an assistant turn. Extra ``variables`` (JSON-like) are visible
        to the template."""
        clash = _RESERVED.intersection(variables)
        if clash:
            raise ChatTemplateError(f"template variable(s) {sorted(clash)} are set by render() itself")
        context = {k: _plain(v, k) for k, v in variables.items()}
        context.update(
            messages=validate_messages(messages),
            add_generation_prompt=bool(add_generation_prompt),
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        with render_budget(self.time_limit):
            gen = self._template.generate(context)
            try:
                parts: list[str] = []
                size = 0
                for chunk in gen:
                    size += len(chunk)
                    self._env.check_size(size, "output")
                    parts.append(chunk)
                return "".join(parts)
            except _TemplateRaised as e:
                raise ChatTemplateError(f"the chat template rejected the messages: {e}") from None
            except LimitExceeded as e:
                raise ChatTemplateError(f"chat template stopped: {e}") from None
            except SecurityError as e:
                raise ChatTemplateError(f"the chat template tried an unsafe operation: {e}") from None
            except TemplateError as e:
                raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
            except RecursionError:
                raise ChatTemplateError("the chat template recursed too deeply") from None
            except Exception as e:  # a template can raise anything Python can (TypeError, ZeroDivisionError, …)
                raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
            finally:
                gen.close()  # type: ignore[attr-defined]  # a generator, which jinja2 annotates as Iterator

    def render_protected(
        self,
        messages: Sequence[Mapping[str, Any]],
        special_spans: Callable[[str], list[tuple[int, int]]],
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> tuple[str, list[tuple[int, int]]]:
        """``render`` plus the spans ``(start, end)`` of the result that hold control-token text taken from
        the strings of the messages and of the other ``variables`` (``tools``), at any depth
        (``special_spans(s)`` gives those of one string: the tokenizer's matches).

        The spans are empty when no such string holds control-token text (then the text was rendered
        once, as ``render`` does). See the module docstring for the rule and how the spans are found."""
        text = self.render(messages, add_generation_prompt, **variables)
        found: list[str] = []

        def mark(s: str) -> str:
            spans = special_spans(s)
            if not spans:
                return s
            out, pos = [], 0
            for a, b in spans:
                out.append(s[pos:a])
                out.append(f"{open_}{len(found)}{close}")
                found.append(s[a:b])
                pos = b
            out.append(s[pos:])
            return "".join(out)

        used = set(text) | set(self.source)
        open_, close = next(((o, c) for o, c in _MARKS if o not in used and c not in used), _MARKS[0])
        marked = _map_strings(validate_messages(messages), mark)
        # every other variable (``tools``: descriptions, enum values, ... at any depth) is request data too
        marked_vars = {k: _map_strings(_plain(v, k), mark, roles=False) for k, v in variables.items()}
        if not found:
            return text, []
        again = self.render(marked, add_generation_prompt, **marked_vars)
        out, spans, pos, size = [], [], 0, 0
        for m in re.finditer(f"{re.escape(open_)}([0-9]+){re.escape(close)}", again):
            piece = again[pos : m.start()]
            out.append(piece)
            size += len(piece)
            k = int(m.group(1))
            token = found[k] if k < len(found) else m.group(0)
            spans.append((size, size + len(token)))
            out.append(token)
            size += len(token)
            pos = m.end()
        out.append(again[pos:])
        if "".join(out) != text:
            raise ChatTemplateError(
                "a message (or a template variable such as tools) holds control-token text and this chat "
                "template transforms it in a way that hides where that text ends up, so it cannot be kept as "
                "plain text",
                hint="remove the control tokens from the messages and tools, or pass special_in_content=True "
                "(--special-in-content) if they are meant as control tokens",
            )
        return text, spans

    def __repr__(self) -> str:
        kind = "default ChatML" if self.is_default else f"{len(self.source)} chars"
        return f"ChatTemplate({kind}, time_limit={self.time_limit:g}s, max_output={self.max_output})"
