"""PEFT LoRA adapters of mixture-of-experts experts (issue 37): PEFT wraps
each expert's ``nn.Linear`` (``model.layers.N.mlp.experts.J.{gate,up,down}_proj``);
``import_peft`` stacks expert J's lora_A/lora_B into llama.cpp's 3-D pairs of
``blk.N.ffn_{gate,up,down}_exps.weight`` (lora_a (E, r, in), lora_b (E, out,
r): the tensors llama.cpp's own convert_lora_to_gguf.py writes), toy applies
them with ``mul_mat_id`` (llama.cpp's ``build_lora_mm_id``) and gives PEFT's
logits; the export writes one PEFT module per expert back (same bytes after a
round trip); an adapter missing one expert's pair is refused naming it.

The models are toy_testsupport.moe_ref's tiny shapes (8 experts, 2 used, 3
layers), converted to F32 GGUF by llama.cpp's converter; the adapters are
PEFT's, every lora parameter drawn N(0, 0.3²) (seeded), so every expert's B
is non-zero. Tolerance: toy (ggml F32, KV cache F32) against torch F32 the
logits agree to ``2e-4 * max|logit| + 1e-5`` (~9e-4 here) with or without the
adapter (measured: 5-7e-6 without, 0.9-1.5e-5 with), while the adapter moves
them by more than 5 (checked: a missing, mis-stacked or mis-scaled expert
pair fails)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from toy.convert.peft import PeftAdapterError, export_peft, import_peft  # noqa: E402
from toy_testsupport import moe_ref  # noqa: E402
from toy_testsupport.hf_checks import hf_causal_lm as _hf  # noqa: E402
from toy_testsupport.hf_checks import torch_logits as _torch_logits  # noqa: E402
from toy_testsupport.hf_checks import toy_logits as _toy_logits  # noqa: E402

EXPERT_TARGETS = ["gate_proj", "up_proj", "down_proj"]  # qwen2moe: its shared expert's projections too


def _tol(ref: np.ndarray) -> float:
    return 2e-4 * float(np.abs(ref).max()) + 1e-5


def _peft_adapter(hf_dir, out: Path, targets, seed: int = 3) -> Path:
    """A PEFT LoRA adapter (r 4, alpha 8) of ``targets`` with every lora parameter N(0, 0.3²)."""
    import torch
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(_hf(hf_dir), LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    pm.save_pretrained(out)
    return out


def _peft_logits(hf_dir, folder, ids) -> np.ndarray:
    from peft import PeftModel

    return _torch_logits(PeftModel.from_pretrained(_hf(hf_dir), str(folder)).eval(), ids)


@pytest.mark.parametrize("shape", ["qwen2moe-tiny", "qwen3moe-tiny", "olmoe-tiny"])
def test_expert_adapter_gives_peft_logits(tmp_path, shape):
    from toy.adapters import load_adapter

    hf, gguf = moe_ref.hf_dir(shape), moe_ref.gguf_path(shape, 0, "f32")
    folder = _peft_adapter(hf, tmp_path / "peft", EXPERT_TARGETS)
    out = import_peft(folder, gguf, tmp_path / "a.gguf")
    ad = load_adapter(out)
    E = moe_ref.SHAPES[shape]["num_experts"]
    a, b = ad.pairs["blk.1.ffn_down_exps.weight"]
    assert a.shape == (E, 4, a.shape[2]) and b.shape == (E, moe_ref.SHAPES[shape]["hidden_size"], 4)
    assert all(np.abs(b[j]).max() > 0 for j in range(E))
    ids = moe_ref.sample_ids(16)
    want = _peft_logits(hf, folder, ids)
    hf_base = _torch_logits(_hf(hf), ids)
    base = _toy_logits(gguf, ids)
    tol = _tol(want)
    assert np.abs(base - hf_base).max() <= tol  # toy = HF without an adapter
    assert np.abs(want - hf_base).max() > 1000 * tol  # the adapter matters (measured > 5)
    assert np.abs(_toy_logits(gguf, ids, lora=out) - want).max() <= tol
    again = export_peft(out, tmp_path / "again", base=gguf)
    assert import_peft(again, gguf, tmp_path / "b.gguf").read_bytes() == out.read_bytes()
    # the exported folder loads in PEFT and gives the same logits
    assert np.abs(_peft_logits(hf, again, ids) - want).max() <= 1e-5
    # toy merge: each expert's B_e A_e added to its matrix of the stacked weight
    from toy.merge import merge_adapters

    merge_adapters(gguf, [out], tmp_path / "merged.gguf", drift=False)
    assert np.abs(_toy_logits(tmp_path / "merged.gguf", ids) - want).max() <= tol


def test_expert_tensors_equal_llamacpp_convert_lora(tmp_path):
    """qwen2moe (experts and shared expert): llama.cpp's convert_lora_to_gguf.py
    writes the same tensors (names, 3-D shapes, F32 values) and alpha."""
    from toy.gguf import GGUFFile

    sys.path.insert(0, str(Path(__file__).parent))
    from test_convert_peft import _llamacpp_convert_lora

    shape = "qwen2moe-tiny"
    hf, gguf = moe_ref.hf_dir(shape), moe_ref.gguf_path(shape, 0, "f32")
    folder = _peft_adapter(hf, tmp_path / "peft", EXPERT_TARGETS)
    ours = import_peft(folder, gguf, tmp_path / "ours.gguf")
    theirs = _llamacpp_convert_lora(folder, hf, tmp_path / "theirs.gguf")
    with GGUFFile(ours) as a, GGUFFile(theirs) as b:
        assert sorted(a.tensors) == sorted(b.tensors)
        assert any(n.endswith("ffn_up_exps.weight.lora_a") for n in b.tensors)
        assert a.metadata["adapter.lora.alpha"] == b.metadata["adapter.lora.alpha"]
        for name in b.tensors:
            assert np.array_equal(a.tensor_to_float(name), b.tensor_to_float(name)), name


def test_expert_adapter_selectable_per_sequence(tmp_path):
    """``toy.load(adapters=...)``: a sequence that names the expert adapter
    gets the logits of the model loaded with it alone, another sequence in the
    same decode graph the base's (the row masks reach the expert products)."""
    import toy

    shape = "qwen3moe-tiny"
    hf, gguf = moe_ref.hf_dir(shape), moe_ref.gguf_path(shape, 0, "f32")
    out = import_peft(_peft_adapter(hf, tmp_path / "peft", ["down_proj", "up_proj"]), gguf, tmp_path / "a.gguf")
    kw = dict(threads=1, n_ctx=64, kv_type="f32")
    prompts = [moe_ref.sample_ids(7, seed=1), moe_ref.sample_ids(5, seed=2)]

    def alone(lora, prompt):
        with toy.load(gguf, lora=lora, **kw) as m:
            first = m.engine.prefill(0, prompt)
            return first, m.engine.decode([0], [7])[0]

    want = [alone(out, prompts[0]), alone(None, prompts[1])]
    assert np.abs(want[0][0] - alone(None, prompts[0])[0]).max() > 1.0
    with toy.load(gguf, adapters={"x": out}, n_slot=2, **kw) as m:
        eng = m.engine
        eng.slot_adapter[0] = m.adapter_index("x")
        got = [eng.prefill(s, p) for s, p in enumerate(prompts)]
        dec = eng.decode([0, 1], [7, 7])
    for s in range(2):
        np.testing.assert_allclose(got[s], want[s][0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(dec[s], want[s][1], rtol=0, atol=1e-5)


def test_missing_expert_refused(tmp_path):
    """Every expert of a targeted module needs its pair (llama.cpp's format
    stacks them all): an adapter without expert 3's down_proj is refused,
    naming it, and nothing is written."""
    shape = "qwen3moe-tiny"
    hf, gguf = moe_ref.hf_dir(shape), moe_ref.gguf_path(shape, 0, "f32")
    folder = _peft_adapter(hf, tmp_path / "peft", r".*\.experts\.(0|1|2|4|5|6|7)\.down_proj")
    with pytest.raises(
        PeftAdapterError, match=r"not for expert 3 \(model\.layers\.\d+\.mlp\.experts\.3\.down_proj"
    ) as e:
        import_peft(folder, gguf, tmp_path / "a.gguf")
    assert "ffn_down_exps" in str(e.value) and e.value.field.endswith("experts.3.down_proj")
    assert not (tmp_path / "a.gguf").exists()
