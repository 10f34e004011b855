"""The CPU backend variants: which one a process loads, and that they agree.

toy_ggml carries ggml's CPU backend once per x86-64 level and loads the one
with ggml's highest score for this CPU (toy_ggml._dispatch). These tests check
the choice against an independent reading of the CPU (/proc/cpuinfo flags
against the instruction sets each level is compiled for), the
TOY_GGML_CPU_VARIANT override and its errors, and that every variant this CPU
can run passes the op tests (test_ops_forward, test_backward,
test_mul_mat_cols, test_out_prod_quantized: NumPy and finite-difference
references) and computes the same values as the others. Each variant runs in
a child process: one CPU backend per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import toy_ggml as tg
from toy_ggml import _dispatch, x86_variants

HERE = Path(__file__).resolve().parent
CHOICE = tg.cpu_variant()
RUNNABLE = [c.tag for c in CHOICE.candidates if c.score > 0]
X86 = os.uname().machine in ("x86_64", "AMD64")


def _child(code: str, variant: str | None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(_dispatch.ENV, None)
    if variant is not None:
        env[_dispatch.ENV] = variant
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


def test_the_loaded_variant_is_the_best_scoring_one():
    assert CHOICE.candidates, "the build carries no CPU variant"
    best = max((c for c in CHOICE.candidates if c.score > 0), key=lambda c: c.score)
    assert CHOICE.tag == best.tag and CHOICE.score == best.score > 0
    assert Path(CHOICE.path).is_file() and Path(CHOICE.path).name.startswith("libggml-cpu")
    assert CHOICE.reason


@pytest.mark.skipif(not X86 or tg.build_config.NATIVE, reason="the variant set is built for x86-64 portable builds")
def test_the_portable_build_carries_avx2_avx512_and_vnni_bf16_levels():
    tags = {c.tag for c in CHOICE.candidates}
    assert {"haswell", "skylakex", "icelake", "zen4"} <= tags
    assert "sapphirerapids" not in tags  # ggml's AMX path (SIGILL on these Xeons) stays out
    assert tuple(sorted(tags)) == tuple(sorted(tg.build_config.CPU_VARIANTS))


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="needs /proc/cpuinfo")
def test_scores_agree_with_the_cpu_flags():
    """ggml's score is 0 exactly for the variants compiled for an instruction
    set /proc/cpuinfo does not list (an independent reading of the CPU)."""
    for c in CHOICE.candidates:
        if c.tag in x86_variants.X86_NEEDS:
            assert (c.score == 0) == bool(c.missing), c


def test_loaded_features_match_the_variant():
    feats = tg.cpu_features()
    needs = x86_variants.X86_NEEDS.get(CHOICE.tag)
    if needs is None:
        pytest.skip(f"no instruction-set table for variant {CHOICE.tag}")
    assert feats["avx2"] == ("avx2" in needs)
    assert feats["avx512"] == ("avx512f" in needs)
    assert feats["avx512_vnni"] == ("avx512_vnni" in needs)
    assert feats["avx512_bf16"] == ("avx512_bf16" in needs)
    assert not feats["amx_int8"]


def test_a_second_cpu_backend_is_refused():
    with pytest.raises(tg.GGMLError, match="already loaded"):
        tg._core.load_backend(CHOICE.path)


@pytest.mark.parametrize("tag", RUNNABLE)
def test_the_override_loads_the_named_variant(tag):
    p = _child("import json, toy_ggml as tg; print(json.dumps(tg.cpu_variant().to_dict()))", tag)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["tag"] == tag
    assert "TOY_GGML_CPU_VARIANT" in got["reason"]


def test_an_unknown_variant_is_an_error_at_import():
    p = _child("import toy_ggml", "no-such-level")
    assert p.returncode != 0
    assert "TOY_GGML_CPU_VARIANT='no-such-level' is not a CPU variant of this build" in p.stderr


def test_a_variant_this_cpu_cannot_run_is_an_error_at_import():
    unrunnable = [c for c in CHOICE.candidates if c.score == 0]
    if not unrunnable:
        pytest.skip("this CPU runs every variant of the build")
    p = _child("import toy_ggml", unrunnable[0].tag)
    assert p.returncode != 0
    assert "this CPU cannot run that variant" in p.stderr


OP_TESTS = ["test_ops_forward.py", "test_backward.py", "test_mul_mat_cols.py", "test_out_prod_quantized.py"]


@pytest.mark.parametrize("tag", [t for t in RUNNABLE if t != CHOICE.tag])
def test_every_runnable_variant_passes_the_op_tests(tag):
    """The loaded variant runs these files in this session; each other one
    this CPU can run runs them in a child pytest."""
    env = dict(os.environ, **{_dispatch.ENV: tag})
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *[str(HERE / f) for f in OP_TESTS]],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=HERE,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]


# One fixed set of products and reductions, computed under each variant.
_OPS = r"""
import sys, numpy as np, toy_ggml as tg
Q = tg.GGMLType
rng = np.random.default_rng(7)
rt = tg.Runtime("cpu", threads=2)
w = rng.standard_normal((96, 256)).astype(np.float32)
b = rng.standard_normal((9, 256)).astype(np.float32)
x = rng.standard_normal((5, 256)).astype(np.float32)
out = {}
for qt in (Q.F32, Q.F16, Q.Q8_0, Q.Q4_1, Q.Q4_K, Q.Q6_K):
    with tg.Context(max_tensors=64) as ctx:
        wt = ctx.tensor(qt, w.shape); bt = ctx.tensor(Q.F32, b.shape)
        y = ctx.mul_mat(wt, bt)
        g = tg.Graph(ctx).build_forward(y)
        ctx.allocate(rt); wt.set_float(w); bt.set(b); rt.compute(g)
        out[f"mul_mat_{qt.name}"] = y.numpy()
