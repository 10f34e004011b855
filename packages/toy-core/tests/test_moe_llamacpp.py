"""Mixture of experts against llama.cpp itself: toy's greedy tokens and
logits on OLMoE / Qwen2-MoE / Qwen3-MoE files equal llama.cpp's, at F32,
Q8_0 and a K-quant mix, on exactly tied routers, and with LoRA adapters toy
writes (attention and router).

Fixture: ``fixtures/moe_llamacpp.json``, recorded by
``tools/fixtures/record_moe_llamacpp.py`` in three steps and two venvs (its
docstring says how): llama-cpp-python 0.3.36 built with AVX2 (no AVX-512;
the CMake arguments are in the fixture), ``Llama(path, n_ctx=256,
n_batch=256, n_threads=2, n_threads_batch=2, logits_all=True, seed=0,
flash_attn=False, type_k=type_v=F16)``: the F16 KV cache and no flash
attention, toy's defaults. This module holds the recipes the recorder
imports (``PROMPTS``, ``MODELS``, ``KQUANT``, ``LORA``, ``make_adapter``,
``toy_tokens``, ``tensor_digests``), so the tests re-create the same files
and check them by sha256 before comparing (the comparison itself is
``llamacpp_parity``'s, shared with test_gemma_llamacpp.py).

- ``models``: ``moe_ref``'s seeded random HF models (8 experts, top-2)
  converted by llama.cpp's ``convert_hf_to_gguf.py``: olmoe-tiny,
  qwen2moe-tiny (shared expert) and qwen3moe-tiny (renormalised weights) in
  F32 and Q8_0, and qwen3moe-tied-router in F32 (router rows of experts 2
  and 5 equal in every layer, so their probabilities tie exactly for every
  token: llama.cpp's CPU argsort keeps the lower index where the pair
  straddles the top-2 boundary). Per prompt: the prompt ids (GPT-2's
  tokenizer as moe_ref's HF folder has it, no BOS: the files say
  ``tokenizer.ggml.add_bos_token = false``, and the recorder checked that
  llama.cpp adds none and tokenizes to the same ids), 24 greedy tokens, the
  chosen token's logit at each step, the first 8 logits of the prompt's
  last position and ``min_margin`` (the smallest top-1 minus top-2 logit
  gap over the 24 steps).
- ``kquant``: the 256-wide olmoe-k, qwen2moe-k and qwen3moe-k F32 files
  quantized by llama.cpp's own quantizer (``llama_model_quantize``,
  ``LLAMA_FTYPE_MOSTLY_Q4_K_M``, default parameters: its Q4_K_M mix, Q4_K
  experts and attn_q, Q5_K attn_output, Q6_K output, attn_k/attn_v Q8_0 by
  its rule for 8-expert models, routers F32), the type, shape and sha256 of
  each of its tensors, and two greedy records on that file: ``prompts``,
  llama.cpp with the model parameter ``use_extra_bufts`` false (ggml's plain
  CPU kernels, those toy runs: the records compared), and
  ``prompts_repacked``, llama.cpp's default, which on an AVX2 CPU repacks
  Q4_K tensors for its own Q4_K x Q8_K GEMM/GEMV (ggml-cpu's repack.cpp,
  ``q4_K_8x8_q8_K``; kept for reference, not compared). The test takes
  ``moe_ref``'s ``q4_k_m`` file (toy's quantizer on the same F32 file) and
  compares greedy tokens only when its tensors are llama.cpp's, byte for
  byte (the metadata may differ: key order, ``general.file_type``);
  otherwise it skips, naming the differing tensors
  (``test_toys_q4_k_m_tensors_are_llamacpps`` says which in every run, on
  any CPU variant).
- ``lora``: a seeded random adapter (``train_helpers.seeded_adapter``:
  rank 4, alpha 8, on q, k, v, o and the router ``ffn_gate_inp`` of every
  layer, entries ``std · N(0, 1)``) on qwen2moe-tiny and qwen3moe-tiny
  (F32), written by toy's ``save_adapter`` and loaded by llama.cpp with
  ``lora_path=..., lora_scale=1.0`` (llama.cpp's ``build_moe_ffn`` runs the
  router through ``build_lora_mm``). The recorder refuses to write unless
  the adapter changes llama.cpp's greedy tokens of some prompt.

What is compared (``test_*_equal_llamacpp``, marked ``avx2_reference``: the
recorded outputs are AVX2 arithmetic; toy loads the weights in the file's
layout, ``repack=False``, as the records' llama.cpp kept them: repacked Q4_K
experts, ``repack="all"``, sum in another order, which can move a near-tied
routing, test_moe.py): the prompt ids, the 24 greedy tokens
exactly, and logits: the first 8 of the prompt's last position (toy's
``logits``, every row's head computed as llama.cpp's ``logits_all``) and the
chosen token's logit at every greedy step through toy's decode path
(``generate``'s: a prefill of the prompt, then one-token decodes), against
llama.cpp's token-by-token decode, within ``LOGIT_ATOL``.
Measured under toy's haswell variant, in float32 (the fixture's decimals
round-trip the float32 values): the last-position heads bit-identical (0.0)
on every file and prompt, with and without the adapters; the greedy-step
logits bit-identical from the second step on, and at the first within
4.8e-7 on the 64-wide files and 1.5e-6 on the -k Q4_K_M files (logits up to
8.8; toy's prefill computes the head for the last row only, llama.cpp with
``logits_all`` for every row, so that one product runs another CPU kernel).
The tied router agrees the same way, and the ties decide tokens: toy on a
copy with experts 2 and 5 exchanged (what picking the higher index
computes) parts from llama.cpp after 0 to 2 of 24 tokens on every prompt.
Each adapter changes llama.cpp's greedy tokens of all four prompts. Under
toy's AVX-512 variant (zen4) every greedy token still agreed when measured,
the logits moving from llama.cpp's by up to 4.3e-4 (F32), 8.3e-3 (Q8_0)
and 5.7e-2 (Q4_K_M).

``min_margin``: the smallest is 3.6e-4 (qwen3moe-tiny F32; 8.9e-4
qwen2moe-tiny Q8_0, 5.5e-4 qwen3moe-tiny with its adapter, 2.2e-3
qwen3moe-k Q4_K_M, 1.4e-3 the tied router), hundreds of times the measured
differences, so the exact token comparison is not a coin toss.

Found on the way: toy's llama-family attention scale was 1/sqrt(head_dim) in
double, rounded to float32, where llama.cpp computes
``1.0f/sqrtf(float(n_embd_head))`` in float32; for head_dim 24 (the
qwen3moe-tiny shapes) they differ by one ulp, which moved qwen3moe-tiny's F32
logits from llama.cpp's by up to 2e-4 once an F16 rounding of the softmax
probabilities flipped (1.5e-6 at every step with F32 K/V); toy now uses
llama.cpp's float32 value. llama.cpp's repacked Q4_K kernels are not ggml's
plain ones: on the same Q4_K_M file its default run moves logits by up to
0.1 from its own ``use_extra_bufts=false`` run (and from toy) before any
token differs, enough to
change the greedy tokens of 3 of the 12 -k prompts (after 0, 18 and 20
steps; the smallest repacked margin is 2.5e-4).

Hugging Face (step 3 of the recorder, F32 files): its logits differ from
llama.cpp's by 4.4e-4 to 2e-3 (F16 K/V against HF's float32), and its greedy
tokens equal llama.cpp's on every prompt of olmoe-tiny and qwen2moe-tiny and
on three of qwen3moe-tiny (on the code prompt HF's last-position logits
are 3.4e-2 from llama.cpp's and the first token differs); on the tied router
HF parts after 0 to 5 tokens on three prompts (its ``torch.topk`` picks the
higher index at about half the ties). test_moe.py compares toy with HF on
an F32 cache instead.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from toy_testsupport import llamacpp_parity as parity
from toy_testsupport import moe_ref
from toy_testsupport.llamacpp_parity import sha256_file

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "moe_llamacpp.json"
LOGIT_ATOL = 1e-5  # |toy - llama.cpp|, logits within ±4.5 (tiny) and ±8.8 (-k); measured <= 1.5e-6 (haswell)
THREADS = 1
N_GEN = 24
BOS = moe_ref.N_VOCAB - 1  # GPT-2's <|endoftext|>, never added to a prompt

# prose, code (runs of spaces, newlines), digits, accented letters and an emoji
PROMPTS = [
    "The weather was cold and windy, so we stayed inside and",
    "def add(a, b):\n    return a + b\n\nprint(add(",
    "Water boils at 100 degrees Celsius and freezes at",
    "Emoji \U0001f680 in Z\u00fcrich: 3.14 \u20ac for a caf\u00e9",
]
# (shape, seed, outtype) of moe_ref.gguf_path
MODELS = [
    ("olmoe-tiny", 0, "f32"),
    ("qwen2moe-tiny", 0, "f32"),
    ("qwen3moe-tiny", 0, "f32"),
    ("olmoe-tiny", 0, "q8_0"),
    ("qwen2moe-tiny", 0, "q8_0"),
    ("qwen3moe-tiny", 0, "q8_0"),
    ("qwen3moe-tied-router", 0, "f32"),
]
TIED = "qwen3moe-tied-router"

# -- the K-quant mix ----------------------------------------------------------------

# the F32 files llama.cpp's quantizer turns into its Q4_K_M mix (llama_ftype 15);
# toy's counterpart is moe_ref.gguf_path(shape, 0, "q4_k_m")
KQUANT = ["olmoe-k", "qwen2moe-k", "qwen3moe-k"]
KQUANT_FTYPE = {"name": "Q4_K_M", "llama_ftype": 15}

# -- the adapters -------------------------------------------------------------------

# rank 4 on attention and the router, alpha 8 (scale 2); std picked when recording so
# that the adapter changes llama.cpp's greedy tokens (the recorder refuses otherwise)
LORA_TARGETS = ["q", "k", "v", "o", "router"]
LORA = {
    "qwen2moe-tiny": {"seed": 20251210, "rank": 4, "alpha": 8.0, "targets": LORA_TARGETS, "std": 0.1},
    "qwen3moe-tiny": {"seed": 20251211, "rank": 4, "alpha": 8.0, "targets": LORA_TARGETS, "std": 0.1},
}

REC = parity.Recorded(
    FIXTURE, moe_ref, "record_moe_llamacpp.py", lora=LORA, n_gen=N_GEN, threads=THREADS, atol=LOGIT_ATOL
)
FIX = REC.fix
# the recipes and toy's side, as the recorder imports them
lora_base, make_adapter, toy_tokens = REC.lora_base, REC.make_adapter, REC.toy_tokens


# -- shared ---------------------------------------------------------------------------


def tensor_digests(path) -> dict[str, dict]:
    """Each tensor of a GGUF: its type name, its ggml shape ``ne`` (innermost
    first, as llama.cpp lists it) and the sha256 of its bytes, read by toy's
    reader (the recorder reads llama.cpp's file with a reader of its own)."""
    from toy.gguf import GGUFFile

    out = {}
    with GGUFFile(path) as gf:
        for name, info in gf.tensors.items():
            out[name] = {
                "type": info.dtype.name,
                "ne": [int(n) for n in reversed(info.shape)],
                "sha256": hashlib.sha256(gf.tensor_bytes(name)).hexdigest(),
            }
    return out


def digest_differences(got: dict[str, dict], want: dict[str, dict]) -> list[str]:
    """How ``got`` (``tensor_digests``) differs from ``want``, one line per tensor."""
    out = [f"{n}: missing" for n in want if n not in got] + [
        f"{n}: not in llama.cpp's file" for n in got if n not in want
    ]
    for n, w in want.items():
        g = got.get(n)
        if g is None:
            continue
        if g["ne"] != w["ne"]:
            out.append(f"{n}: shape {g['ne']}, llama.cpp {w['ne']}")
        elif g["type"] != w["type"]:
            out.append(f"{n}: {g['type']}, llama.cpp {w['type']}")
        elif g["sha256"] != w["sha256"]:
            out.append(f"{n}: {g['type']} with other bytes")
    return out


def swapped_experts(src, dst, a: int = 2, b: int = 5) -> Path:
    """``src`` with experts ``a`` and ``b`` exchanged in every layer's
    ``ffn_{gate,up,down}_exps`` (routers unchanged), by toy's GGUF writer. On
    the tied-router shape (router rows ``a`` and ``b`` equal) this is the
    model whose lower-index-first selection computes what picking the
    higher index of the tied pair computes on ``src``."""
    from toy.gguf import GGUFFile, GGUFWriter

    with GGUFFile(src) as gf:
        w = GGUFWriter(dst)
        for k, v in gf.metadata.items():
            w.add(k, v, gf.types[k])
        for n in gf.tensors:
            x = np.array(gf.tensor_to_float(n), np.float32)
            if n.endswith("_exps.weight"):
                x[[a, b]] = x[[b, a]]
            w.add_tensor(n, x)
        w.write()
    return dst


needs_fixture = REC.needed


def _kquant_params():
    return REC.params("kquant", lambda k: k["shape"])


def _tied_record() -> dict:
    (rec,) = [m for m in FIX["models"] if m["recipe"]["shape"] == TIED]
    return rec


# -- tests ----------------------------------------------------------------------------


@needs_fixture
def test_the_fixture_is_of_these_recipes():
    ctx = FIX["context"]
    assert (ctx["kv_type"], ctx["flash_attn"], ctx["add_bos"], ctx["n_gen"]) == ("f16", False, False, N_GEN)
    assert [(m["recipe"]["shape"], m["recipe"]["seed"], m["recipe"]["outtype"]) for m in FIX["models"]] == MODELS
    assert [k["shape"] for k in FIX["kquant"]] == KQUANT
    assert all(k["llamacpp"]["ftype"] == KQUANT_FTYPE for k in FIX["kquant"])
    records = [m["prompts"] for m in FIX["models"]] + [
        k[w] for k in FIX["kquant"] for w in ("prompts", "prompts_repacked")
    ]
    records += [lo["prompts"] for lo in FIX["lora"]]
    assert all([p["text"] for p in r] == PROMPTS for r in records)
    assert all(len(p["greedy"]) == N_GEN for r in records for p in r)
    assert {lo["base"]["recipe"]["shape"]: lo["adapter"]["recipe"] for lo in FIX["lora"]} == LORA
    assert all(any(lo["changed"]) for lo in FIX["lora"])  # each adapter changes llama.cpp's tokens


@needs_fixture
def test_llamacpps_kquant_mix_has_k_quant_experts():
    """The recorded llama.cpp files are a real K-quant mix of MoE tensors:
    K-quant expert tensors, the router kept F32, attn_k and attn_v Q8_0 (its
    rule for 8-expert models), and the shapes of moe_ref's -k models."""
    for k in FIX["kquant"]:
        tensors = k["llamacpp"]["tensors"]
        shape = moe_ref.SHAPES[k["shape"]]
        n_layer, d = shape["num_hidden_layers"], shape["hidden_size"]
        assert not any(n.startswith(f"blk.{n_layer}.") for n in tensors)
        for i in range(n_layer):
            for which in ("gate", "up", "down"):
                t = tensors[f"blk.{i}.ffn_{which}_exps.weight"]
                assert t["type"].endswith("_K") and t["ne"][2] == 8 and d in t["ne"][:2], (k["shape"], which, t)
            assert tensors[f"blk.{i}.ffn_gate_inp.weight"]["type"] == "F32"
            assert tensors[f"blk.{i}.attn_k.weight"]["type"] == tensors[f"blk.{i}.attn_v.weight"]["type"] == "Q8_0"


@needs_fixture
@pytest.mark.parametrize("rec", REC.model_params())
def test_prompt_ids_equal_llamacpp(rec):
    """toy's tokenizer gives HF's ids without a BOS, which are llama.cpp's
    (checked when recording)."""
    import toy

    with toy.load(REC.model_file(rec), threads=THREADS, n_ctx=64) as m:
        assert m.tokenizer.bos_id == BOS
        for p in rec["prompts"]:
            assert m.tokenize(p["text"]) == p["ids"], p["text"]
            assert BOS not in p["ids"]


@needs_fixture
@pytest.mark.avx2_reference
@pytest.mark.parametrize("rec", REC.model_params())
def test_greedy_tokens_equal_llamacpp(rec):
    REC.assert_model_like_llamacpp(rec)


@needs_fixture
@pytest.mark.avx2_reference
def test_the_tied_pairs_other_choice_gives_other_tokens(tmp_path):
    """On qwen3moe-tied-router, picking the higher expert of the tied pair
    (toy on a copy with experts 2 and 5 exchanged) moves greedy tokens away
    from llama.cpp's: the ties are decided inside the recorded tokens, so
    ``test_greedy_tokens_equal_llamacpp[qwen3moe-tied-router...]`` shows toy
    picks llama.cpp's experts on exact ties."""
    rec = _tied_record()
    other = toy_tokens(swapped_experts(REC.model_file(rec), tmp_path / "swapped.gguf"), PROMPTS)
    differ = [o != p["greedy"] for o, p in zip(other["greedy"], rec["prompts"])]
    assert any(differ), "exchanging the tied experts changes no greedy token: the tie test decides nothing"


@needs_fixture
@pytest.mark.parametrize("k", _kquant_params())
def test_kquant_source_is_the_recorded_f32_file(k):
    """llama.cpp's quantizer read the F32 file toy's quantizer reads (moe_ref's
    ``q4_k_m`` file is made from it)."""
    r = k["source"]["recipe"]
    assert r == moe_ref.recipe(k["shape"], 0, "f32")
    assert sha256_file(moe_ref.gguf_path(k["shape"], 0, "f32")) == k["source"]["sha256"]


def _toy_kquant_file(k: dict) -> Path:
    """moe_ref's ``q4_k_m`` file of ``k``'s shape, or a skip naming how its
    tensors differ from those of llama.cpp's Q4_K_M file."""
    path = moe_ref.gguf_path(k["shape"], 0, "q4_k_m")
    want = k["llamacpp"]["tensors"]
    diff = digest_differences(tensor_digests(path), want)
    if diff:
        pytest.skip(
            f"toy's Q4_K_M file {path.name} is not llama.cpp's Q4_K_M mix of the same F32 file: {len(diff)} of "
            f"{len(want)} tensors differ ({'; '.join(diff[:4])}{'; ...' if len(diff) > 4 else ''}); llama.cpp's "
            "tokens were recorded on its own file, so they are compared once toy's quantizer writes its bytes"
        )
    return path


@needs_fixture
@pytest.mark.parametrize("k", _kquant_params())
def test_toys_q4_k_m_tensors_are_llamacpps(k):
    """toy's quantizer on the F32 file llama.cpp quantized gives llama.cpp's
    tensors, type and bytes (or this skips, saying which differ)."""
    assert tensor_digests(_toy_kquant_file(k)) == k["llamacpp"]["tensors"]


@needs_fixture
@pytest.mark.avx2_reference
@pytest.mark.parametrize("k", _kquant_params())
def test_kquant_greedy_tokens_equal_llamacpp(k):
    """toy on moe_ref's ``q4_k_m`` file (toy's quantizer), compared with
    llama.cpp on its own Q4_K_M file (no repacking), when the two files'
    tensors are the same bytes (their metadata may differ: key order,
    general.file_type)."""
    path = _toy_kquant_file(k)
    got = toy_tokens(path, [p["text"] for p in k["prompts"]])
    REC.assert_like_llamacpp(got, k["prompts"], f"{k['shape']}/Q4_K_M")


@needs_fixture
@pytest.mark.parametrize("lo", REC.lora_params())
def test_adapter_is_the_recorded_file(lo, tmp_path):
    from toy.adapters import load_adapter

    shape = lo["base"]["recipe"]["shape"]
    _, path = REC.lora_files(lo, tmp_path)  # the recorded recipe, base and adapter bytes
    ad = load_adapter(path)
    n_layer = moe_ref.SHAPES[shape]["num_hidden_layers"]
    assert ad.architecture == moe_ref.SHAPES[shape]["arch"] and ad.rank == 4
    assert len(ad.pairs) == n_layer * len(LORA_TARGETS)
    a, b = ad.pairs["blk.0.ffn_gate_inp.weight"]
    assert a.shape == (4, moe_ref.SHAPES[shape]["hidden_size"]) and b.shape == (8, 4)  # the router: 8 experts


@needs_fixture
@pytest.mark.avx2_reference
@pytest.mark.parametrize("lo", REC.lora_params())
def test_lora_greedy_tokens_equal_llamacpp(lo, tmp_path):
    REC.assert_lora_like_llamacpp(lo, tmp_path)
