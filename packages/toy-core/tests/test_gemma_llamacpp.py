"""Gemma 2 / Gemma 3 against llama.cpp itself: toy's greedy tokens and logits
on the converted files, with a LoRA adapter toy writes, and on a full
fine-tune checkpoint toy writes, equal llama.cpp's.

Fixture: ``fixtures/gemma_llamacpp.json``, recorded by
``tools/fixtures/record_gemma_llamacpp.py`` in three steps and two venvs
(its docstring says how): llama-cpp-python 0.3.36 built with AVX2 (no
AVX-512; the CMake arguments are in the fixture), ``Llama(path, n_ctx=256,
n_batch=256, n_threads=2, n_threads_batch=2, logits_all=True, seed=0,
flash_attn=False, type_k=type_v=F16)``: the F16 KV cache and no flash
attention, toy's defaults. This module holds the recipes the recorder
imports (``PROMPTS``, ``MODELS``, ``LORA``, ``make_adapter``, ``FT``,
``finetune_checkpoint``, ``toy_tokens``), so the tests re-create the same
files and check them by sha256 before comparing (the comparison itself is
``llamacpp_parity``'s, shared with test_moe_llamacpp.py).

- ``models``: ``gemma_ref``'s seeded random HF models converted by
  llama.cpp's ``convert_hf_to_gguf.py``: gemma2-tiny, gemma3-tiny and
  gemma3-tiny-untied in F32, gemma2-tiny and gemma3-tiny-untied in Q8_0.
  Per prompt: the prompt ids (HF's ``GemmaTokenizerFast`` with BOS; the
  recorder checked that llama.cpp adds a BOS and tokenizes to the same ids),
  24 greedy tokens, the chosen token's logit at each step, the first 8
  logits of the prompt's last position and ``min_margin`` (the smallest
  top-1 minus top-2 gap over the 24 steps). The prompts are 22 to 25 tokens
  with BOS, so prompt and generation (up to 49 positions) run far past the
  sliding window of 8, and the sliding layers forget most of the sequence.
- ``lora``: a seeded random adapter (``train_helpers.seeded_adapter``:
  rank 4, alpha 8, on q, k, v, o, gate, up and down of every layer, entries
  ``std · N(0, 1)``) on gemma3-tiny-untied (F32) and on gemma2-tiny (F32),
  written by toy's ``save_adapter`` and loaded by llama.cpp with
  ``lora_path=..., lora_scale=1.0``. The recorder refuses to write unless
  the adapter changes llama.cpp's greedy tokens of some prompt (it changes
  all 8 of them).
- ``finetune``: ``FT``, 8 AdamW steps of toy's full fine-tune of gemma2-tiny
  (F32), every tensor trained, through the training engine directly
  (``ArchTrain`` + ``TrainEngine``, as test_gemma_train.py; ggml's own
  products, not toy's CPU GEMM), one thread, constant lr 1e-3, on
  ``gemma_ref.CORPUS`` tokenized by the file's own tokenizer (BOS + each
  sentence, packed into 4 rows of 32 tokens per step, positions restarting
  at each BOS, the target that crosses into the next document masked), then
  written by ``toy.train.checkpoint.save`` as a from-scratch run's model file
  is written: llama.cpp metadata from toy's Gemma ``metadata()`` (not copied
  from the base), the base's ``tokenizer.*`` keys, F32 weights,
  ``general.name`` and ``toy.train.run_id`` the fixed ``FT["run_id"]``. The
  file is then deterministic: the fixture keeps its sha256 and its tensors'
  (``weights_sha256``). The float sums of training depend on the CPU kernels
  (AVX2 here; the recorder runs step 1 under TOY_GGML_CPU_VARIANT=haswell):
  where the re-created weights differ from the recorded ones the llama.cpp
  comparison is skipped with that reason (llama.cpp ran the recorded
  weights). The recorder refuses to write unless the fine-tune changes
  llama.cpp's greedy tokens of some prompt.

What is compared (``test_*_equal_llamacpp``, marked ``avx2_reference``: the
recorded outputs are AVX2 arithmetic): the prompt ids, the 24 greedy tokens
exactly, and logits: the first 8 of the prompt's last position (toy's
``logits``, which computes every row's head as llama.cpp's ``logits_all``
does) and the chosen token's logit at every greedy step through toy's decode
path (``generate``'s: a prefill of the prompt, then one-token decodes),
against llama.cpp's token-by-token decode. ``LOGIT_ATOL`` 1e-5 absolute (the
final soft-cap keeps every logit within ±4, where a float32 ulp is at most
4.8e-7). Measured under toy's haswell variant, in float32 (the fixture's
decimals round-trip the float32 values): the last-position heads
bit-identical (0.0) on every file and prompt, with and without the adapters
and on the fine-tune; the greedy-step logits bit-identical from the second
step on, and within 4.8e-7 at the first (9.5e-7 over the whole row): toy's
prefill computes the head for the last row only, llama.cpp with
``logits_all`` for every row, so that one product runs another CPU kernel.
Two things that look like disagreements and are not: a one-pass prefill
over prompt + tokens differs from a token-by-token decode by up to 1.6e-2
on the F32 files in llama.cpp itself as in toy (the same ggml sums in
another order move some value across a float16 rounding, of the K/V cache,
of the Q·K operand or of the GELU table, ~2^-11 relative; both ways
bit-identical on the Q8_0 files, whose integer dot products do not depend on
the batch shape), which is why the steps are compared decode to decode; and
under toy's AVX-512 variant (zen4) the F32 logits move from llama.cpp's by
up to 4.7e-3 (the tokens still agreed when measured), Q8_0 by up to 2e-4.
``min_margin``: the smallest is 1.1e-4 (gemma2-tiny F32 on the code prompt;
the next 5.3e-4, 25 of the 32 above 3e-3), over a hundred times the measured
differences, so the exact token comparison is not a coin toss.

Hugging Face (step 3 of the recorder, F32 files): its logits differ from
llama.cpp's by 2.5e-3 to 1.4e-2 (the float16 GELU table and F16 K/V), and
its greedy tokens part from llama.cpp's after 5, 4 and 21 of 24 steps on
three of the twelve prompts (gemma2-tiny and gemma3-tiny-untied on the code
prompt, gemma3-tiny on the numbers prompt); test_gemma.py compares toy with
HF on the exact GELU and an F32 cache instead.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from toy_testsupport import gemma_ref
from toy_testsupport import llamacpp_parity as parity
from toy_testsupport.llamacpp_parity import sha256_file, weights_sha256
from toy_testsupport.train_helpers import Batch

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "gemma_llamacpp.json"
LOGIT_ATOL = 1e-5  # |toy - llama.cpp|, logits within ±4 (final soft-cap); measured <= 4.8e-7 (haswell)
THREADS = 1
N_GEN = 24

# prompts of 22-25 tokens with BOS (the window is 8): prose, code (runs of
# spaces, newlines), digits split, accented letters and an emoji
PROMPTS = [
    "The weather was cold and windy, so we stayed",
    "def add(a, b):\n    return a + b\n",
    "Water boils at 100 degrees Celsius and",
    "Emoji \U0001f680 in Z\u00fcrich: 3.14 \u20ac",
]
# (shape, seed, outtype) of gemma_ref.gguf_path
MODELS = [
    ("gemma2-tiny", 0, "f32"),
    ("gemma3-tiny", 0, "f32"),
    ("gemma3-tiny-untied", 0, "f32"),
    ("gemma2-tiny", 0, "q8_0"),
    ("gemma3-tiny-untied", 0, "q8_0"),
]

# -- the adapters -------------------------------------------------------------------

# rank 4 on every Gemma target, alpha 8 (scale 2); std picked when recording so
# that the adapter changes llama.cpp's greedy tokens (the recorder refuses otherwise)
LORA_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
LORA = {
    "gemma3-tiny-untied": {"seed": 20251202, "rank": 4, "alpha": 8.0, "targets": LORA_TARGETS, "std": 0.1},
    "gemma2-tiny": {"seed": 20251203, "rank": 4, "alpha": 8.0, "targets": LORA_TARGETS, "std": 0.1},
}

REC = parity.Recorded(
    FIXTURE, gemma_ref, "record_gemma_llamacpp.py", lora=LORA, n_gen=N_GEN, threads=THREADS, atol=LOGIT_ATOL
)
FIX = REC.fix
# the recipes and toy's side, as the recorder imports them
lora_base, make_adapter, toy_tokens = REC.lora_base, REC.make_adapter, REC.toy_tokens


# -- the full fine-tune -------------------------------------------------------------

FT = {
    "base": ("gemma2-tiny", 0, "f32"),
    "steps": 8,
    "batch": 4,
    "context": 32,
    "lr": 1e-3,  # constant; AdamW otherwise OptimConfig's defaults
    "optim": {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0},
    "threads": 1,
    "gemm": False,
    "run_id": "gemma2-tiny-ft-fixture",
}
# ``gemm`` False: the products run on ggml's own kernels. toy's
# CPU GEMM (patch 0011, ``TrainModel.gemm``) sums in another order, and with it
# the same recipe trains other float32 weights (measured: the first loss 7.104992
# instead of 7.1049953), so the recipe names the kernel rather than following
# ArchTrain's default.


def ft_stream(gf) -> np.ndarray:
    """The fine-tune's token stream: every ``gemma_ref.CORPUS`` sentence in
    order, each as the file's tokenizer encodes it with its BOS."""
    from toy.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gf.metadata)
    out: list[int] = []
    for s in gemma_ref.CORPUS:
        ids = tok.encode(s, add_special=True)
        assert ids[0] == tok.bos_id
        out += ids
    return np.asarray(out, np.int32)


