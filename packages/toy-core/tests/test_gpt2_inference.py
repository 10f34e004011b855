"""GPT-2 inference (``toy.models.gpt2`` through the registry) on GPT-2 files
toy did not write: seeded random Hugging Face ``GPT2LMHeadModel`` checkpoints
converted by llama.cpp's own ``convert_hf_to_gguf.py`` (``gpt2_ref``).

Where each expected value comes from:

- logits: Hugging Face's float32 forward (``gpt2_ref.hf_logits``); for the
  checks without GELU, the same HF model with its MLP input projection
  zeroed in memory (``hf_logits_no_mlp``);
- greedy tokens and the first logits of each prompt: llama.cpp itself
  (``fixtures/gpt2_llamacpp.json``, llama-cpp-python 0.3.36, F16 KV cache,
  no flash attention), after checking the regenerated GGUF hashes to the
  recorded sha256;
- batch invariance, chunked prefill, ``toy eval compare`` of a model with
  itself and the ``lmc`` end points: equalities between two toy paths;
- quantization: llama.cpp's converter's own ``--outtype q8_0`` file.

Tolerances (absolute; max |logit| is 4.1 for "tiny", 13.7 for the 124M
shape, on the 51-token sequence of ``long_sequence``):

- ``TOL`` 1e-4 holds for everything but GELU: toy's FullModel and its
  engine (F32 K/V, prefill + one-token decodes) against HF on the same
  model with the MLP's input projection zeroed (GELU(0) = 0 exactly on both
  sides). Measured 3.7e-6 / 4.7e-6 (tiny), 1.8e-5 (124M, FullModel).
- With ggml's GELU (the default, ``GPT2Config.gelu = "table"``, which keeps
  toy's logits equal to llama.cpp's) 1e-4 is out of reach: ggml's CPU GELU,
  like llama.cpp's, looks the value up in a float16 table, f16(gelu(f16(x))),
  ~2^-11 relative per activation. Measured |toy - HF|: 1.4e-3 .. 2.0e-3
  (tiny; FullModel and F32-K/V engine alike), 6.1e-3 .. 7.1e-3 (124M). The
  float64 reference (``torch_gpt2``) with that table and nothing else
  rounded moves from HF by the same amount (2.0e-3 tiny, 6.4e-3 124M;
  ``test_the_gelu_table_alone_moves_hf_as_far``), while with the exact
  formula it agrees with HF to 5.1e-6 / 2.1e-5. What is left between toy
  and that emulation (6.6e-4 tiny, 4.0e-3 124M) is the size of the gap
  between toy's own two paths (engine decode vs FullModel: 6.6e-4, 4.1e-3):
  float32 sums in another order put a GELU input on the other side of a
  float16 rounding boundary. Bounds: ``GELU_TOL`` 5e-3 (tiny), 2e-2 (124M).
  With ``gelu = "exact"`` (the tanh formula in float32 ggml ops) the whole
  graph, full forward and step-by-step decode, is within ``TOL`` of HF
  (``test_exact_gelu_forward_and_decode_within_1e4_of_hf``).
- The default F16 KV cache (K and V rounded to 11 bits): ``F16_TOL`` 1e-2
  (tiny; measured 3.5e-3), test_engine's F16 bound.
- Eval: a log-softmax moves by at most twice its logits' error, so
  per-token logprobs get ``2 * GELU_TOL`` (measured 4.9e-4); mean NLLs
  average that out: 1e-3 (measured 1.2e-5 for perplexity, 3.0e-5 for the
  lmc midpoint with F16 K/V); KL(a || b) of two seeds relative 1e-3
  (measured 2.4e-6, max 1.9e-5).
- Against llama.cpp's recorded logits: ``LCPP_TOL`` 1e-4 (measured 0.0 on
  every prompt of every file: toy and llama.cpp run the same ggml kernels on
  the same graph).

Measured here: toy's ``quantize`` Q8_0 of the converted F32 file has
every tensor type and byte equal to llama.cpp's converter's ``--outtype
q8_0`` file (tiny and 124M; the whole tiny file is a byte prefix of the
converter's, which only adds 28 bytes of zero padding after the last
tensor), so the 124M Q8_0 greedy check against the fixture applies to
toy's own file.

Runtime (one ggml thread, ``THREADS``; the shared 2-core machine at load
average ~4): 22 s without the ``slow`` tests, 22 s for the four 124M ones,
once ``gpt2_ref``'s cache holds the files (a cold cache adds ~10 s per tiny
file and ~1 min for the 124M HF model and its two conversions).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import toy
import toy.eval as E
import toy_ggml
from toy import models
from toy.eval.windows import log_softmax
from toy.gguf import GGUFFile, GGUFWriter, copy_metadata
from toy.gguf.convert import quantize_model
from toy_testsupport import gpt2_np, gpt2_ref, torch_gpt2
from toy_testsupport.reference.full import FullModel

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "gpt2_llamacpp.json"
FIX = json.loads(FIXTURE.read_text())


TOL = 1e-4
GELU_TOL = {"tiny": 5e-3, "small124m": 2e-2}
F16_TOL = 1e-2
NLL_TOL = 1e-3
LCPP_TOL = 1e-4
# one thread everywhere: ggml's CPU results do not depend on the thread count
# (llama.cpp recorded the fixture with 2; toy's logits equal its with 1), and
# on a shared 2-core machine a second ggml thread mostly spins
THREADS = 1
PROMPTS = [p["text"] for p in FIX["models"][0]["prompts"]]
GPT2 = models.get("gpt2")


def fixture_prompts(shape: str, outtype: str = "f32") -> list[dict]:
    for m in FIX["models"]:
        if (m["recipe"]["shape"], m["recipe"]["outtype"], m["recipe"]["seed"]) == (shape, outtype, 0):
            return m["prompts"]
    raise AssertionError(f"{FIXTURE.name} has no {shape}/{outtype} model")


def long_sequence(shape: str) -> list[int]:
    """51 real tokens: the third prompt, its llama.cpp continuation, the
    second prompt and its continuation (past the 32-cell KV padding)."""
    p = fixture_prompts(shape)
    return p[2]["ids"] + p[2]["greedy"] + p[1]["ids"] + p[1]["greedy"]


def max_err(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max())


def hf_logits_no_mlp(hf, ids) -> np.ndarray:
    """HF's float32 logits with every ``mlp.c_fc`` (GGUF ``ffn_up``) weight
    and bias zeroed: each MLP then adds just its ``c_proj`` bias."""
    import torch

    model = gpt2_ref._load_hf(hf)
    with torch.no_grad():
        for block in model.transformer.h:
            block.mlp.c_fc.weight.zero_()
            block.mlp.c_fc.bias.zero_()
        return model(torch.tensor([list(ids)], dtype=torch.long)).logits[0].float().numpy()


def write_no_mlp(src: Path, dst: Path) -> Path:
    """``src`` with every ``ffn_up`` weight and bias zeroed (toy's writer)."""
    with GGUFFile(src) as gf:
        w = GGUFWriter(dst, alignment=gf.alignment)
        copy_metadata(gf, w)
        for name, t in gf.tensors.items():
            if ".ffn_up." in name:
                w.add_tensor(name, np.zeros(t.shape, np.float32))
            else:
                w.add_tensor_bytes(name, t.shape, t.dtype, gf.tensor_bytes(name))
        return w.write()


def np_weights(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """``gpt2_np``'s (config, float64 weights) of a file, read with toy's
    reader (``gpt2_np.load_gguf`` parses the 50257-token vocabulary with
    the ``gguf`` package: seconds per call)."""
    with GGUFFile(path) as gf:
        cfg = models.config_from_gguf(gf)
        w = {name: gf.tensor_to_float(name).astype(np.float64) for name in gf.tensors}
    return {"n_layer": cfg.n_layer, "n_embd": cfg.d_model, "n_head": cfg.n_head, "eps": cfg.norm_eps}, w


def engine_logits(path: Path, ids, k: int = 5, threads: int = THREADS, **kw) -> np.ndarray:
    """(len(ids), V): a prefill of ids[:k] (every row), then one decode step
    per remaining token, through ``toy.load``'s engine."""
    with toy.load(path, threads=threads, **kw) as m:
        e = m.engine
        rows = [e.prefill(0, ids[:k], all_logits=True)]
        rows += [e.decode([0], [t]) for t in ids[k:]]
        return np.concatenate(rows)


@pytest.fixture(scope="module")
def rt():
    r = toy_ggml.Runtime("cpu", threads=THREADS)
    yield r
    r.close()


@pytest.fixture(scope="module")
def tiny():
    """(HF folder, converted F32 GGUF) of the tiny seed-0 model."""
    return gpt2_ref.hf_dir("tiny", 0), gpt2_ref.gguf_path("tiny", 0, "f32")


@pytest.fixture(scope="module")
def tiny_seq(tiny):
    """The 51-token sequence and HF's logits for it."""
    ids = long_sequence("tiny")
    return ids, gpt2_ref.hf_logits(tiny[0], ids)


@pytest.fixture(scope="module")
def no_mlp(tiny, tiny_seq, tmp_path_factory):
    """(the zero-ffn_up copy of the tiny file, HF's logits of the same model)."""
    path = write_no_mlp(tiny[1], tmp_path_factory.mktemp("gpt2-no-mlp") / "tiny-no-mlp.gguf")
    return path, hf_logits_no_mlp(tiny[0], tiny_seq[0])


# ---------------------------------------------------------------- forward vs HF


def test_full_forward_without_gelu_within_1e4_of_hf(rt, no_mlp, tiny_seq):
    path, want = no_mlp
    with FullModel.load(path, rt, kv_type=None, kv_pad=1) as fm:
        got = fm.logits(tiny_seq[0])
    assert got.shape == want.shape == (len(tiny_seq[0]), gpt2_ref.N_VOCAB)
    err = max_err(got, want)
    assert err < TOL, f"FullModel vs HF without GELU: {err:.2e}"


def test_engine_decode_without_gelu_within_1e4_of_hf(no_mlp, tiny_seq):
    path, want = no_mlp
    err = max_err(engine_logits(path, tiny_seq[0], kv_type="f32"), want)
    assert err < TOL, f"engine (F32 K/V) vs HF without GELU: {err:.2e}"


def test_full_forward_matches_hf(rt, tiny, tiny_seq):
    ids, want = tiny_seq
    with FullModel.load(tiny[1], rt, kv_type=None, kv_pad=1) as fm:
        assert fm.cfg.architecture == "gpt2" and fm.cfg.tied_output
        errs = [max_err(fm.logits(ids[:n]), want[:n]) for n in (5, 10, 26, len(ids))]
    assert max(errs) < GELU_TOL["tiny"], errs


def exact_gelu_logits(path: Path, ids, rt) -> tuple[np.ndarray, np.ndarray]:
    """FullModel and the engine (F32 K/V, prefill of 3 + one-token decodes)
    with ``GPT2Config.gelu = "exact"`` (the tanh formula in float32 ggml ops
    instead of the float16 table)."""
    import dataclasses

    from toy.engine.llm import LLMEngine

    with FullModel.load(path, rt, kv_type=None, kv_pad=1) as fm:
        fm.cfg = dataclasses.replace(fm.cfg, gelu="exact")
        full = fm.logits(ids)
        eng = LLMEngine(fm.cfg, fm.weights, rt, n_ctx=len(ids), kv_type="f32")
        try:
            rows = [eng.prefill(0, ids[:3], all_logits=True)] + [eng.decode([0], [t]) for t in ids[3:]]
        finally:
            eng.close()
    return full, np.concatenate(rows)


@pytest.mark.parametrize("shape", ["tiny", pytest.param("small124m", marks=pytest.mark.slow)])
def test_exact_gelu_forward_and_decode_within_1e4_of_hf(rt, shape):
    """The whole GPT-2 graph, GELU included, within 1e-4 of HF once the GELU
    is the exact formula (measured: 4.5e-6 / 6.1e-6 tiny, 2.4e-5 / 2.1e-5
    124M for the full forward / the engine)."""
    hf, path = gpt2_ref.hf_dir(shape, 0), gpt2_ref.gguf_path(shape, 0, "f32")
    ids = long_sequence(shape)
    want = gpt2_ref.hf_logits(hf, ids)
    full, engine = exact_gelu_logits(path, ids, rt)
    assert max_err(full, want) < TOL and max_err(engine, want) < TOL, (max_err(full, want), max_err(engine, want))


def test_the_gelu_table_alone_moves_hf_as_far(rt, tiny, tiny_seq):
    """The float64 reference (torch_gpt2) with ggml's float16 GELU table and
    otherwise exact arithmetic is as far from HF as toy is; with the exact
    formula it agrees with HF to float32 rounding."""
    ids, want = tiny_seq
    _, w = np_weights(tiny[1])
    with FullModel.load(tiny[1], rt, kv_type=None, kv_pad=1) as fm:
        cfg, got = fm.cfg, fm.logits(ids)
    T = len(ids)
    args = (w, cfg, np.array([ids]), np.arange(T)[None], np.zeros((1, T), np.int64))
    exact = torch_gpt2.logits(*args, gelu="exact")[0]
    table = torch_gpt2.logits(*args, gelu="fp16")[0]
    assert max_err(exact, want) < TOL
    e_table, e_toy = max_err(table, want), max_err(got, want)
    assert e_table > 5 * TOL and e_toy > 5 * TOL
    assert 0.5 < e_toy / e_table < 2, (e_toy, e_table)


def test_engine_decode_f32_kv_matches_hf(tiny, tiny_seq):
    ids, want = tiny_seq
    err = max_err(engine_logits(tiny[1], ids, kv_type="f32"), want)
    assert err < GELU_TOL["tiny"], f"engine (F32 K/V) vs HF: {err:.2e}"


def test_engine_decode_f16_kv_matches_hf(tiny, tiny_seq):
    ids, want = tiny_seq
    got = engine_logits(tiny[1], ids)  # toy.load's default: F16 K/V
    err = max_err(got, want)
    assert err < F16_TOL, f"engine (F16 K/V) vs HF: {err:.2e}"
    assert err > max_err(engine_logits(tiny[1], ids, kv_type="f32"), want)  # the cache type did change


@pytest.mark.slow
def test_small124m_forward_and_decode_match_hf(rt, tmp_path):
    hf, path = gpt2_ref.hf_dir("small124m", 0), gpt2_ref.gguf_path("small124m", 0, "f32")
    ids = long_sequence("small124m")
    want = gpt2_ref.hf_logits(hf, ids)
    with FullModel.load(path, rt, kv_type=None, kv_pad=1) as fm:
        err_full = max_err(fm.logits(ids), want)
    err_engine = max_err(engine_logits(path, ids, kv_type="f32"), want)
    assert err_full < GELU_TOL["small124m"] and err_engine < GELU_TOL["small124m"], (err_full, err_engine)
    # without GELU (the engine's decode path is the tiny test's; its 124M run adds ~2 s per file)
    nm = write_no_mlp(path, tmp_path / "small124m-no-mlp.gguf")
    with FullModel.load(nm, rt, kv_type=None, kv_pad=1) as fm:
        err = max_err(fm.logits(ids), hf_logits_no_mlp(hf, ids))
    assert err < TOL, err


# ---------------------------------------------------------------- toy's own file vs the converter's


def hf_as_gguf(sd: dict[str, np.ndarray], n_layer: int) -> dict[str, np.ndarray]:
    """The HF state dict under GGUF names in NumPy order, as the converter
    maps it: Conv1D weights ``(in, out)`` transposed to ``(out, in)``."""
    out = {
        "token_embd.weight": sd["transformer.wte.weight"],
        "position_embd.weight": sd["transformer.wpe.weight"],
        "output_norm.weight": sd["transformer.ln_f.weight"],
        "output_norm.bias": sd["transformer.ln_f.bias"],
    }
    names = {
        "ln_1": "attn_norm",
        "attn.c_attn": "attn_qkv",
        "attn.c_proj": "attn_output",
        "ln_2": "ffn_norm",
        "mlp.c_fc": "ffn_up",
        "mlp.c_proj": "ffn_down",
    }
    for i in range(n_layer):
        for h, g in names.items():
            w = sd[f"transformer.h.{i}.{h}.weight"]
            out[f"blk.{i}.{g}.weight"] = w if h.startswith("ln_") else np.ascontiguousarray(w.T)
            out[f"blk.{i}.{g}.bias"] = sd[f"transformer.h.{i}.{h}.bias"]
    return out


def write_toy_gguf(hf: Path, converted: Path, dst: Path) -> Path:
    """A GGUF written by toy from the HF checkpoint: the registry's
    ``metadata`` for the config in config.json, the converted file's
    ``tokenizer.*`` keys, tensors in ``params`` order."""
    from toy.models.gpt2 import GPT2Config

    hc = json.loads((hf / "config.json").read_text())
    sd = gpt2_ref.hf_state_dict(hf)
    cfg = GPT2Config(
        n_vocab=hc["vocab_size"],
        d_model=hc["n_embd"],
        n_layer=hc["n_layer"],
        n_head=hc["n_head"],
        d_ff=hc.get("n_inner") or 4 * hc["n_embd"],
        n_ctx_train=hc["n_positions"],
        norm_eps=hc["layer_norm_epsilon"],
        tied_output="lm_head.weight" not in sd,
        context_length=hc["n_ctx"],
    )
    arrays = hf_as_gguf(sd, cfg.n_layer)
    w = GGUFWriter(dst)
    for key, value in GPT2.metadata(cfg, gpt2_ref.MODEL_NAME).items():
        if isinstance(value, tuple):
            w.add(key, *value)  # (value, TypeInfo)
        else:
            w.add(key, value)
    with GGUFFile(converted) as gf:
        for key, value in gf.metadata.items():
            if key.startswith("tokenizer."):
                w.add(key, value, gf.types[key])
    params = GPT2.params(cfg)
    assert sorted(params) == sorted(arrays)
    for name, info in params.items():
        assert arrays[name].shape == info.shape, name
        w.add_tensor(name, arrays[name])
    return w.write()


def test_toy_written_gguf_equals_the_converters(rt, tiny, tiny_seq, tmp_path):
    hf, converted = tiny
    mine = write_toy_gguf(hf, converted, tmp_path / "toy-gpt2.gguf")
    with GGUFFile(mine) as a, GGUFFile(converted) as b:
        # the registry's metadata is the converter's (values and on-disk types)
        for key in a.metadata:
            assert key in b.metadata, key
            assert a.types[key] == b.types[key], key
            va, vb = a.metadata[key], b.metadata[key]
            assert np.array_equal(va, vb) if isinstance(va, np.ndarray) else va == vb, key
        assert {k for k in b.metadata if k.startswith("gpt2.")} == {k for k in a.metadata if k.startswith("gpt2.")}
        assert models.config_from_gguf(a) == models.config_from_gguf(b)
        # the same tensors, byte for byte (the file orders differ: toy writes params order)
        assert sorted(a.tensors) == sorted(b.tensors)
        for name in a.tensors:
            assert (a.tensors[name].dtype, a.tensors[name].shape) == (b.tensors[name].dtype, b.tensors[name].shape)
            assert bytes(a.tensor_bytes(name)) == bytes(b.tensor_bytes(name)), name
    ids = tiny_seq[0]
    with (
        FullModel.load(mine, rt, kv_type=None, kv_pad=1) as fa,
        FullModel.load(converted, rt, kv_type=None, kv_pad=1) as fb,
    ):
        np.testing.assert_array_equal(fa.logits(ids), fb.logits(ids))
    with toy.load(mine, threads=THREADS) as ma, toy.load(converted, threads=THREADS) as mb:
        for p in PROMPTS:
            assert ma.tokenize(p) == mb.tokenize(p)
            ga = ma.generate(p, temperature=0, max_tokens=8, ignore_eos=True)
            gb = mb.generate(p, temperature=0, max_tokens=8, ignore_eos=True)
            assert ga.tokens == gb.tokens and ga.text == gb.text


# ---------------------------------------------------------------- llama.cpp parity


def _fixture_params():
    out = []
    for m in FIX["models"]:
        r = m["recipe"]
        marks = [pytest.mark.slow] if r["shape"] != "tiny" else []
        out.append(pytest.param(m, id=f"{r['shape']}-seed{r['seed']}-{r['outtype']}", marks=marks))
    return out


@pytest.mark.avx2_reference
@pytest.mark.parametrize("rec", _fixture_params())
def test_greedy_tokens_equal_llamacpp(rec):
    r, ctx = rec["recipe"], FIX["context"]
    assert (ctx["kv_type"], ctx["flash_attn"], ctx["add_bos"]) == ("f16", False, False)
    assert rec["recipe"] == gpt2_ref.recipe(r["shape"], r["seed"], r["outtype"])
    path = gpt2_ref.gguf_path(r["shape"], r["seed"], r["outtype"])
    assert gpt2_ref.sha256(path) == rec["sha256"], (
        f"the regenerated {path.name} differs from the recorded one (torch, transformers or the recipe "
        "changed?): re-record with tools/fixtures/record_gpt2_llamacpp.py"
    )
    # llama.cpp ran n_ctx 256 even past the 128 learned positions of "tiny"; toy
    # caps n_ctx at the positions (the sequences here are at most 26 tokens)
    n_ctx = min(ctx["n_ctx"], r["n_positions"])
    with toy.load(path, n_ctx=n_ctx, kv_type="f16", threads=THREADS) as m:
        for p in rec["prompts"]:
            assert m.tokenize(p["text"]) == p["ids"], p["text"]
            out = m.generate(p["ids"], temperature=0, max_tokens=ctx["n_gen"], ignore_eos=True)
            assert out.tokens == p["greedy"], p["text"]
            last = m.logits(p["ids"])[-1]
            np.testing.assert_allclose(last[:8], p["last_logits_head"], rtol=0, atol=LCPP_TOL)


# ---------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("flash_attn", [False, True])
def test_batched_decode_is_bit_exact(tiny, flash_attn):
    """Three sequences (prompts of 5, 30 and 51 tokens; without flash
    attention, attention lengths 32, 32 -> 64 and 64 -> 96 over the steps)
    decoded together, in subsets and in other orders, give each the logits
    it gets decoded alone, bit for bit (F16 K/V, toy.load's default)."""
    # the engine's attention-length step without flash attention: 32, or 64 on
    # the AVX-512 CPU variants (toy.engine.llm); with 32 the prompts are 5, 30, 51
    # (the model's context is 128: with 64 the lengths are 64 and 128, two kinds)
    pad = math.lcm(32, toy_ggml.sum_step())
    seq = (long_sequence("tiny") * 4)[: min(2 * pad - 13, 128 - 20)]
    prompts = [seq[:5], seq[: pad - 2], seq]
    plan = [[0, 1, 2]] * 8 + [[2, 0]] * 6 + [[1]] * 3 + [[1, 2, 0]] * 3
    with toy.load(tiny[1], n_ctx=128, n_slot=3, threads=THREADS, flash_attn=flash_attn) as m:
        e = m.engine
        assert flash_attn or e.kv_pad == pad

        def run(slots_prompts, schedule):
            rows = {s: [e.prefill(s, p)] for s, p in slots_prompts}
            for slots in schedule:
                out = e.decode(slots, [int(np.argmax(rows[s][-1])) for s in slots])
                for r, s in enumerate(slots):
                    rows[s].append(out[r])
            return {s: np.stack(r) for s, r in rows.items()}

        alone = []
        for j, p in enumerate(prompts):
            e.cache.clear()
            alone.append(run([(0, p)], [[0]] * sum(j in s for s in plan))[0])
        e.cache.clear()
        together = run(list(enumerate(prompts)), plan)
        if not flash_attn:  # the slots' attention lengths differ (flash attention pads to n_ctx here)
            assert len({e._n_kv(e.cache.length(j)) for j in range(3)}) == min(3, 128 // pad)
    for j in range(3):
        assert together[j].shape == alone[j].shape
        assert np.array_equal(together[j], alone[j]), f"slot {j}: max |diff| {max_err(together[j], alone[j]):.3g}"


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_chunked_prefill_with_exact_batching_is_bit_exact(tiny, kv_type):
    ids = long_sequence("tiny")
    kw = dict(n_ctx=128, threads=THREADS, kv_type=kv_type, exact_batching=True)
    results = []
    for n_batch in (512, 7, 1):
        with toy.load(tiny[1], n_batch=n_batch, **kw) as m:
            e = m.engine
            rows = e.prefill(0, ids, all_logits=True)
            assert e.stats.computes == -(-len(ids) // n_batch)
            steps = [e.decode([0], [int(np.argmax(rows[-1]))])[0]]
            for _ in range(5):
                steps.append(e.decode([0], [int(np.argmax(steps[-1]))])[0])
            results.append((rows, np.stack(steps)))
    for rows, steps in results[1:]:
        np.testing.assert_array_equal(rows, results[0][0])
        np.testing.assert_array_equal(steps, results[0][1])  # the cached K/V were identical too


# ---------------------------------------------------------------- toy eval

EVAL_TEXT = (
    "The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest "
    "structure in Paris. Its base is square, measuring 125 metres on each side. During its construction, "
    "the Eiffel Tower surpassed the Washington Monument to become the tallest man-made structure in the "
    "world, a title it held for 41 years until the Chrysler Building in New York City was finished in 1930."
)
C = 32


@pytest.fixture(scope="module")
def eval_ids(tiny):
    ids = gpt2_ref.tokenize(tiny[0], EVAL_TEXT)
    assert len(ids) >= 2 * C
    return ids


def hf_logprobs(hf, ids) -> np.ndarray:
    return log_softmax(gpt2_ref.hf_logits(hf, ids))


def test_eval_text_tokenizes_like_hf(tiny, eval_ids):
    with toy.load(tiny[1], n_ctx=C, threads=THREADS) as m:
        assert E.text_ids(m, EVAL_TEXT) == eval_ids


def test_logprobs_match_hf(tiny, eval_ids):
    ids = eval_ids[:C]
    with toy.load(tiny[1], n_ctx=C, kv_type="f32", threads=THREADS) as m:
        res = E.logprobs(m, ids, top_k=4)
        own = log_softmax(m.logits(ids))
    ref = hf_logprobs(tiny[0], ids)
    assert [t.id for t in res.tokens] == ids and res.tokens[0].logprob is None and res.n_scored == C - 1
    tol = 2 * GELU_TOL["tiny"]  # a log-softmax moves at most twice its logits' error
    worst = 0.0
    for i in range(1, C):
        t = res.tokens[i]
        assert t.logprob == pytest.approx(own[i - 1][ids[i]], abs=1e-9)  # the engine's logits, float64
        worst = max(worst, abs(t.logprob - ref[i - 1][ids[i]]))
        assert [j for j, _, _ in t.top] == [int(j) for j in np.argsort(-own[i - 1])[:4]]
        np.testing.assert_allclose([lp for _, _, lp in t.top], ref[i - 1][[j for j, _, _ in t.top]], atol=tol)
    assert worst < tol, worst
    want_nll = -np.mean([ref[i - 1][ids[i]] for i in range(1, C)])
    assert res.nll == pytest.approx(want_nll, abs=NLL_TOL)


def ref_window_nll(hf, ids, context: int) -> np.ndarray:
    """llama-perplexity's scored NLLs from HF logits: windows of ``context``
    tokens at multiples of it (GPT-2 adds no BOS), rows context/2 .. context-2."""
    nll = []
    for s in range(0, len(ids) - context + 1, context):
        lp = hf_logprobs(hf, ids[s : s + context])
        nll += [-lp[j, ids[s + j + 1]] for j in range(context // 2, context - 1)]
    return np.array(nll)


def test_perplexity_matches_hf(tiny, eval_ids):
    with toy.load(tiny[1], n_ctx=C, kv_type="f32", threads=THREADS) as m:
        res = E.perplexity(m, eval_ids, context=C)
    nll = ref_window_nll(tiny[0], eval_ids, C)
    assert res.n_windows == len(eval_ids) // C and res.n_scored == len(nll)
    assert res.nll == pytest.approx(nll.mean(), abs=NLL_TOL)
    assert res.ppl == pytest.approx(np.exp(nll.mean()), rel=NLL_TOL)


@pytest.fixture(scope="module")
def seed1():
    return gpt2_ref.hf_dir("tiny", 1), gpt2_ref.gguf_path("tiny", 1, "f32")


def test_compare_self_and_another_seed(tiny, seed1, eval_ids):
    with (
        toy.load(tiny[1], n_ctx=C, kv_type="f32", threads=THREADS) as a,
        toy.load(seed1[1], n_ctx=C, kv_type="f32", threads=THREADS) as b,
    ):
        same = E.compare(a, a, eval_ids, context=C)
        other = E.compare(a, b, eval_ids, context=C)
    assert same.kl_mean == 0.0 and same.kl_percentiles["max"] == 0.0
    assert same.top1_agreement == 1.0 and same.ppl_a == same.ppl_b
    kl, agree = [], 0
    for s in range(0, len(eval_ids) - C + 1, C):
        la = hf_logprobs(tiny[0], eval_ids[s : s + C])[C // 2 : C - 1]
        lb = hf_logprobs(seed1[0], eval_ids[s : s + C])[C // 2 : C - 1]
        kl += list((np.exp(la) * (la - lb)).sum(axis=1))
        agree += int((la.argmax(1) == lb.argmax(1)).sum())
    assert other.n_scored == len(kl)
    assert other.kl_mean > 0.1
    assert other.kl_mean == pytest.approx(np.mean(kl), rel=1e-3)
    assert other.kl_percentiles["max"] == pytest.approx(max(kl), rel=1e-3)
    assert other.top1_agreement == agree / len(kl)


def test_lmc_endpoints_are_each_checkpoints_perplexity(tiny, seed1, eval_ids):
    res = E.lmc(tiny[1], seed1[1], eval_ids, [0.0, 0.5, 1.0], context=C, threads=THREADS)
    own = []
    for p in (tiny[1], seed1[1]):
        with toy.load(p, n_ctx=C, threads=THREADS) as m:  # the defaults, as lmc's engine (F16 K/V)
            own.append(E.perplexity(m, eval_ids, context=C))
    assert [p.alpha for p in res.points] == [0.0, 0.5, 1.0]
    assert res.points[0].nll == own[0].nll and res.points[2].nll == own[1].nll  # same weights, same kernels
    assert res.points[0].ppl == own[0].ppl and res.points[2].ppl == own[1].ppl
    # the midpoint against the float64 NumPy GPT-2 with interpolated weights
    cfg, wa = np_weights(tiny[1])
    _, wb = np_weights(seed1[1])
    mid = {k: 0.5 * wa[k] + 0.5 * wb[k] for k in wa}
    nll = []
    for s in range(0, len(eval_ids) - C + 1, C):
        lp = log_softmax(gpt2_np.forward(cfg, mid, eval_ids[s : s + C]))
        nll += [-lp[j, eval_ids[s + j + 1]] for j in range(C // 2, C - 1)]
    assert res.points[1].nll == pytest.approx(np.mean(nll), abs=NLL_TOL)
    assert res.barrier == pytest.approx(res.points[1].nll - 0.5 * (own[0].nll + own[1].nll), abs=1e-12)


# ---------------------------------------------------------------- toy quantize


def check_q8_0(mine: Path, converted: Path) -> None:
    """toy's Q8_0 of the F32 file: llama.cpp's type rule, and (measured) the
    same tensor bytes as llama.cpp's converter's --outtype q8_0."""
    with GGUFFile(mine) as a, GGUFFile(converted) as b:
        assert a.metadata["general.file_type"] == b.metadata["general.file_type"] == 7  # MOSTLY_Q8_0
        assert list(a.tensors) == list(b.tensors)
        for name, t in a.tensors.items():
            if name == "position_embd.weight" or len(t.shape) == 1:
                assert t.dtype == toy_ggml.GGMLType.F32, name
            else:
                assert t.dtype == toy_ggml.GGMLType.Q8_0, name
            assert t.dtype == b.tensors[name].dtype, name
            assert bytes(a.tensor_bytes(name)) == bytes(b.tensor_bytes(name)), name


def test_quantize_q8_0_follows_llamacpp(tiny, tmp_path):
    dst = tmp_path / "tiny-q8_0.gguf"
    report = quantize_model(tiny[1], dst, "q8_0")
    assert not report.fallbacks
    converted = gpt2_ref.gguf_path("tiny", 0, "q8_0")
    check_q8_0(dst, converted)
    with toy.load(dst, threads=THREADS) as a, toy.load(converted, threads=THREADS) as b:
        for p in PROMPTS:
            ga = a.generate(p, temperature=0, max_tokens=16, ignore_eos=True)
            assert ga.tokens == b.generate(p, temperature=0, max_tokens=16, ignore_eos=True).tokens


@pytest.mark.slow
def test_small124m_quantize_q8_0_greedy_equals_llamacpp(tmp_path):
    dst = tmp_path / "small124m-q8_0.gguf"
    quantize_model(gpt2_ref.gguf_path("small124m", 0, "f32"), dst, "q8_0")
    converted = gpt2_ref.gguf_path("small124m", 0, "q8_0")
    prompts = fixture_prompts("small124m", "q8_0")
    assert gpt2_ref.sha256(converted) == next(
        m["sha256"] for m in FIX["models"] if m["recipe"] == gpt2_ref.recipe("small124m", 0, "q8_0")
    )
    check_q8_0(dst, converted)
    with toy.load(dst, n_ctx=FIX["context"]["n_ctx"], threads=THREADS) as m:
        for p in prompts:
            out = m.generate(p["ids"], temperature=0, max_tokens=FIX["context"]["n_gen"], ignore_eos=True)
            assert out.tokens == p["greedy"], p["text"]
