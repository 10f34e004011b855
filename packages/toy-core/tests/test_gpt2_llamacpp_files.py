"""GPT-2 files toy writes, loaded by llama.cpp: a from-scratch checkpoint and
a LoRA adapter give toy's greedy tokens there.

Fixture: ``fixtures/gpt2_train_llamacpp.json``, written in two steps by
``tools/fixtures/record_gpt2_train.py`` (step 1, toy's venv: the files and
toy's own tokens; step 2, llama-cpp-python 0.3.36's venv: llama.cpp's tokens
on the very files step 1 kept, checked by sha256: the checkpoint's with its run
id normalized, see below). Its docstring says how.
This module holds the recipes (``write_corpus``, ``train_checkpoint``,
``make_gpt2_adapter``) that the recorder imports, so the test re-creates the
same files.

- ``train``: ``toy train from-scratch --arch gpt2 --preset tiny`` (d 128, 4
  layers, 4 heads, FFN 512; a 320-token BPE; batch 4 x 64; 120 steps, seed
  0, one thread) on a counting corpus made here from arithmetic alone (lines
  of English number words counting up: "thirty-one thirty-two ..."). Python's
  documentation topics (the demo corpus) were tried first: at this size
  greedy decoding from them is one whitespace token repeated (also what
  ``train_runs.json`` records for a 300-step llama), which proves little;
  counting makes the greedy text change every few tokens and depend on the
  prompt, so a wrong position, attention or head would show.

  The checkpoint is not byte-identical run to run: its metadata holds the
  run id (``general.name`` and ``toy.train.run_id``), made of the start time
  and 4 random hex digits. Everything else is: the fixture keeps
  ``normalized_sha256``, the file's sha256 with every occurrence of the run
  id (always 26 characters, so no offset moves) replaced by
  ``RUN_ID_PLACEHOLDER``, and ``weights_sha256`` (the tensors alone, as
  ``test_train_pinned.py`` computes it). On a CPU with the recorded ggml
  features both must match; elsewhere the float sums may differ, and the
  llama.cpp comparison (which is about the recorded weights) is skipped
  with that reason.

- ``lora``: a seeded random adapter on the tiny converted GPT-2 of
  ``gpt2_ref`` (HF ``GPT2LMHeadModel`` with seeded weights, converted by
  llama.cpp's own converter: ``gguf_path("tiny", 0, "f32")``, deterministic,
  checked by sha256): rank 4 on ``qkv``, ``o``, ``up`` and ``down`` of both
  layers, A and B ``std · N(0, 1)`` from one ``np.random.default_rng(seed)``,
  written with ``toy.adapters.save_adapter``. The recorder refused to
  write unless the adapter changes llama.cpp's greedy tokens.

What is compared: the prompt ids (llama.cpp's tokenizer on the embedded
vocabulary must give toy's), the 16 greedy tokens (exactly), and logits
where both sides use an F16 KV cache: the train model's whole last-prompt-
position row and the chosen token's logit at every greedy step, the
adapter's top-8 at the last prompt position (with and without it).
``LOGIT_TOL`` (5e-4) is relative to the row's largest |logit|: both sides
run ggml's CPU kernels, so only summation order may differ (llama.cpp's
build has AVX2, toy's may pick other paths on another CPU). Measured when
recording (the fixture's ``measured``): the last-prompt rows bit-identical
(0.0), the greedy-step logits 8.8e-6 (toy's one-pass prefill against
llama.cpp's token-by-token decode), the adapter's top-8 3.1e-8. The
smallest top-1 minus top-2 gap over the greedy steps (``min_margin``) is
0.0026 (train) and 0.0062 (adapter), hundreds of times the measured
differences, so the exact token comparison is not a coin toss.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

import toy_ggml
from toy_testsupport import gpt2_ref
from toy_testsupport.llamacpp_parity import sha256_file, weights_sha256
from toy_testsupport.train_helpers import seeded_adapter

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "gpt2_train_llamacpp.json"
FIX = json.loads(FIXTURE.read_text()) if FIXTURE.is_file() else None
SAME_CPU = FIX is not None and sorted(k for k, v in toy_ggml.cpu_features().items() if v) == FIX["cpu_features"]
LOGIT_TOL = 5e-4  # |toy - llama.cpp| / max|llama.cpp logit| (F16 KV on both sides); measured <= 1.2e-6
N_GEN = 16

# -- the from-scratch run ---------------------------------------------------------

# what `toy train from-scratch --arch gpt2 --preset tiny --vocab-size 320 -b 4
# --context 64 --steps 120 --seed 0 -t 1 --eval-every 0 --save-every 0 CORPUS`
# sets (toy_cli.commands.train), without samples
RUN = {
    "model.arch": "gpt2",
    "model.preset": "tiny",
    "tokenizer.vocab_size": 320,
    "batch_size": 4,
    "context": 64,
    "steps": 120,
    "seed": 0,
    "threads": 1,
    "eval_every": 0,
    "save_every": 0,
    "sample_tokens": 0,
}
TRAIN_PROMPTS = ["seven eight nine", "thirty-one thirty-two", "sixty"]
RUN_ID_PLACEHOLDER = "train-00000000-000000-0000"

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen"
).split()
_TENS = "- - twenty thirty forty fifty sixty seventy eighty ninety".split()
CORPUS_LINES = 3000


def number_word(n: int) -> str:
    """0..99 in English words: 42 -> "forty-two"."""
    if n < 20:
        return _ONES[n]
    t, o = divmod(n, 10)
    return _TENS[t] + (f"-{_ONES[o]}" if o else "")


def corpus_text() -> str:
    """The counting corpus: line i counts up from (37 i mod 85) for
    6 + (7 i mod 11) numbers (stopping at 99), words joined by spaces, a
    full stop at the end. Arithmetic only: no RNG, no version to drift."""
    lines = []
    for i in range(CORPUS_LINES):
        start, n = (37 * i) % 85, 6 + (7 * i) % 11
        lines.append(" ".join(number_word(k) for k in range(start, min(start + n, 100))) + ".")
    return "\n".join(lines) + "\n"


def write_corpus(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "counting.txt"
    path.write_text(corpus_text(), encoding="utf-8")
    return path


def train_checkpoint(work: Path, run: dict | None = None) -> tuple[Path, str]:
    """Run ``run`` (default ``RUN``) on the counting corpus under ``work``;
    (the final checkpoint, the run id)."""
    from toy.train import config as C
    from toy.train.lmrun import train

    corpus = write_corpus(work / "corpus")
    values = {**(run or RUN), "data.paths": [str(corpus)], "data.cache_dir": str(work / "cache")}
    values["out"] = str(work / "runs")
    res = train(C.override(C.TrainConfig(), **values))
    if res.reason != "completed":
        raise RuntimeError(f"the pinned run ended {res.reason!r}")
    return Path(res.run_dir) / "checkpoints" / f"step_{values['steps']}.gguf", res.run_id


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def normalized_sha256(path: Path, run_id: str) -> str:
    """The file's sha256 with the run id replaced by ``RUN_ID_PLACEHOLDER``
    (same length, so every offset stays); it must occur exactly twice
    (``general.name``, ``toy.train.run_id``)."""
    data = Path(path).read_bytes()
    if len(run_id) != len(RUN_ID_PLACEHOLDER):
        raise ValueError(f"run id {run_id!r} is not {len(RUN_ID_PLACEHOLDER)} characters")
    if data.count(run_id.encode()) != 2:
        raise ValueError(f"{path}: the run id occurs {data.count(run_id.encode())} times, not 2")
    return sha256_bytes(data.replace(run_id.encode(), RUN_ID_PLACEHOLDER.encode()))


# -- the adapter --------------------------------------------------------------------

# rank 4 on every GPT-2 target, alpha 8 (scale 2); std picked when recording so
# that the adapter changes greedy tokens while the text stays GPT-2 tokens
LORA_RECIPE = {"seed": 20251201, "rank": 4, "alpha": 8.0, "targets": ["qkv", "o", "up", "down"], "std": 0.05}
LORA_PROMPTS = ["The capital of France is", "Once upon a time, there was a little", "1, 2, 3, 4, 5,"]
LORA_BASE_NAME = "gpt2-tiny-seed0-f32.gguf"


def make_gpt2_adapter(base_path, out_path, **recipe) -> Path:
    """The adapter of the fixture (``train_helpers.seeded_adapter``, base name ``LORA_BASE_NAME``)."""
    return seeded_adapter(base_path, out_path, base_name=LORA_BASE_NAME, **recipe)


# -- toy's side (the recorder calls these too) ---------------------------------------


def toy_tokens(model_path, prompts, lora=None) -> dict:
    """toy's prompt ids, greedy tokens, the last prompt position's logits
    and the chosen token's logit at each greedy step (F16 KV cache)."""
    import toy

    out = {"prompt_ids": [], "greedy": [], "last_prompt_logits": [], "greedy_logits": []}
    with toy.load(model_path, threads=1, lora=lora, n_ctx=64) as m:
        for p in prompts:
            ids = m.tokenize(p, add_special=False)
            g = m.generate(ids, max_tokens=N_GEN, temperature=0, ignore_eos=True).tokens
            rows = np.asarray(m.logits(ids + g[:-1]), np.float64)  # row j predicts token j + 1
            out["prompt_ids"].append(list(ids))
            out["greedy"].append(list(g))
            out["last_prompt_logits"].append(rows[len(ids) - 1])
            out["greedy_logits"].append([float(rows[len(ids) - 1 + k, t]) for k, t in enumerate(g)])
    return out


