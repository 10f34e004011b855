"""LoRA adapters at inference (``toy.load(..., lora=...)``), the adapter file
format as others read it, and ``toy.merge``.

Where each expected value comes from:

- logits: the float64 NumPy reference (``toy_testsupport.reference.llama_np``, written
  from the math) run on weights ``W + s · B @ A`` computed here in float64,
  with ``s`` = alpha/rank (or alpha/√rank for rank-stabilized LoRA) times
  the user's scale worked out by hand, not read from ``Adapter.scale``.
  Tolerance ``TOL`` 1e-5 relative to the largest |logit|: F32 weights and F32
  K/V leave float32 rounding only (observed ~3e-7);
- a zero B: the base model's own logits, bit for bit;
- the file: the ``gguf`` package from PyPI (llama.cpp's own Python reader);
- the real model: greedy tokens recorded from llama.cpp (llama-cpp-python
  0.3.36, ``tools/fixtures/record_lora_llamacpp.py``) with an adapter this
  module re-creates from the recorded seed and recipe (``make_parity_adapter``,
  which the record script imports too) and checks by sha256.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

import toy
from toy.adapters import AdapterError, load_adapter, save_adapter
from toy_testsupport.train_helpers import seeded_adapter

TOL = 1e-5
FIXTURE = Path(__file__).parent / "fixtures" / "lora_llamacpp.json"
IDS = [1, 5, 9, 33, 2, 70, 4, 4, 12, 88, 40, 41, 7, 0, 63, 95, 17]
ALL = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def make_parity_adapter(base_path, out_path, *, base_name: str = "SmolLM2-135M-Instruct.Q4_1.gguf", **recipe) -> Path:
    """The adapter of the llama.cpp parity fixture (``train_helpers.seeded_adapter``)."""
    return seeded_adapter(base_path, out_path, base_name=base_name, **recipe)


# ---------------------------------------------------------------- tiny models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, config, float64 weights) of a tiny seeded F32 llama (GQA 4:2)."""
    from toy.gguf import GGUFFile
    from toy.models.llama import LlamaConfig
    from toy_testsupport.reference import llama_np
    from toy_testsupport.toy_test_models import write_tiny_model

    path = write_tiny_model(
        tmp_path_factory.mktemp("lora") / "tiny.gguf", seed=3, extra_metadata={"tokenizer.ggml.merges": []}
    )
    with GGUFFile(path) as gf:
        return Path(path), LlamaConfig.from_gguf(gf), llama_np.load_weights(gf)


def random_pairs(weights, stems=ALL, rank=4, seed=0, std=0.3, zero_b=False, layers=(0, 1)):
    rng = np.random.default_rng(seed)
    pairs = {}
    for i in layers:
        for stem in stems:
            name = f"blk.{i}.{stem}.weight"
            out, inn = weights[name].shape
            a = (rng.standard_normal((rank, inn)) * std).astype(np.float32)
            b = np.zeros((out, rank), np.float32) if zero_b else (rng.standard_normal((out, rank)) * std)
            pairs[name] = (a, b.astype(np.float32))
    return pairs


def reference(tiny, terms, ids=IDS):
    """llama_np logits with W + Σ s · B @ A for terms [(pairs, s)]."""
    from toy_testsupport.reference import llama_np

    _, cfg, w = tiny
    w2 = dict(w)
    for pairs, s in terms:
        for name, (a, b) in pairs.items():
            w2[name] = w2[name] + s * (b.astype(np.float64) @ a.astype(np.float64))
    return llama_np.forward_logits(cfg, w2, ids)


def close_to(got, ref, tol=TOL):
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < tol, f"relative error {err:.3g} >= {tol}"


