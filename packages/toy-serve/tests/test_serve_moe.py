"""``toy serve`` on mixture-of-experts files: a LIVE server (``create_app``
under uvicorn, the conftest's ``serving``) over ``moe_ref``'s seeded random
Hugging Face models (8 experts, top-2) converted by llama.cpp's
``convert_hf_to_gguf.py`` (packages/toy-core/tests/moe_ref.py):
qwen2moe-tiny in F32 (a shared expert), qwen3moe-tiny in Q8_0 (renormalised
expert weights; experts Q8_0) and the 256-wide qwen2moe-k quantized by toy's
``quantize_model(..., "Q4_K_M")`` (K-quant experts), each with GPT-2's
tokenizer (no chat template, no BOS).

The model is loaded the way the server loads one (``exact_batching``), with
8 slots so that eight requests decode in one batch, and queried with the
official ``openai`` client, greedy (``temperature=0``). Expectations:

- completions: the library, ``toy.Model.generate`` on a second copy of the
  file (``n_slot=1``, slot 0, no worker, no HTTP): text, finish reason and
  token counts equal;
- streams: the same request without ``stream`` (text, finish reason, usage);
- concurrency: eight requests at once, streamed and plain, give the text
  each gives sent alone: batch invariance of the routed feed-forward, whose
  expert products (``mul_mat_id``) run over the whole batch, whatever
  experts the other sequences pick (the prompts' tokens pick different
  experts: ``test_the_prompts_route_to_different_experts``; toy-ggml patch
  0015 keeps K-quant expert products row-invariant).

No ``model`` marker: the files are generated (cached by ``moe_ref``).
The live server and the library copy are the conftest's ``file_*``
fixtures (over ``file_path`` below, with ``file_slots`` 8).
"""

from __future__ import annotations

from pathlib import Path

import moe_ref
import pytest
import serve_helpers as sh

N = 12
N_SLOT = 8
PROMPTS = [*sh.PROMPTS, "Experts", "A router sends every token to two of its eight experts, and the experts"]
FILES = [("qwen2moe-tiny", "f32"), ("qwen3moe-tiny", "q8_0"), ("qwen2moe-k", "q4_k_m")]


@pytest.fixture(scope="module", params=FILES, ids=lambda p: f"{p[0]}-{p[1]}")
def file_path(request) -> Path:
    return moe_ref.gguf_path(request.param[0], 0, request.param[1])


@pytest.fixture(scope="module")
def file_slots() -> int:
    return N_SLOT


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
    from toy.reference.full import FullModel

    picks = []
    orig = moe.ffn

    def spy(ctx, c, weights, lin, p, u, row_invariant=False):
        probs = ctx.soft_max(lin(f"{p}.ffn_gate_inp.weight", u))
        if p == "blk.0":
            picks.append(probs.set_output())
        out = orig(ctx, c, weights, lin, p, u, row_invariant)
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


def test_models_card(file_live, file_alias, file_ctx):
    sh.assert_models_card(file_live, file_alias, file_ctx)


@pytest.mark.parametrize("prompt", PROMPTS[:4])
def test_greedy_completion_equals_library(file_client, file_alias, file_ref, prompt):
    sh.assert_completion_equals_library(file_client, file_alias, file_ref, prompt, N)


def test_completion_stream_equals_non_stream(file_client, file_alias):
    sh.assert_completion_stream_equals_non_stream(
        file_client, "length", model=file_alias, prompt=PROMPTS[3], max_tokens=N, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


def test_concurrent_requests_equal_solo(file_live, file_client, file_alias, file_ref):
    kw = dict(model=file_alias, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    alone = sh.assert_concurrent_equal_alone(file_live, file_client, PROMPTS, kw)
    # solo through the server is the library's
    assert alone == [file_ref.generate(p, temperature=0, max_tokens=16, ignore_eos=True).text for p in PROMPTS]
    assert len(set(alone)) == len(PROMPTS) and all(alone)
