"""Hugging Face mixture-of-experts folders -> GGUF (``toy.convert.import_hf``):
OLMoE, Qwen2-MoE and Qwen3-MoE.

References, independent of the importer: the seeded random transformers
folders of ``toy_testsupport.moe_ref`` and llama.cpp's own
``convert_hf_to_gguf.py`` (the pinned sdist) on them (``moe_ref.gguf_path``
for f32, f16 and q8_0; ``hf_llama_ref.convert`` for bf16, which moe_ref's
cache does not hold): the per-expert Hugging Face matrices stacked into the
3-D ``ffn_{gate,up,down}_exps`` where the converter places them, the router
and the shared expert's gate F32, every metadata key, every tensor's bytes
(the whole file). transformers' forward on the folder gives the greedy
tokens toy gives on the import.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from toy.convert import HFImportError, import_hf
from toy_testsupport import hf_llama_ref, moe_ref
from toy_testsupport.hf_checks import assert_nothing_written, assert_same_gguf, converted_once, edit_config

pytest.importorskip("transformers")

SHAPES = ("olmoe-tiny", "qwen2moe-tiny", "qwen3moe-tiny")
IDS = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]


@pytest.fixture(scope="module")
def bf16_reference(tmp_path_factory):
    """llama.cpp's converter with ``--outtype bf16`` on a moe_ref folder (once per shape)."""
    return converted_once(tmp_path_factory.mktemp("moe-bf16"), moe_ref.hf_dir, "bf16")


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_llamacpp_converter(bf16_reference, tmp_path, shape, outtype):
    arch = moe_ref.SHAPES[shape]["arch"]
    out = tmp_path / "toy.gguf"
    if outtype == "bf16":
        ref, name = bf16_reference(shape), hf_llama_ref.MODEL_NAME
    else:
        ref, name = moe_ref.gguf_path(shape, 0, outtype), moe_ref.MODEL_NAME
    report = import_hf(moe_ref.hf_dir(shape), out, outtype, name=name)
    assert report.arch == arch and not report.tied
    assert_same_gguf(ref, out)


@pytest.mark.slow
@pytest.mark.parametrize("block_bytes", [1, 1000])
def test_experts_streamed_in_row_blocks_match_the_converter(tmp_path, monkeypatch, block_bytes):
    """Each expert's matrix goes in blocks of rows (one row; a few rows) into
    the stacked tensor: the file is still the converter's."""
    import toy.convert.hf_import as hi

    monkeypatch.setattr(hi, "BLOCK_BYTES", block_bytes)
    out = tmp_path / "toy.gguf"
    import_hf(moe_ref.hf_dir("qwen2moe-tiny"), out, "q8_0", name=moe_ref.MODEL_NAME)
    assert_same_gguf(moe_ref.gguf_path("qwen2moe-tiny", 0, "q8_0"), out)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_toy_runs_the_import_like_transformers(tmp_path, shape):
    """toy on the imported F32 file: transformers' greedy tokens and logits."""
    import toy

    folder = moe_ref.hf_dir(shape)
    out = tmp_path / "toy.gguf"
    import_hf(folder, out, "f32")
    want_greedy = moe_ref.hf_greedy(folder, IDS, 8)
    want_logits = moe_ref.hf_logits(folder, IDS)
    with toy.load(out, threads=2, n_ctx=64, kv_type="f32") as m:
        got_logits = np.asarray(m.logits(IDS), np.float32)
        got_greedy = list(m.generate(IDS, max_tokens=8, temperature=0, ignore_eos=True).tokens)
    assert got_greedy == want_greedy
    np.testing.assert_allclose(got_logits, want_logits, atol=5e-4, rtol=0)


# ------------------------------------------------------------------ refusals


def _copy_with_config(tmp_path, shape: str, **changes):
    folder = edit_config(shutil.copytree(moe_ref.hf_dir(shape), tmp_path / "hf"), **changes)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    return folder, out_dir / "m.gguf"


@pytest.mark.parametrize(
    ("shape", "changes", "field"),
    [
        ("qwen2moe-tiny", {"norm_topk_prob": True}, "norm_topk_prob"),  # llama.cpp's qwen2moe never renormalises
        ("qwen3moe-tiny", {"norm_topk_prob": False}, "norm_topk_prob"),  # ... qwen3moe always does
        ("qwen3moe-tiny", {"mlp_only_layers": [1]}, "mlp_only_layers"),
        ("qwen2moe-tiny", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ("olmoe-tiny", {"clip_qkv": 8.0}, "clip_qkv"),
        ("qwen3moe-tiny", {"num_experts": 4}, "model.layers.0.mlp.experts.4.down_proj.weight"),
        ("qwen3moe-tiny", {"moe_intermediate_size": 16}, "model.layers.0.mlp.experts.0.down_proj.weight"),
    ],
)
def test_moe_configs_toy_would_run_differently_are_refused(tmp_path, shape, changes, field):
    folder, out = _copy_with_config(tmp_path, shape, **changes)
    with pytest.raises(HFImportError) as ei:
        import_hf(folder, out, "f32")
    assert ei.value.field == field, str(ei.value)
    assert ei.value.hint
    assert_nothing_written(out)


def test_a_missing_expert_is_named(tmp_path):
    """A checkpoint that lacks one expert's matrix: the error names it (the
    stacked tensor cannot be assembled)."""
    from safetensors.numpy import load_file, save_file

    folder, out = _copy_with_config(tmp_path, "olmoe-tiny")
    st = folder / "model.safetensors"
    tensors = load_file(st)
    gone = "model.layers.1.mlp.experts.5.up_proj.weight"
    del tensors[gone]
    save_file(tensors, st, metadata={"format": "pt"})
    with pytest.raises(HFImportError) as ei:
        import_hf(folder, out, "f32")
    assert ei.value.field == gone and "blk.1.ffn_up_exps.weight" in str(ei.value)
    assert_nothing_written(out)