def test_logits_equal_numpy_reference_prefill_and_decode(tiny, tmp_path):
    pairs = random_pairs(tiny[2])
    path = save_adapter(tmp_path / "a.gguf", architecture="llama", pairs=pairs, alpha=8.0, rank=4)
    ref = reference(tiny, [(pairs, 0.7 * 8.0 / 4)])
    base = reference(tiny, [])
    assert np.abs(ref - base).max() > 0.1 * np.abs(ref).max()  # the adapter matters
    with toy.load(tiny[0], lora=[(path, 0.7)], kv_type="f32", threads=1) as m:
        assert m.adapters == [(str(path), 0.7)]
        close_to(m.logits(IDS), ref)
        # the decode graph: prefill all but the last 4 tokens, then one token at a time
        eng = m.engine
        eng.cache.clear(0)
        rows = [eng.prefill(0, IDS[:-4])]
        rows += [eng.decode([0], [t])[0] for t in IDS[-4:]]
        eng.cache.clear(0)
        close_to(np.stack(rows), ref[len(IDS) - 5 :])


def test_bare_path_means_scale_one_and_zero_b_is_the_base_bit_for_bit(tiny, tmp_path):
    pairs = random_pairs(tiny[2], zero_b=True)
    path = save_adapter(tmp_path / "zero.gguf", architecture="llama", pairs=pairs, alpha=16.0, rank=4)
    with toy.load(tiny[0], kv_type="f32", threads=1) as m:
        base = m.logits(IDS)
        base_gen = m.generate(IDS, temperature=0, max_tokens=8, ignore_eos=True).tokens
    with toy.load(tiny[0], lora=path, kv_type="f32", threads=1) as m:
        assert m.adapters == [(str(path), 1.0)]
        assert np.array_equal(m.logits(IDS), base)
        assert m.generate(IDS, temperature=0, max_tokens=8, ignore_eos=True).tokens == base_gen


def test_two_adapters_stack(tiny, tmp_path):
    p1 = random_pairs(tiny[2], stems=("attn_q", "attn_v", "ffn_up"), rank=4, seed=1)
    p2 = random_pairs(tiny[2], stems=("attn_v", "attn_output", "ffn_down"), rank=2, seed=2)
    f1 = save_adapter(tmp_path / "one.gguf", architecture="llama", pairs=p1, alpha=4.0, rank=4)
    f2 = save_adapter(tmp_path / "two.gguf", architecture="llama", pairs=p2, alpha=1.0, rank=2)
    ref = reference(tiny, [(p1, 0.5 * 4.0 / 4), (p2, 2.0 * 1.0 / 2)])
    with toy.load(tiny[0], lora=[(f1, 0.5), (load_adapter(f2), 2)], kv_type="f32", threads=1) as m:
        assert m.adapters == [(str(f1), 0.5), (str(f2), 2.0)]
        close_to(m.logits(IDS), ref)
    # one alone is not the stack
    with toy.load(tiny[0], lora=[(f1, 0.5)], kv_type="f32", threads=1) as m:
        assert np.abs(m.logits(IDS) - ref).max() > 1e-2


def test_rank_stabilized_scale(tiny, tmp_path):
    pairs = random_pairs(tiny[2], stems=("attn_q", "ffn_gate"), rank=4, seed=5)
    path = save_adapter(tmp_path / "rs.gguf", architecture="llama", pairs=pairs, alpha=3.0, rank=4, rslora=True)
    ad = load_adapter(path)
    assert ad.alpha == pytest.approx(3.0 * 2.0)  # alpha · √rank in the file, so llama.cpp's alpha/rank = 3/√4
    ref = reference(tiny, [(pairs, 1.5 * 3.0 / math.sqrt(4))])
    with toy.load(tiny[0], lora=[(path, 1.5)], kv_type="f32", threads=1) as m:
        close_to(m.logits(IDS), ref)


