"""RoPE scaling through the Hugging Face import and export
(``toy.models.rope_hf``; linear, YaRN, llama3).

References, independent of toy: llama.cpp's ``convert_hf_to_gguf.py`` of the
pinned sdist (``hf_llama_ref.convert``) on seeded transformers folders with
each ``rope_scaling`` -- its ``{arch}.rope.scaling.*`` keys (order, values,
types) and its llama3 ``rope_freqs.weight`` bytes; the converter's own
``LlamaModel.generate_extra_tensors`` run on a grid of llama3 configs; and
transformers' forward on the folders, at positions beyond the original
context where the scaling matters.

Tolerances: toy's F32 logits vs transformers' within 2e-4 on an import (the
existing import test's) and 1e-4 on an export (the export tests'). llama3's
divisors equal the converter's bytes on Llama 3.1/3.2's configurations; on
a grid of other configurations a few divisors of the blend band differ by
at most 1e-6 relative, where torch's float32 ``pow`` (SLEEF) is not
correctly rounded (``rope_hf``'s docstring) -- the grid test bounds that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from toy.gguf import GGUFFile
from toy.models.hf import HFMappingError
from toy.models.rope_hf import llama3_freq_factors, rope_extra_tensors, rope_metadata_from_hf, rope_scaling_to_hf
from toy_testsupport import gpt2_ref, hf_llama_ref
from toy_testsupport.hf_checks import assert_same_gguf

pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_SMALL = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0}  # fmt: skip
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}  # fmt: skip
LLAMA32 = dict(LLAMA31, factor=32.0)
#: tag -> (architecture, config fields); rope_theta 100 puts llama3's blend band inside a tiny head (16 dims)
CASES = {
    "linear": ("llama", dict(SMALL, rope_scaling={"type": "linear", "factor": 4.0})),
    "yarn": ("llama", dict(SMALL, rope_scaling=YARN)),
    "yarn-qwen2": (
        "qwen2",
        dict(SMALL, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ),
    "llama3": ("llama", dict(SMALL, rope_theta=100.0, rope_scaling=LLAMA3_SMALL)),
    # Llama 3.1 8B's and 3.2 1B's RoPE (head sizes 128 and 64, base 500000) on a one-head model
    "llama3.1": (
        "llama",
        dict(
            hidden_size=128,
            num_attention_heads=1,
            num_key_value_heads=1,
            rope_theta=500000.0,
            max_position_embeddings=131072,
            rope_scaling=LLAMA31,
        ),
    ),
    "llama3.2": (
        "llama",
        dict(
            hidden_size=64,
            num_attention_heads=1,
            num_key_value_heads=1,
            rope_theta=500000.0,
            max_position_embeddings=131072,
            rope_scaling=LLAMA32,
        ),
    ),
}
#: 100 tokens: positions up to 99, beyond the original context of 64
IDS = [(7 * i * i + 13 * i + 464) % 50000 for i in range(100)]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """``case(tag)``: (architecture, the HF folder, llama.cpp's F32 conversion of it), built once each."""
    root = tmp_path_factory.mktemp("rope")
    cache: dict[str, tuple] = {}

    def get(tag: str):
        if tag not in cache:
            arch, fields = CASES[tag]
            folder = hf_llama_ref.make_hf_llama(root / tag, arch=arch, seed=3, **fields)
            cache[tag] = (arch, folder, hf_llama_ref.convert(folder, root / f"{tag}.gguf", "f32"))
        return cache[tag]

    return get


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text(encoding="utf-8"))


def _scaling_keys(gf, arch: str) -> list[tuple[str, object, str]]:
    return [
        (k, v, gf.types[k].type.name.lower()) for k, v in gf.metadata.items() if k.startswith(f"{arch}.rope.scaling.")
    ]


def _freqs(gf) -> np.ndarray:
    return np.frombuffer(bytes(gf.tensor_bytes("rope_freqs.weight")), dtype=np.float32)


# ------------------------------------------------------------------ import, unit level (vs the converter)


