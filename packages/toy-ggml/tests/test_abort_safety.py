"""Everything ggml would abort on is raised as a Python exception instead.

Each case is a short snippet that must raise a given exception. Every case runs
in this process (pytest.raises); the dangerous ones - where a missing check
would be a GGML_ASSERT, i.e. SIGABRT - also run in a fresh interpreter, which
must exit normally having printed the exception's name. That proves the check
happens before ggml is called, not that ggml happened to survive.

Cases that used to let ggml abort (graphs ggml's backward cannot build,
indices that are not plain inputs) run only in a child process, so a
regression fails the test instead of killing the test run.
"""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import toy_ggml as tg

F32 = tg.GGMLType.F32

_PRELUDE = """
import numpy as np
import toy_ggml as tg
F32, F16, I32, I64 = tg.GGMLType.F32, tg.GGMLType.F16, tg.GGMLType.I32, tg.GGMLType.I64
ctx = tg.Context()
"""

_CHILD = """
import sys
import toy_ggml as tg
rt = tg.Runtime("cpu", threads=1)
try:
{body}
except BaseException as e:
    print("RAISED", type(e).__name__, "|", e)
    sys.exit(0)
print("NO EXCEPTION")
"""

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _exc_type(name: str):
    return getattr(tg, name, None) or getattr(builtins, name)


def _run_child(code: str):
    env = dict(os.environ, GGML_NO_BACKTRACE="1")  # an abort prints, no gdb attach
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=_TESTS_DIR
    )
    return r, f"rc={r.returncode}\nstdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-2000:]}"


def _child_code(snippet: str) -> str:
    body = textwrap.indent(textwrap.dedent(_PRELUDE) + textwrap.dedent(snippet), "    ")
    return _CHILD.format(body=body)


