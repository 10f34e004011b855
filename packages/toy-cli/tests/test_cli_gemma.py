"""`toy describe` and `toy infer --chat` on Gemma 2 and Gemma 3 files, and the
Gemma variants toy refuses (greedy `toy infer` against the library, and what
every architecture's describe shows, are test_cli_conformance.py's).

The models are ``gemma_ref``'s (tests/support/src/toy_testsupport/gemma_ref.py):
seeded random Hugging Face Gemmas converted by llama.cpp's own
``convert_hf_to_gguf.py``, with a sliding window of 8, a SentencePiece
tokenizer and Gemma 2's chat template. Expectations:

- ``toy describe``: the rows and the ``--json`` summary carry what the
  Hugging Face configs of ``gemma_ref.SHAPES`` say (window, sliding and
  global layers, soft-caps, RoPE bases, the embedding scale √d); the
  algorithm card has the sliding-window mask and a soft-cap line per cap
  the model has, and none for a cap it lacks;
- ``toy infer --chat`` sends the template's rendering
  (``ChatTemplate.render`` tokenized here) and generates the library's
  tokens (``toy.load`` + ``Model.generate``, no CLI); a system message,
  which Gemma 2's template refuses, is an ``error:`` with the template's
  reason and exit 2 (bad input, as the server's 400);
- a ``gemma3n`` file and a Gemma 1 (``gemma``) file, written here with
  ``toy.gguf.GGUFWriter`` from a converted file with the architecture
  renamed: ``error:`` naming what toy lacks, exit 2, no traceback.

Every run is pinned to the CPU and one thread (as test_cli_infer.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toy_testsupport import gemma_ref
from toy_testsupport.cli_helpers import assert_clean_error, row, run

N = 8


@pytest.fixture(autouse=True)
def _cpu_one_thread(monkeypatch):
    monkeypatch.setenv("TOY_DEVICE", "cpu")
    monkeypatch.setenv("TOY_THREADS", "1")


def path_of(shape: str) -> Path:
    return gemma_ref.gguf_path(shape, 0, "f32")


# ---------------------------------------------------------------- toy describe


def test_describe_gemma2(capsys):
    hf = gemma_ref.SHAPES["gemma2-tiny"]
    code, out, err = run(capsys, "describe", path_of("gemma2-tiny"))
    assert code == 0, err
    row(out, "architecture", "gemma2")
    row(out, "layers", "4")
    row(out, "d_ff", "128 (GeGLU)")
    row(out, "sliding window", f"{hf['sliding_window']} positions on layers 0, 2")
    row(out, "global layers", "1, 3")
    row(out, "soft-caps", "attention 8, logits 4")
    row(out, "embed scale", "√d = 8")
    row(out, "rope (global)", "NeoX, base 10000, no scaling")
    row(out, "rope (sliding)", "NeoX, base 10000, no scaling")
    # the card: the embedding scale, the attention cap before the mask, the window, the final cap
    card = out[out.index("Algorithm: P ← gemma2(x | θ)") :]
    assert "X ← W_e[x, :] · 8" in card
    lines = card.splitlines()
    cap = next(i for i, ln in enumerate(lines) if "S_h ← 8 · tanh(S_h / 8)" in ln)
    mask = next(i for i, ln in enumerate(lines) if "A_h ← softmax(S_h + M_l)·V_g" in ln)
    assert cap < mask and "attention soft-cap" in lines[cap]
    assert "M_l: causal, and on sliding layers t − t′ < 8" in lines[mask]
    assert any("Z ← 4 · tanh(Z / 4)" in ln and "final soft-cap" in ln for ln in lines)
    assert "QK-norm" not in card

    code, out, _ = run(capsys, "describe", path_of("gemma2-tiny"), "--json")
    assert code == 0
    d = json.loads(out)
    s, extra = d["summary"], d["summary"]["extra"]
    assert (s["architecture"], s["n_layer"], s["mlp"], s["qk_norm"]) == ("gemma2", 4, "geglu", False)
    assert extra["sliding_window"] == 8 and extra["sliding_layers"] == [0, 2] and extra["global_layers"] == [1, 3]
    assert (extra["attn_softcap"], extra["final_softcap"]) == (hf["attn_logit_softcapping"], 4.0)
    assert extra["embed_scale"] == 8.0 and extra["attn_scale"] == 0.25  # 1/√head_dim
    assert extra["rope_base"] == extra["rope_base_swa"] == 10000.0
    assert "S_h ← 8 · tanh(S_h / 8)" in d["card"] and "t − t′ < 8" in d["card"]


@pytest.mark.parametrize("shape", ["gemma3-tiny", "gemma3-tiny-untied"])
def test_describe_gemma3(capsys, shape):
    hf = gemma_ref.SHAPES[shape]
    cap = hf["final_logit_softcapping"]
    code, out, err = run(capsys, "describe", path_of(shape))
    assert code == 0, err
    row(out, "architecture", "gemma3")
    row(out, "qk-norm", "yes")
    row(out, "sliding window", "8 positions on layers 0, 1, 2, 3, 4, 6")
    row(out, "global layers", "5")
    row(out, "soft-caps", f"logits {cap:g}" if cap else "none")
    row(out, "embed scale", "√d = 8")
    row(out, "rope (global)", "NeoX, base 1e+06, linear scaling ×2")
    row(out, "rope (sliding)", "NeoX, base 10000, no scaling")
    row(out, "output head", "tied to token_embd" if hf["tie_word_embeddings"] else "untied (output.weight)")
    card = out[out.index("Algorithm: P ← gemma3(x | θ)") :]
    assert "Q ← RMSNorm(Q | γ_q[l]);  K ← RMSNorm(K | γ_k[l])" in card
    assert "M_l: causal, and on sliding layers t − t′ < 8" in card
    assert "base 1e+06 (global), 10000 (sliding), linear ×2 on global layers" in card
    assert "attention soft-cap" not in card  # gemma3 has none
    assert ("Z ← 4 · tanh(Z / 4)" in card) == bool(cap)
    assert ("Z ← X·W_eᵀ" in card) == hf["tie_word_embeddings"]

    code, out, _ = run(capsys, "describe", path_of(shape), "--json")
    extra = json.loads(out)["summary"]["extra"]
    assert extra["sliding_layers"] == [0, 1, 2, 3, 4, 6] and extra["global_layers"] == [5]
    assert (extra["attn_softcap"], extra["final_softcap"]) == (0.0, cap or 0.0)
    assert (extra["rope_base"], extra["rope_base_swa"]) == (hf["rope_theta"], hf["rope_local_base_freq"])
    assert extra["rope_freq_scale"] == 1.0 / hf["rope_scaling"]["factor"] and extra["rope_freq_scale_swa"] == 1.0


# ---------------------------------------------------------------- toy infer


def test_infer_chat_uses_the_gemma_template(capsys):
    import toy
    from toy.gguf import GGUFFile
    from toy.tokenizer import ChatTemplate, Tokenizer

    path = path_of("gemma2-tiny")
    with GGUFFile(path) as gf:
        tok, tpl = Tokenizer.from_gguf(gf.metadata), ChatTemplate.from_gguf(gf.metadata)
    text = tpl.render([{"role": "user", "content": "Hi there"}], add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
    code, out, err = run(capsys, "infer", path, "Hi there", "--chat", "-n", N, "--greedy", "--ignore-eos", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["prompt_ids"] == tok.encode(text, add_special=False, special=True)
    assert d["prompt_ids"].count(tok.bos_id) == 1  # the template's BOS, none added on top
    with toy.load(path, threads=1) as m:
        want = m.generate([{"role": "user", "content": "Hi there"}], max_tokens=N, temperature=0, ignore_eos=True)
    assert d["tokens"] == want.tokens

    # Gemma 2's template has no system role: the template's own reason, exit 2, nothing on stdout
    code, out, err = run(capsys, "infer", path, "Hi there", "--chat", "--system", "Be brief.", "-n", N, "--greedy")
    assert out == ""
    assert_clean_error(code, err, 2, "chat template rejected the messages", "System role not supported")


# ---------------------------------------------------------------- what toy refuses


def renamed(src: Path, dst: Path, arch: str) -> Path:
    """``src`` with ``general.architecture`` = ``arch`` and its ``<arch>.*`` keys
    renamed to match (tensors and tokenizer unchanged), by toy's GGUF writer."""
    from toy.gguf import GGUFFile, GGUFWriter

    with GGUFFile(src) as gf:
        old = gf.architecture
        w = GGUFWriter(dst)
        for k, v in gf.metadata.items():
            key = arch + k[len(old) :] if k.startswith(old + ".") else k
            w.add(key, arch if k == "general.architecture" else v, gf.types[k])
        for n in gf.tensors:
            w.add_tensor(n, gf.tensor_to_float(n))
        w.write()
    return dst


@pytest.mark.parametrize(
    "arch, src, fragments",
    [
        ("gemma3n", "gemma3-tiny", ["architecture 'gemma3n' is not supported", "per-layer embeddings, AltUp"]),
        ("gemma", "gemma2-tiny", ["architecture 'gemma' (Gemma 1) is not supported", "post-sublayer norms"]),
    ],
)
def test_gemma_variants_toy_does_not_run(capsys, tmp_path, arch, src, fragments):
    path = renamed(path_of(src), tmp_path / f"{arch}.gguf", arch)
    from toy.gguf import GGUFFile

    with GGUFFile(path) as gf:
        assert gf.architecture == arch and f"{arch}.block_count" in gf.metadata
    for args in (("infer", path, "Hi", "-n", 2), ("infer", path, "Hi", "--chat", "-n", 2)):
        code, out, err = run(capsys, *args)
        assert out == ""
        assert_clean_error(code, err, 2, *fragments)
    # describe still shows what the metadata says (any GGUF), and says there is no card
    code, out, err = run(capsys, "describe", path)
    assert code == 0, err
    row(out, "architecture", arch)
    assert "no algorithm card" in out and "Algorithm:" not in out