@pytest.mark.slow
@pytest.mark.parametrize("tag", list(CASES))
def test_scaling_keys_and_rope_freqs_equal_the_converters(case, tag):
    arch, folder, ref = case(tag)
    config = _config(folder)
    with GGUFFile(ref) as gf:
        want = _scaling_keys(gf, arch)
        got = [(k, v, t) for k, v, t in rope_metadata_from_hf(arch, config)]
        assert [(k, t) for k, _, t in got] == [(k, t) for k, _, t in want]
        for (k, v, t), (_, w, _) in zip(got, want, strict=True):
            assert (np.float32(v) == np.float32(w)) if t == "float32" else (v == w), k
        extra = rope_extra_tensors(arch, config)
        if "rope_freqs.weight" in gf.tensors:
            assert next(iter(gf.tensors)) == "rope_freqs.weight"  # the converter writes it first
            assert [n for n, _ in extra] == ["rope_freqs.weight"]
            assert extra[0][1].dtype == np.float32
            assert extra[0][1].tobytes() == bytes(gf.tensor_bytes("rope_freqs.weight"))
        else:
            assert extra == []


_CONVERTER_GRID = textwrap.dedent(
    """
    import itertools, sys, types
    import numpy as np
    import gguf
    from conversion.llama import LlamaModel

    out, params = {}, []
    grid = itertools.product([10000.0, 500000.0, 1e6, 100.0], [16, 32, 64, 96, 128, 256], [4.0, 8.0, 32.0],
                             [(1.0, 4.0), (2.0, 8.0), (1.5, 3.0)], [64, 100, 2048, 5000, 8192])
    for base, dim, factor, (low, high), orig in grid:
        stub = types.SimpleNamespace(
            rope_parameters={"rope_type": "llama3", "rope_theta": base, "factor": factor, "low_freq_factor": low,
                             "high_freq_factor": high, "original_max_position_embeddings": orig},
            hparams={"head_dim": dim},
            format_tensor_name=lambda t: gguf.TENSOR_NAMES[t] + ".weight",
        )
        (name, t), = LlamaModel.generate_extra_tensors(stub)
        assert name == "rope_freqs.weight"
        out[f"f{len(params)}"] = t.numpy()
        params.append((base, dim, factor, low, high, orig))
    np.savez(sys.argv[1], params=np.array(params, dtype=np.float64), **out)
    """
)


@pytest.mark.slow
def test_llama3_divisors_follow_the_converters_arithmetic(tmp_path):
    """The converter's own llama3 code (LlamaModel.generate_extra_tensors) on
    a grid of 1080 configurations: equal bytes but for a few divisors of the
    blend band, off by at most 1e-6 relative (torch's pow, module docstring;
    measured: 15 of 5484, at most 6.6e-7; a power-of-two original context
    hides some arithmetic, hence 100 and 5000 too)."""
    lcpp = gpt2_ref.llama_cpp_dir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(lcpp), str(lcpp / "gguf-py")]))
    out = tmp_path / "grid.npz"
    subprocess.run([sys.executable, "-c", _CONVERTER_GRID, str(out)], env=env, check=True, cwd=tmp_path)
    off = blended = 0
    with np.load(out) as ref:
        params = ref["params"]
        assert params.shape == (1080, 6)
        for i, (base, dim, factor, low, high, orig) in enumerate(params.tolist()):
            key = (base, dim, factor, low, high, orig)
            want = ref[f"f{i}"]
            got = llama3_freq_factors(base, int(dim), factor, low, high, orig)
            assert got.dtype == np.float32 and got.shape == want.shape
            band = (want != 1) & (want != np.float32(factor))
            assert np.array_equal(got[~band], want[~band]), key  # 1 and factor exactly, and the same bands
            rel = np.abs(got.astype(np.float64) - want) / want
            assert rel.max() <= 1e-6, key
            off += int(np.count_nonzero(got != want))
            blended += int(np.count_nonzero(band))
    assert blended > 3000 and off <= blended // 100


# ------------------------------------------------------------------ refusals


def _refused(config: dict, field: str, arch: str = "llama") -> HFMappingError:
    with pytest.raises(HFMappingError) as e:
        rope_metadata_from_hf(arch, config)
    assert e.value.field == field, (e.value.field, str(e.value))
    assert e.value.hint
    return e.value


