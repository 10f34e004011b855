#!/usr/bin/env python3
"""Generate docs/reference/ggml-coverage.md: which ggml ops toy binds, and which have a backward pass.

Inputs (all parsed as text; the tool imports nothing from toy and needs no build):

- ``enum ggml_op``, ``enum ggml_unary_op`` and ``enum ggml_glu_op`` in the pinned
  ggml's ``include/ggml.h``: the rows of the three tables;
- ``packages/toy-ggml/src/toy_ggml/_ops.pxi``: the ggml constructors each public
  method calls. ``OP_OF_FUNCTION`` below maps each C constructor to the op(s) it
  builds; a constructor that ``_ops.pxi`` calls but the mapping lacks is an error,
  and so is a mapping entry that ``ggml.c`` contradicts, so the page cannot go stale
  silently;
- ``ggml_compute_backward`` in the patched ``src/ggml.c``: an op has a backward pass
  when it has a ``case`` label of its own in the top-level switch (or in the nested
  unary / GLU switches) whose branch does not unconditionally abort. A label with an
  empty branch falls through into the next one and is *not* credited with that
  branch (``WIN_PART``/``WIN_UNPART`` fall into ``UNARY``'s branch, which asserts the
  op is ``UNARY``);
- ``packages/toy-ggml/patches/*.patch``: ``case`` labels a toy patch adds to
  ``src/ggml.c`` mark that backward as coming from the patch;
- ``subprojects/ggml/.toy-stamp.json``: ggml version, source and patch set.

Output is deterministic (no timestamps, enum order). ``--check`` regenerates in
memory and exits 1 when the committed page differs. Stdlib only.

Usage: ``python tools/ggml_coverage.py [--check]`` (``just coverage``, ``just coverage-check``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script, or loaded by path in tests
from _pages import write_or_check  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAGE = Path("docs/reference/ggml-coverage.md")
PKG = Path("packages/toy-ggml")
GGML = PKG / "subprojects/ggml"
OPS_PXI = PKG / "src/toy_ggml/_ops.pxi"

# C constructor -> the op(s) it builds: "X" is GGML_OP_X, "UNARY:X" is GGML_UNARY_OP_X,
# "GLU:X" is GGML_GLU_OP_X. Extend it when _ops.pxi binds a new constructor.
OP_OF_FUNCTION: dict[str, tuple[str, ...]] = {
    "ggml_add": ("ADD",),
    "ggml_sub": ("SUB",),
    "ggml_mul": ("MUL",),
    "ggml_div": ("DIV",),
    "ggml_scale": ("SCALE",),
    "ggml_scale_bias": ("SCALE",),
    "ggml_sqr": ("SQR",),
    "ggml_sqrt": ("SQRT",),
    "ggml_log": ("LOG",),
    "ggml_clamp": ("CLAMP",),
    "ggml_exp": ("UNARY:EXP",),
    "ggml_neg": ("UNARY:NEG",),
    "ggml_tanh": ("UNARY:TANH",),
    "ggml_sigmoid": ("UNARY:SIGMOID",),
    "ggml_gelu": ("UNARY:GELU",),
    "ggml_gelu_erf": ("UNARY:GELU_ERF",),
    "ggml_erf": ("UNARY:ERF",),
    "ggml_silu": ("UNARY:SILU",),
    "ggml_relu": ("UNARY:RELU",),
    "ggml_swiglu_split": ("GLU:SWIGLU",),
    "ggml_sum": ("SUM",),
    "ggml_sum_sqr": ("SUM_SQR",),  # toy patch 0017
    "ggml_sum_rows": ("SUM_ROWS",),
    "ggml_mean": ("MEAN",),
    "ggml_argmax": ("ARGMAX",),
    "ggml_top_k": ("TOP_K",),
    "ggml_argsort_top_k": ("ARGSORT", "VIEW"),
    "ggml_norm": ("NORM",),
    "ggml_rms_norm": ("RMS_NORM",),
    "ggml_mul_mat": ("MUL_MAT",),
    "ggml_mul_mat_toy_gemm": ("MUL_MAT",),
    "ggml_mul_mat_id": ("MUL_MAT_ID",),
    "ggml_cont": ("CONT",),
    "ggml_reshape_4d": ("RESHAPE",),
    "ggml_view_4d": ("VIEW",),
    "ggml_permute": ("PERMUTE",),
    "ggml_transpose": ("TRANSPOSE",),
    "ggml_cpy": ("CPY",),
    "ggml_cast": ("CPY",),
    "ggml_concat": ("CONCAT",),
    "ggml_repeat_4d": ("REPEAT",),
    "ggml_pad_ext": ("PAD",),
    "ggml_get_rows": ("GET_ROWS",),
    "ggml_set_rows": ("SET_ROWS",),
    "ggml_diag_mask_inf": ("DIAG_MASK_INF",),
    "ggml_soft_max_ext": ("SOFT_MAX",),
    "ggml_rope_ext": ("ROPE",),
    "ggml_flash_attn_ext": ("FLASH_ATTN_EXT",),
    "ggml_im2col": ("IM2COL",),
    "ggml_conv_2d": ("IM2COL", "MUL_MAT"),
    "ggml_pool_2d": ("POOL_2D",),
    "ggml_cross_entropy_loss": ("CROSS_ENTROPY_LOSS",),
    "ggml_opt_step_adamw": ("OPT_STEP_ADAMW",),
    "ggml_opt_step_adamw_scaled": ("OPT_STEP_ADAMW_SCALED",),  # toy patch 0017
}
# Constructors that build several nodes; the page explains them in a note.
COMPOSITE = {
    "ggml_conv_2d": "builds IM2COL, then MUL_MAT over reshaped views, then PERMUTE and CONT; "
    "it is not GGML_OP_CONV_2D (a direct convolution op toy does not bind)",
}

KINDS = ("op", "unary", "glu")
LABEL_PREFIX = {"op": "GGML_OP_", "unary": "GGML_UNARY_OP_", "glu": "GGML_GLU_OP_"}
ENUM_NAME = {"op": "ggml_op", "unary": "ggml_unary_op", "glu": "ggml_glu_op"}


class CoverageError(Exception):
    pass


# ----------------------------------------------------------------------------- source scanning


def blank_c(src: str) -> tuple[str, str]:
    """Two same-length copies of C source: comments blanked (``code``), and comments
    and string/char literal contents blanked (``bare``). Newlines are kept."""
    code, bare = list(src), list(src)
    i, n = 0, len(src)

    def blank(lst: list[str], a: int, b: int) -> None:
        for k in range(a, b):
            if lst[k] != "\n":
                lst[k] = " "

    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            blank(code, i, j), blank(bare, i, j)
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank(code, i, j), blank(bare, i, j)
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            blank(bare, i + 1, min(j, n))
            i = j + 1
        else:
            i += 1
    return "".join(code), "".join(bare)


def blank_py(src: str) -> str:
    """Python/Cython source with comments and string literal contents blanked."""
    out = list(src)
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if c == "#":
            j = src.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
        elif c in "\"'":
            q = src[i : i + 3] if src[i : i + 3] in ('"""', "'''") else c
            j = i + len(q)
            while j < n and not src.startswith(q, j) and (len(q) == 3 or src[j] != "\n"):
                j += 2 if src[j] == "\\" else 1
            for k in range(i + len(q), min(j, n)):
                if out[k] != "\n":
                    out[k] = " "
            i = j + len(q)
        else:
            i += 1
    return "".join(out)