def ft_batches(stream: np.ndarray, bos: int) -> list[Batch]:
    """``FT["steps"]`` batches of ``FT["batch"]`` consecutive rows of
    ``FT["context"]`` tokens of the stream (step k, row r starts at token
    (k B + r) T; the target is the next token); a document starts at each
    BOS (positions restart, attention does not cross it) and the target that
    is the next document's BOS is masked."""
    B, T = FT["batch"], FT["context"]
    out = []
    for k in range(FT["steps"]):
        rows = [stream[(k * B + r) * T : (k * B + r) * T + T + 1] for r in range(B)]
        if any(len(r) != T + 1 for r in rows):
            raise ValueError("the corpus is too short for FT")
        tokens = np.stack([r[:-1] for r in rows]).astype(np.int32)
        targets = np.stack([r[1:] for r in rows]).astype(np.int32)
        doc = np.cumsum(tokens == bos, axis=1).astype(np.int32)
        pos = np.zeros_like(tokens)
        for b in range(B):
            p = 0
            for t in range(T):
                if t > 0 and tokens[b, t] == bos:
                    p = 0
                pos[b, t], p = p, p + 1
        mask = (targets != bos).astype(np.float32)
        out.append(Batch(tokens, targets, mask, pos, doc))
    return out


def finetune_checkpoint(folder: Path) -> tuple[Path, list[float]]:
    """Run ``FT`` and write its checkpoint under ``folder``; (the model file,
    the loss of each step)."""
    import toy_ggml
    from toy import models
    from toy.gguf import GGUFFile
    from toy.train import checkpoint
    from toy.train.model import ArchTrain
    from toy.train.optim import OptimConfig
    from toy.train.stepgraph import TrainEngine

    base = gemma_ref.gguf_path(*FT["base"])
    rt = toy_ggml.Runtime("cpu", threads=FT["threads"])
    try:
        with GGUFFile(base) as gf:
            cfg = models.config_from_gguf(gf)  # as the full recipe: the file's config, GELU "table"
            tok_meta = checkpoint.tokenizer_metadata_of(gf)
            stream = ft_stream(gf)
            model = ArchTrain(cfg)
            model.gemm = FT["gemm"]  # whatever ArchTrain's default (see FT)
            params = {s.name: np.array(gf.tensor_to_float(s.name), np.float32) for s in model.param_specs()}
            assert set(params) == set(gf.tensors)  # every tensor trained
        optim = OptimConfig(lr=FT["lr"], schedule="constant", **FT["optim"])
        eng = TrainEngine(model, params, rt, optim, batch=FT["batch"], context=FT["context"])
        try:
            losses = [eng.train_step([b], FT["lr"]).loss for b in ft_batches(stream, int(stream[0]))]
            path = checkpoint.save(
                folder,
                step=FT["steps"],
                cfg=cfg,
                params=eng.param_values(),
                optimizer=eng.optimizer_state(),
                tokenizer_metadata=tok_meta,
                state={"fixture": "test_gemma_llamacpp.FT", "recipe": FT},
                run_id=FT["run_id"],
            )
        finally:
            eng.close()
    finally:
        rt.close()
    return path, losses


