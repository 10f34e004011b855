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
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import moe_ref
import pytest

CTX = 128
N = 12
N_SLOT = 8
PROMPTS = [
    "Hello world",
    "The capital of France is Paris, and the capital of Germany is",
    "def add(a, b):\n    return",
    "Once upon a time, there was a little girl who lived in a village near the forest. One day",
    "1, 2, 3,",
    "The weather was cold and windy, so we stayed inside and read books all",
    "Experts",
    "A router sends every token to two of its eight experts, and the experts",
]
FILES = [("qwen2moe-tiny", "f32"), ("qwen3moe-tiny", "q8_0"), ("qwen2moe-k", "q4_k_m")]


@pytest.fixture(scope="module", params=FILES, ids=lambda p: f"{p[0]}-{p[1]}")
def moe_path(request) -> Path:
    return moe_ref.gguf_path(request.param[0], 0, request.param[1])


@pytest.fixture(scope="module")
def serve_moe(moe_path):
    import toy

    m = toy.load(moe_path, n_ctx=CTX, n_slot=N_SLOT, threads=1, exact_batching=True)
    yield m
    m.close()


@pytest.fixture(scope="module")
def ref_moe(moe_path):
    import toy

    m = toy.load(moe_path, n_ctx=CTX, n_slot=1, threads=1, exact_batching=True)
    yield m
    m.close()


@pytest.fixture(scope="module")
def live(serve_moe, moe_path, serving, tmp_path_factory):
    from toy_serve import Settings

    settings = Settings(
        model=str(moe_path), runs_dir=str(tmp_path_factory.mktemp("serve-moe-runs")), drain_timeout=10.0
    )
    with serving(settings, serve_moe) as s:
        yield s


@pytest.fixture(scope="module")
def client(live):
    with live.client() as c:
        yield c


@pytest.fixture(scope="module")
def alias(live, moe_path):
    assert live.srv.settings.alias == moe_path.stem
    return live.srv.settings.alias


def completion_tokens(gen) -> int:
    """What the server counts for a library ``Generation``: its tokens plus a
    generated stop token (see test_openai_api.py)."""
    return len(gen.tokens) + isinstance(gen.stop, int)


def test_the_file_is_a_mixture_of_experts(ref_moe, moe_path):
    from toy.gguf import GGUFFile

    cfg = ref_moe.cfg
    assert (cfg.n_expert, cfg.n_expert_used) == (8, 2)
    with GGUFFile(moe_path) as gf:
        types = {i.dtype.name for n, i in gf.tensors.items() if n.endswith("_exps.weight")}
    want = {"f32": {"F32"}, "q8_0": {"Q8_0"}}.get(moe_path.stem.rsplit("-", 1)[-1])
    if want is not None:
        assert types == want
    else:  # toy's Q4_K_M: K-quant experts
        assert types and all(t.endswith("_K") for t in types), types


def test_the_prompts_route_to_different_experts(ref_moe, moe_path):
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
    fm = FullModel.load(moe_path, rt, kv_type=None)
    moe.ffn = spy
    try:
        sets = []
        for p in PROMPTS:
            picks.clear()
            fm.logits(ref_moe.tokenize(p))
            probs = picks[0].numpy()[-1].copy()  # (E,) of the last token
            sets.append(frozenset(int(e) for e in moe_ref.llamacpp_topk(probs, 2)))
    finally:
        moe.ffn = orig
        fm.close()
        rt.close()
    assert len(set(sets)) >= 4, sets
    assert len(set().union(*sets)) >= 6, sets


def test_models_card(live, alias):
    raw = live.http.get("/v1/models").json()
    assert [m["id"] for m in raw["data"]] == [alias] and raw["data"][0]["max_model_len"] == CTX


@pytest.mark.parametrize("prompt", PROMPTS[:4])
def test_greedy_completion_equals_library(client, alias, ref_moe, prompt):
    r = client.completions.create(model=alias, prompt=prompt, max_tokens=N, temperature=0)
    want = ref_moe.generate(prompt, temperature=0, max_tokens=N)
    c = r.choices[0]
    assert c.text == want.text and c.finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(ref_moe.tokenize(prompt))
    assert r.usage.completion_tokens == completion_tokens(want)


def test_completion_stream_equals_non_stream(client, alias):
    prompt = PROMPTS[3]
    kw = dict(model=alias, prompt=prompt, max_tokens=N, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    parts = [ch.choices[0] for ch in chunks if ch.choices]
    assert len(parts) > 1  # really streamed
    assert "".join(p.text for p in parts) == full.choices[0].text
    assert parts[-1].finish_reason == full.choices[0].finish_reason == "length"
    u = chunks[-1].usage
    assert not chunks[-1].choices and u is not None
    assert (u.prompt_tokens, u.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)


def test_concurrent_requests_equal_solo(live, client, alias, ref_moe):
    kw = dict(model=alias, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in PROMPTS]
    # solo through the server is the library's
    assert alone == [ref_moe.generate(p, temperature=0, max_tokens=16, ignore_eos=True).text for p in PROMPTS]

    async def one(c, prompt):
        parts, finish, first = [], None, None
        stream = await c.completions.create(prompt=prompt, stream=True, **kw)
        async for chunk in stream:
            if first is None:
                first = time.monotonic()
            for ch in chunk.choices:
                parts.append(ch.text)
                finish = ch.finish_reason or finish
        return "".join(parts), finish, first, time.monotonic()

    async def streamed():
        async with live.async_client() as c:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))

    results = asyncio.run(streamed())
    for p, want, (text, finish, _, _) in zip(PROMPTS, alone, results):
        assert finish == "length", p
        assert text == want, p
    # they ran together: some stream was still open when another produced its first chunk
    spans = sorted((first, end) for _, _, first, end in results)
    assert any(spans[i + 1][0] < spans[i][1] for i in range(len(spans) - 1))

    async def plain():
        async with live.async_client() as c:
            rs = await asyncio.gather(*(c.completions.create(prompt=p, **kw) for p in PROMPTS))
        return [r.choices[0].text for r in rs]

    assert asyncio.run(plain()) == alone
    assert len(set(alone)) == len(PROMPTS) and all(alone)
