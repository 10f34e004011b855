"""The mixture-of-experts reference models themselves (``moe_ref``), checked
before toy runs any of them.

Where each expected value comes from:

- the model: Hugging Face ``transformers`` (``OlmoeForCausalLM``,
  ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``, seeded random weights)
  and its float32 eager forward, ``moe_ref.hf_logits`` / ``hf_greedy`` /
  ``hf_router_topk``;
- the file: llama.cpp's own ``convert_hf_to_gguf.py`` (llama-cpp-python
  0.3.36 sdist) run on that checkpoint, read back with the ``gguf`` package:
  its metadata (expert counts and widths), its tensors (names, ggml shapes,
  types) and their contents (each expert's slice of the 3-D tensors equal to
  HF's per-expert matrix);
- the shapes in the expected tensor lists: llama.cpp's loaders
  (``src/models/{olmoe,qwen2moe,qwen3moe}.cpp``), as summarised in
  /work/notes/moe_spec.md section 1.3.

The recipe is also checked for strength: decisive routing (the top-k margins
``moe_ref.MARGINS``), exact router ties for ``qwen3moe-tied-router``, greedy
text that moves on. Files are cached (``moe_ref.cache_root()``): a first run
builds them (about 6 s a shape, most of it the converter), later runs only
read them.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from toy_testsupport import gpt2_ref, moe_ref

SHAPES = sorted(moe_ref.SHAPES)
N_GEN = 16
PROMPT_IDS = moe_ref.sample_ids(8, seed=1)


# (metadata, GGUFReader) of a converted file (cached), and its tensors by name
fields, tensors = gpt2_ref.read_gguf, gpt2_ref.gguf_tensors


def ne(t) -> list[int]:
    return [int(x) for x in t.shape]


@functools.lru_cache(maxsize=16)
def state_dict(shape):
    return moe_ref.hf_state_dict(moe_ref.hf_dir(shape))


@functools.lru_cache(maxsize=16)
def router(shape):
    return moe_ref.hf_router_topk(moe_ref.hf_dir(shape), moe_ref.sample_ids(64))


def dims(shape) -> dict:
    """D, H, Hkv, d, E, k, F, Fs, L of a shape."""
    s = moe_ref.SHAPES[shape]
    arch = s["arch"]
    D, H = s["hidden_size"], s["num_attention_heads"]
    return {
        "arch": arch,
        "D": D,
        "H": H,
        "Hkv": s["num_key_value_heads"],
        "d": s.get("head_dim") or D // H,
        "E": s["num_experts"],
        "k": s["num_experts_per_tok"],
        "F": s["intermediate_size"] if arch == "olmoe" else s["moe_intermediate_size"],
        "Fs": s.get("shared_expert_intermediate_size"),
        "L": s["num_hidden_layers"],
    }


def expected_tensors(shape) -> dict[str, list[int]]:
    """Every tensor llama.cpp's loader creates for the shape, with its ne."""
    g = dims(shape)
    arch, D, H, Hkv, d, E, F, Fs = (g[n] for n in ("arch", "D", "H", "Hkv", "d", "E", "F", "Fs"))
    V = moe_ref.N_VOCAB
    out = {"token_embd.weight": [D, V], "output_norm.weight": [D], "output.weight": [D, V]}
    for i in range(g["L"]):
        b = f"blk.{i}."
        out |= {
            b + "attn_norm.weight": [D],
            b + "attn_q.weight": [D, H * d],
            b + "attn_k.weight": [D, Hkv * d],
            b + "attn_v.weight": [D, Hkv * d],
            b + "attn_output.weight": [H * d, D],
            b + "ffn_norm.weight": [D],
            b + "ffn_gate_inp.weight": [D, E],
            b + "ffn_gate_exps.weight": [D, F, E],
            b + "ffn_up_exps.weight": [D, F, E],
            b + "ffn_down_exps.weight": [F, D, E],
        }
        if arch == "olmoe":  # Q/K norms over the whole projection (so Hkv == H)
            out |= {b + "attn_q_norm.weight": [D], b + "attn_k_norm.weight": [D]}
        elif arch == "qwen3moe":  # per head
            out |= {b + "attn_q_norm.weight": [d], b + "attn_k_norm.weight": [d]}
        else:  # qwen2moe: Q/K/V biases, the shared expert and its gate
            out |= {
                b + "attn_q.bias": [H * d],
                b + "attn_k.bias": [Hkv * d],
                b + "attn_v.bias": [Hkv * d],
                b + "ffn_gate_inp_shexp.weight": [D, 1],
                b + "ffn_gate_shexp.weight": [D, Fs],
                b + "ffn_up_shexp.weight": [D, Fs],
                b + "ffn_down_shexp.weight": [Fs, D],
            }
    return out