needs_fixture = REC.needed


# -- tests ----------------------------------------------------------------------------


@needs_fixture
def test_the_fixture_is_of_these_recipes():
    ctx = FIX["context"]
    assert (ctx["kv_type"], ctx["flash_attn"], ctx["add_bos"], ctx["n_gen"]) == ("f16", False, True, N_GEN)
    assert [(m["recipe"]["shape"], m["recipe"]["seed"], m["recipe"]["outtype"]) for m in FIX["models"]] == MODELS
    assert all([p["text"] for p in m["prompts"]] == PROMPTS for m in FIX["models"])
    assert {lo["base"]["recipe"]["shape"]: lo["adapter"]["recipe"] for lo in FIX["lora"]} == LORA
    ft = FIX["finetune"]
    assert ft["recipe"] == {**FT, "base": list(FT["base"])}
    # every prompt runs past the window; the adapters and the fine-tune change tokens
    window = gemma_ref.SHAPES["gemma2-tiny"]["sliding_window"]
    assert all(len(p["ids"]) > 2 * window for m in FIX["models"] for p in m["prompts"])
    assert all(any(lo["changed"]) for lo in FIX["lora"]) and any(ft["changed"])


@needs_fixture
@pytest.mark.parametrize("rec", REC.model_params())
def test_prompt_ids_equal_llamacpp(rec):
    """toy's tokenizer (BOS added, as the file says) gives HF's ids, which
    are llama.cpp's (checked when recording)."""
    import toy

    with toy.load(REC.model_file(rec), threads=THREADS, n_ctx=64) as m:
        assert m.tokenizer.bos_id == 2
        for p in rec["prompts"]:
            assert m.tokenize(p["text"]) == p["ids"], p["text"]
            assert p["ids"][0] == 2 and p["ids"][1] != 2


