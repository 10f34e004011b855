"""The backward allow-lists in _graph.pxi mirror ggml_compute_backward.

toy refuses (UnsupportedBackwardError) a backward pass through any op not in
BACKWARD_OPS / BACKWARD_UNARY_OPS / BACKWARD_GLU_OPS, because ggml would abort
the process there. These lists are written by hand; this test derives them
from the source of ``ggml_compute_backward`` in the patched tree that toy is
built from (packages/toy-ggml/subprojects/ggml/src/ggml.c) and compares:

- every ``case GGML_OP_X:`` label of its ``switch (tensor->op)`` except those
  whose body only aborts (``GGML_OP_COUNT`` falls into ``default:``, which
  aborts), and except ``GGML_OP_WIN_PART`` / ``GGML_OP_WIN_UNPART``: those two
  labels fall through into the ``GGML_OP_UNARY`` case, which then reads a
  unary op id out of a WIN_PART/WIN_UNPART tensor's op params - not a real
  gradient, so toy rightly leaves them out;
- every ``case GGML_UNARY_OP_X:`` of the nested unary switch that does not
  only abort (SGN and STEP are no-ops: supported, gradient zero);
- likewise the ``case GGML_GLU_OP_X:`` labels of the GLU switch.

Names are mapped through ggml's own name tables (enum position in ggml.h ->
``ggml_op_name``), not assumed from the enumerator spelling.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import toy_ggml as tg
from toy_ggml import _core

GGML_DIR = Path(__file__).resolve().parents[1] / "subprojects" / "ggml"
GGML_C = GGML_DIR / "src" / "ggml.c"
GGML_H = GGML_DIR / "include" / "ggml.h"


def _require(path: Path) -> str:
    if not path.is_file():
        pytest.fail(
            f"{path} is missing: the patched ggml tree is not laid out. Run `python tools/fetch_ggml.py` "
            "from the repository root (CI always has it)."
        )
    return path.read_text(encoding="utf-8", errors="replace")


def _strip_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", " ", src)


def _block_after(src: str, start: int) -> str:
    """The text inside the brace block that opens at or after ``start``."""
    i = src.index("{", start)
    depth = 0
    for j in range(i, len(src)):
        if src[j] == "{":
            depth += 1
        elif src[j] == "}":
            depth -= 1
            if depth == 0:
                return src[i + 1 : j]
    raise AssertionError("unbalanced braces")


def _function_body(src: str, name: str) -> str:
    m = re.search(r"\bstatic\s+void\s+" + name + r"\s*\(", src)
    assert m, f"{name} not found in ggml.c"
    # skip the parameter list, then take the body
    close = src.index(")", src.index("(", m.start()))
    return _block_after(src, close)


def _switch_body(src: str, head_regex: str) -> str:
    m = re.search(head_regex, src)
    assert m, f"switch {head_regex!r} not found"
    return _block_after(src, m.end() - 1)


_LABEL = re.compile(r"\bcase\s+(\w+)\s*:|\bdefault\s*:")


def _top_level_labels(body: str):
    """[(label or 'default', segment text up to the next top-level label)]."""
    found = []  # (name, keyword start, label end)
    depth = 0
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0 and (i == 0 or not (body[i - 1].isalnum() or body[i - 1] == "_")):
            m = _LABEL.match(body, i)
            if m:
                found.append((m.group(1) or "default", i, m.end()))
                i = m.end()
                continue
        i += 1
    out = []
    for k, (name, _, seg_start) in enumerate(found):
        seg_end = found[k + 1][1] if k + 1 < len(found) else len(body)
        out.append((name, body[seg_start:seg_end]))
    return out


def _classify(segment: str) -> str:
    """'fallthrough' (empty), 'abort' (only fprintf/GGML_ABORT), or 'handled'."""
    code = segment.strip()
    if not code:
        return "fallthrough"
    stmts = [s.strip() for s in re.sub(r"[{}]", " ", code).split(";")]
    stmts = [s for s in stmts if s and s != "break"]
    if any(s.startswith("GGML_ABORT") for s in stmts) and all(
        s.startswith("GGML_ABORT") or s.startswith("fprintf") for s in stmts
    ):
        return "abort"
    return "handled"


def _resolve(labels):
    """label -> (classification of the body it runs, label whose body that is)."""
    out = {}
    for k, (name, _) in enumerate(labels):
        j = k
        while _classify(labels[j][1]) == "fallthrough":
            j += 1
        out[name] = (_classify(labels[j][1]), labels[j][0])
    return out


def _enum_names(header: str, enum: str) -> list[str]:
    body = _block_after(header, re.search(r"\benum\s+" + enum + r"\s*\{", header).end() - 1)
    names = []
    value = -1
    for entry in _strip_comments(body).split(","):
        entry = entry.strip()
        if not entry:
            continue
        m = re.fullmatch(r"(\w+)(?:\s*=\s*(\d+))?", entry)
        assert m, f"cannot parse enum entry {entry!r}"
        value = int(m.group(2)) if m.group(2) is not None else value + 1
        assert value == len(names), f"{enum}: non-sequential value at {entry!r}"
        names.append(m.group(1))
    return names


@pytest.fixture(scope="module")
def backward_source():
    src = _strip_comments(_require(GGML_C))
    return _function_body(src, "ggml_compute_backward")


@pytest.fixture(scope="module")
def enum_to_name():
    header = _require(GGML_H)
    table = {}
    for enum, name_fn, count_fn in (
        ("ggml_op", _core.op_name, _core.op_count),
        ("ggml_unary_op", _core.unary_op_name, _core.unary_op_count),
        ("ggml_glu_op", _core.glu_op_name, _core.glu_op_count),
    ):
        names = _enum_names(header, enum)
        count_name = names[-1]
        assert count_name.endswith("_COUNT"), count_name
        assert len(names) - 1 == count_fn(), f"{enum}: ggml.h and the built library disagree on the count"
        for i, n in enumerate(names[:-1]):
            table[n] = name_fn(i)
        table[count_name] = "COUNT"
    return table


def _op_labels(backward_source):
    return _top_level_labels(_switch_body(backward_source, r"switch\s*\(\s*tensor->op\s*\)\s*\{"))


def test_backward_ops_match_ggml(backward_source, enum_to_name):
    resolved = _resolve(_op_labels(backward_source))
    handled = {lab for lab, (kind, _) in resolved.items() if lab != "default" and kind == "handled"}
    into_unary = {lab for lab, (_, target) in resolved.items() if target == "GGML_OP_UNARY" and lab != "GGML_OP_UNARY"}
    expected = {enum_to_name[lab] for lab in handled - into_unary}
    assert expected == set(tg.BACKWARD_OPS), (
        f"only in ggml: {sorted(expected - set(tg.BACKWARD_OPS))}; "
        f"only in toy: {sorted(set(tg.BACKWARD_OPS) - expected)}"
    )


def test_win_part_falls_through_into_unary(backward_source, enum_to_name):
    resolved = _resolve(_op_labels(backward_source))
    into_unary = {lab for lab, (_, target) in resolved.items() if target == "GGML_OP_UNARY" and lab != "GGML_OP_UNARY"}
    assert into_unary == {"GGML_OP_WIN_PART", "GGML_OP_WIN_UNPART"}
    assert not {enum_to_name[lab] for lab in into_unary} & set(tg.BACKWARD_OPS)


def test_abort_only_ops_are_count_and_default(backward_source):
    resolved = _resolve(_op_labels(backward_source))
    aborting = {lab for lab, (kind, _) in resolved.items() if kind == "abort"}
    assert aborting == {"GGML_OP_COUNT", "default"}


def test_patched_ops_present(backward_source):
    # NORM, GELU and GELU_ERF come from toy's patches; an unpatched tree would lack them
    assert "NORM" in tg.BACKWARD_OPS and {"GELU", "GELU_ERF"} <= tg.BACKWARD_UNARY_OPS
    labels = dict(_op_labels(backward_source))
    assert "GGML_OP_NORM" in labels, "ggml.c lacks the NORM backward: is patches/0001 applied?"
    unary = dict(
        _top_level_labels(_switch_body(labels["GGML_OP_UNARY"], r"switch\s*\(\s*ggml_get_unary_op\(tensor\)\s*\)\s*\{"))
    )
    assert "GGML_UNARY_OP_GELU" in unary, "ggml.c lacks the GELU backward: is patches/0002 applied?"
    assert "GGML_UNARY_OP_GELU_ERF" in unary, "ggml.c lacks the GELU_ERF backward: is patches/0010 applied?"


def test_backward_unary_ops_match_ggml(backward_source, enum_to_name):
    labels = dict(_op_labels(backward_source))
    unary_switch = _switch_body(labels["GGML_OP_UNARY"], r"switch\s*\(\s*ggml_get_unary_op\(tensor\)\s*\)\s*\{")
    resolved = _resolve(_top_level_labels(unary_switch))
    assert resolved["default"][0] == "abort"
    expected = {enum_to_name[lab] for lab, (kind, _) in resolved.items() if lab != "default" and kind == "handled"}
    assert expected == set(tg.BACKWARD_UNARY_OPS), (
        f"only in ggml: {sorted(expected - set(tg.BACKWARD_UNARY_OPS))}; "
        f"only in toy: {sorted(set(tg.BACKWARD_UNARY_OPS) - expected)}"
    )


def test_backward_glu_ops_match_ggml(backward_source, enum_to_name):
    labels = dict(_op_labels(backward_source))
    glu_switch = _switch_body(labels["GGML_OP_GLU"], r"switch\s*\(\s*ggml_get_glu_op\(tensor\)\s*\)\s*\{")
    resolved = _resolve(_top_level_labels(glu_switch))
    assert resolved["default"][0] == "abort"
    expected = {enum_to_name[lab] for lab, (kind, _) in resolved.items() if lab != "default" and kind == "handled"}
    assert expected == set(tg.BACKWARD_GLU_OPS)


def test_parser_on_a_known_snippet():
    # the label scanner itself: fall-through, nested switch, abort-only default
    src = """
    switch (tensor->op) {
        case GGML_OP_A: { f(); } break;
        case GGML_OP_B:
        case GGML_OP_C: {
            switch (x) { case GGML_UNARY_OP_Z: { g(); } break; default: { GGML_ABORT("no"); } }
        } break;
        case GGML_OP_D: { } break;
        case GGML_OP_COUNT:
        default: { GGML_ABORT("%s", "x"); }
    }
    """
    resolved = _resolve(_top_level_labels(_switch_body(src, r"switch\s*\(\s*tensor->op\s*\)\s*\{")))
    assert resolved == {
        "GGML_OP_A": ("handled", "GGML_OP_A"),
        "GGML_OP_B": ("handled", "GGML_OP_C"),
        "GGML_OP_C": ("handled", "GGML_OP_C"),
        "GGML_OP_D": ("handled", "GGML_OP_D"),
        "GGML_OP_COUNT": ("abort", "default"),
        "default": ("abort", "default"),
    }
