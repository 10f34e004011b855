"""PEFT LoRA adapters <-> toy adapter GGUFs (``toy.convert.peft``), checked
against PEFT itself: an adapter trained a few steps with PEFT on a seeded
random HF llama (base turned into GGUF by llama.cpp's own converter), imported,
gives toy logits equal to PEFT's; a toy adapter exported loads in
``PeftModel.from_pretrained`` and gives PEFT logits equal to toy's; a round
trip gives the same bytes; the cases other converters get wrong are refused
with errors naming the field or tensor, and nothing is written at OUT.

Tolerance (llama): toy runs the model in F32 (ggml, KV cache F32) and torch in F32;
logits agree to ``2e-4 * max|logit| + 1e-5`` while the adapter moves them by
far more than that (checked, so a missing or mis-scaled adapter fails)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from toy.adapters import AdapterError  # noqa: E402
from toy.convert.peft import PeftAdapterError, export_peft, import_peft  # noqa: E402
from toy_testsupport import gpt2_ref  # noqa: E402
from toy_testsupport.hf_checks import torch_logits as _torch_logits  # noqa: E402
from toy_testsupport.hf_checks import toy_logits as _toy_logits  # noqa: E402
from toy_testsupport.train_helpers import seeded_adapter  # noqa: E402

IDS = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13, 50256, 11, 314]
# toy's GPT-2 uses ggml's float16 GELU table (as llama.cpp does): its logits sit
# 1.4e-3 .. 2e-3 from HF's on the tiny model with or without an adapter; the
# bound of test_gpt2_inference (GELU_TOL, tiny) applies
GPT2_GELU_TOL = 5e-3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tol(ref: np.ndarray) -> float:
    return 2e-4 * float(np.abs(ref).max()) + 1e-5


def _make_llama(out: Path, seed: int = 0, arch: str = "llama", **fields) -> Path:
    import torch
    import transformers

    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix}ForCausalLM")

    shape = dict(
        vocab_size=gpt2_ref.N_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=50256,
        eos_token_id=50256,
        head_dim=16,
    )
    cfg = config_cls(**{**shape, **fields})
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.1 if p.shape[0] == cfg.vocab_size else 1.6 / p.shape[-1] ** 0.5))
    model.save_pretrained(out, safe_serialization=True)
    gpt2_ref.gpt2_tokenizer_files(out)
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    hf = _make_llama(root / "hf")
    gguf = gpt2_ref.convert_to_gguf(hf, root / "base.gguf", "f32")
    return hf, gguf


def _hf(hf_dir):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _train_peft(hf_dir, out: Path, *, targets, steps=4, seed=1, **lora) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model

    model = _hf(hf_dir)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, **lora)
    pm = get_peft_model(model, cfg)
    opt = torch.optim.Adam([p for p in pm.parameters() if p.requires_grad], lr=2e-2)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
    for _ in range(steps):
        loss = pm(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    pm.save_pretrained(out)
    return out


def _peft_logits(hf_dir, folder, ids) -> np.ndarray:
    return _torch_logits(_peft_model(hf_dir, folder), ids)


@pytest.mark.parametrize("rslora", [False, True])
def test_peft_trained_adapter_imported_gives_peft_logits(llama, tmp_path, rslora):
    hf, gguf = llama
    folder = _train_peft(hf, tmp_path / "peft", targets=TARGETS, use_rslora=rslora)
    out = import_peft(folder, gguf, tmp_path / "a.gguf")
    want = _peft_logits(hf, folder, IDS)
    base = _toy_logits(gguf, IDS)
    got = _toy_logits(gguf, IDS, lora=out)
    tol = _tol(want)
    assert np.abs(base - want).max() > 50 * tol  # the adapter matters
    assert np.abs(got - want).max() <= tol


def test_rank_and_alpha_patterns(llama, tmp_path):
    """Per-module ranks and alphas (PEFT's rank_pattern / alpha_pattern) with
    rsLoRA: one file alpha cannot express every module's scale, so the ratio
    goes into those modules' lora_b; an export writes the ranks back."""
    hf, gguf = llama
    folder = _train_peft(
        hf,
        tmp_path / "peft",
        targets=TARGETS,
        use_rslora=True,
        rank_pattern={"q_proj": 2, "down_proj": 6},
        alpha_pattern={"v_proj": 32},
    )
    out = import_peft(folder, gguf, tmp_path / "a.gguf")
    want = _peft_logits(hf, folder, IDS)
    got = _toy_logits(gguf, IDS, lora=out)
    assert np.abs(got - want).max() <= _tol(want)
    again = export_peft(out, tmp_path / "again", base=gguf)
    cfg = json.loads((again / "adapter_config.json").read_text())
    assert cfg["rank_pattern"] == {
        f"model.layers.{i}.{m}": r for i in (0, 1) for m, r in [("self_attn.q_proj", 2), ("mlp.down_proj", 6)]
    }
    assert np.abs(_peft_logits(hf, again, IDS) - want).max() <= _tol(want)
    assert import_peft(again, gguf, tmp_path / "b.gguf").read_bytes() == out.read_bytes()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_adapters_both_ways(tmp_path, arch):
    """No Q/K row permutation for these (the converter keeps HF's order); qwen2
    has Q/K/V biases, qwen3 per-head Q/K norms, both untouched by LoRA."""
    hf = _make_llama(tmp_path / "hf", seed=2, arch=arch)
    gguf = gpt2_ref.convert_to_gguf(hf, tmp_path / "base.gguf", "f32")
    folder = _train_peft(hf, tmp_path / "peft", targets=TARGETS)
    out = import_peft(folder, gguf, tmp_path / "a.gguf")
    want = _peft_logits(hf, folder, IDS)
    tol = _tol(want)
    assert np.abs(_toy_logits(gguf, IDS) - want).max() > 50 * tol
    assert np.abs(_toy_logits(gguf, IDS, lora=out) - want).max() <= tol
    again = export_peft(out, tmp_path / "again", base=gguf)
    assert np.abs(_peft_logits(hf, again, IDS) - want).max() <= tol
    assert import_peft(again, gguf, tmp_path / "b.gguf").read_bytes() == out.read_bytes()


def test_toy_adapter_exported_loads_in_peft_and_round_trips(llama, tmp_path):
    hf, gguf = llama
    targets = ["q", "k", "v", "o", "gate", "up", "down"]
    ad = seeded_adapter(
        gguf, tmp_path / "toy.gguf", seed=3, rank=4, alpha=8.0, targets=targets, std=0.2, base_name="base.gguf"
    )
    folder = export_peft(ad, tmp_path / "peft", base=gguf)
    want = _toy_logits(gguf, IDS, lora=ad)
    got = _peft_logits(hf, folder, IDS)
    tol = _tol(want)
    assert np.abs(_toy_logits(gguf, IDS) - want).max() > 50 * tol
    assert np.abs(got - want).max() <= tol
    back = import_peft(folder, gguf, tmp_path / "back.gguf")
    assert back.read_bytes() == Path(ad).read_bytes()
    assert json.loads((folder / "adapter_config.json").read_text())["fan_in_fan_out"] is False
    # without the base, the Q/K row order of llama cannot be undone: refused, naming the weight
    with pytest.raises(AdapterError, match=r"blk\.0\.attn_[qk]\.weight") as e:
        export_peft(ad, tmp_path / "nobase")
    assert "--base" in e.value.hint and not (tmp_path / "nobase").exists()


def test_gpt2_fused_c_attn(tmp_path):
    hf, gguf = gpt2_ref.hf_dir("tiny"), gpt2_ref.gguf_path("tiny")
    folder = _train_peft(hf, tmp_path / "peft", targets=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    out = import_peft(folder, gguf, tmp_path / "a.gguf")
    ids = IDS[:8]
    want = _peft_logits(hf, folder, ids)
    got = _toy_logits(gguf, ids, lora=out)
    tol = GPT2_GELU_TOL
    assert np.abs(_toy_logits(gguf, ids) - want).max() > 10 * tol
    assert np.abs(got - want).max() <= tol
    again = export_peft(out, tmp_path / "again")  # no base: the family's example config tells the Conv1D
    assert json.loads((again / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    assert import_peft(again, gguf, tmp_path / "b.gguf").read_bytes() == out.read_bytes()


@pytest.mark.parametrize("shape", ["gemma2-tiny", "gemma3-tiny-untied"])
def test_gemma_adapters_both_ways(tmp_path, shape):
    """Gemma's modules are llama's names (no row reordering). toy runs GELU
    through ggml's float16 table as llama.cpp does, which alone moves its
    logits from HF's by a few 1e-3 (test_gemma.py); with the adapter toy
    stays within 3x that of PEFT's logits, which the adapter moves by >100x."""
    from toy_testsupport import gemma_ref

    hf, gguf = gemma_ref.hf_dir(shape, 0), gemma_ref.gguf_path(shape, 0, "f32")
    ids = [2] + [int(t) for t in np.random.default_rng(0).integers(8, gemma_ref.sp_vocab_size(), 15)]  # BOS, text
    folder = _train_peft(hf, tmp_path / "peft", targets=TARGETS, steps=3)
    out = import_peft(folder, gguf, tmp_path / "a.gguf")
    want = _peft_logits(hf, folder, ids)
    base = _toy_logits(gguf, ids)
    table = float(np.abs(base - _torch_logits(_hf(hf), ids)).max())  # the GELU table's own effect, no adapter
    assert table < 1e-2  # measured 3.6e-3 (gemma2, soft-capped), 6.2e-3 (gemma3)
    moved = float(np.abs(base - want).max())  # measured 3.6 and 5.4
    assert moved > 100 * table  # the adapter matters far more than the table
    # with the adapter: measured 0.8x (gemma2) and 1.4x (gemma3) the table's effect; a 1% error in the
    # adapter's scale alone would be ~0.05
    assert np.abs(_toy_logits(gguf, ids, lora=out) - want).max() <= 3 * table
    again = export_peft(out, tmp_path / "again")
    assert import_peft(again, gguf, tmp_path / "b.gguf").read_bytes() == out.read_bytes()


def _llamacpp_convert_lora(peft_dir: Path, hf_base: Path, out: Path) -> Path:
    """llama.cpp's own convert_lora_to_gguf.py (the pinned sdist's) on a PEFT folder, F32."""
    import os
    import subprocess
    import sys
    import tarfile

    script = out.parent / "convert_lora_to_gguf.py"
    with tarfile.open(gpt2_ref._sdist(), "r:gz") as tar:
        src = tar.extractfile(gpt2_ref._PREFIX + "convert_lora_to_gguf.py")
        assert src is not None
        script.write_bytes(src.read())
    lcpp = gpt2_ref.llama_cpp_dir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(lcpp / "gguf-py"), str(lcpp)])
    cmd = [
        sys.executable,
        str(script),
        str(peft_dir),
        "--base",
        str(hf_base),
        "--outfile",
        str(out),
        "--outtype",
        "f32",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_moe_router_adapted_experts_incomplete_refused(tmp_path):
    """qwen3moe: PEFT's ``mlp.gate`` (the router) becomes ``ffn_gate_inp``'s
    pair; an adapter of the experts imports as 3-D ``ffn_*_exps`` pairs
    (test_convert_peft_experts.py checks their logits), but only with every
    expert's pair: one trained on some experts is refused, naming a missing
    one, and nothing is written."""
    from toy_testsupport import moe_ref

    hf, gguf = moe_ref.hf_dir("qwen3moe-tiny"), moe_ref.gguf_path("qwen3moe-tiny")
    folder = _train_peft(hf, tmp_path / "peft", targets=["q_proj", "v_proj", "gate"], steps=3)
    out = import_peft(folder, gguf, tmp_path / "a.gguf")
    want = _peft_logits(hf, folder, IDS)
    tol = _tol(want)
    assert np.abs(_toy_logits(gguf, IDS) - want).max() > 50 * tol
    assert np.abs(_toy_logits(gguf, IDS, lora=out) - want).max() <= tol
    experts = _train_peft(hf, tmp_path / "experts", targets=r".*\.experts\.[1-7]\.down_proj", steps=1)
    with pytest.raises(
        PeftAdapterError, match=r"not for expert 0 \(model\.layers\.\d+\.mlp\.experts\.0\.down_proj"
    ) as e:
        import_peft(experts, gguf, tmp_path / "b.gguf")
    assert "ffn_down_exps" in str(e.value) and "every expert" in e.value.hint and "merge" in e.value.hint
    assert e.value.field.endswith("experts.0.down_proj") and not (tmp_path / "b.gguf").exists()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tensors_equal_llamacpp_convert_lora(llama, tmp_path, arch):
    """llama.cpp's convert_lora_to_gguf.py writes the same tensors (names,
    shapes, F32 values; llama's Q/K lora_b permuted) and the same alpha; for
    gpt2 it writes every pair transposed (its bug, see below)."""
    from toy.gguf import GGUFFile

    if arch == "llama":
        hf, gguf = llama
        targets = TARGETS
    else:
        hf, gguf = gpt2_ref.hf_dir("tiny"), gpt2_ref.gguf_path("tiny")
        targets = ["c_attn", "c_proj", "c_fc"]
    folder = _train_peft(hf, tmp_path / "peft", targets=targets, steps=2)
    ours = import_peft(folder, gguf, tmp_path / "ours.gguf")
    theirs = _llamacpp_convert_lora(folder, hf, tmp_path / "theirs.gguf")
    with GGUFFile(ours) as a, GGUFFile(theirs) as b:
        assert sorted(a.tensors) == sorted(b.tensors)
        assert a.metadata["adapter.lora.alpha"] == b.metadata["adapter.lora.alpha"]
        assert a.metadata["general.architecture"] == b.metadata["general.architecture"]
        for name in b.tensors:
            if arch == "gpt2":
                # llama.cpp transposes GPT-2's Conv1D weights into Linear form, and its LoRA
                # converter transposes the adapter too, which PEFT already keeps in Linear
                # form: every pair comes out swapped and transposed. B·A is then (in, out):
                # rejected for attn_qkv/ffn_up/ffn_down, silently wrong for the square
                # attn_output. toy's pairs are the ones PEFT's logits confirm
                # (test_gpt2_fused_c_attn); llama.cpp's hold the same numbers, transposed.
                other = name[:-1] + ("b" if name.endswith("a") else "a")
                assert np.array_equal(b.tensor_to_float(name), a.tensor_to_float(other).T), name
            else:
                assert np.array_equal(a.tensor_to_float(name), b.tensor_to_float(name)), name


# ------------------------------------------------------------ llama.cpp runs the imported adapter

LLAMACPP_FIXTURE = Path(__file__).parent / "fixtures" / "peft_llamacpp.json"
#: the cases of fixtures/peft_llamacpp.json, recorded by tools/fixtures/record_peft_llamacpp.py with
#: llama.cpp's llama-server (``make_llamacpp_case`` builds each; the fixture keeps both files' sha256)
LLAMACPP_CASES: dict[str, dict] = {
    # llama: the converter reorders Q/K rows, so lora_b of attn_q/attn_k is permuted; rsLoRA scale
    "llama": {
        "arch": "llama",
        "seed": 7,
        "fields": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2},
        "peft_seed": 10,
        "lora": {"r": 8, "lora_alpha": 16, "use_rslora": True, "target_modules": TARGETS},
        "std": 0.1,
    },
    # qwen2: Q/K/V biases (not adapted), HF's row order kept; plain scale alpha / r
    "qwen2": {
        "arch": "qwen2",
        "seed": 9,
        "fields": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2},
        "peft_seed": 10,
        "lora": {"r": 4, "lora_alpha": 8, "use_rslora": False, "target_modules": TARGETS},
        "std": 0.15,
    },
}
LLAMACPP_PROMPTS = ["The quick brown fox", "Once upon a time, in a small village,", "1, 2, 3, 4,"]
LLAMACPP_N_GEN = 16


def make_llamacpp_case(case: str, folder: Path) -> tuple[Path, Path]:
    """The base GGUF and the adapter GGUF of a llama.cpp parity case, in
    ``folder``: the seeded random HF model (``hf_llama_ref.make_hf_llama``)
    converted by llama.cpp's converter (F32), and a PEFT adapter made by PEFT
    on it (``get_peft_model`` with the case's ``LoraConfig``, then every
    ``lora_A``/``lora_B`` drawn anew from N(0, std²) after
    ``torch.manual_seed(peft_seed)``, in ``named_parameters`` order: a
    non-zero ``lora_B``, so the adapter matters), saved with
    ``save_pretrained`` and imported by ``import_peft``. File names are
    fixed (the adapter records its folder's and its base's names)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from toy_testsupport import hf_llama_ref

    c = LLAMACPP_CASES[case]
    hf = hf_llama_ref.make_hf_llama(folder / f"hf-{case}", arch=c["arch"], seed=c["seed"], **c["fields"])
    base = hf_llama_ref.convert(hf, folder / f"base-{case}.gguf", "f32")
    pm = get_peft_model(_hf(hf), LoraConfig(lora_dropout=0.0, **c["lora"]))
    torch.manual_seed(c["peft_seed"])
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.normal_(0.0, c["std"])
    pm.save_pretrained(folder / f"peft-{case}")
    return base, import_peft(folder / f"peft-{case}", base, folder / f"adapter-{case}.gguf")


def _llamacpp_records() -> list:
    if not LLAMACPP_FIXTURE.is_file():
        return []
    return [pytest.param(r, id=r["case"]) for r in json.loads(LLAMACPP_FIXTURE.read_text())["cases"]]


@pytest.mark.slow
@pytest.mark.parametrize("rec", _llamacpp_records())
def test_llamacpp_runs_the_imported_adapter_like_toy(tmp_path, rec):
    """llama.cpp's llama-server loaded toy's import of a PEFT adapter
    (``--lora``) and its greedy tokens were recorded (fixtures/
    peft_llamacpp.json); toy with the same base and adapter gives the same
    tokens, and without the adapter the same base tokens; PEFT itself (F32)
    gives them too, so llama.cpp runs the adapter PEFT trained, not merely
    the file toy wrote. The files are re-created here and must be the
    recorded bytes, so the record applies. The smallest top-1 minus top-2
    logit gap of llama.cpp's steps is recorded (>= 5e-3 here), far above
    toy's differences from llama.cpp (~1e-6 on these tiny F32 models)."""
    from toy_testsupport.llamacpp_parity import sha256_file, toy_tokens

    assert rec["recipe"] == LLAMACPP_CASES[rec["case"]], "the case changed: re-record the fixture"
    base, adapter = make_llamacpp_case(rec["case"], tmp_path)
    how = "re-record with tools/fixtures/record_peft_llamacpp.py (torch, transformers, PEFT or the converter changed?)"
    assert sha256_file(base) == rec["base"]["sha256"], f"the base GGUF differs from the recorded one: {how}"
    assert sha256_file(adapter) == rec["adapter"]["sha256"], f"the adapter GGUF differs from the recorded one: {how}"
    texts = [p["text"] for p in rec["prompts"]]
    with_adapter = toy_tokens(base, texts, n_gen=rec["n_gen"], lora=adapter)
    without = toy_tokens(base, texts, n_gen=rec["n_gen"])
    assert any(p["greedy"] != p["base_greedy"] for p in rec["prompts"])  # the adapter matters to llama.cpp
    for i, p in enumerate(rec["prompts"]):
        assert with_adapter["prompt_ids"][i] == p["ids"] == without["prompt_ids"][i], p["text"]
        assert with_adapter["greedy"][i] == p["greedy"], f"{p['text']!r} with the adapter"
        assert without["greedy"][i] == p["base_greedy"], f"{p['text']!r} without it"
    peft_model = _peft_model(tmp_path / f"hf-{rec['case']}", tmp_path / f"peft-{rec['case']}")
    for p in rec["prompts"]:
        assert _torch_greedy(peft_model, p["ids"], rec["n_gen"]) == p["greedy"], f"{p['text']!r}: PEFT's tokens"


def _peft_model(hf_dir, folder):
    from peft import PeftModel

    return PeftModel.from_pretrained(_hf(hf_dir), str(folder)).eval()


def _torch_greedy(model, ids, n: int) -> list[int]:
    """``n`` greedy tokens of a torch causal LM (the whole sequence each step: no cache)."""
    import torch

    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(out[-1])
    return out


# ------------------------------------------------------------ refused cases


@pytest.fixture(scope="module")
def trained(llama, tmp_path_factory):
    hf, _ = llama
    return _train_peft(hf, tmp_path_factory.mktemp("trained") / "peft", targets=["q_proj", "v_proj"], steps=1)


def _variant(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(config)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "lora_only"}, "bias"),
        ({"r": "four"}, "r is 'four'"),
        ({"peft_type": "IA3"}, "peft_type"),
    ],
)
def test_refused_configs_name_the_field(llama, trained, tmp_path, config, needle):
    _, gguf = llama
    folder = _variant(trained, tmp_path / "v", **config)
    out = tmp_path / "out.gguf"
    with pytest.raises(PeftAdapterError, match=needle) as e:
        import_peft(folder, gguf, out)
    assert e.value.hint
    assert not out.exists() and list(tmp_path.glob(".out.gguf*")) == []