# ------------------------------------------------------------------ the HF models


@pytest.mark.parametrize("shape", SHAPES)
def test_hf_config(shape):
    spec = moe_ref.SHAPES[shape]
    cfg = json.loads((moe_ref.hf_dir(shape) / "config.json").read_text())
    arch = spec["arch"]
    assert cfg["model_type"] == {"olmoe": "olmoe", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}[arch]
    assert cfg["vocab_size"] == moe_ref.N_VOCAB
    assert cfg["num_experts"] == 8 and cfg["num_experts_per_tok"] == 2
    assert cfg.get("tie_word_embeddings", False) is False  # output.weight is required by olmoe/qwen2moe
    # llama.cpp renormalises the top-k weights for qwen3moe only
    assert cfg["norm_topk_prob"] is (arch == "qwen3moe")
    if arch == "olmoe":
        assert cfg["num_key_value_heads"] == cfg["num_attention_heads"]
        assert cfg["clip_qkv"] is None and cfg["rms_norm_eps"] == 1e-5
    else:
        assert cfg["decoder_sparse_step"] == 1 and cfg["mlp_only_layers"] == []
        assert cfg["use_sliding_window"] is False
    if arch == "qwen2moe":
        assert (
            cfg["qkv_bias"] is True
            and cfg["shared_expert_intermediate_size"] == spec["shared_expert_intermediate_size"]
        )
    if arch == "qwen3moe":
        assert cfg["attention_bias"] is False
        assert cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]