def assert_logits_close(got, want, what: str, tol: float = LOGIT_TOL) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err < tol, f"{what}: relative logit difference {err:.3g} >= {tol}"
    return err


needs_fixture = pytest.mark.skipif(FIX is None, reason=f"{FIXTURE.name} not recorded yet")


# -- tests ------------------------------------------------------------------------


@needs_fixture
def test_counting_corpus_is_the_recorded_one():
    assert sha256_bytes(corpus_text().encode()) == FIX["train"]["corpus_sha256"]
    assert number_word(0) == "zero" and number_word(42) == "forty-two" and number_word(90) == "ninety"


@needs_fixture
@pytest.mark.slow  # the 120-step run takes ~12 s on one thread
@pytest.mark.avx2_reference  # recorded on the AVX2 CPU variant (SAME_CPU compares its features)
def test_gpt2_checkpoint_is_the_recorded_file_and_llama_cpp_agrees(tmp_path):
    from toy.gguf import GGUFFile

    want = FIX["train"]
    assert want["config"] == RUN and want["prompts"] == TRAIN_PROMPTS
    ckpt, run_id = train_checkpoint(tmp_path)
    with GGUFFile(ckpt) as gf:
        md = gf.metadata
        assert md["general.architecture"] == "gpt2" and md["general.type"] == "model"
        assert md["general.name"] == run_id and md["toy.train.run_id"] == run_id  # the only run-dependent bytes
    norm, wsha = normalized_sha256(ckpt, run_id), weights_sha256(ckpt)
    if SAME_CPU:
        assert wsha == want["weights_sha256"]
        assert norm == want["normalized_sha256"]  # the whole file but the run id, byte for byte
    got = toy_tokens(ckpt, TRAIN_PROMPTS)
    lc = want["llama_cpp"]
    assert got["prompt_ids"] == lc["prompt_ids"]  # llama.cpp reads the embedded BPE the same
    if wsha != lc["weights_sha256"]:
        pytest.skip("this CPU trained other float32 weights than the recorded ones (llama.cpp ran those)")
    assert got["greedy"] == lc["greedy"]
    for i, p in enumerate(TRAIN_PROMPTS):
        assert_logits_close(got["last_prompt_logits"][i], lc["last_prompt_logits"][i], f"{p!r} last prompt row")
        scale = float(np.abs(lc["last_prompt_logits"][i]).max())
        err = np.abs(np.subtract(got["greedy_logits"][i], lc["greedy_logits"][i])).max() / scale
        assert err < LOGIT_TOL, f"{p!r}: greedy-step logits differ by {err:.3g} of the row scale"
    assert any(len(set(g)) >= 6 for g in lc["greedy"])  # not one token repeated