# (id, snippet, exception name, message regex, also run in a child process)
CASES = [
    # shapes
    (
        "mul_mat_inner_mismatch",
        "ctx.mul_mat(ctx.tensor(F32, (3, 4)), ctx.tensor(F32, (2, 5)))",
        "ValueError",
        "inner extents",
        True,
    ),
    (
        "mul_mat_batch_not_broadcastable",
        "ctx.mul_mat(ctx.tensor(F32, (3, 2, 4)), ctx.tensor(F32, (2, 5, 4)))",
        "ValueError",
        "broadcast",
        True,
    ),
    (
        "mul_mat_transposed_a",
        "a = ctx.tensor(F32, (4, 4))\nctx.mul_mat(ctx.transpose(a), ctx.tensor(F32, (2, 4)))",
        "ValueError",
        "transposed",
        True,
    ),
    (
        "add_not_broadcastable",
        "ctx.add(ctx.tensor(F32, (3, 4)), ctx.tensor(F32, (2, 4)))",
        "ValueError",
        "broadcast",
        True,
    ),
    (
        "add_b_larger_than_a",
        "ctx.add(ctx.tensor(F32, (4,)), ctx.tensor(F32, (3, 4)))",
        "ValueError",
        "broadcast",
        False,
    ),
    (
        "mul_not_broadcastable",
        "ctx.mul(ctx.tensor(F32, (3, 4)), ctx.tensor(F32, (3,)))",
        "ValueError",
        "broadcast",
        False,
    ),
    ("reshape_wrong_count", "ctx.reshape(ctx.tensor(F32, (3, 4)), (5, 2))", "ValueError", "reshape", True),
    (
        "reshape_not_contiguous",
        "ctx.reshape(ctx.transpose(ctx.tensor(F32, (3, 4))), (12,))",
        "ValueError",
        "contiguous",
        True,
    ),
    ("view_past_end", "ctx.view(ctx.tensor(F32, (3, 4)), (4, 4))", "ValueError", "past the end", True),
    ("view_offset_past_end", "ctx.view(ctx.tensor(F32, (3, 4)), (4,), offset=40)", "ValueError", "past the end", False),
    (
        "view_strides_past_end",
        "ctx.view(ctx.tensor(F32, (3, 4)), (3, 2), strides=(32, 4))",
        "ValueError",
        "past the end",
        False,
    ),
    (
        "view_bad_inner_stride",
        "ctx.view(ctx.tensor(F32, (3, 4)), (2, 2), strides=(16, 8))",
        "ValueError",
        "innermost stride",
        False,
    ),
    ("permute_repeated_axis", "ctx.permute(ctx.tensor(F32, (2, 3, 4)), (0, 0, 1))", "ValueError", "permutation", True),
    ("permute_too_few_axes", "ctx.permute(ctx.tensor(F32, (2, 3, 4)), (1, 0))", "ValueError", "permutation", False),
    ("permute_axis_out_of_range", "ctx.permute(ctx.tensor(F32, (2, 3)), (0, 2))", "ValueError", "permutation", False),
    (
        "concat_mismatch",
        "ctx.concat(ctx.tensor(F32, (2, 3)), ctx.tensor(F32, (3, 4)), 0)",
        "ValueError",
        "differ",
        False,
    ),
    ("concat_bad_axis", "ctx.concat(ctx.tensor(F32, (2, 3)), ctx.tensor(F32, (2, 3)), 2)", "ValueError", "axis", False),
    ("tensor_five_dims", "ctx.tensor(F32, (1, 2, 3, 4, 5))", "ValueError", "1 to 4", False),
    ("tensor_negative_extent", "ctx.tensor(F32, (2, -1))", "ValueError", "negative", False),
    ("tensor_unknown_type", "ctx.tensor(4, (2,))", "ValueError", "unknown ggml type", False),
    # rows
    ("get_rows_i64_index", "ctx.get_rows(ctx.tensor(F32, (5, 4)), ctx.tensor(I64, (2,)))", "TypeError", "I32", True),
    ("get_rows_f32_index", "ctx.get_rows(ctx.tensor(F32, (5, 4)), ctx.tensor(F32, (2,)))", "TypeError", "I32", False),
    (
        "get_rows_dims_mismatch",
        "ctx.get_rows(ctx.tensor(F32, (2, 5, 4)), ctx.tensor(I32, (3, 2)))",
        "ValueError",
        "line up",
        True,
    ),
    (
        "set_rows_dims_mismatch",
        "ctx.set_rows(ctx.tensor(F32, (5, 4)), ctx.tensor(F32, (2, 3)), ctx.tensor(I32, (2,)))",
        "ValueError",
        "line up",
        False,
    ),
    # attention
    ("rope_odd_n_dims", "ctx.rope(ctx.tensor(F32, (3, 2, 8)), ctx.tensor(I32, (3,)), 5)", "ValueError", "n_dims", True),
    (
        "rope_n_dims_too_large",
        "ctx.rope(ctx.tensor(F32, (3, 2, 8)), ctx.tensor(I32, (3,)), 10)",
        "ValueError",
        "n_dims",
        False,
    ),
    (
        "rope_pos_length",
        "ctx.rope(ctx.tensor(F32, (3, 2, 8)), ctx.tensor(I32, (4,)), 8)",
        "ValueError",
        "positions",
        True,
    ),
    ("rope_pos_f32", "ctx.rope(ctx.tensor(F32, (3, 2, 8)), ctx.tensor(F32, (3,)), 8)", "TypeError", "pos", False),
    (
        "rope_bad_mode",
        "ctx.rope(ctx.tensor(F32, (3, 2, 8)), ctx.tensor(I32, (3,)), 8, mode='x')",
        "ValueError",
        "mode",
        False,
    ),
    (
        "soft_max_mask_width",
        "ctx.soft_max(ctx.tensor(F32, (3, 4)), ctx.tensor(F32, (3, 5)))",
        "ValueError",
        "mask",
        True,
    ),
    (
        "soft_max_mask_too_few_rows",
        "ctx.soft_max(ctx.tensor(F32, (3, 4)), ctx.tensor(F32, (2, 4)))",
        "ValueError",
        "mask",
        False,
    ),
    ("soft_max_mask_i32", "ctx.soft_max(ctx.tensor(F32, (3, 4)), ctx.tensor(I32, (3, 4)))", "TypeError", "mask", False),
    (
        "soft_max_alibi_without_mask",
        "ctx.soft_max(ctx.tensor(F32, (3, 4)), max_bias=8.0)",
        "ValueError",
        "ALiBi",
        False,
    ),
    (
        "flash_attn_head_mismatch",
        "ctx.flash_attn_ext(ctx.tensor(F32, (1, 2, 3, 8)), ctx.tensor(F16, (1, 2, 5, 4)), ctx.tensor(F16, (1, 2, 5, 4)))",
        "ValueError",
        "head sizes",
        True,
    ),
    # dtypes
    ("sqr_of_i32", "ctx.sqr(ctx.tensor(I32, (4,)))", "TypeError", "F32", True),
    ("add_of_f16", "ctx.add(ctx.tensor(F16, (4,)), ctx.tensor(F32, (4,)))", "TypeError", "F32", False),
    ("mul_mat_b_i32", "ctx.mul_mat(ctx.tensor(F32, (3, 4)), ctx.tensor(I32, (2, 4)))", "TypeError", "F32", False),
    ("mul_mat_a_i32", "ctx.mul_mat(ctx.tensor(I32, (3, 4)), ctx.tensor(F32, (2, 4)))", "TypeError", "I32", False),
    ("set_param_i32", "ctx.tensor(I32, (4,)).set_param()", "TypeError", "F32 or F16", False),
    # eps and scalar arguments
    ("rms_norm_negative_eps", "ctx.rms_norm(ctx.tensor(F32, (2, 4)), -1e-5)", "ValueError", "eps", True),
    ("norm_negative_eps", "ctx.norm(ctx.tensor(F32, (2, 4)), -1e-5)", "ValueError", "eps", True),
    ("norm_nan_eps", "ctx.norm(ctx.tensor(F32, (2, 4)), float('nan'))", "ValueError", "eps", False),
    ("clamp_lo_above_hi", "ctx.clamp(ctx.tensor(F32, (4,)), 1.0, -1.0)", "ValueError", "lo", False),
    ("diag_mask_negative", "ctx.diag_mask_inf(ctx.tensor(F32, (4, 4)), -1)", "ValueError", "n_past", False),
    ("top_k_too_large", "ctx.top_k(ctx.tensor(F32, (2, 4)), 5)", "ValueError", "k=5", False),
    # row reductions read each row's elements as consecutive floats
    ("sum_rows_transposed", "ctx.sum_rows(ctx.transpose(ctx.tensor(F32, (2, 3))))", "ValueError", "consecutive", True),
    ("mean_transposed", "ctx.mean(ctx.transpose(ctx.tensor(F32, (2, 3))))", "ValueError", "consecutive", False),
    ("argmax_transposed", "ctx.argmax(ctx.transpose(ctx.tensor(F32, (2, 3))))", "ValueError", "consecutive", False),
    # capacity
    (
        "context_full",
        "small = tg.Context(max_tensors=1)\nx = small.tensor(F32, (4,))\nfor _ in range(100000):\n    x = small.sqr(x)",
        "GGMLError",
        "full",
        True,
    ),
    (
        "graph_too_small",
        "x = ctx.tensor(F32, (4,))\ny = x\nfor _ in range(10):\n    y = ctx.sqr(y)\ntg.Graph(ctx, size=4).build_forward(y)",
        "GGMLError",
        "size 4",
        True,
    ),
    # loss and parameters
    ("set_loss_not_scalar", "ctx.sum_rows(ctx.tensor(F32, (2, 3))).set_loss()", "ValueError", "scalar", True),
    ("set_loss_i32", "ctx.tensor(I32, (1,)).set_loss()", "ValueError", "scalar F32", False),
    (
        "backward_no_param",
        "x = ctx.tensor(F32, (3,))\nloss = ctx.sum(ctx.sqr(x)).set_loss()\n"
        "tg.Graph(ctx, grads=True).build_forward(loss).build_backward()",
        "GGMLError",
        "no parameter",
        True,
    ),
    (
        "backward_no_loss",
        "x = ctx.tensor(F32, (3,)).set_param()\nloss = ctx.sum(ctx.sqr(x))\n"
        "tg.Graph(ctx, grads=True).build_forward(loss).build_backward()",
        "GGMLError",
        "no loss",
        True,
    ),
    (
        "backward_without_grads_graph",
        "x = ctx.tensor(F32, (3,)).set_param()\nloss = ctx.sum(ctx.sqr(x)).set_loss()\n"
        "tg.Graph(ctx).build_forward(loss).build_backward()",
        "GGMLError",
        "grads=True",
        True,
    ),
    ("backward_empty_graph", "tg.Graph(ctx, grads=True).build_backward()", "GGMLError", "empty", True),
    (
        "backward_twice",
        "x = ctx.tensor(F32, (3,)).set_param()\nloss = ctx.sum(ctx.sqr(x)).set_loss()\n"
        "g = tg.Graph(ctx, grads=True).build_forward(loss).build_backward()\ng.build_backward()",
        "GGMLError",
        "already",
        False,
    ),
    (
        "reset_before_allocation",
        "x = ctx.tensor(F32, (3,)).set_param()\nloss = ctx.sum(ctx.sqr(x)).set_loss()\n"
        "g = tg.Graph(ctx, grads=True).build_forward(loss).build_backward()\ng.reset()",
        "GGMLError",
        "no memory",
        True,
    ),
    (
        "grad_before_backward",
        "x = ctx.tensor(F32, (3,)).set_param()\ng = tg.Graph(ctx, grads=True).build_forward(ctx.sum(x))\ng.grad(x)",
        "GGMLError",
        "no backward",
        False,
    ),
    # data-dependent indices
    (
        "get_rows_index_too_large",
        "a = ctx.tensor(F32, (4, 3))\ni = ctx.tensor(I32, (2,))\nout = ctx.get_rows(a, i)\n"
        "g = tg.Graph(ctx).build_forward(out)\nctx.allocate(rt)\na.set(np.zeros((4, 3), np.float32))\n"
        "i.set(np.array([1, 4], np.int32))\nrt.compute(g)",
        "IndexError",
        "out of range",
        True,
    ),
    (
        "get_rows_index_negative",
        "a = ctx.tensor(F32, (4, 3))\ni = ctx.tensor(I32, (2,))\nout = ctx.get_rows(a, i)\n"
        "g = tg.Graph(ctx).build_forward(out)\nctx.allocate(rt)\na.set(np.zeros((4, 3), np.float32))\n"
        "i.set(np.array([-1, 0], np.int32))\nrt.compute(g)",
        "IndexError",
        "out of range",
        True,
    ),
    (
        "set_rows_index_too_large",
        "a = ctx.tensor(F32, (4, 3))\nb = ctx.tensor(F32, (2, 3))\ni = ctx.tensor(I64, (2,))\n"
        "out = ctx.set_rows(a, b, i)\ng = tg.Graph(ctx).build_forward(out)\nctx.allocate(rt)\n"
        "a.set(np.zeros((4, 3), np.float32))\nb.set(np.ones((2, 3), np.float32))\n"
        "i.set(np.array([0, 9], np.int64))\nrt.compute(g)",
        "IndexError",
        "out of range",
        True,
    ),
    (
        "mul_mat_id_index_too_large",
        "e = ctx.tensor(F32, (2, 3, 4))\nb = ctx.tensor(F32, (2, 1, 4))\nids = ctx.tensor(I32, (2, 1))\n"
        "out = ctx.mul_mat_id(e, b, ids)\ng = tg.Graph(ctx).build_forward(out)\nctx.allocate(rt)\n"
        "e.set(np.zeros((2, 3, 4), np.float32))\nb.set(np.zeros((2, 1, 4), np.float32))\n"
        "ids.set(np.array([[0], [2]], np.int32))\nrt.compute(g)",
        "IndexError",
        "out of range",
        True,
    ),
    # quantization
    (
        "quantize_row_not_whole_blocks",
        "tg.quantize(np.zeros((2, 33), np.float32), tg.GGMLType.Q8_0)",
        "ValueError",
        "block size",
        True,
    ),
    ("quantize_nan", "tg.quantize(np.full((1, 32), np.nan, np.float32), tg.GGMLType.Q8_0)", "ValueError", "NaN", False),
    (
        "quantize_unsupported_type",
        "tg.quantize(np.zeros((1, 32), np.float32), tg.GGMLType.I32)",
        "ValueError",
        "cannot quantize",
        False,
    ),
    (
        "quantized_tensor_row_not_whole_blocks",
        "ctx.tensor(tg.GGMLType.Q4_0, (2, 33))",
        "ValueError",
        "block size",
        True,
    ),
    (
        "dequantize_wrong_size",
        "tg.dequantize(np.zeros(10, np.uint8), tg.GGMLType.Q8_0, (1, 32))",
        "ValueError",
        "needs",
        False,
    ),
    # tensor data
    (
        "set_wrong_shape",
        "t = ctx.tensor(F32, (2, 3))\nctx.allocate()\nt.set(np.zeros((3, 2), np.float32))",
        "ValueError",
        "shape",
        False,
    ),
    (
        "set_wrong_dtype",
        "t = ctx.tensor(I32, (3,))\nctx.allocate()\nt.set(np.zeros(3, np.float32))",
        "TypeError",
        "float32",
        False,
    ),
    (
        "set_int_out_of_range",
        "t = ctx.tensor(I32, (1,))\nctx.allocate()\nt.set(np.array([2**40]))",
        "ValueError",
        "out of range",
        False,
    ),
    (
        "set_raw_wrong_size",
        "t = ctx.tensor(F32, (4,))\nctx.allocate()\nt.set_raw(b'0' * 15)",
        "ValueError",
        "bytes",
        False,
    ),
    (
        "set_raw_invalid_quant_data",
        "t = ctx.tensor(tg.GGMLType.Q8_0, (32,))\nctx.allocate()\n"
        "q = tg.quantize(np.ones((32,), np.float32), tg.GGMLType.Q8_0)\nq[:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)\n"
        "t.set_raw(q)",
        "ValueError",
        "not valid",
        True,
    ),
    ("name_too_long", "ctx.tensor(F32, (2,), name='x' * 64)", "ValueError", "longer than", False),
    (
        "numpy_of_non_contiguous",
        "t = ctx.tensor(F32, (2, 3))\ntt = ctx.transpose(t)\nctx.allocate()\ntt.numpy()",
        "ValueError",
        "contiguous",
        False,
    ),
    ("numpy_without_memory", "ctx.tensor(F32, (2, 3)).numpy()", "GGMLError", "no memory", True),
]

