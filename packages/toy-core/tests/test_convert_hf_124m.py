"""124M-class imports: ``import_hf`` on seeded random Hugging Face folders of about GPT-2-small's size, for
the architectures whose tiny imports the other ``test_convert_hf_*`` modules check (llama and GPT-2 have
their own 124M-class cases there), equal to llama.cpp's converter tensor for tensor.

The point of the size: the row-block streaming splits every large tensor into many blocks here (a
38.6M-parameter embedding is ten 16 MB blocks), heads and experts cross block boundaries, and a layout bug
that a 64-wide model hides (a head permutation that happens to be symmetric, an expert stride) shows.
One folder at a time: made by transformers (float32, seeded), converted by the pinned
``convert_hf_to_gguf.py`` and by toy, compared, deleted.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from toy.convert import import_hf
from toy.gguf import GGUFFile
from toy_testsupport import gemma_ref, hf_llama_ref, moe_ref
from toy_testsupport.hf_checks import assert_same_gguf

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

# the converter's guesses from the folder name (general.name / basename / size label) are not toy's
NAMING = {"general.name", "general.basename", "general.size_label", "general.finetune", "general.version"}

_ATTN = dict(hidden_size=768, num_attention_heads=12, max_position_embeddings=1024)
CASES = {
    # GPT-2's vocabulary (50257) with a tied head: 38.6M embedding + 12 layers
    "qwen2": (
        "llama",
        dict(arch="qwen2", tie=True, **_ATTN, num_key_value_heads=4, intermediate_size=2048, num_hidden_layers=12),
    ),  # fmt: skip
    "qwen3": (
        "llama",
        dict(
            arch="qwen3",
            tie=True,
            **_ATTN,
            num_key_value_heads=4,
            intermediate_size=2048,
            num_hidden_layers=12,
            head_dim=64,
        ),
    ),  # fmt: skip
    # a 512-token SentencePiece vocabulary: the layers are the model
    "gemma2": (
        "gemma",
        dict(
            arch="gemma2",
            **_ATTN,
            head_dim=64,
            num_key_value_heads=4,
            intermediate_size=3072,
            num_hidden_layers=12,
            sliding_window=512,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        ),
    ),  # fmt: skip
    "gemma3": (
        "gemma",
        dict(
            arch="gemma3",
            **_ATTN,
            head_dim=64,
            num_key_value_heads=4,
            intermediate_size=3072,
            num_hidden_layers=12,
            sliding_window=512,
            final_logit_softcapping=None,
            tie_word_embeddings=True,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
        ),
    ),  # fmt: skip
    # 8 experts of width 384 in 8 layers, next to the untied 50257-token embedding and head
    "olmoe": (
        "moe",
        dict(moe_ref._OLMOE, **_ATTN, num_key_value_heads=12, intermediate_size=384, num_hidden_layers=8),
    ),  # fmt: skip
    "qwen2moe": (
        "moe",
        dict(
            moe_ref._QWEN2MOE,
            **_ATTN,
            num_key_value_heads=4,
            intermediate_size=2048,
            moe_intermediate_size=384,
            shared_expert_intermediate_size=768,
            num_hidden_layers=6,
        ),
    ),  # fmt: skip
    "qwen3moe": (
        "moe",
        dict(
            moe_ref._QWEN3MOE,
            **_ATTN,
            num_key_value_heads=4,
            head_dim=64,
            intermediate_size=2048,
            moe_intermediate_size=384,
            num_hidden_layers=8,
        ),
    ),  # fmt: skip
}


def _make(kind: str, out, fields: dict):
    fields = dict(fields)
    fields["max_position_embeddings"] = fields.get("max_position_embeddings", 1024)
    if kind == "llama":
        return hf_llama_ref.make_hf_llama(out, seed=5, **fields)
    arch = fields.pop("arch")
    if kind == "gemma":
        return gemma_ref.make_hf_gemma(out, arch=arch, seed=5, **fields)
    return moe_ref.make_hf_moe(out, arch=arch, seed=5, **fields)


def _n_params(path) -> int:
    with GGUFFile(path) as gf:
        return sum(int(np.prod(t.shape)) for t in gf.tensors.values())


@pytest.mark.parametrize("arch", list(CASES))
def test_124m_class_import_equals_the_converter(tmp_path, arch):
    kind, fields = CASES[arch]
    try:
        hf = _make(kind, tmp_path / "hf", fields)
        ref = hf_llama_ref.convert(hf, tmp_path / "ref.gguf", "f32")
        got = tmp_path / "toy.gguf"
        import_hf(hf, got, type="f32")
        shutil.rmtree(hf)
        n = _n_params(ref)
        assert 90e6 <= n <= 170e6, n  # the class this test is about
        assert_same_gguf(ref, got, skip_keys=NAMING, whole_file=False)  # the naming keys differ, so the files do
    finally:  # up to 1.8 GB of files: the test run keeps every tmp_path until the next runs
        shutil.rmtree(tmp_path, ignore_errors=True)
