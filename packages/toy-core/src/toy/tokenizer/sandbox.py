"""A Jinja sandbox with a wall-clock deadline and size caps, for chat templates.

Chat templates come from model files, so they are untrusted code. Jinja's
``ImmutableSandboxedEnvironment`` already blocks private and dunder attributes
(``__class__``, ``__globals__`` …; here an error instead of a silent undefined),
mutation of lists and dicts, unsafe ``str.format`` and ranges over 100 000
items; there is no loader, and ``include``/``import``/``extends`` are refused
when the template is compiled. ``GuardedEnvironment`` adds the two limits
the sandbox lacks, so that a hostile template can neither run forever nor
exhaust memory:

- time: a per-render deadline (``render_budget``), checked at every attribute
  and item access, call, intercepted operator, filter, every iteration of every
  ``{% for %}`` loop (the parsed template is rewritten so each loop iterates
  through a checking generator; a recursive loop's ``loop(...)`` re-entry is
  checked per call) and every output chunk;
- size: every string or container the template builds through ``+ * % ~``,
  filters, method calls, ``{% set %}`` blocks and macros, and the total output,
  is capped at ``max_output`` items/characters. Operations that could allocate
  a lot in one C call (``*``, ``**``, ``%`` widths, ``center``/``ljust``/
  ``zfill``, ``replace``, ``join``, ``indent``, ``batch``, ``lipsum`` …) are
  checked *before* they run; anything else is checked right after, so it can
  overshoot the cap once, by what one operation on capped inputs allocates.

Invariants: the budget lives in a ``ContextVar``, so one environment can render
in many threads at once; outside ``render_budget`` (e.g. while Jinja
constant-folds at compile time) only the size caps apply. Limits raise
``LimitExceeded``, a ``jinja2.exceptions.SecurityError``; the caller maps Jinja
errors to its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from jinja2 import Template, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum, pass_context
from jinja2.visitor import NodeTransformer

MAX_OUTPUT = 1 << 20  # characters of output, and items/characters of anything built
DEFAULT_TIME_LIMIT = 1.0  # seconds per render
MAX_INT_BITS = 1 << 16  # results of ** (a 65536-bit integer is ~20 000 digits)
MAX_LIPSUM = 100  # paragraphs
_LOOP_GUARD = "__toy_loop_guard"
_CONCAT_GUARD = "__toy_concat_guard"


class LimitExceeded(SecurityError):
    """A render ran past its deadline or built something too large."""


@dataclass(frozen=True)
class _Budget:
    deadline: float
    time_limit: float


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("toy_jinja_budget", default=None)


@contextlib.contextmanager
def render_budget(time_limit: float) -> Iterator[None]:
    """Run a render under a wall-clock limit of ``time_limit`` seconds."""
    token = _budget.set(_Budget(time.monotonic() + time_limit, time_limit))
    try:
        yield
    finally:
        _budget.reset(token)


def tick() -> None:
    """Raise ``LimitExceeded`` once the current render is past its deadline."""
    b = _budget.get()
    if b is not None and time.monotonic() > b.deadline:
        raise LimitExceeded(f"the chat template ran longer than its {b.time_limit:g} s limit")


def _len(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) else 0


_PCT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FMT_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")


def _number(digits: str) -> int:
    # int() refuses very long digit strings; anything over 9 digits is "huge"
    return int(digits) if len(digits) <= 9 else 10**9


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox chat templates render in; see the module docstring."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, max_output: int = MAX_OUTPUT):
        super().__init__(
            loader=None,
            autoescape=False,
            trim_blocks=True,  # as HF transformers and llama-cpp-python render chat templates
            lstrip_blocks=True,
            extensions=[loopcontrols, _GenerationTag],
        )
        self.max_output = max_output
        # {% set %} blocks, macros and filter blocks join through this; jinja2 reads it per instance (the class
        # attribute is "".join), so an instance attribute is how it is replaced
        self.concat = self._concat  # type: ignore[method-assign]
        for name, func in list(self.filters.items()):
            self.filters[name] = self._guard_filter(name, func)
        self.filters["tojson"] = self._guard_filter("tojson", _tojson)
        self.filters[_LOOP_GUARD] = self._loop_guard
        self.filters[_CONCAT_GUARD] = self._concat_guard
        self.globals["lipsum"] = self._lipsum

    # -- compile -------------------------------------------------------------

    def compile_guarded(self, source: str) -> Template:
        """Parse ``source``, route every loop and ``~`` through the guards, compile."""
        tree = self.parse(source)
        tree = _Rewrite().visit(tree)
        return self.from_string(tree)

    # -- checks --------------------------------------------------------------

    def check_size(self, n: int, what: str) -> None:
        if n > self.max_output:
            raise LimitExceeded(f"the chat template built {what} of {n} items, over the {self.max_output} limit")

    def _check_result(self, value: Any, what: str) -> Any:
        self.check_size(_len(value), what)
        return value

    def _check_percent(self, fmt: str, args: Any) -> None:
        for m in _PCT_SPEC.finditer(fmt):
            for g in m.groups():
                if g == "*":
                    for v in args if isinstance(args, tuple) else (args,):
                        if isinstance(v, int):
                            self.check_size(abs(v), "a %-format width")
                elif g is not None:
                    self.check_size(_number(g), "a %-format width")

    def _check_format_spec(self, fmt: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for spec in _FMT_SPEC.findall(fmt):
            for num in re.findall(r"\d+", spec):
                self.check_size(_number(num), "a format width")
        if _NESTED_FIELD.search(fmt):  # "{:>{w}}": the width comes from the arguments
            for v in (*args, *kwargs.values()):
                if isinstance(v, int):
                    self.check_size(abs(v), "a format width")

    def _check_join(self, items: Any, sep: str) -> None:
        if isinstance(items, (list, tuple)):
            total = sum(len(x) for x in items if isinstance(x, str)) + len(sep) * max(len(items) - 1, 0)
            self.check_size(total, "a joined string")

    def _check_replace(self, s: str, old: Any, new: Any, count: Any = -1) -> None:
        if isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
            hits = len(s) + 1 if old == "" else s.count(old)
            if isinstance(count, int) and count >= 0:
                hits = min(hits, count)
            self.check_size(len(s) + hits * (len(new) - len(old)), "a replaced string")

    # -- sandbox hooks -------------------------------------------------------

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # Jinja returns a silent Undefined; refusing outright makes probing visible
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def getattr(self, obj: Any, attribute: str) -> Any:
        tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        tick()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _len(seq) and isinstance(n, int):
                    self.check_size(_len(seq) * max(n, 0), "a repeated sequence")
        elif operator == "+":
            if _len(left) and _len(right):
                self.check_size(_len(left) + _len(right), "a concatenation")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                if abs(left).bit_length() * right > MAX_INT_BITS:
                    raise LimitExceeded(f"the chat template computed a power over {MAX_INT_BITS} bits")
        elif operator == "%" and isinstance(left, str):
            self._check_percent(left, right)
        return self._check_result(super().call_binop(context, operator, left, right), f"the result of {operator!r}")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        tick()
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, str):
            __self._check_str_method(owner, name, args, kwargs)
        wrapped = getattr(__obj, "__wrapped__", None)  # the sandbox's str.format wrapper
        if isinstance(fmt := getattr(wrapped, "__self__", None), str):
            __self._check_format_spec(fmt, args, kwargs)
        rv = super().call(__context, __obj, *args, **kwargs)
        return __self._check_result(rv, f"the result of {name or 'a call'}()")

    def _check_str_method(self, s: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
            self.check_size(args[0], f"str.{name}()")
        elif name == "expandtabs":
            size = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(size, int):
                self.check_size(len(s) + s.count("\t") * size, "str.expandtabs()")
        elif name == "replace" and len(args) >= 2:
            self._check_replace(s, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1))
        elif name == "join" and args:
            self._check_join(args[0], s)

    # -- guarded filters and globals -----------------------------------------

    def _guard_filter(self, name: str, func: Any) -> Any:
        pass_arg = getattr(getattr(func, "jinja_pass_arg", None), "name", None)
        env = self

        @pass_context  # never constant-folded at compile time
        def guarded(context: Any, value: Any = None, *args: Any, **kwargs: Any) -> Any:
            tick()
            env._precheck_filter(name, value, args, kwargs)
            if pass_arg == "context":
                rv = func(context, value, *args, **kwargs)
            elif pass_arg == "eval_context":
                rv = func(context.eval_ctx, value, *args, **kwargs)
            elif pass_arg == "environment":
                rv = func(context.environment, value, *args, **kwargs)
            else:
                rv = func(value, *args, **kwargs)
            if isinstance(rv, (str, list, tuple, dict)):
                env._check_result(rv, f"the result of the {name!r} filter")
            return rv

        guarded.__name__ = f"guarded_{name}"
        return guarded

    def _precheck_filter(self, name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first = args[0] if args else None
        if name == "center":
            width = first if args else kwargs.get("width", 80)
            if isinstance(width, int):
                self.check_size(width, "a centered string")
        elif name == "indent" and isinstance(value, str):
            width = first if args else kwargs.get("width", 4)
            per_line = width if isinstance(width, int) else _len(width)
            self.check_size(len(value) + (value.count("\n") + 1) * max(per_line, 0), "an indented string")
        elif name in ("batch", "slice"):
            count = first if args else kwargs.get("linecount" if name == "batch" else "slices", 0)
            if isinstance(count, int):
                self.check_size(count, f"a {name}")
        elif name == "format" and isinstance(value, str):
            self._check_percent(value, tuple(args) or kwargs)
        elif name == "join":
            sep = first if args else kwargs.get("d", "")
            self._check_join(value, sep if isinstance(sep, str) else "")
        elif name == "replace" and isinstance(value, str) and len(args) >= 2:
            self._check_replace(value, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1))
        elif name == "sum":
            start = args[1] if len(args) > 1 else kwargs.get("start", 0)
            if _len(start) or isinstance(start, (list, tuple, str)):
                items = value if isinstance(value, (list, tuple)) else ()
                self.check_size(_len(start) + sum(_len(x) for x in items), "a sum of sequences")
        elif name == "tojson":
            indent = first if args else kwargs.get("indent")
            if isinstance(indent, int) and indent > 64 or isinstance(indent, str) and len(indent) > 64:
                raise LimitExceeded("the chat template asked tojson for an indent over 64")

    def _lipsum(self, n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
        if not all(isinstance(v, int) for v in (n, min, max)) or n > MAX_LIPSUM or max > 1000 or min > max:
            raise LimitExceeded(f"lipsum() is limited to {MAX_LIPSUM} paragraphs of at most 1000 words")
        return generate_lorem_ipsum(n=n, html=html, min=min, max=max)

    @pass_context
    def _loop_guard(self, context: Any, iterable: Any) -> Iterator[Any]:
        # wraps the iterable of every {% for %}: one deadline check per item
        for item in iterable:
            tick()
            yield item

    @pass_context
    def _concat_guard(self, context: Any, parts: list[Any]) -> str:
        # replaces "a ~ b ~ c": check the total before joining
        strs = [str(p) for p in parts]
        self.check_size(sum(map(len, strs)), "a concatenation")
        return "".join(strs)

    def _concat(self, parts: Any) -> str:
        parts = list(parts)
        self.check_size(sum(len(p) for p in parts if isinstance(p, str)), "a captured block")
        return "".join(parts)


class _Rewrite(NodeTransformer):
    """Route each ``{% for %}`` iterable through the loop guard and each ``~``
    through the concat guard (filters, so a template cannot rebind them);
    refuse ``include``/``import``/``extends`` up front (there are no files)."""

    def visit_Template(self, node: nodes.Template) -> nodes.Node:
        for bad in node.find_all((nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)):
            kind = type(bad).__name__.lower().replace("fromimport", "from-import")
            raise SecurityError(f"line {bad.lineno}: chat templates cannot {kind} other templates (no file access)")
        self.generic_visit(node)
        return node

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _LOOP_GUARD, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        items = nodes.List(list(node.nodes), lineno=node.lineno)
        return nodes.Filter(items, _CONCAT_GUARD, [], [], None, None, lineno=node.lineno)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """``tojson`` as HF transformers defines it for chat templates (no HTML
    escaping, unlike Jinja's own)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """``{% generation %}…{% endgeneration %}`` (HF marks assistant turns with
    it for training masks): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()
