"""`toy describe` on mixture-of-experts files: OLMoE, Qwen2-MoE (a shared
expert) and Qwen3-MoE (renormalised expert weights). Greedy `toy infer`
against the library on these files (F32, and Q8_0) is test_cli_conformance.py's,
with every other architecture's.

The models are ``moe_ref``'s (tests/support/src/toy_testsupport/moe_ref.py): seeded
random Hugging Face models with 8 experts, top-2, converted by llama.cpp's
own ``convert_hf_to_gguf.py`` (F32 and Q8_0), and a 256-wide file quantized
by toy's ``quantize_model(..., "Q4_K_M")`` (K-quant experts). Expectations:

- ``toy describe``: the rows carry what the Hugging Face configs of
  ``moe_ref.SHAPES`` say: the experts line (count, used per token, expert
  width, renormalisation for qwen3moe only), the shared expert line for
  qwen2moe only, the expert tensors' types (counted here from the file's
  ``ffn_{gate,up,down}_exps`` tensors), the dense ``d_ff`` marked as not the
  layers' width; the algorithm card has the router softmax (W_r of d × 8),
  the top-2 selection, the expert sum with the 3-D expert shapes, the
  shared expert's sigmoid gate for qwen2moe, each variant's QK-norm, and no
  dense feed-forward line; ``--json`` carries ``n_expert``,
  ``n_expert_used``, ``d_ff_expert``, ``d_ff_shared``,
  ``expert_weights_norm`` and ``expert_types``.

Every run is pinned to the CPU and one thread (as test_cli_infer.py).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from toy_testsupport import moe_ref
from toy_testsupport.cli_helpers import no_row, row, run

SHAPES = ["olmoe-tiny", "qwen2moe-tiny", "qwen3moe-tiny"]


@pytest.fixture(autouse=True)
def _cpu_one_thread(monkeypatch):
    monkeypatch.setenv("TOY_DEVICE", "cpu")
    monkeypatch.setenv("TOY_THREADS", "1")


def path_of(shape: str, outtype: str = "f32") -> Path:
    return moe_ref.gguf_path(shape, 0, outtype)


def expert_types(path: Path) -> Counter:
    """The types of a file's 3-D expert tensors, counted."""
    from toy.gguf import GGUFFile

    with GGUFFile(path) as gf:
        return Counter(i.dtype.name for n, i in gf.tensors.items() if n.endswith("_exps.weight"))


# ---------------------------------------------------------------- toy describe


@pytest.mark.parametrize("shape", SHAPES)
def test_describe_rows(capsys, shape):
    hf = moe_ref.SHAPES[shape]
    arch = hf["arch"]
    d = hf["hidden_size"]
    F = hf.get("moe_intermediate_size", hf["intermediate_size"])  # olmoe: intermediate_size is the expert width
    code, out, err = run(capsys, "describe", path_of(shape))
    assert code == 0, err
    row(out, "architecture", arch)
    row(out, "layers", str(hf["num_hidden_layers"]))
    row(out, "d_model", str(d))
    row(out, "d_ff", f"{hf['intermediate_size']} (dense width; the layers are experts)")
    norm = ", weights renormalised" if hf["norm_topk_prob"] else ""
    row(
        out,
        "experts",
        f"{hf['num_experts']} per layer, {hf['num_experts_per_tok']} used per token, width {F} (SwiGLU){norm}",
    )
    if arch == "qwen2moe":
        row(out, "shared expert", f"width {hf['shared_expert_intermediate_size']}, sigmoid gate")
        row(out, "qkv bias", "yes")
    else:
        no_row(out, "shared expert")
        row(out, "qkv bias", "no")
    row(out, "expert types", "F32 ×9")  # gate, up and down of 3 layers
    row(out, "qk-norm", "no" if arch == "qwen2moe" else "yes")
    row(out, "output head", "untied (output.weight)")
    row(out, "tokenizer", "gpt2 (pre: gpt-2)")