def matching(text: str, i: int) -> int:
    """Index of the bracket closing the one at ``text[i]`` (in blanked text)."""
    open_c = text[i]
    close_c = {"{": "}", "(": ")", "[": "]"}[open_c]
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_c:
            depth += 1
        elif text[j] == close_c:
            depth -= 1
            if depth == 0:
                return j
    raise CoverageError(f"unbalanced {open_c!r} at offset {i}")


def flatten(text: str) -> str:
    """``text`` with everything inside nested braces blanked (depth-0 code only)."""
    out, depth = list(text), 0
    for k, c in enumerate(text):
        if c == "}":
            depth -= 1
        if depth > 0 and c != "\n":
            out[k] = " "
        if c == "{":
            depth += 1
    return "".join(out)


def c_function_body(bare: str, name: str) -> tuple[int, int] | None:
    """(start, end) of the body between the braces of C function ``name``'s definition."""
    for m in re.finditer(rf"(?m)^[A-Za-z_][\w \t*]*\b{re.escape(name)}\s*\(", bare):
        close = matching(bare, m.end() - 1)
        rest = bare[close + 1 :]
        stripped = rest.lstrip()
        if stripped.startswith("{"):
            open_i = close + 1 + (len(rest) - len(stripped))
            return open_i + 1, matching(bare, open_i)
    return None