with tg.Context(max_tensors=64) as ctx:
    xt = ctx.tensor(Q.F32, x.shape)
    ys = [ctx.rms_norm(xt, 1e-5), ctx.soft_max(xt), ctx.gelu(xt), ctx.silu(xt)]
    g = tg.Graph(ctx).build_forward(*ys)
    ctx.allocate(rt); xt.set(x); rt.compute(g)
    for name, y in zip(("rms_norm", "soft_max", "gelu", "silu"), ys):
        out[name] = y.numpy()
np.savez(sys.argv[1] if len(sys.argv) > 1 else "/dev/null", **out)
"""


@pytest.mark.skipif(len(RUNNABLE) < 2, reason="this CPU runs only one variant")
def test_runnable_variants_compute_the_same_values(tmp_path):
    """Every variant gives the same values within float rounding: F32 and F16
    products, norms and activations to 1e-5 relative L2, quantized products
    (activations quantized to Q8 by each variant's own SIMD code) to 1e-3.
    The count of bit-identical outputs is printed for the record."""
    results = {}
    for tag in RUNNABLE:
        path = tmp_path / f"{tag}.npz"
        p = subprocess.run(
            [sys.executable, "-c", _OPS, str(path)],
            env=dict(os.environ, **{_dispatch.ENV: tag}),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr
        results[tag] = dict(np.load(path))
    ref_tag = RUNNABLE[0]
    identical = 0
    total = 0
    for tag in RUNNABLE[1:]:
        for name, ref in results[ref_tag].items():
            got = results[tag][name]
            assert got.shape == ref.shape
            rel = float(np.linalg.norm(got.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))
            quantized = name.startswith("mul_mat_Q")
            assert rel < (1e-3 if quantized else 1e-5), (tag, name, rel)
            identical += int(np.array_equal(got, ref))
            total += 1
    print(f"\ncpu variants {RUNNABLE}: {identical}/{total} outputs bit-identical to {ref_tag}'s")