def test_embedding_and_head_targets_are_refused(llama, tmp_path):
    hf, gguf = llama
    folder = _train_peft(hf, tmp_path / "peft", targets=["q_proj", "lm_head"], steps=1)
    with pytest.raises(PeftAdapterError, match="lm_head"):
        import_peft(folder, gguf, tmp_path / "o.gguf")
    assert not (tmp_path / "o.gguf").exists()


def test_tied_embeddings(tmp_path):
    """A model whose head is its embedding (no output.weight in the GGUF): an
    adapter of the projections converts and matches PEFT; one on the tied
    embedding is refused, naming it."""
    hf = _make_llama(tmp_path / "hf", seed=4, tie_word_embeddings=True)
    gguf = gpt2_ref.convert_to_gguf(hf, tmp_path / "base.gguf", "f32")
    folder = _train_peft(hf, tmp_path / "peft", targets=["q_proj", "v_proj", "down_proj"], steps=3)
    out = import_peft(folder, gguf, tmp_path / "a.gguf")
    want = _peft_logits(hf, folder, IDS)
    assert np.abs(_toy_logits(gguf, IDS, lora=out) - want).max() <= _tol(want)
    emb = _train_peft(hf, tmp_path / "emb", targets=["q_proj", "embed_tokens"], steps=1)
    with pytest.raises(PeftAdapterError, match="embed_tokens") as e:
        import_peft(emb, gguf, tmp_path / "o.gguf")
    assert "tied or not" in str(e.value) and not (tmp_path / "o.gguf").exists()