# ----------------------------------------------------------------------------- ggml.h enums


def parse_enum(header: str, enum: str, prefix: str) -> list[str]:
    """Member names (prefix stripped, COUNT left out) of ``enum <enum> {...}``, in order."""
    _, bare = blank_c(header)
    m = re.search(rf"\benum\s+{enum}\s*\{{", bare)
    if not m:
        raise CoverageError(f"enum {enum} not found in ggml.h")
    body = bare[m.end() : matching(bare, m.end() - 1)]
    names = []
    for item in body.split(","):
        item = item.split("=")[0].strip()
        if not item:
            continue
        if not item.startswith(prefix):
            raise CoverageError(f"enum {enum}: member {item!r} lacks the prefix {prefix}")
        if item != prefix + "COUNT":
            names.append(item[len(prefix) :])
    return names


def tensor_constructors(header: str) -> set[str]:
    """ggml.h functions of the form ``struct ggml_tensor * f(struct ggml_context * ctx, ...)``."""
    _, bare = blank_c(header)
    pat = r"GGML_API\s+struct\s+ggml_tensor\s*\*\s*(ggml_\w+)\s*\(\s*struct\s+ggml_context\s*\*"
    return set(re.findall(pat, bare))


# ----------------------------------------------------------------------------- backward cases


@dataclass
class Branch:
    """One ``case`` label of ggml_compute_backward's switches."""

    kind: str  # "yes" | "no-op" | "abort" | "fallthrough"
    into: str | None = None  # the label a fallthrough falls into
    notes: tuple[str, ...] = ()  # GGML_ASSERT messages in the branch (partial support)


_LABEL = re.compile(r"\b(?:case\s+([A-Za-z_]\w*)\s*:(?!:)|default\s*:(?!:))")
_ABORT = re.compile(r"(?:^|[;{}])\s*(?:GGML_ABORT|abort)\s*\(")


def _switch_labels(bare: str, start: int, end: int) -> list[tuple[str, int, int]]:
    """Labels at depth 0 of the switch block bare[start:end]: (label, label_start, body_start)."""
    flat = flatten(bare[start:end])
    return [(m.group(1) or "default", start + m.start(), start + m.end()) for m in _LABEL.finditer(flat)]


def _parse_switch(
    code: str, bare: str, start: int, end: int, out: dict[str, dict[str, Branch]], kinds: tuple[str, ...]
) -> None:
    """Record the labels of ``kinds`` in the switch block bare[start:end] (the top level takes
    ggml_op labels, nested switches unary and GLU labels; others, such as GGML_OP_POOL_MAX
    of enum ggml_op_pool in a nested switch, are ignored)."""
    labels = _switch_labels(bare, start, end)
    segs = []
    for k, (label, _, body_start) in enumerate(labels):
        seg_end = labels[k + 1][1] if k + 1 < len(labels) else end
        segs.append((label, body_start, seg_end))
    for k, (label, s, e) in enumerate(segs):
        kind = next((kd for kd in kinds if label.startswith(LABEL_PREFIX[kd])), None)
        if bare[s:e].strip() == "":
            into = next((lb for lb, s2, e2 in segs[k + 1 :] if bare[s2:e2].strip()), None)
            branch = Branch("fallthrough", into)
        else:
            branch = _branch(code, bare, s, e, out)
        name = label[len(LABEL_PREFIX[kind]) :] if kind else ""
        if kind is not None and name != "COUNT":
            out[kind].setdefault(name, branch)


