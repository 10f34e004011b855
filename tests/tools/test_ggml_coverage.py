"""tools/ggml_coverage.py: the parsers on synthetic sources, and --check on the committed page."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GGML_TREE = ROOT / "packages/toy-ggml/subprojects/ggml"


def _load():
    spec = importlib.util.spec_from_file_location("ggml_coverage", ROOT / "tools/ggml_coverage.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


gc = _load()

MINI_GGML_C = r"""
static void ggml_compute_backward(struct ggml_context * ctx, struct ggml_cgraph * cgraph, int i,
                                  const bool * grads_needed);  /* a prototype, not the definition */

static void ggml_compute_backward(
        struct ggml_context * ctx, struct ggml_cgraph * cgraph, int i, const bool * grads_needed) {
    struct ggml_tensor * tensor = cgraph->nodes[i];
    const char * decoy = "case GGML_OP_COS: {";   // case GGML_OP_COS: in a comment too
    switch (tensor->op) {
        case GGML_OP_ADD: {
            if (src0_needs_grads) {
                ggml_add_or_set(ctx, cgraph, isrc0, grad);
            }
        } break;
        case GGML_OP_SOFT_MAX: {
            if (src0_needs_grads) { back(); }
            GGML_ASSERT((!src1 || !src1_needs_grads) && "backward pass for softmax mask not implemented");
        } break;
        case GGML_OP_SIN:
            if (bad) GGML_ABORT("only sometimes");
            ggml_add_or_set(ctx, cgraph, isrc0, grad);
            break;
        case GGML_OP_SUM: {
            GGML_ABORT("always");
        } break;
        case GGML_OP_POOL_2D: {
            switch (op) {
                case GGML_OP_POOL_MAX: { max_back(); } break;  // enum ggml_op_pool, not an op
                default: { avg_back(); } break;
            }
        } break;
        case GGML_OP_WIN_PART:
        case GGML_OP_WIN_UNPART:
        case GGML_OP_UNARY: {
            switch (ggml_get_unary_op(tensor)) {
                case GGML_UNARY_OP_ABS: {
                    if (src0_needs_grads) { char c = '}'; use(c); }
                } break;
                case GGML_UNARY_OP_SGN: {
                    // noop
                } break;
                default: {
                    fprintf(stderr, "%s: unsupported unary op {\n", __func__);
                    GGML_ABORT("fatal error");
                } //break;
            }
        } break;
        case GGML_OP_GLU: {
            switch (ggml_get_glu_op(tensor)) {
                case GGML_GLU_OP_SWIGLU: {
                    GGML_ASSERT(src1 && "split only");
                } break;
                default: GGML_ABORT("unsupported glu op");
            }
        } break;
        case GGML_OP_NONE: {
            // noop
        } break;
        case GGML_OP_COUNT:
        default: {
            GGML_ABORT("%s: unsupported ggml op for backward pass: %s\n", __func__, ggml_op_name(tensor->op));
        } //break;
    }
}
"""


def test_backward_sets_handle_fallthrough_nesting_and_aborts():
    sets = gc.backward_sets(MINI_GGML_C)
    # WIN_PART/WIN_UNPART share UNARY's branch but have no backward of their own;
    # SUM always aborts; SIN only aborts on a condition; COS is only in a string and a comment;
    # POOL_MAX (a nested switch over another enum) is not an op.
    assert sets == {
        "op": {"ADD", "SOFT_MAX", "SIN", "POOL_2D", "UNARY", "GLU", "NONE"},
        "unary": {"ABS", "SGN"},
        "glu": {"SWIGLU"},
    }


def test_branch_details():
    br = gc.parse_backward(MINI_GGML_C)
    assert br["op"]["WIN_PART"].kind == "fallthrough"
    assert br["op"]["WIN_PART"].into == "GGML_OP_UNARY"
    assert br["op"]["SUM"].kind == "abort"
    assert br["op"]["NONE"].kind == "no-op"
    assert br["unary"]["SGN"].kind == "no-op"
    assert "COUNT" not in br["op"]
    assert br["op"]["SOFT_MAX"].notes == ("backward pass for softmax mask not implemented",)
    assert br["op"]["UNARY"].notes == ()  # the nested switch's strings are not UNARY's notes
    assert br["glu"]["SWIGLU"].notes == ("split only",)


def test_patched_labels(tmp_path):
    (tmp_path / "0003-foo.patch").write_text(
        "header\n\n--- a/src/ggml.c\n+++ b/src/ggml.c\n@@ -1,1 +1,2 @@\n"
        "+        case GGML_OP_CONCAT: {\n"
        "--- a/src/other.c\n+++ b/src/other.c\n@@ -1,1 +1,2 @@\n"
        "+        case GGML_OP_TANH: {\n"
    )
    assert gc.patched_labels(tmp_path) == {"GGML_OP_CONCAT": "0003"}


MINI_PXI = '''
cdef inline int _f32(Tensor a, str op) except -1:
    # ggml_bogus(a) in a comment is ignored
    if a.ptr.type != GGML_TYPE_F32:
        raise TypeError(f"{op}: ggml_bogus(")
    return 0


cdef class Context(_ContextBase):
    cdef Tensor _binary(self, Tensor a, Tensor b, int which):
        _f32(a, "x")
        cdef ggml_tensor * p
        if which == 0:
            p = ggml_add(self.ptr, a.ptr, b.ptr)
        else:
            p = ggml_sub(self.ptr, a.ptr, b.ptr)
        return self._r(p)

    def add(self, Tensor a, Tensor b):
        """a + b (calls ggml_add(ctx, a, b))."""
        return self._binary(a, b, 0)

    def sub(self, Tensor a, Tensor b):
        return self._binary(a, b, 1)

    def plus(self, Tensor a, Tensor b):
        return self._binary(a, b, 0)

    def conv(self, Tensor k, Tensor x,
             int s0=1):
        if ggml_is_contiguous(x.ptr):
            return self._r(ggml_conv_2d(self.ptr, k.ptr, x.ptr, s0, 1, 0, 0, 1, 1))
'''


def test_parse_bindings():
    got = gc.parse_bindings(MINI_PXI, {"ggml_add", "ggml_sub", "ggml_conv_2d", "ggml_bogus"})
    assert got == {
        "ggml_add": {"Context.add", "Context.plus"},
        "ggml_sub": {"Context.sub", "Context.plus"},  # plus: no ggml_plus, so the helper's every call
        "ggml_conv_2d": {"Context.conv"},
    }


def test_unmapped_constructor_fails_loudly():
    pxi = "cdef class Context:\n    def frob(self, Tensor a):\n        return ggml_frobnicate(self.ptr, a.ptr)\n"
    with pytest.raises(gc.CoverageError, match="ggml_frobnicate"):
        gc.parse_bindings(pxi, {"ggml_frobnicate"})


def test_missing_tree(tmp_path, capsys):
    assert gc.main(["--check"], root=tmp_path) == 1
    assert "run python tools/fetch_ggml.py first" in capsys.readouterr().err


needs_tree = pytest.mark.skipif(not (GGML_TREE / ".toy-stamp.json").is_file(), reason="no ggml tree (fetch_ggml.py)")


@needs_tree
def test_check_passes_on_committed_page(capsys):
    assert gc.main(["--check"]) == 0, capsys.readouterr().err


@needs_tree
def test_check_fails_on_stale_page(tmp_path, capsys):
    (tmp_path / "packages").symlink_to(ROOT / "packages")
    page = tmp_path / gc.PAGE
    page.parent.mkdir(parents=True)
    page.write_text((ROOT / gc.PAGE).read_text().replace("| `ADD` | yes |", "| `ADD` | no |"))
    assert gc.main(["--check"], root=tmp_path) == 1
    assert "docs/reference/ggml-coverage.md is stale: run `just coverage`" in capsys.readouterr().err
    page.unlink()
    assert gc.main(["--check"], root=tmp_path) == 1


@needs_tree
def test_real_tree_agrees_with_toy_allow_lists():
    # toy_ggml's allow-lists (in _graph.pxi) guard the same switch this page reads.
    tg = pytest.importorskip("toy_ggml")
    sets = gc.backward_sets((GGML_TREE / "src/ggml.c").read_text())
    assert sets["op"] == set(tg.BACKWARD_OPS)
    assert sets["unary"] == set(tg.BACKWARD_UNARY_OPS)
    assert sets["glu"] == set(tg.BACKWARD_GLU_OPS)