@pytest.mark.parametrize("shape", SHAPES)
def test_weights_redrawn(shape):
    sd = state_dict(shape)
    g = dims(shape)
    norms = np.concatenate([v for k, v in sd.items() if k.endswith("norm.weight")])
    assert abs(norms.mean() - moe_ref.NORM_MEAN) < 0.05 and abs(norms.std() - moe_ref.NORM_STD) < 0.05
    gate = np.stack([sd[f"model.layers.{i}.mlp.gate.weight"] for i in range(g["L"])])
    assert abs(gate.std() * g["D"] ** 0.5 - moe_ref.ROUTER_GAIN) < 0.4
    up = sd["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert abs(up.std() * up.shape[1] ** 0.5 - moe_ref.WEIGHT_GAIN) < 0.1
    assert abs(sd["lm_head.weight"].std() - moe_ref.EMBD_STD) < 0.005


@pytest.mark.parametrize("shape", SHAPES)
def test_hf_greedy_moves_on(shape):
    hf = moe_ref.hf_dir(shape)
    out = moe_ref.hf_greedy(hf, PROMPT_IDS, N_GEN)
    assert len(out) == N_GEN and len(set(out)) >= 12, out
    logits = moe_ref.hf_logits(hf, PROMPT_IDS)
    assert logits.shape == (len(PROMPT_IDS), moe_ref.N_VOCAB) and logits.dtype == np.float32
    assert np.isfinite(logits).all() and logits.std() > 0.5
    # the greedy tokens are the logits' argmax, fed back
    assert int(np.argmax(logits[-1])) == out[0]


@pytest.mark.parametrize("shape", SHAPES)
def test_router_topk(shape):
    """hf_router_topk is HF's routing: shapes, softmax, top-k, weights."""
    g = dims(shape)
    r = router(shape)
    L, T, E, k = g["L"], 64, g["E"], g["k"]
    assert r["logits"].shape == r["probs"].shape == (L, T, E)
    assert r["experts"].shape == r["weights"].shape == (L, T, k)
    np.testing.assert_allclose(r["probs"].sum(-1), 1.0, rtol=1e-5)
    top = np.take_along_axis(r["probs"], r["experts"], -1)
    assert (np.diff(top, axis=-1) <= 0).all()  # slot 0 is the largest
    assert (top.min(-1) >= np.sort(r["probs"], -1)[..., -k]).all()
    if g["arch"] == "qwen3moe":
        np.testing.assert_allclose(r["weights"], top / top.sum(-1, keepdims=True), rtol=1e-6)
    else:
        np.testing.assert_array_equal(r["weights"], top)
    # the sample exercises (nearly) every expert of every layer
    assert len(np.unique(r["experts"])) == E
    for li in range(L):
        assert len(np.unique(r["experts"][li])) >= E - 1


@pytest.mark.parametrize("shape", SHAPES)
def test_router_margins(shape):
    """The routing is as decisive as the module reports (MARGINS, measured on
    sample_ids(64), seed 0)."""
    m = moe_ref.router_margin(router(shape))
    want = moe_ref.MARGINS[shape]
    assert m["boundary_ties"] == want["boundary_ties"] and m["inner_ties"] == want["inner_ties"]
    assert m["prob"] == pytest.approx(want["prob"], rel=1e-2)
    assert m["logit"] == pytest.approx(want["logit"], rel=1e-2)
    assert m["logit"] > 5e-4  # far above float rounding of the router logits (~1e-6)
    if "tied_router" not in moe_ref.SHAPES[shape]:
        assert m["boundary_ties"] == m["inner_ties"] == 0


def test_tied_router_ties():
    shape = "qwen3moe-tied-router"
    a, b = moe_ref.SHAPES[shape]["tied_router"]
    g = dims(shape)
    sd = state_dict(shape)
    for i in range(g["L"]):
        w = sd[f"model.layers.{i}.mlp.gate.weight"]
        np.testing.assert_array_equal(w[a], w[b])
        assert len({tuple(row) for row in w}) == g["E"] - 1  # only that pair
    r = router(shape)
    # exact ties for every layer and token, in the logits and the probabilities
    np.testing.assert_array_equal(r["logits"][..., a], r["logits"][..., b])
    np.testing.assert_array_equal(r["probs"][..., a], r["probs"][..., b])
    # the tie falls at the top-k boundary for some tokens (one of the pair
    # selected, the other not) and inside the selection for others
    sel = r["experts"]
    has_a, has_b = (sel == a).any(-1), (sel == b).any(-1)
    assert (has_a ^ has_b).sum() == moe_ref.MARGINS[shape]["boundary_ties"] > 0
    assert (has_a & has_b).sum() == moe_ref.MARGINS[shape]["inner_ties"] > 0
    # llama.cpp (lower index first among ties) always keeps expert a at a boundary
    # tie; HF's torch.topk keeps b at some: HF is no reference at those tokens
    lc = moe_ref.llamacpp_topk(r["probs"], g["k"])
    boundary = has_a ^ has_b
    assert ((lc == a).any(-1) & ~(lc == b).any(-1))[boundary].all()
    assert has_b[boundary].sum() == moe_ref.MARGINS[shape]["hf_picks_higher"] > 0
    assert (np.sort(lc, -1) == np.sort(sel, -1)).all(-1)[~boundary].all()  # same sets elsewhere
    # the same weights elsewhere as qwen3moe-tiny (same seed, same stream)
    base = state_dict("qwen3moe-tiny")
    assert set(base) == set(sd)
    for name, v in base.items():
        if name.endswith("mlp.gate.weight"):
            rows = [e for e in range(g["E"]) if e != b]
            np.testing.assert_array_equal(sd[name][rows], v[rows], err_msg=name)
        else:
            np.testing.assert_array_equal(sd[name], v, err_msg=name)


# ------------------------------------------------------------------ the GGUF files


@pytest.mark.parametrize("shape", SHAPES)
def test_gguf_metadata(shape):
    meta, _ = fields(moe_ref.gguf_path(shape))
    g = dims(shape)
    arch = g["arch"]
    s = moe_ref.SHAPES[shape]
    assert meta["general.architecture"] == arch
    assert meta["general.name"] == moe_ref.MODEL_NAME
    assert meta["general.file_type"] == 0  # all F32
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
    assert meta[f"{arch}.block_count"] == g["L"]
    assert meta[f"{arch}.embedding_length"] == g["D"]
    assert meta[f"{arch}.attention.head_count"] == g["H"]
    assert meta[f"{arch}.attention.head_count_kv"] == g["Hkv"]
    assert meta[f"{arch}.expert_count"] == g["E"]
    assert meta[f"{arch}.expert_used_count"] == g["k"]
    assert meta[f"{arch}.rope.freq_base"] == pytest.approx(s["rope_theta"])
    assert meta[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(s["rms_norm_eps"])
    assert meta[f"{arch}.feed_forward_length"] == s["intermediate_size"]
    if arch == "olmoe":  # the expert width is feed_forward_length
        assert f"{arch}.expert_feed_forward_length" not in meta
    else:
        assert meta[f"{arch}.expert_feed_forward_length"] == g["F"]
    if arch == "qwen2moe":
        assert meta[f"{arch}.expert_shared_feed_forward_length"] == g["Fs"]
    else:
        assert f"{arch}.expert_shared_feed_forward_length" not in meta
    if arch == "qwen3moe":
        assert meta[f"{arch}.attention.key_length"] == meta[f"{arch}.attention.value_length"] == g["d"]
    else:
        assert f"{arch}.attention.key_length" not in meta
    # nothing the loaders would read as another gating rule
    for key in ("expert_weights_norm", "expert_weights_scale", "expert_gating_func", "rope.dimension_count"):
        assert f"{arch}.{key}" not in meta


@pytest.mark.parametrize("shape", SHAPES)
def test_gguf_tensors(shape):
    ts = tensors(moe_ref.gguf_path(shape))
    want = expected_tensors(shape)
    assert {n: ne(t) for n, t in ts.items()} == want
    assert all(t.tensor_type.name == "F32" for t in ts.values())
    # every HF parameter is in the file, nothing else
    n_hf = sum(v.size for v in state_dict(shape).values())
    assert sum(int(t.n_elements) for t in ts.values()) == n_hf


@pytest.mark.parametrize("shape", SHAPES)
def test_gguf_expert_slices(shape):
    """The 3-D expert tensors stack HF's per-expert matrices in expert order
    (numpy ``[e]`` = ggml slice ne2 = e); routers and shared experts are HF's."""
    ts = tensors(moe_ref.gguf_path(shape))
    sd = state_dict(shape)
    g = dims(shape)
    for i in range(g["L"]):
        p = f"model.layers.{i}.mlp."
        for hf, gg in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            arr = np.asarray(ts[f"blk.{i}.ffn_{gg}_exps.weight"].data)
            assert arr.shape[0] == g["E"]
            for e in range(g["E"]):
                np.testing.assert_array_equal(arr[e], sd[f"{p}experts.{e}.{hf}.weight"], err_msg=f"{i} {gg} {e}")
        np.testing.assert_array_equal(np.asarray(ts[f"blk.{i}.ffn_gate_inp.weight"].data), sd[p + "gate.weight"])
        if g["arch"] == "qwen2moe":
            np.testing.assert_array_equal(
                np.asarray(ts[f"blk.{i}.ffn_gate_inp_shexp.weight"].data), sd[p + "shared_expert_gate.weight"]
            )
            for gg in ("gate", "up", "down"):
                np.testing.assert_array_equal(
                    np.asarray(ts[f"blk.{i}.ffn_{gg}_shexp.weight"].data), sd[f"{p}shared_expert.{gg}_proj.weight"]
                )


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_gguf_outtypes(outtype):
    """The converter's --outtype: the routers (and the shared-expert gate)
    stay F32, the experts take the type (q8_0 falls back to F16 where a
    row is not a multiple of 32: the 48-wide shared expert's down)."""
    shape = "qwen2moe-tiny"
    ts = tensors(moe_ref.gguf_path(shape, 0, outtype))
    assert {n: ne(t) for n, t in ts.items()} == expected_tensors(shape)
    want = outtype.upper()
    for n, t in ts.items():
        if len(t.shape) == 1 or n.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
            assert t.tensor_type.name == "F32", n
        elif n.endswith("ffn_down_shexp.weight"):
            assert t.tensor_type.name == "F16", n
        else:
            assert t.tensor_type.name == want, n
    f16 = np.asarray(tensors(moe_ref.gguf_path(shape, 0, "f16"))["blk.1.ffn_up_exps.weight"].data)
    np.testing.assert_array_equal(
        f16[5], state_dict(shape)["model.layers.1.mlp.experts.5.up_proj.weight"].astype(np.float16)
    )


def test_toy_q4_k_m():
    """gguf_path(..., "q4_k_m"): toy's quantizer on the F32 file, expert
    tensors in K-quants (256-wide rows), the file type Q4_K_M."""
    shape = "qwen3moe-k"
    path = moe_ref.gguf_path(shape, 0, "q4_k_m")
    meta, _ = fields(path)
    assert meta["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    ts = tensors(path)
    assert set(ts) == set(expected_tensors(shape))
    for n, t in ts.items():
        if "_exps." in n:
            assert t.tensor_type.name in ("Q4_K", "Q6_K"), (n, t.tensor_type.name)
    assert moe_ref.gguf_path(shape, 0, "q4_k_m") == path  # cached
    with pytest.raises(ValueError):
        moe_ref.gguf_path(shape, 0, "q4_0")


def test_recipe():
    r = moe_ref.recipe("qwen3moe-tied-router", 0, "q4_k_m")
    assert r["tied_router"] == [2, 5] and r["quantizer"] == "toy" and r["router_gain"] == moe_ref.ROUTER_GAIN
    assert moe_ref.recipe("olmoe-k", 1, "f16")["quantizer"] == "convert_hf_to_gguf.py"