def test_wrong_base_and_non_adapter_files_are_refused(tiny, tmp_path):
    _, _, w = tiny
    a = np.zeros((4, 64), np.float32)
    # attn_k is (32, 64) in this model: a B of 64 rows makes a (64, 64) product
    bad = save_adapter(
        tmp_path / "shape.gguf",
        architecture="llama",
        pairs={"blk.1.attn_k.weight": (a, np.zeros((64, 4), np.float32))},
        alpha=1.0,
        rank=4,
    )
    with pytest.raises(AdapterError, match=r"blk\.1\.attn_k\.weight") as e:
        toy.load(tiny[0], lora=[bad])
    assert str(bad) in str(e.value) and e.value.hint
    missing = save_adapter(
        tmp_path / "layer.gguf",
        architecture="llama",
        pairs={"blk.7.attn_q.weight": (a, np.zeros((64, 4), np.float32))},
        alpha=1.0,
        rank=4,
    )
    with pytest.raises(AdapterError, match=r"blk\.7\.attn_q\.weight.*does not have"):
        toy.load(tiny[0], lora=[missing])
    other = save_adapter(tmp_path / "qwen.gguf", architecture="qwen2", pairs=random_pairs(w), alpha=1.0, rank=4)
    with pytest.raises(AdapterError, match="qwen2"):
        toy.load(tiny[0], lora=[other])
    embd = save_adapter(
        tmp_path / "embd.gguf",
        architecture="llama",
        pairs={"output_norm.weight": (np.zeros((4, 64), np.float32), np.zeros((1, 4), np.float32))},
        alpha=1.0,
        rank=4,
    )
    with pytest.raises(AdapterError, match="output_norm"):
        toy.load(tiny[0], lora=[embd])
    with pytest.raises(AdapterError, match=r"tiny\.gguf.*not an adapter"):
        toy.load(tiny[0], lora=[tiny[0]])
    with pytest.raises(toy.ToyError, match="no such file"):
        toy.load(tiny[0], lora=[tmp_path / "absent.gguf"])
    with pytest.raises(toy.ToyError, match="scale"):
        toy.load(tiny[0], lora=[(bad, float("nan"))])


def test_parse_lora_arg(tmp_path):
    from toy.adapters import parse_lora_arg

    assert parse_lora_arg("a.gguf") == ("a.gguf", 1.0)
    assert parse_lora_arg("dir/a.gguf:0.25") == ("dir/a.gguf", 0.25)
    assert parse_lora_arg("a.gguf:-1e-1") == ("a.gguf", -0.1)
    assert parse_lora_arg(r"C:\models\a.gguf") == (r"C:\models\a.gguf", 1.0)
    odd = tmp_path / "x:2"
    odd.write_bytes(b"")
    assert parse_lora_arg(str(odd)) == (str(odd), 1.0)  # an existing file wins
    for bad in ("a.gguf:half", "a.gguf:inf", "a.gguf:", ""):
        with pytest.raises(toy.ToyError):
            parse_lora_arg(bad)


def test_gguf_package_reads_the_adapter_as_llamacpp_expects(tiny, tmp_path):
    import gguf

    pairs = random_pairs(tiny[2], stems=("attn_q", "attn_v"), rank=4)
    path = save_adapter(tmp_path / "a.gguf", architecture="llama", pairs=pairs, alpha=8.0, rank=4)
    r = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in r.fields.items()}
    assert fields["general.type"] == "adapter"
    assert fields["adapter.type"] == "lora"
    assert fields["general.architecture"] == "llama"
    assert fields["adapter.lora.alpha"] == pytest.approx(8.0)
    assert r.fields["adapter.lora.alpha"].types == [gguf.GGUFValueType.FLOAT32]
    seen = {t.name: t for t in r.tensors}
    assert set(seen) == {f"{n}.lora_{x}" for n in pairs for x in "ab"}
    for name, (a, b) in pairs.items():
        out, inn = tiny[2][name].shape
        ta, tb = seen[f"{name}.lora_a"], seen[f"{name}.lora_b"]
        assert list(ta.shape) == [inn, 4] and list(tb.shape) == [4, out]  # ggml ne: lora_a [in, r], lora_b [r, out]
        assert ta.tensor_type == tb.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(np.asarray(ta.data).reshape(4, inn), a)
        np.testing.assert_array_equal(np.asarray(tb.data).reshape(out, 4), b)


# ---------------------------------------------------------------- merge