_BY_ID = {c[0]: c for c in CASES}


@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_raises_in_process(rt, case_id):
    _, snippet, exc, match, _ = _BY_ID[case_id]
    ns: dict = {"rt": rt}
    exec(textwrap.dedent(_PRELUDE), ns)
    try:
        with pytest.raises(_exc_type(exc), match=match):
            exec(textwrap.dedent(snippet), ns)
    finally:
        ns["ctx"].close()


@pytest.mark.parametrize("case_id", [c[0] for c in CASES if c[4]])
def test_raises_in_child_process(case_id):
    _, snippet, exc, _, _ = _BY_ID[case_id]
    r, detail = _run_child(_child_code(snippet))
    assert r.returncode == 0, "child died (abort?): " + detail
    assert f"RAISED {exc} |" in r.stdout, detail


def test_name_of_max_length_is_fine():
    with tg.Context() as ctx:
        t = ctx.tensor(F32, (2,), name="x" * 63)
        assert t.name == "x" * 63


def test_context_full_then_graph_is_refused():
    # a full context refuses both new tensors and new graphs, with GGMLError
    ctx = tg.Context(max_tensors=1)
    x = ctx.tensor(F32, (4,))
    with pytest.raises(tg.GGMLError, match="full"):
        for _ in range(100000):
            x = ctx.sqr(x)
    with pytest.raises(tg.GGMLError):
        tg.Graph(ctx, size=64)
    ctx.close()