def _branch(code: str, bare: str, s: int, e: int, out: dict[str, dict[str, Branch]]) -> Branch:
    lead = len(bare[s:e]) - len(bare[s:e].lstrip())
    if bare[s + lead] == "{":
        s = s + lead + 1
        e = matching(bare, s - 1)
    flat = flatten(bare[s:e])
    nested = []
    for m in re.finditer(r"\bswitch\s*\(", flat):
        close = matching(bare, s + m.end() - 1)
        open_i = bare.index("{", close)
        block_end = matching(bare, open_i)
        _parse_switch(code, bare, open_i + 1, block_end, out, ("unary", "glu"))
        nested.append((s + m.start(), block_end + 1))
    if _ABORT.search(flat):
        return Branch("abort")
    if re.sub(r"\bbreak\s*;", "", flat).strip() == "":
        return Branch("no-op")
    own = "".join(" " if any(a <= k < b for a, b in nested) else c for k, c in enumerate(code[s:e], start=s))
    notes = []
    for m in re.finditer(r"\bGGML_ASSERT\s*\(", own):
        args = own[m.end() - 1 : matching(blank_c(own)[1], m.end() - 1) + 1]
        notes += re.findall(r'"((?:[^"\\]|\\.)*)"', args)
    return Branch("yes", notes=tuple(notes))


def parse_backward(ggml_c: str) -> dict[str, dict[str, Branch]]:
    """Every case label of ``ggml_compute_backward``, by kind ("op", "unary", "glu")
    and name without prefix."""
    code, bare = blank_c(ggml_c)
    span = c_function_body(bare, "ggml_compute_backward")
    if span is None:
        raise CoverageError("ggml_compute_backward not found in ggml.c")
    start, end = span
    m = re.search(r"\bswitch\s*\(", flatten(bare[start:end]))
    if not m:
        raise CoverageError("ggml_compute_backward has no switch")
    open_i = bare.index("{", matching(bare, start + m.end() - 1))
    out: dict[str, dict[str, Branch]] = {kd: {} for kd in KINDS}
    _parse_switch(code, bare, open_i + 1, matching(bare, open_i), out, ("op",))
    return out


def backward_sets(ggml_c: str) -> dict[str, set[str]]:
    """Names with a backward of their own, by kind."""
    return {kd: {nm for nm, b in br.items() if b.kind in ("yes", "no-op")} for kd, br in parse_backward(ggml_c).items()}


def patched_labels(patch_dir: Path) -> dict[str, str]:
    """Full case label (``GGML_OP_NORM``) -> number (``0001``) of the toy patch that adds it to src/ggml.c."""
    found: dict[str, str] = {}
    for p in sorted(patch_dir.glob("*.patch")):
        number = p.name.split("-", 1)[0]
        target = None
        for line in p.read_text(encoding="utf-8").splitlines():
            if line.startswith("+++ "):
                target = line[4:].split("\t")[0].strip()
            elif line.startswith("+") and target in ("b/src/ggml.c", "src/ggml.c"):
                for label in re.findall(r"\bcase\s+(GGML_\w+)\s*:", line):
                    found.setdefault(label, number)
    return found


# ----------------------------------------------------------------------------- bindings


@dataclass
class _PyFunc:
    name: str
    kw: str
    cls: str | None
    body: str
    calls: set[str] = field(default_factory=set)