def test_merge_f32_equals_base_with_adapter(tiny, tmp_path):
    from toy.gguf import GGUFFile
    from toy.merge import merge_adapters

    p1 = random_pairs(tiny[2], stems=("attn_q", "attn_v", "ffn_down"), seed=7)
    p2 = random_pairs(tiny[2], stems=("attn_v",), rank=2, seed=8)
    f1 = save_adapter(tmp_path / "one.gguf", architecture="llama", pairs=p1, alpha=8.0, rank=4)
    f2 = save_adapter(tmp_path / "two.gguf", architecture="llama", pairs=p2, alpha=2.0, rank=2)
    out = tmp_path / "merged.gguf"
    seen = []
    rep = merge_adapters(tiny[0], [(f1, 0.5), (f2, 2.0)], out, progress=lambda *a: seen.append(a))
    assert rep.adapters == [(str(f1), 0.5), (str(f2), 2.0)] and rep.dtype is None
    assert sorted(rep.merged) == sorted(p1)
    assert seen[-1][0] == "checking" and any(s[0] == "merging" for s in seen)
    with GGUFFile(tiny[0]) as gb, GGUFFile(out) as gm:
        assert list(gm.metadata) == list(gb.metadata) and gm.types == gb.types
        for key, value in gb.metadata.items():
            assert np.array_equal(np.asarray(gm.metadata[key]), np.asarray(value)), key
        assert "general.type" not in gm.metadata
        assert list(gm.tensors) == list(gb.tensors)
        for name in gb.tensors:
            if name not in p1:
                assert bytes(gm.tensor_bytes(name)) == bytes(gb.tensor_bytes(name)), name
        w = tiny[2]["blk.1.attn_v.weight"]
        want = w + 0.5 * 2.0 * (p1["blk.1.attn_v.weight"][1].astype(np.float64) @ p1["blk.1.attn_v.weight"][0])
        want += 2.0 * 1.0 * (p2["blk.1.attn_v.weight"][1].astype(np.float64) @ p2["blk.1.attn_v.weight"][0])
        np.testing.assert_allclose(gm.tensor_to_float("blk.1.attn_v.weight"), want, rtol=1e-6, atol=1e-7)
    with toy.load(tiny[0], lora=[(f1, 0.5), (f2, 2.0)], kv_type="f32", threads=1) as a:
        want = a.logits(IDS)
    with toy.load(out, kv_type="f32", threads=1) as m:
        np.testing.assert_allclose(m.logits(IDS), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    d = rep.drift
    assert d is not None and d.sample == "ids" and d.n_scored > 100  # a tiny tokenizer: seeded ids
    assert 0 <= d.kl_mean < 1e-9 and d.kl_max < 1e-8 and d.top1_agreement == 1.0
    assert d.max_abs_logit_diff < 1e-4 * d.max_abs_logit
    assert json.dumps(rep.to_dict())


def test_merge_q8_0_reports_small_positive_kl(tiny, tmp_path):
    from toy.gguf import GGUFFile
    from toy.merge import merge_adapters
    from toy_ggml import GGMLType

    pairs = random_pairs(tiny[2], stems=("attn_q", "ffn_up"), seed=9)
    f = save_adapter(tmp_path / "a.gguf", architecture="llama", pairs=pairs, alpha=4.0, rank=4)
    out = tmp_path / "out" / "merged.Q8_0.gguf"
    rep = merge_adapters(tiny[0], [f], out, dtype="q8_0")
    assert rep.dtype == "Q8_0"
    assert os.listdir(out.parent) == [out.name]  # the temporary F32 merge is gone
    with GGUFFile(out) as g:
        kinds = {g.tensors[n].dtype for n in g.tensors if len(g.tensors[n].shape) == 2}
        assert kinds == {GGMLType.Q8_0}
        assert g.metadata["general.file_type"] == 7
    d = rep.drift
    assert 1e-7 < d.kl_mean < 0.01 and d.kl_max < 0.1 and d.top1_agreement > 0.8
    assert 0 < d.max_abs_logit_diff < 0.5 * d.max_abs_logit
    with pytest.raises(toy.ToyError, match="Q9"):
        merge_adapters(tiny[0], [f], tmp_path / "x.gguf", dtype="Q9")
    with pytest.raises(toy.ToyError, match="base model"):
        merge_adapters(tiny[0], [f], tiny[0], drift=False)


# ---------------------------------------------------------------- llama.cpp parity


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.mark.avx2_reference
@pytest.mark.model
def test_greedy_with_adapter_equals_llamacpp(smollm2_path, tmp_path):
    rec = json.loads(FIXTURE.read_text())
    assert rec["model"]["sha256"] == _sha256(smollm2_path)
    recipe = rec["adapter"]["recipe"]
    adapter = make_parity_adapter(smollm2_path, tmp_path / "parity.gguf", base_name=rec["model"]["file"], **recipe)
    assert _sha256(adapter) == rec["adapter"]["sha256"], "make_parity_adapter no longer makes the recorded adapter"
    ctx = rec["context"]
    assert ctx["kv_type"] == "f16" and not ctx["flash_attn"]
    changed = 0
    with toy.load(smollm2_path, lora=[(adapter, rec["adapter"]["lora_scale"])], n_ctx=ctx["n_ctx"], threads=1) as m:
        for p in rec["prompts"]:
            assert m.tokenize(p["prompt"]) == p["prompt_ids"]
            got = m.generate(p["prompt_ids"], temperature=0, max_tokens=len(p["lora_greedy"]), ignore_eos=True)
            assert got.tokens == p["lora_greedy"], p["prompt"]
            changed += p["lora_greedy"] != p["base_greedy"]
    assert changed >= 1  # the adapter visibly changes llama.cpp's output


# ---------------------------------------------------------------- selectable adapters (one per sequence)


def test_selectable_adapters_batch_together_bit_for_bit(tiny, tmp_path):
    """``toy.load(adapters={name: file})``: a sequence that names an adapter gets the logits that model
    loaded with that adapter alone gives, bit for bit (same kernels, exact batching), also while other
    sequences in the same decode graph use another adapter or none; a sequence without one gets the base."""
    paths = {}
    for k, name in enumerate(("a", "b", "c")):
        pairs = random_pairs(tiny[2], seed=10 + k, layers=(0, 1) if k != 2 else (1,))
        paths[name] = save_adapter(tmp_path / f"{name}.gguf", architecture="llama", pairs=pairs, alpha=8.0, rank=4)
    prompts = [IDS[:9], IDS[3:14], IDS[1:6], IDS[5:17]]
    choice = ["a", None, "c", "b"]
    kw = {"kv_type": "f32", "threads": 1, "exact_batching": True, "n_ctx": 64}

    def alone(lora, prompt, steps=6):
        with toy.load(tiny[0], lora=lora, **kw) as m:
            eng = m.engine
            rows, toks = [eng.prefill(0, prompt)], []
            for _ in range(steps):
                toks.append(int(np.argmax(rows[-1])))
                rows.append(eng.decode([0], [toks[-1]])[0])
            return np.stack(rows), toks

    want = [alone([paths[c]] if c else None, p) for c, p in zip(choice, prompts)]
    assert not np.array_equal(want[0][0], alone(None, prompts[0])[0])  # the adapter matters
    with toy.load(tiny[0], adapters={n: paths[n] for n in ("a", "b", "c")}, n_slot=4, **kw) as m:
        assert [n for n, _, _ in m.named_adapters] == ["a", "b", "c"]
        eng = m.engine
        rows = [[] for _ in prompts]
        for s, (c, p) in enumerate(zip(choice, prompts)):
            eng.slot_adapter[s] = m.adapter_index(c)
            rows[s].append(eng.prefill(s, p))
        for step in range(6):
            toks = [want[s][1][step] for s in range(4)]
            out = eng.decode([0, 1, 2, 3], toks)
            for s in range(4):
                rows[s].append(out[s])
        for s in range(4):
            assert np.array_equal(np.stack(rows[s]), want[s][0]), (s, choice[s])
        # the library API: generate(adapter=...) equals the model loaded with that adapter alone
        g = m.generate(prompts[0], temperature=0, max_tokens=6, ignore_eos=True, adapter="a")
        assert g.tokens == want[0][1]
        with pytest.raises(toy.errors.BadInputError, match="no adapter named 'z'"):
            m.generate(prompts[0], max_tokens=2, adapter="z")