def test_adapter_for_another_base_names_the_tensor(trained, tmp_path):
    gguf = gpt2_ref.gguf_path("tiny")  # gpt2: no q_proj
    with pytest.raises(PeftAdapterError, match=r"q_proj"):
        import_peft(trained, gguf, tmp_path / "o.gguf")
    other = _make_llama(tmp_path / "hf2", hidden_size=32, intermediate_size=48)
    g2 = gpt2_ref.convert_to_gguf(other, tmp_path / "b2.gguf", "f32")
    with pytest.raises(PeftAdapterError, match=r"blk\.0\.attn_q\.weight") as e:
        import_peft(trained, g2, tmp_path / "o.gguf")
    assert "--base" in e.value.hint
    assert not (tmp_path / "o.gguf").exists()


def test_keys_with_another_path_before_the_blocks(llama, trained, tmp_path):
    """PEFT keys of a bare ``LlamaModel`` (``layers.N…``, no ``model.``) or a
    wrapper (``language_model.model.layers.N…``) name the same modules: the
    family's blocks container (the last part of ``peft_prefix``) is matched."""
    from safetensors.numpy import load_file, save_file

    from toy.adapters import load_adapter

    _, gguf = llama
    want = load_adapter(import_peft(trained, gguf, tmp_path / "a.gguf")).pairs
    for i, path in enumerate(["", "language_model.model."]):
        folder = _variant(trained, tmp_path / f"v{i}")
        w = folder / "adapter_model.safetensors"
        renamed = {k.replace("base_model.model.model.", "base_model.model." + path): v for k, v in load_file(w).items()}
        assert set(renamed).isdisjoint(load_file(w))  # every key renamed
        save_file(renamed, w, metadata={"format": "pt"})
        got = load_adapter(import_peft(folder, gguf, tmp_path / f"b{i}.gguf")).pairs
        assert sorted(got) == sorted(want)
        assert all(np.array_equal(got[n][j], want[n][j]) for n in want for j in (0, 1))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_sources(llama, trained, tmp_path, dtype):
    """A PEFT folder saved in BF16 or F16: the values become F32 exactly as torch widens them."""
    import torch
    from safetensors.torch import load_file, save_file

    from toy.adapters import load_adapter

    _, gguf = llama
    folder = _variant(trained, tmp_path / "half")
    w = folder / "adapter_model.safetensors"
    half = {k: v.to(getattr(torch, dtype)) for k, v in load_file(w).items()}
    save_file(half, w, metadata={"format": "pt"})
    ad = load_adapter(import_peft(folder, gguf, tmp_path / "a.gguf"))
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_{}.weight"
    a, b = ad.pairs["blk.1.attn_v.weight"]
    assert np.array_equal(a, half[key.format("A")].float().numpy())
    assert np.array_equal(b, half[key.format("B")].float().numpy())


