"""Forward values of every ``Context`` op against NumPy references.

Expected values are computed here in NumPy (float64 unless noted) from each
op's mathematical definition, on random inputs from the ``rng`` fixture; never
from ggml. Where ggml's exact semantics are non-obvious, a comment names the
ggml source the reference follows (paths relative to
packages/toy-ggml/subprojects/ggml/).

Tolerances (per dtype / kind of op):

- Data movement (cont, reshape, view, permute, transpose, cpy/cast F32<->F16,
  F32->BF16/I32, concat, repeat, pad, get_rows, set_rows, diag_mask_inf,
  im2col, argmax, top_k): exact equality (F16/BF16 against NumPy
  round-to-nearest-even, which is what ggml's conversions do).
- F32 elementwise ops (add..div, scale, sqr..relu except gelu, clamp, swiglu):
  rtol 1e-5, atol 1e-6 (ggml's SIMD expf/tanhf are within a few ulp).
- F32 reductions, norms, softmax, rope, cross-entropy, AdamW, F32 matmul and
  attention: rtol 1e-5 (1e-4 for matmul/attention) with an atol of ~1e-5 of
  the output scale: float32 accumulation in a different order than NumPy.
- pool_2d: rtol 1e-6, atol 1e-6 (max is exact; avg is a short F32 sum).
- cpy F32 -> Q8_0 vs tg.dequantize(tg.quantize(x)): ggml's copy uses the SIMD
  quantizer, tg.quantize the reference one; they may round a tie differently,
  so at most one quantization step (amax/127) apart in < 1 % of the elements
  (measured: identical). get_rows of a quantized table: exact (same
  dequantize kernel).
- GELU: the CPU rounds x to F16 and reads GELU from an F16 table
  (ggml-cpu/vec.h, GGML_GELU_FP16), so |err| <= 2**-11 * (1.13*|x| + |y|):
  rtol 2e-3, atol 1e-3.
- GELU, erf form: float32 with erff, no table: rtol 1e-6 plus an absolute
  2**-22 * |x| for the cancellation of 1 + erf at x < 0 (see test_gelu_erf).
- F16 weights in mul_mat: ggml converts the F32 activations to F16 (the F16
  vec_dot_type), so the reference rounds them to F16 too; what remains is F32
  accumulation error: rtol 1e-4, atol 1e-4.
- conv_2d: ggml_conv_2d runs im2col in F16 and an F16 matmul (ggml.c), so the
  reference rounds x and the kernel to F16: rtol 1e-4, atol 1e-4.
- Quantized weights (mul_mat, mul_mat_id): reference = dequantized weights
  (tg.dequantize(tg.quantize(W, t), t, W.shape)) @ F32 activations. ggml also
  quantizes the activations to Q8_0 / Q8_1 / Q8_K blocks (step amax/127, i.e.
  ~0.5-0.7 % RMS relative error per element, independent of W), so the
  relative L2 error of the whole output must be < 1e-2 (measured 0.54 % for
  Q8_0/Q8_1 activations, 0.65-0.72 % for Q8_K). For weight types whose
  vec_dot_type is Q8_0 (Q8_0, Q4_0, Q5_0) the reference can quantize the
  activations the same way (tg.quantize(b, Q8_0)); then only F32 accumulation
  and possible rounding-tie differences between ggml's SIMD quantizer and the
  reference one remain (one flipped element moves the output by ~4e-4 relative
  L2): relative L2 < 1e-3 (measured 8e-8).
- flash_attn_ext with F16 K/V: Q is converted to F16 for the KQ dot and the
  V accumulator is F16 (ggml-cpu/ops.cpp,
  ggml_compute_forward_flash_attn_ext_f16_one_chunk): reference uses the
  F16-rounded q. Each of the n_kv F16 accumulator updates rounds at 2**-11
  relative, so relative L2 < sqrt(n_kv) * 2**-11 and elementwise
  atol = sqrt(n_kv) * 2**-11 * max|ref| (measured errors are ~1/3 of that).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import toy_ggml as tg

Q = tg.GGMLType


def _load_conftest():
    # pytest runs with --import-mode=importlib, so `from conftest import ...`
    # does not work: reuse the module pytest loaded, or load it by path.
    path = Path(__file__).with_name("conftest.py").resolve()
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if f and Path(f).resolve() == path:
            return mod
    spec = importlib.util.spec_from_file_location("_toy_ggml_tests_conftest", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


eval_graph = _load_conftest().eval_graph

F32 = np.float32


# ----------------------------------------------------------------------------- helpers


def f16r(x):
    """x rounded to float16 and back (round-to-nearest-even)."""
    return np.asarray(x, F32).astype(np.float16).astype(F32)


def bf16r(x):
    """x rounded to bfloat16 (round-to-nearest-even, as ggml's fp32->bf16) and back."""
    u = np.asarray(x, F32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return (u << 16).astype(np.uint32).view(F32)


def qdq(w, t):
    """W as ggml stores it in type t: quantize then dequantize through ggml's reference kernels."""
    return tg.dequantize(tg.quantize(w, t), t, w.shape)


def rel_l2(got, ref):
    return float(np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref))


def softmax(x, axis=-1):
    x = np.asarray(x, np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=axis, keepdims=True)


def log_softmax(x, axis=-1):
    x = np.asarray(x, np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def to4(x):
    x = np.asarray(x)
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def tile_to(b, shape):
    """ggml broadcasting of b over a tensor of ``shape``: index i of an axis
    reads b at i % extent (ggml_can_repeat + the modulo in binary-ops.cpp)."""
    bs = (1,) * (len(shape) - b.ndim) + b.shape
    return np.tile(b.reshape(bs), tuple(s // e for s, e in zip(shape, bs, strict=True)))


def mod_lead(m, lead):
    """Broadcast the two leading axes of 4-D m to ``lead`` by index modulo
    (soft_max / flash_attn mask: i12 = i02 % ne12, i13 = i03 % ne13)."""
    m = m[np.arange(lead[0]) % m.shape[0]]
    return m[:, np.arange(lead[1]) % m.shape[1]]


def alibi_slopes(n_head, max_bias):
    # ggml-cpu/ops.cpp ggml_compute_forward_soft_max_f32 (and flash_attn_ext): h = index of ne[2]
    n_head_log2 = 2 ** int(np.floor(np.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_head_log2)
    m1 = 2.0 ** (-max_bias / 2.0 / n_head_log2)
    return np.array([m0 ** (h + 1) if h < n_head_log2 else m1 ** (2 * (h - n_head_log2) + 1) for h in range(n_head)])


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(F32)


def close(got, ref, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- binary / scale

BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}


@pytest.mark.parametrize("op", list(BINARY))
@pytest.mark.parametrize(
    "a_shape,b_shape",
    [
        ((3, 4, 37), (3, 4, 37)),  # same shape, odd row length (SIMD tail)
        ((2, 3, 4, 16), (16,)),  # row vector
        ((2, 3, 4, 16), (3, 1, 16)),  # extents of 1
        ((4, 6, 8), (2, 3, 8)),  # extents dividing a's: ggml tiles (i % ne)
        ((5, 12), (5, 3)),  # tiling inside a row
    ],
)
def test_binary(rt, rng, op, a_shape, b_shape):
    a = randn(rng, *a_shape)
    b = randn(rng, *b_shape)
    if op == "div":
        b = (np.sign(b) * (0.5 + np.abs(b))).astype(F32)
    got = eval_graph(rt, lambda ctx, x, y: getattr(ctx, op)(x, y), a, b)
    assert got.shape == a_shape
    close(got, BINARY[op](a.astype(np.float64), tile_to(b, a_shape)))


@pytest.mark.parametrize("s,bias", [(0.37, 0.0), (-2.5, 0.0), (0.37, 1.25), (1.0, -0.5)])
def test_scale(rt, rng, s, bias):
    a = randn(rng, 3, 5, 33)
    got = eval_graph(rt, lambda ctx, x: ctx.scale(x, s, bias), a)
    close(got, a.astype(np.float64) * np.float32(s) + np.float32(bias))


# ----------------------------------------------------------------------------- unary


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


UNARY = [
    # name, reference, input kind, rtol, atol
    ("sqr", np.square, "normal", 1e-5, 1e-6),
    ("sqrt", np.sqrt, "positive", 1e-5, 1e-6),
    ("exp", np.exp, "normal", 1e-5, 1e-6),
    ("log", np.log, "positive", 1e-5, 1e-6),
    ("neg", np.negative, "normal", 0, 0),
    ("tanh", np.tanh, "normal", 1e-5, 1e-6),
    ("sigmoid", lambda x: 1.0 / (1.0 + np.exp(-x)), "normal", 1e-5, 1e-6),
    ("gelu", _gelu_tanh, "wide", 2e-3, 1e-3),
    ("silu", lambda x: x / (1.0 + np.exp(-x)), "normal", 1e-5, 1e-6),
    ("relu", lambda x: np.maximum(x, 0.0), "normal", 0, 0),
]


@pytest.mark.parametrize("name,fn,kind,rtol,atol", UNARY, ids=[u[0] for u in UNARY])
def test_unary(rt, rng, name, fn, kind, rtol, atol):
    x = randn(rng, 4, 67, scale=3.0)
    if kind == "positive":
        x = (np.abs(x) + 1e-3).astype(F32)
    elif kind == "wide":  # past ggml's +-10 cut-offs of the GELU table
        x.flat[:6] = [-12.0, -10.0, -9.99, 9.99, 10.0, 15.0]
    got = eval_graph(rt, lambda ctx, a: getattr(ctx, name)(a), x)
    close(got, fn(x.astype(np.float64)), rtol=rtol, atol=atol)


def _gelu_erf(x):
    # 0.5 x (1 + erf(x/sqrt2)) = 0.5 x erfc(-x/sqrt2): erfc keeps the float64
    # reference exact where 1 + erf would cancel (x << 0).
    return np.array([0.5 * v * math.erfc(-v / math.sqrt(2.0)) for v in np.asarray(x, np.float64).ravel()]).reshape(
        np.shape(x)
    )


def _erf_ulps(got, x):
    """|got - erf(x)| in float32 ulps of erf(x) (math.erf in float64 as the reference)."""
    ref = np.array([math.erf(float(v)) for v in x.ravel()]).reshape(x.shape)
    ulp = np.spacing(np.maximum(np.abs(ref), 2.0**-126).astype(F32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - ref) / ulp


def test_erf_within_3_ulp(rt, rng):
    # patch 0014: erf(x) = x * Q_i(|x| - c_i) on 8 intervals of [0, 4), +-1 beyond. Measured max
    # 2.8 ulp (the fit's own error is far below; the rest is float32 rounding of t, Horner and
    # the product). Inputs: uniform over [-6, 6], near 0 (relative accuracy there), every cut
    # point and its float32 neighbours.
    cuts = np.array([0.5 * i for i in range(1, 9)], F32)
    near = np.concatenate([cuts, np.nextafter(cuts, 0), np.nextafter(cuts, 10), -cuts])
    x = np.concatenate(
        [rng.uniform(-6, 6, 1_000_000), rng.standard_normal(100_000) * 1e-3, rng.standard_normal(1000) * 1e-30, near]
    ).astype(F32)
    got = eval_graph(rt, lambda ctx, a: ctx.erf(a), x)
    e = _erf_ulps(got, x)
    assert e.max() <= 3.0, f"x={x[np.argmax(e)]}: {e.max():.2f} ulp"
    np.testing.assert_array_equal(eval_graph(rt, lambda ctx, a: ctx.erf(a), -x), -got)  # odd, exactly


def test_erf_special_values(rt):
    x = np.array([0.0, -0.0, 4.0, -4.0, 5.0, -1e30, np.inf, -np.inf, np.nan, 2.0**-149], F32)
    got = eval_graph(rt, lambda ctx, a: ctx.erf(a), x)
    np.testing.assert_array_equal(got[:8], [0.0, -0.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    assert np.signbit(got[1]) and not np.signbit(got[0])
    assert np.isnan(got[8]) and got[9] > 0  # NaN stays NaN; the smallest subnormal stays positive


_VARIANT_CHILD = r"""
import hashlib, sys
import numpy as np
import toy_ggml as tg
x = np.random.default_rng(3).uniform(-6, 6, 100_003).astype(np.float32)  # a vector tail too
rt = tg.Runtime("cpu", threads=2)
outs = []
with tg.Context(max_tensors=8) as ctx:
    a = ctx.tensor(tg.GGMLType.F32, x.shape)
    e, g = ctx.erf(a), ctx.gelu_erf(a)
    graph = tg.Graph(ctx, size=16).build_forward(e, g)
    ctx.allocate(rt)
    a.set(x)
    rt.compute(graph)
    print(tg.cpu_variant().tag, hashlib.sha256(e.numpy().tobytes() + g.numpy().tobytes()).hexdigest())
"""


def test_erf_is_the_same_on_every_cpu_variant():
    # patch 0014: the scalar, AVX2 and AVX-512 forms do the same operations in the same order
    runnable = [c.tag for c in tg.cpu_variant().candidates if not c.missing]
    if len(runnable) < 2:
        pytest.skip("this build has one CPU variant this machine runs")
    digests = {}
    for tag in runnable:
        env = dict(os.environ, TOY_GGML_CPU_VARIANT=tag)
        proc = subprocess.run([sys.executable, "-c", _VARIANT_CHILD], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        got_tag, digest = proc.stdout.split()[-2:]
        assert got_tag == tag
        digests[tag] = digest
    assert len(set(digests.values())) == 1, digests


def test_soft_max_max_at_every_position(rt):
    # patch 0013: the row maximum in vector lanes. A row of n values with its maximum at
    # position j, 1000 above the rest: with a wrong maximum exp overflows (inf/NaN) or every
    # term underflows (0/0); with the right one the row is one-hot to float32 precision.
    for n in (1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 70):
        x = np.tile(np.linspace(-1.0, 1.0, n, dtype=F32), (n, 1))
        x[np.arange(n), np.arange(n)] = 1000.0
        got = eval_graph(rt, lambda ctx, a: ctx.soft_max(a), x)
        z = x.astype(np.float64)
        ref = np.exp(z - z.max(axis=1, keepdims=True))
        ref /= ref.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-30, err_msg=f"n={n}")


def test_gelu_erf(rt, rng):
    # ggml-cpu/vec.h ggml_vec_gelu_erf_f32: y = 0.5f*x*(1.0f + erf(x*SQRT_2_INV)) in float32 with
    # toy's vector erf (patch 0014), no float16 table. Error: a few ulp from erf (<= 3), the
    # x*SQRT_2_INV and product roundings -> rtol 1e-6 (~16 * 2**-24); plus, for x < 0 where
    # 1 + erf cancels, an absolute error of erf near -1 (<= 3 * 2**-24) and of the sum 1 + erf
    # scaled by 0.5|x|: atol 2**-22 * |x|. Measured on x in [-12, 12] (glibc's erff, before patch
    # 0014): max err/tol 0.11; toy's erf on 500,000 inputs over [-8, 8]: max err/tol 0.70. Inputs include 0, +-tiny, +-subnormal, the +-10 region (no
    # cut-off there, unlike gelu()) and the tails.
    special = np.array(
        [0.0, -0.0, 1e-30, -1e-30, 1e-40, -1e-40, 1e-7, -1e-7, 0.5, -0.5, 1.0, -1.0, 3.0, -3.0]
        + [5.0, -5.0, 9.99, -9.99, 10.0, -10.0, 12.0, -12.0, 30.0, -30.0, 1e4, -1e4],
        F32,
    )
    x = np.concatenate([special, randn(rng, 4 * 67 - special.size, scale=3.0).ravel()]).reshape(4, 67).astype(F32)
    got = np.asarray(eval_graph(rt, lambda ctx, a: ctx.gelu_erf(a), x), np.float64)
    ref = _gelu_erf(x)
    # (+ 2**-149, one subnormal step: 0.5 * x rounds there)
    tol = 1e-6 * np.abs(ref) + 2.0**-22 * np.abs(x.astype(np.float64)) + 2.0**-149
    err = np.abs(got - ref)
    assert np.all(err <= tol), f"worst x={x.flat[np.argmax(err - tol)]}: err {err.max():.3g}"
    assert np.all(got[x > 0] > 0) and got.flat[0] == 0.0
    # far from 0 erf saturates to +-1: gelu_erf(1e4) = 1e4, gelu_erf(-1e4) = 0
    assert got.flat[special.size - 2] == 1e4 and got.flat[special.size - 1] == 0.0


@pytest.mark.parametrize("lo,hi", [(-0.5, 0.5), (0.0, 10.0), (-1.0, -1.0)])
def test_clamp(rt, rng, lo, hi):
    x = randn(rng, 3, 40, scale=2.0)
    got = eval_graph(rt, lambda ctx, a: ctx.clamp(a, lo, hi), x)
    np.testing.assert_array_equal(got, np.clip(x, np.float32(lo), np.float32(hi)))


def test_swiglu(rt, rng):
    a = randn(rng, 2, 5, 36, scale=2.0)
    b = randn(rng, 2, 5, 36)
    got = eval_graph(rt, lambda ctx, x, y: ctx.swiglu(x, y), a, b)
    a64 = a.astype(np.float64)
    close(got, a64 / (1.0 + np.exp(-a64)) * b)


# ----------------------------------------------------------------------------- reductions


def test_sum(rt, rng):
    x = randn(rng, 3, 5, 41)
    got = eval_graph(rt, lambda ctx, a: ctx.sum(a), x)
    assert got.shape == (1,)
    close(got, [x.astype(np.float64).sum()], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", [(50,), (7, 50), (2, 3, 50)])
def test_sum_rows_and_mean(rt, rng, shape):
    x = randn(rng, *shape)
    s, m = eval_graph(rt, lambda ctx, a: (ctx.sum_rows(a), ctx.mean(a)), x)
    x64 = x.astype(np.float64)
    close(s, x64.sum(-1, keepdims=True), rtol=1e-5, atol=1e-5)
    close(m, x64.mean(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_argmax(rt, rng):
    x = randn(rng, 7, 53)
    got = eval_graph(rt, lambda ctx, a: ctx.argmax(a), x)
    assert got.dtype == np.int32 and got.shape == (7,)
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


@pytest.mark.parametrize("shape,k", [((6, 40), 1), ((6, 40), 5), ((2, 3, 33), 7), ((4, 16), 16)])
def test_top_k(rt, rng, shape, k):
    x = randn(rng, *shape)
    got = eval_graph(rt, lambda ctx, a: ctx.top_k(a, k), x)
    assert got.dtype == np.int32 and got.shape == shape[:-1] + (k,)
    # order is unspecified (ggml even swaps the first two): compare sets
    ref = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    np.testing.assert_array_equal(np.sort(got, -1), np.sort(ref, -1))


# ----------------------------------------------------------------------------- norms


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rms_norm(rt, rng, eps):
    x = randn(rng, 3, 4, 64, scale=2.0)
    got = eval_graph(rt, lambda ctx, a: ctx.rms_norm(a, eps), x)
    x64 = x.astype(np.float64)
    close(got, x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + np.float32(eps)), atol=1e-5)


@pytest.mark.parametrize("eps", [1e-5, 1e-1])
def test_norm(rt, rng, eps):
    x = (randn(rng, 3, 4, 64, scale=2.0) + 3.0).astype(F32)
    got = eval_graph(rt, lambda ctx, a: ctx.norm(a, eps), x)
    x64 = x.astype(np.float64)
    mu = x64.mean(-1, keepdims=True)
    var = ((x64 - mu) ** 2).mean(-1, keepdims=True)
    close(got, (x64 - mu) / np.sqrt(var + np.float32(eps)), atol=1e-5)


# ----------------------------------------------------------------------------- mul_mat


def mul_mat_ref(a, b):
    """b @ a.T over the last two axes with ggml's broadcasting: a's leading
    extents divide b's and b's batch j reads a's batch j // (ratio)
    (ggml-cpu/ggml-cpu.c: i02 = i12 / r2, i03 = i13 / r3), i.e. np.repeat."""
    a4, b4 = to4(np.asarray(a, np.float64)), to4(np.asarray(b, np.float64))
    a4 = np.repeat(a4, b4.shape[0] // a4.shape[0], axis=0)
    a4 = np.repeat(a4, b4.shape[1] // a4.shape[1], axis=1)
    out = b4 @ np.swapaxes(a4, -1, -2)
    nd = max(2, np.ndim(a), np.ndim(b))
    return out.reshape(out.shape[4 - nd :])


MUL_MAT_SHAPES = [
    ((5, 64), (7, 64)),
    ((5, 64), (64,)),  # b a vector -> (1, 5)
    ((3, 5, 64), (3, 7, 64)),
    ((5, 64), (2, 3, 7, 64)),  # a broadcast over b's batches
    ((2, 5, 64), (2, 4, 7, 64)),  # a batch 2 over b batch 4: ggml repeats, not tiles
    ((3, 2, 6, 48), (3, 4, 9, 48)),
]


@pytest.mark.parametrize("a_shape,b_shape", MUL_MAT_SHAPES)
def test_mul_mat_f32(rt, rng, a_shape, b_shape):
    a = randn(rng, *a_shape)
    b = randn(rng, *b_shape)
    got = eval_graph(rt, lambda ctx, x, y: ctx.mul_mat(x, y), a, b)
    ref = mul_mat_ref(a, b)
    assert got.shape == ref.shape
    close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("a_shape,b_shape", MUL_MAT_SHAPES[:1] + MUL_MAT_SHAPES[3:])
def test_mul_mat_f16(rt, rng, a_shape, b_shape):
    a = randn(rng, *a_shape).astype(np.float16)
    b = randn(rng, *b_shape)
    got = eval_graph(rt, lambda ctx, x, y: ctx.mul_mat(x, y), a, b)
    ref = mul_mat_ref(a.astype(F32), f16r(b))  # ggml converts b to F16 (vec_dot_type)
    assert got.shape == ref.shape
    close(got, ref, rtol=1e-4, atol=1e-4)
    # and it is F16-rounding close to the all-F32 product
    assert rel_l2(got, mul_mat_ref(a.astype(F32), b)) < 2e-3


QUANT_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K]
Q8_0_ACT = {Q.Q8_0, Q.Q4_0, Q.Q5_0}  # types whose vec_dot_type is Q8_0 (ggml-cpu/ggml-cpu.c type_traits_cpu)


@pytest.mark.parametrize("qt", QUANT_TYPES, ids=[t.name for t in QUANT_TYPES])
@pytest.mark.parametrize("a_shape,b_shape", [((16, 256), (9, 256)), ((2, 8, 256), (4, 5, 256))])
def test_mul_mat_quantized(rt, rng, qt, a_shape, b_shape):
    w = randn(rng, *a_shape)
    b = randn(rng, *b_shape)
    got = eval_graph(rt, lambda ctx, x, y: ctx.mul_mat(x, y), (qt, w), b)
    wq = qdq(w, qt)
    ref = mul_mat_ref(wq, b)
    assert got.shape == ref.shape
    assert rel_l2(got, ref) < 1e-2
    if qt in Q8_0_ACT:
        assert rel_l2(got, mul_mat_ref(wq, qdq(b, Q.Q8_0))) < 1e-3


def _mul_mat_id_ref(experts, b, ids):
    t_n, u_n = ids.shape
    out = np.empty((t_n, u_n, experts.shape[1]))
    for t in range(t_n):
        for u in range(u_n):
            # b's expert-slot axis broadcasts by modulo (i11 = id % ne11)
            out[t, u] = experts[ids[t, u]].astype(np.float64) @ b[t, u % b.shape[1]].astype(np.float64)
    return out


@pytest.mark.parametrize("u_b", [2, 1])
def test_mul_mat_id(rt, rng, u_b):
    e = randn(rng, 4, 6, 32)
    b = randn(rng, 5, u_b, 32)
    ids = np.stack([rng.permutation(4)[:2] for _ in range(5)]).astype(np.int32)
    got = eval_graph(rt, lambda ctx, x, y, i: ctx.mul_mat_id(x, y, i), e, b, ids)
    assert got.shape == (5, 2, 6)
    close(got, _mul_mat_id_ref(e, b, ids), rtol=1e-4, atol=1e-4)


def test_mul_mat_id_quantized(rt, rng):
    e = randn(rng, 3, 8, 64)
    b = randn(rng, 6, 2, 64)
    ids = rng.integers(0, 3, size=(6, 2)).astype(np.int32)
    got = eval_graph(rt, lambda ctx, x, y, i: ctx.mul_mat_id(x, y, i), (Q.Q8_0, e), b, ids)
    eq = qdq(e.reshape(-1, 64), Q.Q8_0).reshape(e.shape)
    assert rel_l2(got, _mul_mat_id_ref(eq, b, ids)) < 1e-2
    assert rel_l2(got, _mul_mat_id_ref(eq, qdq(b.reshape(-1, 64), Q.Q8_0).reshape(b.shape), ids)) < 1e-3


# ----------------------------------------------------------------------------- layout


@pytest.mark.parametrize("new_shape", [(24, 10), (2, 2, 60), (240,), (2, 3, 4, 10)])
def test_reshape_and_cont(rt, rng, new_shape):
    x = randn(rng, 4, 6, 10)
    r, c = eval_graph(rt, lambda ctx, a: (ctx.reshape(a, new_shape), ctx.cont(ctx.reshape(a, new_shape))), x)
    np.testing.assert_array_equal(r, x.reshape(new_shape))
    np.testing.assert_array_equal(c, x.reshape(new_shape))


@pytest.mark.parametrize(
    "src_shape,shape,strides,offset",
    [
        ((50,), (20,), None, 40),  # x[10:30]
        ((10, 16), (4, 16), None, 3 * 64),  # x[3:7]
        ((10, 16), (5, 8), (128, 4), 16),  # x[::2, 4:12]
        ((6, 8, 10), (3, 4, 5), (640, 80, 4), 48),  # x[::2, 1::2, 2:7]
        ((4, 6, 10), (2, 3, 2, 5), (480, 120, 20, 4), 4),  # overlapping-free 4-D view with an offset
    ],
)
def test_view(rt, rng, src_shape, shape, strides, offset):
    x = randn(rng, *src_shape)
    got = eval_graph(rt, lambda ctx, a: ctx.cont(ctx.view(a, shape, strides, offset)), x)
    flat = x.ravel()
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1 :])) * 4 for i in range(len(shape)))
    ref = np.lib.stride_tricks.as_strided(flat[offset // 4 :], shape=shape, strides=strides)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize(
    "shape,axes",
    [
        ((5, 7), (1, 0)),
        ((2, 3, 4), (2, 0, 1)),
        ((2, 3, 4), (1, 0, 2)),
        ((2, 3, 4), (0, 2, 1)),
        ((2, 3, 4, 5), (0, 1, 2, 3)),
        ((2, 3, 4, 5), (0, 2, 1, 3)),
        ((2, 3, 4, 5), (3, 2, 1, 0)),
        ((2, 3, 4, 5), (1, 3, 0, 2)),
        ((2, 3, 4, 5), (2, 0, 3, 1)),
    ],
)
def test_permute(rt, rng, shape, axes):
    x = randn(rng, *shape)
    got = eval_graph(rt, lambda ctx, a: ctx.cont(ctx.permute(a, axes)), x)
    np.testing.assert_array_equal(got, np.transpose(x, axes))


@pytest.mark.parametrize("shape", [(5, 7), (2, 5, 7), (2, 3, 4, 5)])
def test_transpose(rt, rng, shape):
    x = randn(rng, *shape)
    got = eval_graph(rt, lambda ctx, a: ctx.cont(ctx.transpose(a)), x)
    np.testing.assert_array_equal(got, np.swapaxes(x, -1, -2))


# ----------------------------------------------------------------------------- cpy / cast


def test_cpy_f32_to_f16_and_back(rt, rng):
    x = randn(rng, 4, 33, scale=10.0)
    got = eval_graph(rt, lambda ctx, a, b: ctx.cpy(a, b), x, np.zeros((4, 33), np.float16))
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, x.astype(np.float16))
    h = x.astype(np.float16)
    got = eval_graph(rt, lambda ctx, a, b: ctx.cpy(a, b), h, np.zeros((4, 33), F32))
    np.testing.assert_array_equal(got, h.astype(F32))


def test_cpy_reshapes_in_element_order(rt, rng):
    x = randn(rng, 4, 6)
    got = eval_graph(rt, lambda ctx, a, b: ctx.cpy(a, b), x, np.zeros((3, 8), F32))
    np.testing.assert_array_equal(got, x.reshape(3, 8))


def test_cpy_f32_to_q8_0(rt, rng):
    x = randn(rng, 4, 64, scale=3.0)
    got = eval_graph(rt, lambda ctx, a, b: ctx.cpy(a, b), x, (Q.Q8_0, np.zeros((4, 64), F32)))
    ref = qdq(x, Q.Q8_0)
    # ggml's CPU copy uses the SIMD quantize_row_q8_0, tg.quantize the reference
    # quantizer; they may differ by one step on rounding ties, nowhere more.
    step = np.repeat(np.abs(x).reshape(4, 2, 32).max(-1) / 127.0, 32, axis=-1).reshape(4, 64)
    assert np.all(np.abs(got - ref) <= 1.01 * step)
    assert np.mean(got != ref) < 0.01


def test_cast(rt, rng):
    x = randn(rng, 3, 45, scale=30.0)
    x.flat[:4] = [0.5, -0.5, 2.999, -2.999]

    def build(ctx, a):
        return ctx.cast(a, Q.F16), ctx.cast(a, Q.BF16), ctx.cast(a, Q.I32), ctx.cast(a, Q.F32)

    h, bf, i, f = eval_graph(rt, build, x)
    np.testing.assert_array_equal(h, x.astype(np.float16))
    np.testing.assert_array_equal(bf, bf16r(x))
    assert i.dtype == np.int32
    np.testing.assert_array_equal(i, np.trunc(x).astype(np.int32))  # C float->int: toward zero
    np.testing.assert_array_equal(f, x)


def test_cast_to_f32(rt, rng):
    h = randn(rng, 2, 17).astype(np.float16)
    n = rng.integers(-1000, 1000, size=(2, 17)).astype(np.int32)
    fh, fn = eval_graph(rt, lambda ctx, a, b: (ctx.cast(a, Q.F32), ctx.cast(b, Q.F32)), h, n)
    np.testing.assert_array_equal(fh, h.astype(F32))
    np.testing.assert_array_equal(fn, n.astype(F32))


# ----------------------------------------------------------------------------- concat / repeat / pad


@pytest.mark.parametrize(
    "shape,axis", [((2, 3, 4), ax) for ax in (0, 1, 2, -1)] + [((2, 3, 4, 5), ax) for ax in (0, 1, 2, 3, -2)]
)
def test_concat(rt, rng, shape, axis):
    b_shape = list(shape)
    b_shape[axis] = 3
    a, b = randn(rng, *shape), randn(rng, *b_shape)
    got = eval_graph(rt, lambda ctx, x, y: ctx.concat(x, y, axis), a, b)
    np.testing.assert_array_equal(got, np.concatenate([a, b], axis=axis))


@pytest.mark.parametrize("dtype", [np.float16, np.int32])
def test_concat_other_types(rt, rng, dtype):
    a = (randn(rng, 3, 4) * 100).astype(dtype)
    b = (randn(rng, 2, 4) * 100).astype(dtype)
    got = eval_graph(rt, lambda ctx, x, y: ctx.concat(x, y, 0), a, b)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, np.concatenate([a, b], axis=0))


@pytest.mark.parametrize(
    "shape,target", [((3, 4), (2, 6, 8)), ((1, 3, 1, 4), (2, 3, 5, 8)), ((5,), (3, 10)), ((2, 3), (2, 3))]
)
def test_repeat(rt, rng, shape, target):
    x = randn(rng, *shape)
    got = eval_graph(rt, lambda ctx, a: ctx.repeat(a, target), x)
    np.testing.assert_array_equal(got, tile_to(x, target))


@pytest.mark.parametrize(
    "shape,pads",
    [((7,), ((2, 3),)), ((2, 3, 5), ((0, 1), (2, 0), (1, 3))), ((2, 1, 3, 4), ((1, 0), (0, 2), (1, 1), (0, 3)))],
)
def test_pad(rt, rng, shape, pads):
    x = randn(rng, *shape)
    got = eval_graph(rt, lambda ctx, a: ctx.pad(a, pads), x)
    np.testing.assert_array_equal(got, np.pad(x, pads))


# ----------------------------------------------------------------------------- rows


@pytest.mark.parametrize(
    "table_shape,idx_shape", [((10, 16), (7,)), ((3, 10, 16), (3, 5)), ((2, 3, 10, 8), (2, 3, 4)), ((10, 16), (1,))]
)
def test_get_rows_f32(rt, rng, table_shape, idx_shape):
    t = randn(rng, *table_shape)
    idx = rng.integers(0, table_shape[-2], size=idx_shape).astype(np.int32)
    got = eval_graph(rt, lambda ctx, a, i: ctx.get_rows(a, i), t, idx)
    ref = np.take_along_axis(t, idx[..., None], axis=-2) if t.ndim > 2 else t[idx]
    np.testing.assert_array_equal(got, ref)


def test_get_rows_f16(rt, rng):
    t = randn(rng, 10, 16).astype(np.float16)
    idx = np.array([9, 0, 3, 3], np.int32)
    got = eval_graph(rt, lambda ctx, a, i: ctx.get_rows(a, i), t, idx)
    assert got.dtype == F32
    np.testing.assert_array_equal(got, t[idx].astype(F32))


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.Q4_1, Q.Q4_K], ids=lambda t: t.name)
def test_get_rows_quantized(rt, rng, qt):
    t = randn(rng, 10, 256)
    idx = np.array([4, 0, 9, 4, 2, 7], np.int32)
    got = eval_graph(rt, lambda ctx, a, i: ctx.get_rows(a, i), (qt, t), idx)
    assert got.dtype == F32
    # get_rows dequantizes with the type's to_float, the same kernel as tg.dequantize
    np.testing.assert_array_equal(got, qdq(t, qt)[idx])


def _set_rows_ref(a, b, idx):
    out = np.array(a, copy=True)
    a4, b4, i3 = to4(out), to4(b), idx.reshape((1,) * (3 - idx.ndim) + idx.shape)
    for i3_ in range(a4.shape[0]):
        for i2 in range(a4.shape[1]):
            # ggml-cpu/ops.cpp set_rows: idx broadcast by modulo over b's batches
            rows = i3[i3_ % i3.shape[0], i2 % i3.shape[1]]
            a4[i3_, i2, rows] = b4[i3_, i2]
    return out


SET_ROWS_CASES = [
    ((8, 16), (3, 16), (3,), np.int32, F32),
    ((8, 16), (3, 16), (3,), np.int64, F32),
    ((8, 16), (3, 16), (3,), np.int32, np.float16),  # F32 rows written into an F16 table
    ((2, 8, 16), (2, 3, 16), (3,), np.int32, F32),  # one idx row for every batch
    ((2, 8, 16), (2, 3, 16), (2, 3), np.int32, F32),  # idx per batch
]


def _set_rows_inputs(rng, a_shape, b_shape, idx_shape, idx_dtype, a_dtype):
    a = randn(rng, *a_shape).astype(a_dtype)
    b = randn(rng, *b_shape)
    n_rows = a_shape[-2]
    idx = np.stack([rng.permutation(n_rows)[: idx_shape[-1]] for _ in range(int(np.prod(idx_shape[:-1])))])
    return a, b, idx.reshape(idx_shape).astype(idx_dtype)


@pytest.mark.parametrize("a_shape,b_shape,idx_shape,idx_dtype,a_dtype", SET_ROWS_CASES)
def test_set_rows(rt, rng, a_shape, b_shape, idx_shape, idx_dtype, a_dtype):
    a, b, idx = _set_rows_inputs(rng, a_shape, b_shape, idx_shape, idx_dtype, a_dtype)
    got = eval_graph(rt, lambda ctx, x, y, i: ctx.set_rows(x, y, i), a, b, idx)
    ref = _set_rows_ref(a.astype(F32), b.astype(a_dtype).astype(F32), idx)
    np.testing.assert_array_equal(np.asarray(got, F32), ref)


@pytest.mark.parametrize("a_shape,b_shape,idx_shape,idx_dtype,a_dtype", SET_ROWS_CASES)
def test_set_rows_into_op_result(rt, rng, a_shape, b_shape, idx_shape, idx_dtype, a_dtype):
    # Same as test_set_rows, but the destination is an op result (cont of the
    # input), which the binding's index check does not look at.
    a, b, idx = _set_rows_inputs(rng, a_shape, b_shape, idx_shape, idx_dtype, a_dtype)
    got = eval_graph(rt, lambda ctx, x, y, i: ctx.set_rows(ctx.cont(x), y, i), a, b, idx)
    ref = _set_rows_ref(a.astype(F32), b.astype(a_dtype).astype(F32), idx)
    np.testing.assert_array_equal(np.asarray(got, F32), ref)


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("shape,n_past", [((4, 4), 0), ((2, 5, 7), 0), ((2, 5, 7), 2), ((3, 6), 10)])
def test_diag_mask_inf(rt, rng, shape, n_past):
    x = randn(rng, *shape)
    got = eval_graph(rt, lambda ctx, a: ctx.diag_mask_inf(a, n_past), x)
    i = np.arange(shape[-2])[:, None]
    j = np.arange(shape[-1])[None, :]
    np.testing.assert_array_equal(got, np.where(j > n_past + i, -np.inf, x))


def soft_max_ref(a, mask=None, scale=1.0, max_bias=0.0):
    # ggml-cpu/ops.cpp ggml_compute_forward_soft_max_f32: softmax(a*scale + slope[h]*mask), the mask's
    # first rows used, its leading extents broadcast by modulo, h = index along ne[2] (NumPy axis -3).
    a4 = to4(a).astype(np.float64) * np.float32(scale)
    if mask is not None:
        m4 = to4(mask).astype(np.float64)[:, :, : a4.shape[2], :]
        m4 = mod_lead(m4, a4.shape[:2])
        slope = alibi_slopes(a4.shape[1], max_bias) if max_bias > 0 else np.ones(a4.shape[1])
        a4 = a4 + slope[None, :, None, None] * m4
    return softmax(a4).reshape(np.shape(a))


def _causal(rows, cols, rng, dtype=F32, extra=True):
    m = rng.uniform(-2.0, 0.0, size=(rows, cols)) if extra else np.zeros((rows, cols))
    m[np.arange(cols)[None, :] > np.arange(rows)[:, None] + (cols - rows)] = -np.inf
    return m.astype(dtype)


@pytest.mark.parametrize(
    "case",
    ["plain", "scale", "mask_f32", "mask_f16", "mask_more_rows", "mask_per_head", "mask_tiled", "alibi", "alibi_pow2"],
)
def test_soft_max(rt, rng, case):
    a = randn(rng, 2, 6, 5, 17, scale=2.0)
    mask, scale, max_bias = None, 1.0, 0.0
    if case == "scale":
        scale = 0.3
    elif case == "mask_f32":
        mask, scale = _causal(5, 17, rng), 0.5
    elif case == "mask_f16":
        mask = _causal(5, 17, rng, np.float16)
    elif case == "mask_more_rows":
        mask = _causal(8, 17, rng)
    elif case == "mask_per_head":
        mask = np.stack([_causal(5, 17, rng, np.float16) for _ in range(6)])
    elif case == "mask_tiled":  # mask heads 2 over a's 6: head h reads mask h % 2
        mask = np.stack([_causal(5, 17, rng) for _ in range(2)])
    elif case == "alibi":  # 6 heads: not a power of two, both slope branches used
        mask, scale, max_bias = _causal(5, 17, rng, np.float16), 0.7, 8.0
    elif case == "alibi_pow2":
        a = randn(rng, 2, 4, 5, 17, scale=2.0)
        mask, max_bias = _causal(5, 17, rng), 4.0
    inputs = (a,) if mask is None else (a, mask)
    got = eval_graph(rt, lambda ctx, x, *m: ctx.soft_max(x, *m, scale=scale, max_bias=max_bias), *inputs)
    close(got, soft_max_ref(a, mask, scale, max_bias), rtol=1e-5, atol=1e-6)


def rope_ref(x, pos, n_dims, mode, freq_base=10000.0, freq_scale=1.0, freq_factors=None, attn_factor=1.0):
    """x (..., T, H, D), pos (T,). Pair i (i < n_dims/2) is rotated by
    theta_i = pos * freq_scale * freq_base**(-2i/n_dims) / freq_factors[i];
    "normal" pairs (x[2i], x[2i+1]), "neox" pairs (x[i], x[i + n_dims/2]);
    dims >= n_dims pass through; with ext_factor 0 the rotation is scaled by
    attn_factor (ggml-cpu/ops.cpp rope_yarn, ggml_rope_cache_init, rotate_pairs)."""
    x = np.asarray(x, np.float64)
    half = n_dims // 2
    inv = float(freq_base) ** (-2.0 * np.arange(half) / n_dims)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors[:half], np.float64)
    theta = np.asarray(pos, np.float64)[:, None] * inv[None, :] * freq_scale  # (T, half)
    cos = (np.cos(theta) * attn_factor)[:, None, :]  # broadcast over heads
    sin = (np.sin(theta) * attn_factor)[:, None, :]
    out = x.copy()
    if mode == "normal":
        x0, x1 = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
        out[..., 0:n_dims:2] = x0 * cos - x1 * sin
        out[..., 1:n_dims:2] = x0 * sin + x1 * cos
    else:
        x0, x1 = x[..., :half], x[..., half:n_dims]
        out[..., :half] = x0 * cos - x1 * sin
        out[..., half:n_dims] = x0 * sin + x1 * cos
    return out


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize(
    "case", ["full", "partial", "freq_factors", "freq_scale", "freq_base", "attn_factor", "3d", "partial_factors"]
)
def test_rope(rt, rng, mode, case):
    shape, n_dims, kw, ff = (2, 6, 3, 16), 16, {}, None
    if case == "partial":
        n_dims = 8
    elif case == "freq_factors":
        ff = rng.uniform(1.0, 8.0, size=8).astype(F32)
    elif case == "partial_factors":
        n_dims, ff = 6, rng.uniform(1.0, 8.0, size=5).astype(F32)  # more factors than n_dims/2: extras unused
    elif case == "freq_scale":
        kw = {"freq_scale": 0.25}
    elif case == "freq_base":
        kw = {"freq_base": 500.0}
    elif case == "attn_factor":
        kw = {"attn_factor": 0.5}
    elif case == "3d":
        shape = (6, 4, 32)
    x = randn(rng, *shape)
    pos = rng.integers(0, 100, size=shape[-3]).astype(np.int32)
    inputs = (x, pos) if ff is None else (x, pos, ff)
    got = eval_graph(rt, lambda ctx, a, p, *f: ctx.rope(a, p, n_dims, mode, *f, **kw), *inputs)
    close(got, rope_ref(x, pos, n_dims, mode, freq_factors=ff, **kw), rtol=1e-5, atol=2e-5)


def attn_ref(q, k, v, mask, scale):
    """softmax(q k^T * scale + mask) v with GQA (q head h reads kv head
    h // (Hq/Hkv): ggml-cpu/ops.cpp ik2 = iq2 / rk2) -> (B, Tq, Hq, Dv)."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    r = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)
    s = q @ np.swapaxes(k, -1, -2) * np.float32(scale)
    if mask is not None:
        m4 = to4(mask).astype(np.float64)[:, :, : q.shape[2], :]
        s = s + mod_lead(m4, s.shape[:2])
    return (softmax(s) @ v).transpose(0, 2, 1, 3)


@pytest.mark.parametrize(
    "case,B,Hq,Hkv,Tq,Tkv,D,Dv",
    [
        ("f16_mask", 1, 4, 2, 3, 16, 64, 64),
        ("f16_mask", 2, 4, 1, 5, 32, 32, 32),
        ("f16_mask_per_head", 2, 4, 2, 4, 16, 64, 64),
        ("f16_nomask", 1, 2, 2, 1, 24, 64, 32),
        ("f32", 2, 6, 3, 3, 20, 32, 32),
        ("f32_mask", 1, 4, 4, 2, 16, 64, 48),
    ],
)
def test_flash_attn_ext(rt, rng, case, B, Hq, Hkv, Tq, Tkv, D, Dv):
    f16 = case.startswith("f16")
    q = randn(rng, B, Hq, Tq, D)
    k = randn(rng, B, Hkv, Tkv, D)
    v = randn(rng, B, Hkv, Tkv, Dv)
    if f16:
        k, v = k.astype(np.float16), v.astype(np.float16)
    mask = None
    if "mask" in case and "nomask" not in case:
        if "per_head" in case:
            mask = np.stack([_causal(Tq, Tkv, rng, np.float16) for _ in range(Hq)])[None]
        else:
            mask = _causal(Tq + 2, Tkv, rng, np.float16)  # extra rows are ignored
    scale = 1.0 / np.sqrt(D)
    inputs = (q, k, v) if mask is None else (q, k, v, mask)
    got = eval_graph(rt, lambda ctx, a, b, c, *m: ctx.flash_attn_ext(a, b, c, *m, scale=scale), *inputs)
    assert got.shape == (B, Tq, Hq, Dv)
    if f16:
        # q is rounded to F16 for the F16 K dot; the V accumulator is F16 and is rounded
        # (2**-11 relative) at each of the Tkv steps: a random walk of Tkv roundings.
        ref = attn_ref(f16r(q), k, v, mask, scale)
        bound = np.sqrt(Tkv) * 2.0**-11
        assert rel_l2(got, ref) < bound
        close(got, ref, rtol=0, atol=bound * np.abs(ref).max())
    else:
        close(got, attn_ref(q, k, v, mask, scale), rtol=1e-4, atol=1e-5)


def test_flash_attn_row_invariant(rt, rng):
    """``row_invariant`` (patch 0020): a query row gets the same bits alone as among 80 rows (ggml's
    tiled kernel otherwise takes 64 rows and more) and, against 600 keys, alone as among two rows
    (ggml otherwise splits 512 keys and more across the threads of a lone row); a row against 600
    keys of which 500 are masked gets the bits of the same row against the 100 it sees; the results
    are the attention (NumPy, float64)."""
    B, Hq, Hkv, Tq, Tkv, D = 1, 4, 2, 80, 96, 64
    q = randn(rng, B, Hq, Tq, D)
    k = randn(rng, B, Hkv, Tkv, D).astype(np.float16)
    v = randn(rng, B, Hkv, Tkv, D).astype(np.float16)
    mask = _causal(Tq, Tkv, rng, np.float16)
    scale = 1.0 / np.sqrt(D)

    def fa(q, k, v, mask, ri):
        return eval_graph(
            rt, lambda ctx, a, b, c, m: ctx.flash_attn_ext(a, b, c, m, scale=scale, row_invariant=ri), q, k, v, mask
        )

    whole, tiled = fa(q, k, v, mask, True), fa(q, k, v, mask, False)
    alone = np.concatenate([fa(q[:, :, i : i + 1], k, v, mask[i : i + 1], True) for i in range(Tq)], axis=1)
    np.testing.assert_array_equal(whole, alone)
    assert not np.array_equal(tiled, alone)  # the test reaches the kernel the switch turns off
    ref = attn_ref(f16r(q), k, v, mask, scale)
    bound = np.sqrt(Tkv) * 2.0**-11
    assert rel_l2(whole, ref) < bound

    # one row against 600 keys (ggml's split-key kernel without the switch) equals the row among two
    n = 600
    q2 = randn(rng, B, Hq, 2, D)
    k2 = randn(rng, B, Hkv, n, D).astype(np.float16)
    v2 = randn(rng, B, Hkv, n, D).astype(np.float16)
    m2 = rng.uniform(-2.0, 0.0, size=(2, n)).astype(np.float16)
    pair = fa(q2, k2, v2, m2, True)
    np.testing.assert_array_equal(fa(q2[:, :, :1], k2, v2, m2[:1], True), pair[:, :1])
    assert not np.array_equal(fa(q2[:, :, :1], k2, v2, m2[:1], False), pair[:, :1])  # the split kernel is reached
    assert rel_l2(pair, attn_ref(f16r(q2), k2, v2, m2, scale)) < np.sqrt(n) * 2.0**-11

    # one row against 600 keys, the last 500 masked, equals the row against its 100 keys
    seen, total = 100, 600
    q1 = randn(rng, B, Hq, 1, D)
    k_long = randn(rng, B, Hkv, total, D).astype(np.float16)
    v_long = randn(rng, B, Hkv, total, D).astype(np.float16)
    m_long = np.full((1, total), -np.inf, np.float16)
    m_long[:, :seen] = rng.uniform(-2.0, 0.0, size=(1, seen))
    long = fa(q1, k_long, v_long, m_long, True)
    short = fa(q1, k_long[:, :, :seen], v_long[:, :, :seen], m_long[:, :seen], True)
    np.testing.assert_array_equal(long, short)
    ref = attn_ref(f16r(q1), k_long[:, :, :seen], v_long[:, :, :seen], m_long[:, :seen], scale)
    assert rel_l2(long, ref) < np.sqrt(seen) * 2.0**-11


# ----------------------------------------------------------------------------- vision


def im2col_ref(x, kh, kw, s0, s1, p0, p1, d0, d1):
    """(N, C, H, W) -> (N, OH, OW, C*KH*KW), the last axis ordered (c, kh, kw), zero padding
    (ggml-cpu/ops.cpp ggml_compute_forward_im2col_f32)."""
    n, c, h, w = x.shape
    oh = (h + 2 * p1 - d1 * (kh - 1) - 1) // s1 + 1
    ow = (w + 2 * p0 - d0 * (kw - 1) - 1) // s0 + 1
    xp = np.pad(x, ((0, 0), (0, 0), (p1, p1), (p0, p0)))
    out = np.empty((n, oh, ow, c, kh, kw), x.dtype)
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i * d1 : i * d1 + s1 * (oh - 1) + 1 : s1, j * d0 : j * d0 + s0 * (ow - 1) + 1 : s0]
            out[..., i, j] = patch.transpose(0, 2, 3, 1)
    return out.reshape(n, oh, ow, c * kh * kw)


def conv2d_ref(x, k, s0, s1, p0, p1, d0, d1):
    """Direct convolution (cross-correlation, as in ggml/PyTorch): out[n, o, y, x] =
    sum_{c, i, j} k[o, c, i, j] * xpad[n, c, y*s1 + i*d1, x*s0 + j*d0]."""
    x, k = np.asarray(x, np.float64), np.asarray(k, np.float64)
    n, c, h, w = x.shape
    oc, _, kh, kw = k.shape
    oh = (h + 2 * p1 - d1 * (kh - 1) - 1) // s1 + 1
    ow = (w + 2 * p0 - d0 * (kw - 1) - 1) // s0 + 1
    xp = np.pad(x, ((0, 0), (0, 0), (p1, p1), (p0, p0)))
    out = np.zeros((n, oc, oh, ow))
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i * d1 : i * d1 + s1 * (oh - 1) + 1 : s1, j * d0 : j * d0 + s0 * (ow - 1) + 1 : s0]
            out += np.einsum("oc,nchw->nohw", k[:, :, i, j], patch)
    return out


CONV_PARAMS = [
    (1, 1, 0, 0, 1, 1),
    (2, 1, 1, 0, 1, 1),
    (1, 2, 1, 2, 2, 1),
    (2, 2, 2, 1, 1, 2),
    (3, 2, 0, 1, 2, 2),
]


@pytest.mark.parametrize("s0,s1,p0,p1,d0,d1", CONV_PARAMS)
@pytest.mark.parametrize("out_dtype", [Q.F32, Q.F16], ids=["F32", "F16"])
def test_im2col(rt, rng, s0, s1, p0, p1, d0, d1, out_dtype):
    kern = randn(rng, 2, 3, 3, 2)
    x = randn(rng, 2, 3, 9, 11)
    got = eval_graph(rt, lambda ctx, k, a: ctx.im2col(k, a, s0, s1, p0, p1, d0, d1, dtype=out_dtype), kern, x)
    ref = im2col_ref(x, 3, 2, s0, s1, p0, p1, d0, d1)
    if out_dtype == Q.F16:
        ref = ref.astype(np.float16)
    assert got.shape == ref.shape
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("s0,s1,p0,p1,d0,d1", CONV_PARAMS)
@pytest.mark.parametrize("kdtype", [F32, np.float16], ids=["F32", "F16"])
def test_conv_2d(rt, rng, s0, s1, p0, p1, d0, d1, kdtype):
    kern = randn(rng, 4, 3, 3, 3).astype(kdtype)
    x = randn(rng, 2, 3, 9, 11)
    got = eval_graph(rt, lambda ctx, k, a: ctx.conv_2d(k, a, s0, s1, p0, p1, d0, d1), kern, x)
    ref = conv2d_ref(f16r(x), f16r(kern), s0, s1, p0, p1, d0, d1)
    assert got.shape == ref.shape
    close(got, ref, rtol=1e-4, atol=1e-4)
    assert rel_l2(got, conv2d_ref(x, kern.astype(F32), s0, s1, p0, p1, d0, d1)) < 2e-3


def pool2d_ref(x, op, k0, k1, s0, s1, p0, p1):
    """ggml-cpu/ops.cpp ggml_compute_forward_pool_2d: padded cells are skipped
    (max starts at -FLT_MAX) and avg always divides by k0*k1, so avg equals
    zero padding with the padding counted (count_include_pad)."""
    n, c, h, w = x.shape
    oh = (h + 2 * p1 - k1) // s1 + 1
    ow = (w + 2 * p0 - k0) // s0 + 1
    fill = -np.inf if op == "max" else 0.0
    xp = np.pad(np.asarray(x, np.float64), ((0, 0), (0, 0), (p1, p1), (p0, p0)), constant_values=fill)
    wins = [
        xp[:, :, i : i + s1 * (oh - 1) + 1 : s1, j : j + s0 * (ow - 1) + 1 : s0] for i in range(k1) for j in range(k0)
    ]
    return np.max(wins, axis=0) if op == "max" else np.sum(wins, axis=0) / (k0 * k1)


@pytest.mark.parametrize("op", ["max", "avg"])
@pytest.mark.parametrize(
    "k0,k1,s0,s1,p0,p1",
    [(2, 2, 2, 2, 0, 0), (3, 3, 1, 1, 1, 1), (3, 2, 2, 1, 1, 0), (2, 3, 1, 2, 0, 2), (3, 3, 3, 3, 0, 0)],
)
def test_pool_2d(rt, rng, op, k0, k1, s0, s1, p0, p1):
    x = randn(rng, 2, 3, 8, 9)
    got = eval_graph(rt, lambda ctx, a: ctx.pool_2d(a, op, k0, k1, s0, s1, p0, p1), x)
    ref = pool2d_ref(x, op, k0, k1, s0, s1, p0, p1)
    assert got.shape == ref.shape
    close(got, ref, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("labels_kind", ["soft", "one_hot"])
def test_cross_entropy_loss(rt, rng, labels_kind):
    logits = randn(rng, 6, 33, scale=3.0)
    if labels_kind == "soft":
        labels = softmax(randn(rng, 6, 33)).astype(F32)
    else:
        labels = np.eye(33, dtype=F32)[rng.integers(0, 33, size=6)]
    got = eval_graph(rt, lambda ctx, a, b: ctx.cross_entropy_loss(a, b), logits, labels)
    assert got.shape == (1,)
    # ggml-cpu/ops.cpp ggml_compute_forward_cross_entropy_loss_f32: the sum over all rows of
    # sum(labels * log_softmax(logits)), times -1/nrows
    ref = -np.mean(np.sum(labels.astype(np.float64) * log_softmax(logits), axis=-1))
    close(got, [ref], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("wd,t", [(0.0, 1), (0.1, 3)])
def test_opt_step_adamw(rt, rng, wd, t):
    w = randn(rng, 4, 33)
    g = randn(rng, 4, 33)
    m = randn(rng, 4, 33, scale=0.1)
    v = (np.abs(randn(rng, 4, 33)) * 0.01).astype(F32)
    lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8
    # hparams order of ggml-cpu/ops.cpp ggml_compute_forward_opt_step_adamw_f32
    hp = np.array([lr, b1, b2, eps, wd, 1.0 / (1.0 - b1**t), 1.0 / (1.0 - b2**t)], F32)

    def build(ctx, p, gr, mm, vv, h):
        p.set_param()
        return ctx.opt_step_adamw(p, gr, mm, vv, h), mm, vv

    w1, m1, v1 = eval_graph(rt, build, w, g, m, v, hp)
    # AdamW (Loshchilov & Hutter): decoupled weight decay, bias-corrected moments, eps outside the sqrt.
    # The hyperparameters are what ggml sees: float32 (1 - float32(0.999) is 1.3e-5 off 0.001).
    lr, b1, b2, eps, wd = (float(h) for h in hp[:5])
    g64 = g.astype(np.float64)
    m_ref = b1 * m + (1 - b1) * g64
    v_ref = b2 * v + (1 - b2) * g64**2
    m_hat = m_ref / (1 - 0.9**t)  # bias corrections from the step count t
    v_hat = v_ref / (1 - 0.999**t)
    w_ref = w - lr * (m_hat / (np.sqrt(v_hat) + eps) + wd * w)
    close(m1, m_ref, rtol=1e-5, atol=1e-7)
    close(v1, v_ref, rtol=1e-5, atol=1e-9)
    close(w1, w_ref, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- scheduler path

_NP2GGML = {np.dtype(F32): Q.F32, np.dtype(np.float16): Q.F16, np.dtype(np.int32): Q.I32}


def sched_eval(rt, build, *inputs):
    """Inputs live in their own Context allocated with ctx.allocate(rt); the op
    results live in another Context and get no memory until rt.compute(), so the
    Runtime's scheduler allocates them. Inputs: NumPy arrays or (GGMLType, floats)."""
    with tg.Context(max_tensors=32) as cin, tg.Context(max_tensors=256) as cops:
        ts = []
        for i, x in enumerate(inputs):
            if isinstance(x, tuple):
                ts.append((cin.tensor(x[0], x[1].shape, name=f"in{i}"), "float", x[1]))
            else:
                ts.append((cin.tensor(_NP2GGML[x.dtype], x.shape, name=f"in{i}"), "set", x))
        cin.allocate(rt)
        for t, how, x in ts:
            (t.set if how == "set" else t.set_float)(x)
        out = build(cops, *(t for t, _, _ in ts))
        out.set_output()
        g = tg.Graph(cops, size=1024).build_forward(out)
        assert not out.allocated
        rt.compute(g)
        assert out.allocated
        return out.numpy()


def test_sched_mlp_block(rt, rng):
    x = randn(rng, 3, 5, 64)
    w1, w2 = randn(rng, 96, 64, scale=0.1), randn(rng, 64, 96, scale=0.1)
    gamma = randn(rng, 64)

    def build(ctx, a, u, d, gm):
        h = ctx.mul(ctx.rms_norm(a, 1e-5), gm)
        h = ctx.relu(ctx.mul_mat(u, h))
        return ctx.add(ctx.mul_mat(d, h), a)

    got = sched_eval(rt, build, x, w1, w2, gamma)
    x64 = x.astype(np.float64)
    h = x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + 1e-5) * gamma
    ref = np.maximum(h @ w1.T, 0.0) @ w2.T + x64
    close(got, ref, rtol=1e-4, atol=1e-4)
    # the classic path gives the same
    close(eval_graph(rt, build, x, w1, w2, gamma), ref, rtol=1e-4, atol=1e-4)


def test_sched_attention(rt, rng):
    q = randn(rng, 2, 4, 6, 16)
    k = randn(rng, 2, 4, 6, 16)
    mask = _causal(6, 6, rng, extra=False)
    pos = np.arange(6, dtype=np.int32)

    def build(ctx, qq, kk, m, p):
        qr = ctx.permute(ctx.rope(ctx.cont(ctx.permute(qq, (0, 2, 1, 3))), p, 16, "neox"), (0, 2, 1, 3))
        kr = ctx.permute(ctx.rope(ctx.cont(ctx.permute(kk, (0, 2, 1, 3))), p, 16, "neox"), (0, 2, 1, 3))
        return ctx.soft_max(ctx.mul_mat(ctx.cont(kr), ctx.cont(qr)), m, scale=0.25)

    got = sched_eval(rt, build, q, k, mask, pos)
    qr = rope_ref(q.transpose(0, 2, 1, 3), pos, 16, "neox").transpose(0, 2, 1, 3)
    kr = rope_ref(k.transpose(0, 2, 1, 3), pos, 16, "neox").transpose(0, 2, 1, 3)
    close(got, softmax(qr @ np.swapaxes(kr, -1, -2) * 0.25 + mask), rtol=1e-4, atol=1e-6)


def test_sched_quantized_get_rows_and_matmul(rt, rng):
    emb = randn(rng, 12, 256)
    w = randn(rng, 8, 256)
    idx = np.array([3, 11, 0, 3], np.int32)

    def build(ctx, e, i, ww):
        return ctx.mul_mat(ww, ctx.get_rows(e, i))

    got = sched_eval(rt, build, (Q.Q4_K, emb), idx, (Q.Q8_0, w))
    ref = qdq(emb, Q.Q4_K)[idx] @ qdq(w, Q.Q8_0).T.astype(np.float64)
    assert got.shape == (4, 8)
    assert rel_l2(got, ref) < 1e-2


def test_sched_conv_pool(rt, rng):
    x = randn(rng, 1, 3, 10, 10)
    kern = randn(rng, 4, 3, 3, 3).astype(np.float16)

    def build(ctx, a, k):
        return ctx.pool_2d(ctx.conv_2d(k, a, 1, 1, 1, 1), "max", 2, 2, 2, 2)

    got = sched_eval(rt, build, x, kern)
    ref = pool2d_ref(conv2d_ref(f16r(x), kern, 1, 1, 1, 1, 1, 1), "max", 2, 2, 2, 2, 0, 0)
    close(got, ref, rtol=1e-4, atol=1e-4)


# Conversions ggml's CPU copy cannot do abort the process inside compute
# (ggml-cpu/ops.cpp ggml_compute_forward_dup); the binding refuses them first.
@pytest.mark.parametrize(
    "src,dst",
    [
        (tg.GGMLType.F16, tg.GGMLType.I32),
        (tg.GGMLType.Q8_0, tg.GGMLType.F16),
        (tg.GGMLType.I32, tg.GGMLType.F16),
        (tg.GGMLType.F32, tg.GGMLType.IQ2_XXS),
        (tg.GGMLType.Q4_0, tg.GGMLType.Q8_0),
    ],
)
def test_unsupported_conversions_are_refused(src, dst):
    with tg.Context() as ctx:
        a = ctx.tensor(src, (4, 256))
        with pytest.raises(TypeError, match="cannot convert"):
            ctx.cast(a, dst)
        with pytest.raises(TypeError, match="cannot convert"):
            ctx.cpy(a, ctx.tensor(dst, (4, 256)))


def test_set_rows_index_out_of_range_is_refused_before_compute(rt, rng):
    a = rng.standard_normal((3, 8)).astype(F32)
    b = rng.standard_normal((2, 8)).astype(F32)
    for bad in ([0, 3], [-1, 0]):
        with pytest.raises(IndexError, match="out of range 0..2"):
            eval_graph(rt, lambda ctx, x, y, i: ctx.set_rows(x, y, i), a, b, np.array(bad, dtype=np.int32))


# the weight types tinyBLAS (F32 .. Q4_0) or the tiled K-quant path (Q4_K, Q6_K) take on the CPU
ROW_TYPES = [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K]


@pytest.mark.parametrize("qt", ROW_TYPES, ids=[t.name for t in ROW_TYPES])
def test_mul_mat_row_invariant(rt, rng, qt):
    """Patch 0004: with row_invariant=True a row of b multiplied inside a batch
    gives bit-identical results to the same row multiplied alone. Without the
    flag an F32 batch goes through tinyBLAS and its rows differ from the
    one-row products in the last bits, which is what the patch exists for."""
    w = randn(rng, 64, 512)
    b = randn(rng, 32, 512)
    inputs = ((qt, w) if qt not in (Q.F32, Q.F16) else w.astype(np.float16 if qt == Q.F16 else F32), b, b[3:4])

    def build(flag):
        return lambda ctx, x, y, y1: (ctx.mul_mat(x, y, row_invariant=flag), ctx.mul_mat(x, y1, row_invariant=flag))

    batch, alone = eval_graph(rt, build(True), *inputs)
    np.testing.assert_array_equal(batch[3:4], alone)
    batch_default, alone_default = eval_graph(rt, build(False), *inputs)
    np.testing.assert_array_equal(alone_default, alone)  # one row: vec_dot either way
    if qt == Q.F32 and tg.cpu_features()["avx"]:
        # tinyBLAS (llamafile sgemm) takes F32 batches only in AVX builds; the x64
        # CPU variant multiplies every row with vec_dot, so there is nothing to differ
        assert not np.array_equal(batch_default[3:4], alone_default)