def test_process_survives_all_in_process_cases(rt):
    # after every refusal above, the library still works
    with tg.Context() as ctx:
        a = ctx.tensor(F32, (2, 2))
        out = ctx.mul_mat(a, a)
        g = tg.Graph(ctx).build_forward(out)
        ctx.allocate(rt)
        a.set(np.eye(2, dtype=np.float32))
        rt.compute(g)
        np.testing.assert_array_equal(out.numpy(), np.eye(2))


# ---------------------------------------------------------------------------
# build_backward through an op without a gradient: UnsupportedBackwardError
# naming the op (ggml itself would abort)

_NO_BACKWARD = [
    ("sigmoid", "ctx.sigmoid(x)", "SIGMOID"),
    ("pad", "ctx.pad(x, [(1, 1), (0, 2)])", "PAD"),
    ("concat", "ctx.concat(x, x, 0)", "CONCAT"),
    ("flash_attn_ext", "r = ctx.reshape(x, (1, 1, 4, 6))\nout = ctx.flash_attn_ext(r, r, r)", "FLASH_ATTN_EXT"),
    ("set_rows", "out = ctx.set_rows(x, ctx.scale(x, 2.0), ids)", "SET_ROWS"),
    ("soft_max_mask_param", "ctx.soft_max(x, x)", "mask"),
    (
        "rope_freq_factors_param",
        "ctx.rope(ctx.reshape(x, (4, 1, 6)), ids, 6, freq_factors=ctx.reshape(x, (24,)))",
        "frequency factors",
    ),
    ("cross_entropy_labels_param", "ctx.cross_entropy_loss(ctx.scale(x, 1.0), x)", "labels"),
    ("sigmoid_deep_in_graph", "ctx.sum_rows(ctx.mul(ctx.sigmoid(ctx.silu(x)), x))", "SIGMOID"),
]


