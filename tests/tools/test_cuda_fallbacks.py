"""tools/cuda_fallbacks.py: the graph walker against ggml's own graph printer, the grouping of refused nodes,
the recording of toy's graphs (no CUDA needed); the CUDA backend's rules (toy patch 0024) on nodes checked by
hand against src/ggml-cuda/ggml-cuda.cu, no node of any graph toy builds left to the CPU, and the committed page
against a fresh one, when a CUDA module is built.

CI builds no CUDA module: the last three skip there with the reason (tools/cuda_fallbacks.py's search order: the
installed toy_ggml_cuda plugin, ``$TOY_CUDA_LIB``, ``build/cuda/ggml-cmake/bin/libggml-cuda.so``)."""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
from pathlib import Path

import pytest

import toy_ggml as tg

ROOT = Path(__file__).resolve().parents[2]
F32 = tg.GGMLType.F32


def _load():
    spec = importlib.util.spec_from_file_location("cuda_fallbacks", ROOT / "tools/cuda_fallbacks.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


cf = _load()


def _graph(ctx):
    """A small graph with a product, a row-invariant product, a transposed operand, toy's ERF and SUM_SQR."""
    w = ctx.tensor(F32, (6, 8), "w")
    x = ctx.tensor(F32, (4, 8), "x")
    y = ctx.mul_mat(w, x)  # (4, 6)
    z = ctx.mul_mat(w, x, row_invariant=True)
    t = ctx.cont(ctx.transpose(y))  # (6, 4)
    e = ctx.erf(ctx.rms_norm(ctx.add(y, z), 1e-5))
    s = ctx.sum_sqr(e)
    g = tg.Graph(ctx, size=64)
    g.build_forward(s, t)
    return g


def _printed(caplog, g) -> list[tuple[int, str, tuple[int, int, int]]]:
    """The nodes ggml_graph_print lists: (index, op name, ne[0..2])."""
    with caplog.at_level(logging.INFO, logger="toy_ggml"):
        caplog.clear()
        g.log()
    text = "\n".join(r.getMessage() for r in caplog.records)
    nodes_part = text.split("n_leafs")[0]
    pat = re.compile(r"-\s+(\d+): \[\s*(-?\d+),\s*(-?\d+),\s*(-?\d+)\]\s+(\S+)")
    return [(int(m[1]), m[5], (int(m[2]), int(m[3]), int(m[4]))) for m in pat.finditer(nodes_part)]


def test_walker_lists_the_nodes_ggml_prints(caplog):
    with tg.Context(max_tensors=64, graph_size=64) as ctx:
        g = _graph(ctx)
        nodes = cf.walk(g)
        printed = _printed(caplog, g)
        assert len(printed) == g.n_nodes == len(nodes) > 0
        for n, (i, op, ne3) in zip(nodes, printed, strict=True):
            assert n.index == i
            assert n.op.split(":")[0] == op  # ggml prints UNARY for UNARY:ERF
            assert n.ne[:3] == ne3
        ops = [n.op for n in nodes]
        for want in ("MUL_MAT", "TRANSPOSE", "CONT", "RMS_NORM", "UNARY:ERF", "SUM_SQR"):
            assert want in ops
        # patch 0004's hint is op_params[1] == 2 on the row-invariant product only
        mms = [n for n in nodes if n.op == "MUL_MAT"]
        assert sorted(n.op_params[1] for n in mms) == [0, 2]
        assert [n.toy_switch() for n in mms].count("MUL_MAT row-invariant hint (patch 0004)") == 1
        # the transposed view feeding CONT is marked not contiguous
        cont = next(n for n in nodes if n.op == "CONT")
        assert cont.srcs == (("F32", (4, 6, 1, 1), False),)
        assert cont.describe() == "CONT F32[4,6] <- (F32[4,6]~)"


def test_ask_counts_refused_nodes_per_cc_and_leaves_views_out():
    with tg.Context(max_tensors=64, graph_size=64) as ctx:
        g = _graph(ctx)
        nodes = cf.walk(g)
        op_of = {n.address: n.op for n in nodes}

        def rules(addr, cc):  # refuses ERF everywhere, SUM_SQR on sm_80 only, and asked no views
            assert op_of[addr] not in cf.VIEW_OPS
            return not (op_of[addr] == "UNARY:ERF" or (op_of[addr] == "SUM_SQR" and cc == 800))

        rep = cf.ask(nodes, rules, (800, 900), "w", "forward")
        assert rep.n_nodes == sum(1 for n in nodes if n.op not in cf.VIEW_OPS) == len(nodes) - 1  # TRANSPOSE
        assert {op: c for op, (c, _) in rep.refused[800].items()} == {"UNARY:ERF": 1, "SUM_SQR": 1}
        assert {op: c for op, (c, _) in rep.refused[900].items()} == {"UNARY:ERF": 1}
        assert rep.switches == {"MUL_MAT row-invariant hint (patch 0004)": 1}
        page = cf.render([rep], (800, 900))
        assert "| w | forward | 7 | 1 | 2 | 1 | MUL_MAT row-invariant hint (patch 0004) ×1 |" in page
        assert "| SUM_SQR | sm_80 | 1 | 1 | `SUM_SQR F32[1] <- (F32[6,4])` |" in page
        assert "| UNARY:ERF | sm_80, sm_90 | 1 | 1 |" in page


def test_recording_sees_the_engine_graphs_as_a_gpu_runtime_builds_them():
    """The pretrain and inference workloads, every node accepted: the step graph has AdamW, the inference
    phases are recorded apart, and no product carries patch 0011's toy-GEMM hint (cpu_gemm is False)."""
    seen = []

    def rules(addr, cc):
        seen.append(cc)
        return True

    reports = cf.collect(rules, (800,), only=("infer",))
    by = {r.workload.split(" (")[0]: r for r in reports}
    assert {r.role for r in reports if r.workload.startswith("pretrain")} >= {"step (forward, backward, AdamW)"}
    phases = [r.workload for r in reports if r.workload.startswith("inference")]
    assert any("prefill" in p for p in phases) and any(p.endswith("decode (1 sequence)") for p in phases)
    assert any("batched decode (2 sequences)" in p for p in phases)
    assert all(not r.refused[800] for r in reports) and set(seen) == {800}
    assert not any("toy-GEMM" in s for r in reports for s in r.switches), by
    assert tg.Runtime.__name__ == "Runtime"  # the recording runtime is gone again


# -- with a CUDA module ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda():
    try:
        rules, where = cf.cuda_rules()
    except cf.FallbackError as e:
        pytest.skip(f"no CUDA module with toy patch 0024 to ask: {e}")
    return rules


def test_cuda_rules_on_nodes_checked_by_hand(cuda):
    """ggml-cuda.cu's supports_op: an F32 product, RMS_NORM and toy's ERF (a kernel since patch 0024) are
    supported; a product whose first operand is a transposed view (toy's GEMM, patch 0011, reads those) is not
    (nb[0] != the element size), nor is
    toy's SUM_SQR (patch 0017: no case there, the default refuses)."""
    with tg.Context(max_tensors=64, graph_size=64) as ctx:
        w = ctx.tensor(F32, (6, 8), "w")
        x = ctx.tensor(F32, (4, 8), "x")
        y = ctx.mul_mat(w, x)
        yt = ctx.mul_mat(ctx.transpose(ctx.tensor(F32, (8, 6), "wt")), x, gemm=True)  # toy's GEMM reads it
        r = ctx.rms_norm(y, 1e-5)
        e = ctx.erf(r)
        s = ctx.sum_sqr(e)
        g = tg.Graph(ctx, size=64)
        g.build_forward(s, yt)
        for cc in cf.CCS:
            got = {(n.op, n.srcs[0][2] if n.srcs else True): cuda(n.address, cc) for n in cf.walk(g)}
            assert got[("MUL_MAT", True)] is True
            assert got[("MUL_MAT", False)] is False
            assert got[("RMS_NORM", True)] is True
            assert got[("UNARY:ERF", True)] is True
            assert got[("SUM_SQR", True)] is False


@pytest.fixture(scope="module")
def reports(cuda):
    return cf.collect(cuda)


def test_no_graph_leaves_a_node_to_the_cpu(reports):
    # issue 39: every graph toy builds runs whole on a CUDA device (patch 0025 gave the last three,
    # the QLoRA input gradient, OUT_PROD_ID and the 3-D GET_ROWS_BACK of a MoE fine-tune, standard forms)
    workloads = {r.workload for r in reports}
    assert {w.split(":")[0] for w in workloads} >= {"pretrain (from-scratch)", "inference", "toy-vit"}
    assert {"SFT, QLoRA (Q4_0 base)", "MoE: full fine-tune"} <= workloads
    for r in reports:
        for cc in cf.CCS:
            assert not r.refused[cc], (r.workload, r.role, cc, r.refused[cc])


def test_cuda_fallbacks_page_is_up_to_date(reports):
    page = (ROOT / cf.PAGE).read_text(encoding="utf-8")
    assert page == cf.render(reports), "docs/reference/cuda-fallbacks.md is stale: run `just cuda-fallbacks`"
