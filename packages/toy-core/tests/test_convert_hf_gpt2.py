"""GPT-2 Hugging Face folder -> GGUF import (``toy.convert.import_hf`` with
``toy.models.gpt2_hf``'s table).

The references are independent of toy: ``toy_testsupport.gpt2_ref`` makes a
seeded random ``GPT2LMHeadModel`` with transformers and runs llama.cpp's own
``convert_hf_to_gguf.py`` (the pinned llama-cpp-python sdist) on it. The
import must equal the converter's file key for key (value and type) and
tensor for tensor (name, shape, type, bytes), and then byte for byte; toy's
greedy tokens on the import must be transformers' on the folder. A config
field toy's GPT-2 does not compute is refused naming the field, with
nothing written.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from toy.convert import HFImportError, import_hf
from toy.gguf import GGUFFile
from toy_testsupport import gpt2_ref, hf_llama_ref
from toy_testsupport.hf_checks import assert_same_gguf, edit_config

pytest.importorskip("transformers")

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tiny():
    return gpt2_ref.hf_dir("tiny")


@pytest.mark.parametrize("outtype", gpt2_ref.OUTTYPES)
def test_matches_llamacpp_converter(tiny, tmp_path, outtype):
    out = tmp_path / "toy.gguf"
    report = import_hf(tiny, out, outtype, name=gpt2_ref.MODEL_NAME)
    assert (report.arch, report.pre, report.tied) == ("gpt2", "gpt-2", True)
    assert_same_gguf(gpt2_ref.gguf_path("tiny", 0, outtype), out)


@pytest.mark.slow
def test_bf16_matches_llamacpp_converter(tiny, tmp_path):
    """gpt2_ref caches f32, f16 and q8_0 only: BF16 runs the converter here."""
    ref = hf_llama_ref.convert(tiny, tmp_path / "ref.gguf", "bf16")
    out = tmp_path / "toy.gguf"
    import_hf(tiny, out, "bf16", name=hf_llama_ref.MODEL_NAME)
    assert_same_gguf(ref, out)


@pytest.mark.slow
def test_untied_head_matches_llamacpp_converter(tmp_path):
    """An untied model: ``lm_head.weight`` becomes ``output.weight``."""
    folder = gpt2_ref.make_hf_gpt2(tmp_path / "hf", n_layer=1, n_embd=64, n_head=2, n_positions=32, seed=3, tie=False)
    ref = gpt2_ref.convert_to_gguf(folder, tmp_path / "ref.gguf", "q8_0")
    out = tmp_path / "toy.gguf"
    report = import_hf(folder, out, "q8_0", name=gpt2_ref.MODEL_NAME)
    assert not report.tied
    assert_same_gguf(ref, out)
    with GGUFFile(out) as f:
        assert "output.weight" in f.tensors


def test_toy_runs_the_import_like_transformers(tiny, tmp_path):
    import toy

    out = tmp_path / "toy.gguf"
    import_hf(tiny, out, "f32")
    ids = gpt2_ref.tokenize(tiny, PROMPT)
    want = gpt2_ref.hf_greedy(tiny, ids, 12)
    assert len(set(want)) > 4  # the reference is not one token repeated
    with toy.load(out, threads=2, n_ctx=64, kv_type="f32") as m:
        assert m.tokenize(PROMPT) == ids
        got = list(m.generate(ids, max_tokens=12, temperature=0, ignore_eos=True).tokens)
    assert got == want


@pytest.mark.slow
def test_small124m_matches_llamacpp_converter(tmp_path):
    """A 124M-class GPT-2 (12 layers, 768 wide), F32: the same file."""
    out = tmp_path / "toy.gguf"
    try:
        import_hf(gpt2_ref.hf_dir("small124m"), out, "f32", name=gpt2_ref.MODEL_NAME)
        assert_same_gguf(gpt2_ref.gguf_path("small124m", 0, "f32"), out)
    finally:  # 0.5 GB: the test run keeps every tmp_path until the next runs
        out.unlink(missing_ok=True)


def _linked_copy(src, dst, **changes):
    """``src`` with every file but config.json linked, and a copy of
    config.json edited (``edit_config``: ``...`` removes a key)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    shutil.copyfile(src / "config.json", dst / "config.json")
    return edit_config(dst, **changes)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"activation_function": "gelu"}, "activation_function"),
        ({"activation_function": "relu"}, "activation_function"),
        ({"n_inner": 100}, "n_inner"),
        ({"scale_attn_weights": False}, "scale_attn_weights"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ({"add_cross_attention": True}, "add_cross_attention"),
        ({"n_head": 5}, "n_head"),
        ({"n_layer": "2"}, "n_layer"),
        ({"n_embd": ...}, "n_embd"),
        ({"layer_norm_epsilon": -1.0}, "layer_norm_epsilon"),
    ],
)
def test_refused_config_fields(tiny, tmp_path, changes, field):
    folder = _linked_copy(tiny, tmp_path / "hf", **changes)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(HFImportError) as ei:
        import_hf(folder, out_dir / "m.gguf", "f32")
    assert ei.value.field == field
    assert field in str(ei.value) and ei.value.hint
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("changes", [{"n_inner": 256}, {"activation_function": "gelu_pytorch_tanh"}, {"n_ctx": ...}])
def test_accepted_config_spellings(tiny, tmp_path, changes):
    """``n_inner = 4 * n_embd``, transformers' other name of the tanh GELU,
    and no legacy ``n_ctx`` (the converter stops there; the context is then
    ``n_positions``, which the folder's ``n_ctx`` equals) describe the same
    model: the same file as the converter's of the folder as it was."""
    folder = _linked_copy(tiny, tmp_path / "hf", **changes)
    out = tmp_path / "toy.gguf"
    import_hf(folder, out, "f32", name=gpt2_ref.MODEL_NAME)
    assert_same_gguf(gpt2_ref.gguf_path("tiny", 0, "f32"), out)