def _no_backward_snippet(expr: str) -> str:
    lines = expr.split("\n")
    body = "\n".join(lines[:-1])
    last = lines[-1] if lines[-1].startswith("out =") else f"out = {lines[-1]}"
    return (
        "x = ctx.tensor(F32, (4, 6)).set_param()\nids = ctx.tensor(I32, (4,))\n"
        + (body + "\n" if body else "")
        + last
        + "\nloss = (out if out.size == 1 else ctx.sum(out)).set_loss()\n"
        "g = tg.Graph(ctx, size=4096, grads=True).build_forward(loss)\ng.build_backward()"
    )


@pytest.mark.parametrize("expr, names", [pytest.param(e, n, id=i) for i, e, n in _NO_BACKWARD])
def test_backward_through_op_without_gradient(expr, names):
    ns: dict = {}
    exec(textwrap.dedent(_PRELUDE), ns)
    try:
        with pytest.raises(tg.UnsupportedBackwardError, match=names):
            exec(_no_backward_snippet(expr), ns)
    finally:
        ns["ctx"].close()


@pytest.mark.parametrize("expr, names", [pytest.param(e, n, id=i) for i, e, n in _NO_BACKWARD[:4]])
def test_backward_through_op_without_gradient_in_child(expr, names):
    r, detail = _run_child(_child_code(_no_backward_snippet(expr)))
    assert r.returncode == 0, "child died (abort?): " + detail
    assert "RAISED UnsupportedBackwardError |" in r.stdout, detail
    assert names in r.stdout, detail