@needs_fixture
def test_gpt2_lora_adapter_is_the_recorded_file_and_llama_cpp_agrees(tmp_path):
    from toy.adapters import load_adapter

    want = FIX["lora"]
    assert want["adapter"]["recipe"] == LORA_RECIPE and want["prompts"] == LORA_PROMPTS
    g = gpt2_ref
    base = g.gguf_path("tiny", 0, "f32")
    assert want["base"]["recipe"] == g.recipe("tiny", 0, "f32")
    assert sha256_file(base) == want["base"]["sha256"]
    path = make_gpt2_adapter(base, tmp_path / "gpt2-lora.gguf", **LORA_RECIPE)
    assert sha256_file(path) == want["adapter"]["sha256"]  # numpy's stream and toy's writer: the same bytes
    ad = load_adapter(path)
    assert ad.architecture == "gpt2" and ad.rank == 4 and len(ad.pairs) == 2 * 4
    lc = want["llama_cpp"]
    plain = toy_tokens(base, LORA_PROMPTS)
    with_lora = toy_tokens(base, LORA_PROMPTS, lora=[(path, 1.0)])
    assert plain["prompt_ids"] == with_lora["prompt_ids"] == lc["prompt_ids"]
    assert plain["greedy"] == lc["base_greedy"]
    assert with_lora["greedy"] == lc["lora_greedy"]
    assert lc["base_greedy"] != lc["lora_greedy"]  # the adapter matters (the recorder refuses otherwise)
    for i, p in enumerate(LORA_PROMPTS):
        for side, got in (("base", plain), ("lora", with_lora)):
            ids, vals = lc[f"{side}_top8"][i]
            assert_logits_close(got["last_prompt_logits"][i][ids], vals, f"{p!r} {side} top-8")