@pytest.mark.parametrize(
    "scaling, field",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type"),
        ({"type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type"),
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "rope_scaling.rope_type"),
        ({"type": "su", "short_factor": [1.0], "long_factor": [2.0]}, "rope_scaling.rope_type"),
        ({"rope_type": "ntk-by-parts", "factor": 2.0}, "rope_scaling.rope_type"),
        ({"rope_type": 3}, "rope_scaling.rope_type"),
        ({"rope_type": "linear"}, "rope_scaling.factor"),
        ({"rope_type": "linear", "factor": "4"}, "rope_scaling.factor"),
        ({"rope_type": "linear", "factor": 0.0}, "rope_scaling.factor"),
        ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.2}, "rope_scaling.attention_factor"),
        ({"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5}, "rope_scaling.mscale"),
        ({"rope_type": "yarn", "factor": 4.0, "truncate": False}, "rope_scaling.truncate"),
        ({"rope_type": "yarn", "factor": 4.0, "extrapolation_factor": 0.5}, "rope_scaling.extrapolation_factor"),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64.5},
            "rope_scaling.original_max_position_embeddings",
        ),  # fmt: skip
        ({k: v for k, v in LLAMA3_SMALL.items() if k != "low_freq_factor"}, "rope_scaling.low_freq_factor"),
        (dict(LLAMA3_SMALL, high_freq_factor=1.0), "rope_scaling.high_freq_factor"),
        ("linear", "rope_scaling"),
    ],
)
def test_unsupported_scaling_is_refused_naming_the_field(scaling, field):
    _refused({"rope_scaling": scaling, "max_position_embeddings": 256, "hidden_size": 64,
              "num_attention_heads": 4}, field)  # fmt: skip


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen2moe", "qwen3moe", "olmoe"])
def test_llama3_outside_llama_is_refused(arch):
    """llama.cpp's converter computes rope_freqs.weight for llama only; for
    the others it drops the scaling, which would be another model."""
    e = _refused({"rope_scaling": LLAMA3_SMALL, "hidden_size": 64, "num_attention_heads": 4},
                 "rope_scaling.rope_type", arch)  # fmt: skip
    assert "llama3" in str(e)


def test_no_scaling_writes_nothing():
    for config in ({}, {"rope_scaling": None}, {"rope_scaling": {"rope_type": "default"}},
                   {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}):  # fmt: skip
        assert rope_metadata_from_hf("llama", config) == []
        assert rope_extra_tensors("llama", config) == []


def test_yarn_without_original_context_takes_max_position_embeddings():
    """transformers' fallback; llama.cpp's converter stops on such a config."""
    got = rope_metadata_from_hf("qwen2", {"rope_scaling": {"type": "yarn", "factor": 2.0},
                                          "max_position_embeddings": 4096})  # fmt: skip
    assert got == [
        ("qwen2.rope.scaling.type", "yarn", "string"),
        ("qwen2.rope.scaling.factor", 2.0, "float32"),
        ("qwen2.rope.scaling.original_context_length", 4096, "uint32"),
    ]


# ------------------------------------------------------------------ export, unit level


@pytest.mark.slow
@pytest.mark.parametrize("tag", list(CASES))
def test_export_recovers_the_configs_rope_scaling(case, tag):
    """From llama.cpp's file (llama3: the rope_freqs.weight alone, as the
    converter writes no keys for it), config.json's rope_scaling comes back."""
    from toy import models

    arch, folder, ref = case(tag)
    scaling = _config(folder)["rope_scaling"]
    want = {k: v for k, v in scaling.items() if k != "type"}
    want["rope_type"] = scaling.get("rope_type", scaling.get("type"))
    with GGUFFile(ref) as gf:
        cfg = models.config_from_gguf(gf)
        freqs = _freqs(gf) if "rope_freqs.weight" in gf.tensors else None
        got = rope_scaling_to_hf(arch, cfg, gf.metadata, freqs)
    if want["rope_type"] == "yarn":  # the export states YaRN's defaults
        want = {"beta_fast": 32.0, "beta_slow": 1.0, **want}
    assert got == want


def _llama3_cfg(dims=16, base=100.0):
    from toy.models.llama import LlamaConfig

    return LlamaConfig(n_vocab=8, d_model=64, n_layer=1, n_head=4, n_head_kv=2, head_dim=dims, d_ff=8,
                       rms_eps=1e-5, rope_base=base, rope_dims=dims, rope_mode="normal", tied_output=True,
                       context_length=256, rope_scaling="llama3")  # fmt: skip


def test_export_refuses_llama3_divisors_it_cannot_recover_exactly():
    freqs = llama3_freq_factors(100.0, 16, 8.0, 1.0, 4.0, 64)
    assert rope_scaling_to_hf("llama", _llama3_cfg(), {}, freqs)["original_max_position_embeddings"] == 64
    bent = freqs.copy()
    band = np.nonzero((freqs != 1) & (freqs != 8))[0]
    bent[band[0]] *= np.float32(1.01)  # no llama3 parameters give this
    with pytest.raises(HFMappingError) as e:
        rope_scaling_to_hf("llama", _llama3_cfg(), {}, bent)
    assert e.value.field == "rope_freqs.weight"
    with pytest.raises(HFMappingError) as e:
        rope_scaling_to_hf("llama", _llama3_cfg(), {}, None)
    assert e.value.field == "rope_freqs.weight"