def _py_functions(src: str) -> list[_PyFunc]:
    bare = blank_py(src)
    lines = bare.splitlines(keepends=True)
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln))
    head = re.compile(r"^([ \t]*)(def|cdef|cpdef)\s+([^\n(=:]*?)\b([A-Za-z_]\w*)\s*\(")
    cls_re = re.compile(r"^([ \t]*)(?:cdef\s+)?class\s+(\w+)")
    funcs, classes = [], []  # classes: (indent, name)
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        indent = len(ln) - len(ln.lstrip())
        while classes and indent <= classes[-1][0]:
            classes.pop()
        if m := cls_re.match(ln):
            classes.append((len(m.group(1)), m.group(2)))
            continue
        m = head.match(ln)
        if not m or m.group(3).strip().startswith("class"):
            continue
        close = matching(bare, offsets[i] + m.end() - 1)
        tail = bare[close + 1 : bare.find("\n", close)] if "\n" in bare[close:] else bare[close + 1 :]
        if not re.fullmatch(r"[^=]*:\s*", tail):
            continue  # a declaration such as `cdef int x = f(y)`
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
            j += 1
        body = bare[offsets[i] : offsets[j]]
        funcs.append(_PyFunc(m.group(4), m.group(2), classes[-1][1] if classes else None, body))
    return funcs


def parse_bindings(pxi: str, constructors: set[str]) -> dict[str, set[str]]:
    """C constructor -> public methods (``Context.add``) that call it, directly or
    through a private helper. A helper called by method ``m`` is credited with
    ``ggml_m`` when it calls that, otherwise with every constructor it calls."""
    funcs = _py_functions(pxi)
    by_name = {f.name: f for f in funcs}
    wanted = constructors | set(OP_OF_FUNCTION)
    for f in funcs:
        f.calls = set(re.findall(r"\b(ggml_\w+)\s*\(", f.body)) & wanted
    unknown = sorted({c for f in funcs for c in f.calls} - set(OP_OF_FUNCTION))
    if unknown:
        raise CoverageError(
            f"{OPS_PXI} calls ggml constructor(s) missing from OP_OF_FUNCTION in tools/ggml_coverage.py: "
            + ", ".join(unknown)
            + " (add what each builds)"
        )
    out: dict[str, set[str]] = {}
    for f in funcs:
        if f.kw != "def" or f.name.startswith("_"):
            continue
        public = f"{f.cls}.{f.name}" if f.cls else f.name
        for c in f.calls:
            out.setdefault(c, set()).add(public)
        seen, todo = set(), [f]
        while todo:
            g = todo.pop()
            for h in re.findall(r"\b(_\w+)\s*\(", g.body):
                helper = by_name.get(h)
                if helper is None or h in seen or helper is f:
                    continue
                seen.add(h)
                todo.append(helper)
                own = f"ggml_{f.name}"
                for c in {own} if own in helper.calls else helper.calls:
                    out.setdefault(c, set()).add(public)
    return out


def check_mapping(ggml_c: str, used: set[str]) -> None:
    """Each used mapping entry must be reachable from the C constructor's definition:
    an ``->op = GGML_OP_X`` assignment or a GGML_UNARY_OP_X / GGML_GLU_OP_X constant in
    it or in the tensor constructors it calls (three levels deep)."""
    _, bare = blank_c(ggml_c)

    def reached(fn: str, depth: int, seen: set[str]) -> set[str]:
        span = c_function_body(bare, fn)
        if span is None or fn in seen:
            return set()
        seen.add(fn)
        body = bare[span[0] : span[1]]
        got = set(re.findall(r"->\s*op\s*=\s*GGML_OP_(\w+)", body))
        got |= {"UNARY:" + x for x in re.findall(r"\bGGML_UNARY_OP_(\w+)", body)}
        got |= {"GLU:" + x for x in re.findall(r"\bGGML_GLU_OP_(\w+)", body)}
        if depth > 0:
            for callee in set(re.findall(r"\b(ggml_\w+)\s*\(\s*ctx\b", body)):
                got |= reached(callee, depth - 1, seen)
        return got

    for fn in sorted(used):
        got = reached(fn, 3, set())
        missing = [op for op in OP_OF_FUNCTION[fn] if op not in got]
        if missing:
            raise CoverageError(
                f"OP_OF_FUNCTION says {fn} builds {', '.join(missing)}, but ggml.c's {fn} does not "
                f"(it reaches: {', '.join(sorted(got)) or 'nothing'}); fix the mapping"
            )


# ----------------------------------------------------------------------------- collect and render