def test_backward_through_i32_argmax_gives_no_gradient():
    # ARGMAX has no backward, but its output is I32: like ggml, toy does not
    # propagate gradients through integer tensors, so the parameter simply
    # gets none (no abort, no error).
    with tg.Context() as ctx:
        x = ctx.tensor(F32, (3, 4)).set_param()
        loss = ctx.sum(ctx.cast(ctx.argmax(x), F32)).set_loss()
        g = tg.Graph(ctx, grads=True).build_forward(loss)
        g.build_backward()
        assert g.grad(x) is None


def test_backward_mixed_argmax_path_keeps_other_gradient(rt):
    # loss = sum(x) + sum(argmax(x)): d/dx is 1 everywhere from the sum alone
    with tg.Context() as ctx:
        x = ctx.tensor(F32, (3, 4)).set_param()
        loss = ctx.add(ctx.sum(x), ctx.sum(ctx.cast(ctx.argmax(x), F32))).set_loss()
        g = tg.Graph(ctx, grads=True).build_forward(loss).build_backward()
        gx = g.grad(x)
        assert gx is not None
        ctx.allocate(rt)
        x.set(np.arange(12, dtype=np.float32).reshape(3, 4))
        g.reset()
        rt.compute(g)
        np.testing.assert_array_equal(gx.numpy(), np.ones((3, 4)))


