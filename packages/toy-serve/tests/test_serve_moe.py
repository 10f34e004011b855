"""``toy serve`` on mixture-of-experts files: what the live-server tests
(test_serve_conformance.py) rely on about ``moe_ref``'s seeded random
Hugging Face models (8 experts, top-2) converted by llama.cpp's
``convert_hf_to_gguf.py`` (tests/support/src/toy_testsupport/moe_ref.py):
qwen2moe-tiny in F32 (a shared expert), qwen3moe-tiny in Q8_0 (renormalised
expert weights; experts Q8_0) and the 256-wide qwen2moe-k quantized by toy's
``quantize_model(..., "Q4_K_M")`` (K-quant experts), each with GPT-2's
tokenizer (no chat template, no BOS).

test_serve_conformance.py serves these files as the server loads one
(``exact_batching``, 8 slots so that eight requests decode in one batch),
with ``serve_helpers.MOE_PROMPTS``: completions equal the library's, streams
equal the same request sent plain, and eight requests at once, streamed and
plain, give the text each gives sent alone and differ from prompt to prompt:
batch invariance of the routed feed-forward, whose expert products
(``mul_mat_id``) run over the whole batch, whatever experts the other
sequences pick (toy-ggml patch 0015 keeps K-quant expert products
row-invariant). Expectations here, on the library copy of each file
(the conftest's ``file_ref``, over ``file_path`` below):

- the file is a mixture of experts (8, top-2) with the expert types of
  its outtype;
- the prompts' tokens pick different experts (so a decode batch of them
  mixes expert choices).

No ``model`` marker: the files are generated (cached by ``moe_ref``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from toy_testsupport import moe_ref
from toy_testsupport import serve_helpers as sh

PROMPTS = sh.MOE_PROMPTS
FILES = [("qwen2moe-tiny", "f32"), ("qwen3moe-tiny", "q8_0"), ("qwen2moe-k", "q4_k_m")]


@pytest.fixture(scope="module", params=FILES, ids=lambda p: f"{p[0]}-{p[1]}")
def file_path(request) -> Path:
    return moe_ref.gguf_path(request.param[0], 0, request.param[1])


def test_the_file_is_a_mixture_of_experts(file_ref, file_path):
    from toy.gguf import GGUFFile

    cfg = file_ref.cfg
    assert (cfg.n_expert, cfg.n_expert_used) == (8, 2)
    with GGUFFile(file_path) as gf:
        types = {i.dtype.name for n, i in gf.tensors.items() if n.endswith("_exps.weight")}
    want = {"f32": {"F32"}, "q8_0": {"Q8_0"}}.get(file_path.stem.rsplit("-", 1)[-1])
    if want is not None:
        assert types == want
    else:  # toy's Q4_K_M: K-quant experts
        assert types and all(t.endswith("_K") for t in types), types


def test_the_prompts_route_to_different_experts(file_ref, file_path):
    """The experts layer 0 picks for each prompt's last token (toy's graph,
    read from the router's softmax): the eight prompts do not all use the
    same two experts, so a decode batch of them mixes expert choices
    (measured: 6 or 7 different pairs, 7 or 8 of the experts in all)."""
    import toy_ggml
    from toy.models import moe
    from toy_testsupport.reference.full import FullModel

    picks = []
    orig = moe.ffn

    def spy(ctx, c, weights, lin, p, u, row_invariant=False, lora=None):
        probs = ctx.soft_max(lin(f"{p}.ffn_gate_inp.weight", u))
        if p == "blk.0":
            picks.append(probs.set_output())
        out = orig(ctx, c, weights, lin, p, u, row_invariant, lora)
        return ctx.add(out, ctx.scale(ctx.sum(probs), 0.0))  # + exactly 0: keeps probs in the graph

    rt = toy_ggml.Runtime("cpu", threads=1)
    fm = FullModel.load(file_path, rt, kv_type=None)
    moe.ffn = spy
    try:
        sets = []
        for p in PROMPTS:
            picks.clear()
            fm.logits(file_ref.tokenize(p))
            probs = picks[0].numpy()[-1].copy()  # (E,) of the last token
            sets.append(frozenset(int(e) for e in moe_ref.llamacpp_topk(probs, 2)))
    finally:
        moe.ffn = orig
        fm.close()
        rt.close()
    assert len(set(sets)) >= 4, sets
    assert len(set().union(*sets)) >= 6, sets