@dataclass
class Coverage:
    stamp: dict
    enums: dict[str, list[str]]
    backward: dict[str, dict[str, Branch]]
    patched: dict[str, str]
    methods: dict[str, dict[str, set[str]]]  # kind -> name -> {"Context.add", ...}
    composite: dict[str, set[str]]  # C function -> methods


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def collect(root: Path) -> Coverage:
    ggml = root / GGML
    stamp_path = ggml / ".toy-stamp.json"
    if not stamp_path.is_file() or not (ggml / "src/ggml.c").is_file():
        raise CoverageError(f"the ggml source tree is missing ({GGML}): run python tools/fetch_ggml.py first")
    stamp = json.loads(stamp_path.read_text(encoding="utf-8"))
    patch_dir = root / PKG / "patches"
    have = [{"name": p.name, "sha256": _sha256(p)} for p in sorted(patch_dir.glob("*.patch"))]
    if stamp.get("patches") != have:
        raise CoverageError(
            f"{GGML} was patched with a different patch set than {PKG}/patches: run python tools/fetch_ggml.py first"
        )
    header = (ggml / "include/ggml.h").read_text(encoding="utf-8")
    ggml_c = (ggml / "src/ggml.c").read_text(encoding="utf-8")
    enums = {kd: parse_enum(header, ENUM_NAME[kd], LABEL_PREFIX[kd]) for kd in KINDS}
    for fn, ops in OP_OF_FUNCTION.items():
        for op in ops:
            kd, _, nm = op.rpartition(":")
            kd = {"": "op", "UNARY": "unary", "GLU": "glu"}[kd]
            if nm not in enums[kd]:
                raise CoverageError(f"OP_OF_FUNCTION[{fn!r}] names {op}, which ggml {stamp['ggml_version']} lacks")
    backward = parse_backward(ggml_c)
    for kd in KINDS:
        stray = sorted(set(backward[kd]) - set(enums[kd]))
        if stray:
            raise CoverageError(f"ggml_compute_backward has case labels not in enum {ENUM_NAME[kd]}: {stray}")
    bindings = parse_bindings((root / OPS_PXI).read_text(encoding="utf-8"), tensor_constructors(header))
    check_mapping(ggml_c, set(bindings))
    methods: dict[str, dict[str, set[str]]] = {kd: {} for kd in KINDS}
    for fn, meths in bindings.items():
        for op in OP_OF_FUNCTION[fn]:
            kd, _, nm = op.rpartition(":")
            kd = {"": "op", "UNARY": "unary", "GLU": "glu"}[kd]
            methods[kd].setdefault(nm, set()).update(meths)
            if kd != "op":
                methods["op"].setdefault(kd.upper(), set()).update(meths)
    composite = {fn: bindings[fn] for fn in COMPOSITE if fn in bindings}
    return Coverage(stamp, enums, backward, patched_labels(patch_dir), methods, composite)


def _backward_cell(cov: Coverage, kd: str, name: str) -> tuple[str, str]:
    b = cov.backward[kd].get(name)
    if b is None:
        return "no", ""
    if b.kind == "fallthrough":
        into = b.into or "?"
        for pre in LABEL_PREFIX.values():
            into = into[len(pre) :] if into.startswith(pre) else into
        return "no", f"its case falls through into `{into}`'s branch (no backward of its own)"
    if b.kind == "abort":
        return "no", "its case aborts"
    patch = cov.patched.get(LABEL_PREFIX[kd] + name)
    cell = f"yes (toy patch {patch})" if patch else "yes"
    note = "no-op branch (passes no gradient on)" if b.kind == "no-op" else ""
    if b.notes:
        note = "; ".join(dict.fromkeys(b.notes))
    return cell, note


def _methods_cell(cov: Coverage, meths: set[str]) -> str:
    comp = {m for ms in cov.composite.values() for m in ms}
    return ", ".join(f"`{m}`" + (" (composite)" if m in comp else "") for m in sorted(meths))