@pytest.mark.parametrize("shape", SHAPES)
def test_describe_card(capsys, shape):
    hf = moe_ref.SHAPES[shape]
    arch, d, E, k = hf["arch"], hf["hidden_size"], hf["num_experts"], hf["num_experts_per_tok"]
    F = hf.get("moe_intermediate_size", hf["intermediate_size"])
    code, out, err = run(capsys, "describe", path_of(shape))
    assert code == 0, err
    card = out[out.index(f"Algorithm: P ← {arch}(x | θ)") :]
    lines = card.splitlines()

    def line(*fragments: str) -> int:
        hits = [i for i, ln in enumerate(lines) if all(f in ln for f in fragments)]
        assert len(hits) == 1, f"{fragments} on {len(hits)} lines of\n{card}"
        return hits[0]

    router = line("p ← softmax(Y·W_r[l])", f"router W_r ∈ ℝ^{{{d}×{E}}}", f"p ∈ (0,1)^{{T×{E}}}")
    renorm = ", renormalised to sum 1" if hf["norm_topk_prob"] else ""
    select = line(f"S_t ← the {k} largest p[t, :], w_t ← p[t, S_t]{renorm}", f"top-{k} of {E} experts per token")
    if not renorm:
        assert "renormalised" not in lines[select]
    experts = line(
        "X_t ← X_t + Σ_{e∈S_t} w_t[e]·(SiLU(Y_t·W_gate[l,e]) ⊙ Y_t·W_up[l,e])·W_down[l,e]",
        f"W_gate, W_up ∈ ℝ^{{{E}×{d}×{F}}}, W_down ∈ ℝ^{{{E}×{F}×{d}}}",
    )
    assert router < select < experts
    assert "W_gate[l])" not in card and "W_down[l]" not in card  # no dense feed-forward line
    assert "three expert-indexed products (mul_mat_id)" in card
    if arch == "qwen2moe":
        shared = line("X ← X + σ(Y·w_s[l]) ⊙ (SiLU(Y·S_gate[l]) ⊙ Y·S_up[l])·S_down[l]", "shared expert of width 48")
        assert experts < shared
    else:
        assert "shared expert" not in card
    if arch == "olmoe":
        line("Q ← RMSNorm(Q | γ_q[l]);  K ← RMSNorm(K | γ_k[l])", "over the whole projection, before the head split")
    elif arch == "qwen3moe":
        line("Q ← RMSNorm(Q | γ_q[l]);  K ← RMSNorm(K | γ_k[l])", f"per head, over d_h = {hf['head_dim']}")
    else:
        assert "QK-norm" not in card


@pytest.mark.parametrize("shape", SHAPES)
def test_describe_json(capsys, shape):
    hf = moe_ref.SHAPES[shape]
    code, out, err = run(capsys, "describe", path_of(shape), "--json")
    assert code == 0, err
    d = json.loads(out)
    s = d["summary"]
    got = (s["architecture"], s["mlp"], s["n_layer"], s["d_model"])
    assert got == (hf["arch"], "moe", hf["num_hidden_layers"], hf["hidden_size"])
    assert (s["n_expert"], s["n_expert_used"]) == (hf["num_experts"], hf["num_experts_per_tok"]) == (8, 2)
    assert s["d_ff_expert"] == hf.get("moe_intermediate_size", hf["intermediate_size"])
    assert s["d_ff_shared"] == hf.get("shared_expert_intermediate_size")  # None without a shared expert
    assert s["expert_weights_norm"] is hf["norm_topk_prob"]
    assert s["expert_types"] == {"F32": 9}
    assert s["qk_norm"] is (hf["arch"] != "qwen2moe") and s["qkv_bias"] is (hf["arch"] == "qwen2moe")
    assert s["tokenizer_model"] == "gpt2" and s["chat_template"] is False
    assert "p ← softmax(Y·W_r[l])" in d["card"] and "mul_mat_id" in d["card"]


@pytest.mark.parametrize("shape, outtype", [("qwen3moe-tiny", "q8_0"), ("qwen2moe-k", "q4_k_m")])
def test_describe_quantized_experts(capsys, shape, outtype):
    """The expert types row and ``expert_types`` follow the file: Q8_0
    experts from the converter, K-quants from toy's Q4_K_M (counted from the
    file, whatever mix the quantizer picks)."""
    path = path_of(shape, outtype)
    want = expert_types(path)
    assert sum(want.values()) == 3 * moe_ref.SHAPES[shape]["num_hidden_layers"]
    if outtype == "q8_0":
        assert want == {"Q8_0": 9}
    else:
        assert all(t.endswith("_K") for t in want), want
    code, out, err = run(capsys, "describe", path, "--json")
    assert code == 0, err
    assert json.loads(out)["summary"]["expert_types"] == dict(want)
    code, out, err = run(capsys, "describe", path)
    assert code == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith("expert types"))
    assert {t: int(n) for t, n in re.findall(r"(\w+) ×(\d+)", line)} == dict(want), line