@needs_fixture
@pytest.mark.avx2_reference
@pytest.mark.parametrize("rec", REC.model_params())
def test_greedy_tokens_equal_llamacpp(rec):
    REC.assert_model_like_llamacpp(rec)


@needs_fixture
@pytest.mark.parametrize("lo", REC.lora_params())
def test_adapter_is_the_recorded_file(lo, tmp_path):
    from toy.adapters import load_adapter

    shape = lo["base"]["recipe"]["shape"]
    _, path = REC.lora_files(lo, tmp_path)  # the recorded recipe, base and adapter bytes
    ad = load_adapter(path)
    n_layer = gemma_ref.SHAPES[shape]["num_hidden_layers"]
    assert ad.architecture == shape[:6] and ad.rank == 4 and len(ad.pairs) == n_layer * len(LORA_TARGETS)


@needs_fixture
@pytest.mark.avx2_reference
@pytest.mark.parametrize("lo", REC.lora_params())
def test_lora_greedy_tokens_equal_llamacpp(lo, tmp_path):
    REC.assert_lora_like_llamacpp(lo, tmp_path)


@needs_fixture
@pytest.mark.avx2_reference
def test_finetune_checkpoint_is_the_recorded_file_and_llama_cpp_agrees(tmp_path):
    from toy.gguf import GGUFFile

    ft = FIX["finetune"]
    base = gemma_ref.gguf_path(*FT["base"])
    assert sha256_file(base) == ft["base_sha256"]
    with GGUFFile(base) as gf:
        assert hashlib.sha256(ft_stream(gf).tobytes()).hexdigest() == ft["stream_sha256"]
    path, losses = finetune_checkpoint(tmp_path / "ckpt")
    assert losses[-1] < losses[0]  # it learns
    with GGUFFile(path) as gf:
        md = gf.metadata
        assert md["general.architecture"] == "gemma2" and md["general.name"] == FT["run_id"]
        assert md["toy.train.step"] == FT["steps"] and md["tokenizer.ggml.model"] == "llama"
    wsha = weights_sha256(path)
    if wsha != ft["weights_sha256"]:
        pytest.skip(
            "this CPU trained other float32 weights than the recorded ones (llama.cpp ran those): "
            f"losses {losses} against the recorded {ft['losses']}"
        )
    assert sha256_file(path) == ft["sha256"]  # the whole file, metadata included, byte for byte
    got = toy_tokens(path, [p["text"] for p in ft["prompts"]])
    REC.assert_like_llamacpp(got, ft["prompts"], "fine-tune")