def test_softmax_alibi_backward_is_refused_not_aborted():
    # SOFT_MAX_BACK on the CPU asserts max_bias == 0; the scheduler check
    # refuses the node before compute
    code = _child_code(
        "x = ctx.tensor(F32, (2, 3, 4)).set_param()\nm = ctx.tensor(F32, (3, 4))\n"
        "loss = ctx.sum(ctx.soft_max(x, m, max_bias=8.0)).set_loss()\n"
        "g = tg.Graph(ctx, grads=True).build_forward(loss).build_backward()\n"
        "ctx.allocate(rt)\nx.set(np.zeros((2, 3, 4), np.float32))\nm.set(np.zeros((3, 4), np.float32))\n"
        "g.reset()\nrt.compute(g)"
    )
    r, detail = _run_child(code)
    assert r.returncode == 0, "child died (abort?): " + detail
    assert "RAISED GGMLError |" in r.stdout or "RAISED UnsupportedBackwardError |" in r.stdout, detail


# ---------------------------------------------------------------------------
# known holes: ggml aborts because toy does not check. Each runs in a child.
# A pass is: the child exits normally and either refuses with a toy_ggml
# error / ValueError, or computes a gradient that matches finite differences.

_GRAD_CHILD = """
import sys
sys.path.insert(0, {tests_dir!r})
import numpy as np
import toy_ggml as tg
from test_backward import grad_check
rt = tg.Runtime("cpu", threads=1)
rng = np.random.default_rng(11)
try:
    grad_check(rt, {build}, {params}, {consts})
    print("RESULT OK")
except AssertionError as e:
    print("RESULT WRONG", str(e)[:2000])
except (tg.GGMLError, ValueError, TypeError) as e:
    print("RESULT REFUSED", type(e).__name__, e)
"""


def _grad_child(build, params, consts="[]"):
    return _GRAD_CHILD.format(tests_dir=_TESTS_DIR, build=build, params=params, consts=consts)