def _shift_last(folder: Path, by: int, extra: bytes = b"") -> str:
    """Move the last tensor's data_offsets by ``by`` bytes (the header kept
    its length) and append ``extra`` to the file: the tensor's name."""
    w = folder / "adapter_model.safetensors"
    data = w.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    head = json.loads(data[8 : 8 + n])
    name = max((k for k in head if k != "__metadata__"), key=lambda k: head[k]["data_offsets"][1])
    lo, hi = head[name]["data_offsets"]
    head[name]["data_offsets"] = [lo + by, hi + by]
    h = json.dumps(head, separators=(",", ":")).encode()
    assert len(h) <= n
    w.write_bytes(struct.pack("<Q", n) + h + b" " * (n - len(h)) + data[8 + n :] + extra)
    return name


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("truncated", "run past the end of the file"),
        ("overlap", "overlap"),  # the right size, inside the file, over the previous tensor
        ("gap", "after a gap"),
        ("trailing", "bytes after the last tensor"),
    ],
)
def test_truncated_and_lying_safetensors(llama, trained, tmp_path, case, needle):
    """A header that lies about the data (safetensors_io's checks, which
    the safetensors library makes too) is refused, naming the file and the
    tensor where there is one; nothing is written."""
    _, gguf = llama
    bad = _variant(trained, tmp_path / case)
    w = bad / "adapter_model.safetensors"
    name = None
    if case == "truncated":
        w.write_bytes(w.read_bytes()[:-10])
    elif case == "trailing":
        w.write_bytes(w.read_bytes() + b"\0" * 8)
    else:
        name = _shift_last(bad, -4 if case == "overlap" else 4, b"" if case == "overlap" else b"\0" * 4)
    with pytest.raises(PeftAdapterError, match=needle) as e:
        import_peft(bad, gguf, tmp_path / "o.gguf")
    assert "adapter_model.safetensors" in str(e.value) and e.value.hint
    if name is not None:
        assert name in str(e.value)
    assert not (tmp_path / "o.gguf").exists() and list(tmp_path.glob(".o.gguf*")) == []