def _with_tensors(src, dst, tensors):
    """``src`` with every file but model.safetensors linked, and
    model.safetensors holding ``tensors``."""
    from safetensors.numpy import save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).symlink_to(f)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _mask_buffers(tensors, prefix="transformer."):
    """The causal-mask buffers older GPT-2 checkpoints saved with each block."""
    n_pos = tensors[f"{prefix}wpe.weight"].shape[0]
    out = dict(tensors)
    for i in range(2):
        out[f"{prefix}h.{i}.attn.bias"] = np.tril(np.ones((n_pos, n_pos), np.float32))[None, None]
        out[f"{prefix}h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    return out


def test_attention_mask_buffers_are_skipped(tiny, tmp_path):
    """Older checkpoints also hold each block's causal-mask buffers
    (``attn.bias``, ``attn.masked_bias``): they are not weights, and the
    import equals the converter's file of the folder without them."""
    folder = _with_tensors(tiny, tmp_path / "hf", _mask_buffers(gpt2_ref.hf_state_dict(tiny)))
    out = tmp_path / "toy.gguf"
    import_hf(folder, out, "f32", name=gpt2_ref.MODEL_NAME)
    assert_same_gguf(gpt2_ref.gguf_path("tiny", 0, "f32"), out)


@pytest.mark.slow
def test_gpt2model_checkpoint_matches_llamacpp_converter(tiny, tmp_path):
    """A checkpoint saved from the bare ``GPT2Model``, as OpenAI's own
    ``gpt2`` folders are: names without ``transformer.``, mask buffers
    included. The converter reads the same names (it stops at the buffers,
    so it converts the folder without them)."""
    bare = {k.removeprefix("transformer."): v for k, v in gpt2_ref.hf_state_dict(tiny).items()}
    assert "wte.weight" in bare and "lm_head.weight" not in bare
    ref = gpt2_ref.convert_to_gguf(_with_tensors(tiny, tmp_path / "ref-hf", bare), tmp_path / "ref.gguf", "f16")
    folder = _with_tensors(tiny, tmp_path / "hf", _mask_buffers(bare, prefix=""))
    out = tmp_path / "toy.gguf"
    import_hf(folder, out, "f16", name=gpt2_ref.MODEL_NAME)
    assert_same_gguf(ref, out)