def _table(cov: Coverage, kd: str) -> list[str]:
    rows = ["| op | bound | toy method | backward | notes |", "|---|---|---|---|---|"]
    for name in cov.enums[kd]:
        meths = cov.methods[kd].get(name, set())
        bw, note = _backward_cell(cov, kd, name)
        methods = _methods_cell(cov, meths)
        if kd == "op" and name in ("UNARY", "GLU"):
            sub = "unary" if name == "UNARY" else "glu"
            methods = f"see [{sub} ops](#{sub}-ops)" if meths else ""
            note = f"per {sub} op: see [{sub} ops](#{sub}-ops)"
        rows.append(f"| `{name}` | {'yes' if meths else 'no'} | {methods} | {bw} | {note} |")
    return rows


def _counts(cov: Coverage, kd: str) -> tuple[int, int, int, int]:
    names = cov.enums[kd]
    bound = {n for n in names if cov.methods[kd].get(n)}
    bw = {n for n in names if _backward_cell(cov, kd, n)[0] != "no"}
    return len(names), len(bound), len(bw), len(bound & bw)


def render(cov: Coverage) -> str:
    st = cov.stamp
    patches = ", ".join(f"`{p['name']}`" for p in st["patches"]) or "none"
    out = [
        "# ggml op coverage",
        "",
        "<!-- Generated by tools/ggml_coverage.py: do not edit; run `just coverage`. -->",
        "",
        f"Generated by `tools/ggml_coverage.py` (run `just coverage`; `just coverage-check` fails when this page "
        f"is stale) from ggml {st['ggml_version']} as shipped in `{st['source']}` "
        f"(sdist sha256 `{st['sdist_sha256']}`), with the toy patches {patches}.",
        "",
        "- **bound**: a public method of `toy_ggml` builds the op; found by parsing "
        "`packages/toy-ggml/src/toy_ggml/_ops.pxi` for the ggml constructors it calls.",
        "- **backward**: `ggml_compute_backward` in the patched `src/ggml.c` has a case of its own for the op "
        "that does not abort. *yes (toy patch N)*: the case comes from that patch (see [Patches](patches.md)). "
        "Where ggml has no case, building a backward graph through the op would abort the process; "
        "`Graph.build_backward` raises `UnsupportedBackwardError` instead.",
        "- **notes**: limits ggml asserts in the backward branch, or why an op has no backward.",
        "",
        "## Summary",
        "",
        "| enum | ops | bound | with backward | bound and with backward |",
        "|---|---|---|---|---|",
    ]
    for kd in KINDS:
        total, bound, bw, both = _counts(cov, kd)
        out.append(f"| `{ENUM_NAME[kd]}` | {total} | {bound} | {bw} | {both} |")
    gaps = [f"`{n}`" for n in cov.enums["op"] if cov.methods["op"].get(n) and _backward_cell(cov, "op", n)[0] == "no"]
    gaps += [
        f"`UNARY:{n}`"
        for n in cov.enums["unary"]
        if cov.methods["unary"].get(n) and _backward_cell(cov, "unary", n)[0] == "no"
    ]
    gaps += [
        f"`GLU:{n}`" for n in cov.enums["glu"] if cov.methods["glu"].get(n) and _backward_cell(cov, "glu", n)[0] == "no"
    ]
    out += ["", f"Bound without a backward pass: {', '.join(gaps) or 'none'}."]
    if cov.composite:
        out += ["", "Composite constructors (one method, several graph nodes):", ""]
        for fn, meths in sorted(cov.composite.items()):
            out.append(f"- {', '.join(f'`{m}`' for m in sorted(meths))} calls `{fn}`, which {COMPOSITE[fn]}.")
    out += ["", "## ggml ops", "", *_table(cov, "op"), "", "## Unary ops", ""]
    out += ["Members of `enum ggml_unary_op`; each builds a `GGML_OP_UNARY` node.", "", *_table(cov, "unary")]
    out += ["", "## GLU ops", ""]
    out += ["Members of `enum ggml_glu_op`; each builds a `GGML_OP_GLU` node.", "", *_table(cov, "glu"), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed page is stale")
    args = ap.parse_args(argv)
    try:
        text = render(collect(root))
    except CoverageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return write_or_check(root, PAGE, text, args.check, "ggml_coverage", "coverage")


if __name__ == "__main__":
    sys.exit(main())