def test_export_writes_the_factor_config_json_had():
    """GGUF keeps factors as float32 (3.3 is 3.2999999523...); the export
    writes the shortest decimal that reads back as that float32."""
    import dataclasses

    for kind in ("linear", "yarn"):
        (key, f, _), *_ = [e for e in rope_metadata_from_hf("llama", {"rope_scaling": {"rope_type": kind,
                           "factor": 3.3}, "max_position_embeddings": 64}) if e[0].endswith(".factor")]  # fmt: skip
        stored = float(np.float32(f))
        cfg = dataclasses.replace(_llama3_cfg(), rope_scaling=kind, rope_freq_scale=1.0 / stored, yarn_ext_factor=1.0)
        assert rope_scaling_to_hf("llama", cfg)["factor"] == 3.3
        assert rope_scaling_to_hf("llama", cfg, {key: stored})["factor"] == 3.3


def test_export_refuses_what_transformers_cannot_express():
    import dataclasses

    yarn = dataclasses.replace(
        _llama3_cfg(), rope_scaling="yarn", rope_freq_scale=0.25, rope_orig_ctx=64, yarn_ext_factor=1.0
    )
    assert rope_scaling_to_hf("llama", yarn)["factor"] == 4.0
    for change, field in (
        (dict(yarn_ext_factor=0.5), "llama.rope.scaling.yarn_ext_factor"),
        (dict(rope_attn_factor=2.0), "llama.rope.scaling.attn_factor"),
        (dict(rope_scaling="longrope"), "llama.rope.scaling.type"),
    ):
        with pytest.raises(HFMappingError) as e:
            rope_scaling_to_hf("llama", dataclasses.replace(yarn, **change))
        assert e.value.field == field


# ------------------------------------------------------------------ through the import and export engines


@pytest.mark.slow
@pytest.mark.parametrize("tag", list(CASES))
def test_import_equals_the_converters_file(case, tmp_path, tag):
    from toy.convert import import_hf

    _, folder, ref = case(tag)
    out = tmp_path / "toy.gguf"
    import_hf(folder, out, "f32", name=hf_llama_ref.MODEL_NAME)
    assert_same_gguf(ref, out)


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_llama3_import_keeps_rope_freqs_f32_like_the_converter(case, tmp_path, outtype):
    from toy.convert import import_hf

    _, folder, _ = case("llama3")
    ref = hf_llama_ref.convert(folder, tmp_path / "ref.gguf", outtype)
    out = tmp_path / "toy.gguf"
    import_hf(folder, out, outtype, name=hf_llama_ref.MODEL_NAME)
    with GGUFFile(ref) as gf:
        assert gf.tensors["rope_freqs.weight"].dtype.name == "F32"
    assert ref.read_bytes() == out.read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["linear", "yarn", "yarn-qwen2", "llama3"])
def test_toy_runs_the_import_like_transformers_beyond_the_original_context(case, tmp_path, tag):
    import toy
    from toy.convert import import_hf

    _, folder, _ = case(tag)
    out = tmp_path / "toy.gguf"
    import_hf(folder, out, "f32")
    hf = gpt2_ref.load_causal_lm(folder)
    want = gpt2_ref.model_logits(hf, IDS, threads=2)
    with toy.load(out, threads=2, n_ctx=128, kv_type="f32") as m:
        got = np.asarray(m.logits(IDS), np.float32)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    # the scaling matters here: unscaled RoPE would be far off beyond position 64
    unscaled = gpt2_ref.model_logits(gpt2_ref.load_causal_lm(folder, rope_scaling=None), IDS, threads=2)
    assert np.abs(unscaled[64:] - want[64:]).max() > 100 * 2e-4


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["llama3", "yarn", "yarn-qwen2", "linear"])
def test_export_loads_in_transformers_with_toys_logits(case, tmp_path, tag):
    import torch
    import transformers

    import toy
    from toy.convert.hf_export import export_hf

    _, folder, ref = case(tag)
    dest = tmp_path / "hf"
    export_hf(ref, dest)
    config = _config(dest)
    assert config["rope_scaling"]["rope_type"] == tag.split("-")[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        want = model(torch.tensor([IDS])).logits[0].numpy()
    with toy.load(ref, threads=2, n_ctx=128, kv_type="f32") as m:
        got = np.asarray(m.logits(IDS), np.float32)
    np.testing.assert_allclose(want, got, atol=1e-4, rtol=0)