_STRUCTURAL_HOLES = [
    pytest.param(
        "lambda c, x, y: c.sub(x, y)",
        "[rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((1, 4)).astype(np.float32)]",
        "[]",
        id="sub_broadcast_b_param",
    ),
    pytest.param(
        "lambda c, x, y: c.div(x, y)",
        "[rng.standard_normal((3, 4)).astype(np.float32), (2 + rng.random((1, 4))).astype(np.float32)]",
        "[]",
        id="div_broadcast_b_param",
    ),
    pytest.param(
        "lambda c, t, i: c.get_rows(t, i)",
        "[rng.standard_normal((2, 5, 4)).astype(np.float32)]",
        "[np.array([[0, 2, 4], [1, 1, 3]], np.int32)]",
        id="get_rows_3d_table_param",
    ),
    pytest.param(
        "lambda c, a, b: c.mul_mat(a, b)",
        "[rng.standard_normal((2, 1, 3, 4)).astype(np.float32), rng.standard_normal((2, 2, 5, 4)).astype(np.float32)]",
        "[]",
        id="mul_mat_4d_broadcast_a_param",
    ),
]


@pytest.mark.parametrize("build, params, consts", _STRUCTURAL_HOLES)
def test_backward_structural_holes(build, params, consts):
    r, detail = _run_child(_grad_child(build, params, consts))
    assert r.returncode == 0, "child died (abort?): " + detail
    assert "RESULT OK" in r.stdout or "RESULT REFUSED" in r.stdout, detail


def test_backward_with_adamw_node_in_graph():
    code = _child_code(
        "x = ctx.tensor(F32, (4,)).set_param()\n"
        "gr, m, v, h = (ctx.tensor(F32, s) for s in ((4,), (4,), (4,), (7,)))\n"
        "step = ctx.opt_step_adamw(x, gr, m, v, h)\n"
        "loss = ctx.sum(ctx.sqr(x)).set_loss()\n"
        "g = tg.Graph(ctx, grads=True).build_forward(loss, step)\n"
        "g.build_backward()\n"
        "print('BUILT')"
    )
    r, detail = _run_child(code)
    assert r.returncode == 0, "child died (abort?): " + detail
    assert "BUILT" in r.stdout or "RAISED GGMLError |" in r.stdout or "RAISED UnsupportedBackwardError |" in r.stdout, (
        detail
    )


_INDEX_HOLES = [
    pytest.param(
        "a = ctx.tensor(F32, (4, 3))\ni = ctx.tensor(I32, (2, 2))\nout = ctx.get_rows(a, ctx.reshape(i, (4,)))\n"
        "g = tg.Graph(ctx).build_forward(out)\nctx.allocate(rt)\na.set(np.zeros((4, 3), np.float32))\n"
        "i.set(np.array([[1, 100], [0, 0]], np.int32))\nrt.compute(g)",
        id="get_rows_index_is_reshape_of_leaf",
    ),
    pytest.param(
        "a = ctx.tensor(F32, (4, 3))\nf = ctx.tensor(F32, (2,))\nout = ctx.get_rows(a, ctx.cast(f, I32))\n"
        "g = tg.Graph(ctx).build_forward(out)\nctx.allocate(rt)\na.set(np.zeros((4, 3), np.float32))\n"
        "f.set(np.array([1.0, 100.0], np.float32))\nrt.compute(g)",
        id="get_rows_index_computed_in_graph",
    ),
    pytest.param(
        "a = ctx.tensor(F32, (4, 3))\nb = ctx.tensor(F32, (2, 3))\nf = ctx.tensor(F32, (2,))\n"
        "out = ctx.set_rows(a, b, ctx.cast(f, I32))\ng = tg.Graph(ctx).build_forward(out)\nctx.allocate(rt)\n"
        "a.set(np.zeros((4, 3), np.float32))\nb.set(np.ones((2, 3), np.float32))\n"
        "f.set(np.array([1.0, 100.0], np.float32))\nrt.compute(g)",
        id="set_rows_index_computed_in_graph",
    ),
]


@pytest.mark.parametrize("snippet", _INDEX_HOLES)
def test_out_of_range_index_not_from_a_leaf(snippet):
    r, detail = _run_child(_child_code(snippet))
    assert r.returncode == 0, "child died (abort?): " + detail
    assert "RAISED IndexError |" in r.stdout or "RAISED GGMLError |" in r.stdout, detail
