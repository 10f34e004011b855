"""The fine-tuning recipes on Gemma GGUFs: LoRA and full fine-tunes through
``toy.train.lmrun.train`` / ``resume`` (the entry points of the llama recipe
tests), on ``gemma_ref``'s converted Gemma 2 (sliding window 8 on layers 0
and 2, soft-caps 8 and 4, tied head) and Gemma 3 (QK-norm, six sliding
layers of seven, linear RoPE scaling on the global one, an untied head with
a final soft-cap). Rows are 48 positions, six times the window.

The data is JSONL in all three formats, ``messages`` rendered by the
model's own chat template (Gemma 2's, which every ``gemma_ref`` file carries).

Where each expectation comes from:

- resume: a run stopped at step k and resumed equals the uninterrupted run
  (as test_train_recipes.py asserts for llama): step losses, the adapter's
  A/B (LoRA) or every weight (full), and the AdamW moments, bit for bit;
- the adapter at inference: ``toy.load(base, lora=adapter)`` against the
  merged model ``toy.merge`` writes (W + s·B·A in float64, then the
  plain forward), both with an F32 KV cache, on 24 tokens (three windows),
  within ``TOL`` of the largest logit (float32 rounding, which ggml's
  float16 GELU table can turn into a float16 step); the adapter's effect on
  the logits is over 100 times that;
- the training graph: a LoRA run's step-0 validation loss (B = 0, the
  base) against the mean NLL the inference engine (``toy.load``) gives the
  same validation examples one at a time, within 1e-4 relative (measured
  3e-6): the recipe path builds the windows and soft-caps the registry
  says, as the KV-cache engine does;
- the full fine-tune's checkpoint: its metadata against the base's
  (``toy.gguf.GGUFFile``: every key but the file type and toy's training
  keys, with its on-disk type), its config against the base's, and
  ``toy.load`` runs it;
- eval: ``toy.eval.lmc`` between the base and its full fine-tune (an
  engine of its own over interpolated weights) against
  ``toy.eval.perplexity`` of each end through ``toy.load``: equal to the
  last bit at alpha 0 and 1, as ``toy.eval.lmc`` promises for F32 files;
- the chat template: the ``messages`` example's tokens against the
  template's text tokenized (``Tokenizer.encode``), its loss spans decoded
  against the assistant contents plus ``<end_of_turn>``. Gemma 2's template
  has no system role: it calls ``raise_exception('System role not
  supported')``, and toy reports that as a ``DataError`` naming the file
  and line (training) or a ``ChatTemplateError`` (inference).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import toy
from toy import models
from toy.adapters import load_adapter
from toy.gguf import GGUFFile
from toy.tokenizer import ChatTemplate, ChatTemplateError, Tokenizer
from toy.train.data import DataError
from toy.train.instruct import load_examples
from toy.train.lmrun import train
from toy_testsupport import gemma_ref
from toy_testsupport import train_helpers as th
from toy_testsupport.gpt2_ref import sha256 as sha
from toy_testsupport.train_helpers import assert_full_checkpoints, events, loss_spans

SHAPES = ("gemma2-tiny", "gemma3-tiny-untied")
CONTEXT = 48  # six windows of 8
# adapter applied vs merged weights: float32 rounding, except that ggml's GELU reads a float16 table
# (its input rounded to float16), so a rounding-level change in the gate's product can move a GELU
# output by a float16 step (observed 1.3e-4 of the largest |logit|)
TOL = 2e-3
CHAT = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Bye now."},
]


def base_path(shape: str) -> Path:
    return gemma_ref.gguf_path(shape, 0, "f32")


def ids_past_the_window(n: int = 24) -> list[int]:
    """BOS, then text-ish ids: three windows of 8."""
    return [2] + [int(t) for t in np.random.default_rng(5).integers(8, gemma_ref.sp_vocab_size(), n - 1)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """48 examples, 16 of each format, 17 to 29 tokens: each fits a row, and passes the window."""
    path = tmp_path_factory.mktemp("gemma-data") / "data.jsonl"
    return th.write_examples(path, 48, ("text", "prompt_completion", "messages"))


def cfg_for(shape: str, recipe: str, data: Path, out: Path, steps: int, **kw):
    return th.recipe_config(recipe, base_path(shape), data, out, steps, CONTEXT, **kw)


def resumed(cfg, tmp: Path, stop: int):
    """The run straight and stopped after ``stop`` steps and resumed, checked
    alike (``train_helpers.resumed_run``): (straight, resumed, the base's config)."""
    return th.resumed_run(cfg, tmp, stop, {"text": 16, "prompt_completion": 16, "messages": 16})


# ---------------------------------------------------------------- the chat template


def test_messages_are_rendered_by_the_gemma_template(tmp_path):
    """A two-turn conversation: the tokens are the template's text
    (``<start_of_turn>model``, not ``assistant``), the targets the two
    replies with their ``<end_of_turn>``, nothing else."""
    with GGUFFile(base_path("gemma2-tiny")) as gf:
        tok, tpl = Tokenizer.from_gguf(gf.metadata), ChatTemplate.from_gguf(gf.metadata)
    assert not tpl.is_default
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    (ex,), st = load_examples(path, tok, tpl, max_length=200)
    text = tpl.render(CHAT, add_generation_prompt=False)
    assert text == (
        "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\nBye now.<end_of_turn>\n"
    )
    assert ex.tokens.tolist() == tok.encode(text, add_special=False, special=True)
    assert ex.tokens[0] == tok.bos_id  # once: the template's {{ bos_token }}
    end_of_turn = tok.token_to_id("<end_of_turn>")
    assert end_of_turn in tok.eog_ids

    assert not ex.loss[-1]  # the last token (the template's newline) is no target
    assert loss_spans(tok, ex) == ["Hello!<end_of_turn>", "Bye now.<end_of_turn>"]
    assert st.kinds == {"messages": 1}


def test_a_system_message_is_a_clear_error(tmp_path, data):
    """Gemma 2's template has no system role: the line is refused naming the
    file, the line and the template's reason, before any step; the
    inference prompt path raises the template's error too."""
    path = tmp_path / "system.jsonl"
    ok = {"messages": CHAT[:2]}
    sys_row = {"messages": [{"role": "system", "content": "Be brief."}, *CHAT[:2]]}
    path.write_text(json.dumps(ok) + "\n" + json.dumps(sys_row) + "\n")
    with GGUFFile(base_path("gemma2-tiny")) as gf:
        tok, tpl = Tokenizer.from_gguf(gf.metadata), ChatTemplate.from_gguf(gf.metadata)
    with pytest.raises(DataError, match=rf"{path}:2: chat template: .*System role not supported"):
        load_examples(path, tok, tpl, max_length=200)
    cfg = cfg_for("gemma2-tiny", "lora", path, tmp_path / "runs", 2, **{"data.paths": [str(data), str(path)]})
    with pytest.raises(DataError, match=r"system\.jsonl:2: .*System role not supported"):
        train(cfg)
    assert not any((tmp_path / "runs").glob("*/checkpoints/*.gguf"))
    with toy.load(base_path("gemma2-tiny"), threads=1, n_ctx=64) as m:
        with pytest.raises(ChatTemplateError, match="System role not supported"):
            m.prompt_ids([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
        # without it, the template's prompt, one BOS (the template's: the tokenizer adds none on top)
        got = m.prompt_ids(CHAT[:1])
        assert got == tok.encode(tpl.render(CHAT[:1], add_generation_prompt=True), add_special=False, special=True)
        assert got.count(tok.bos_id) == 1 and got[0] == tok.bos_id


# ---------------------------------------------------------------- training graph = inference engine


@pytest.mark.parametrize("shape", SHAPES)
def test_the_runs_base_loss_is_the_inference_engines(shape, data, tmp_path):
    """The step-0 validation loss of a LoRA run (B = 0: the base model),
    computed by the recipe's training graph over packed rows (block-causal,
    the model's windows and soft-caps), equals the mean NLL of the same
    validation examples' targets from ``toy.load``'s KV-cache engine, one
    example at a time (three examples of 20 to 26 tokens, one of each
    format; windows of 8). Measured: 1e-6 and 3e-6 relative; ignoring the
    window moves this loss by 5%, ignoring Gemma 2's attention cap by 1%."""
    cfg = cfg_for(shape, "lora", data, tmp_path, 1, eval_every=1, save_every=0, sample_tokens=0)
    res = train(cfg)
    (first, *_) = [e for e in events(res.run_dir) if e["kind"] == "eval"]
    assert first["step"] == 0

    from toy.train.instruct import InstructData

    with toy.load(base_path(shape), threads=1, kv_type="f32") as m:
        exs, _ = load_examples(data, m.tokenizer, m.chat_template, max_length=CONTEXT + 1)
        packed = InstructData(exs, CONTEXT, val_fraction=cfg.data.val_fraction)
        val = [exs[i] for row in packed.rows[packed.n_train :] for i in row]
        assert val and max(len(e.tokens) for e in val) > 8  # the windows bite
        total, n = 0.0, 0
        for ex in val:
            z = m.logits(ex.tokens[:-1].tolist()).astype(np.float64)
            logp = z - z.max(1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(1, keepdims=True))
            keep = ex.loss[1:]
            total -= float(logp[np.arange(len(z)), ex.tokens[1:]][keep].sum())
            n += int(keep.sum())
    assert first["tokens"] == n
    assert first["loss"] == pytest.approx(total / n, rel=1e-4)


# ---------------------------------------------------------------- LoRA


@pytest.mark.parametrize("shape", SHAPES)
def test_lora_run_resumes_exactly_and_its_adapter_loads(shape, data, tmp_path):
    base = base_path(shape)
    before = sha(base)
    targets = ["q", "v", "o", "gate", "down"]
    cfg = cfg_for(shape, "lora", data, tmp_path / "a", 6, **{"lora.targets": targets, "lora.rank": 4, "optim.lr": 1e-2})
    straight, done, mcfg = resumed(cfg, tmp_path, 2)
    assert straight.checkpoint.name == done.checkpoint.name == "step_6.gguf"

    ad, bd = load_adapter(straight.checkpoint), load_adapter(done.checkpoint)
    assert ad.architecture == mcfg.architecture and (ad.rank, ad.alpha) == (4, 16.0)
    stems = ("attn_q", "attn_v", "attn_output", "ffn_gate", "ffn_down")
    assert set(ad.pairs) == set(bd.pairs) == {f"blk.{i}.{s}.weight" for i in range(mcfg.n_layer) for s in stems}
    for k in ad.pairs:
        for x, y in zip(ad.pairs[k], bd.pairs[k]):
            assert x.tobytes() == y.tobytes(), k
    assert any(np.abs(b).max() > 0 for _, b in ad.pairs.values())  # B moved off zero
    assert sha(base) == before  # the base is never written

    # toy.load applies the adapter: the logits of the merged weights, not the base's
    from toy.merge import merge_adapters

    merged = tmp_path / "merged.gguf"
    merge_adapters(base, [(straight.checkpoint, 1.0)], merged, drift=False)
    ids = ids_past_the_window()
    with toy.load(base, threads=1, kv_type="f32") as m:
        plain = m.logits(ids)
    with toy.load(base, threads=1, kv_type="f32", lora=str(straight.checkpoint)) as m:
        assert m.adapters == [(str(straight.checkpoint), 1.0)]
        adapted = m.logits(ids)
    with toy.load(merged, threads=1, kv_type="f32") as m:
        want = m.logits(ids)
    tol = TOL * float(np.abs(want).max())
    np.testing.assert_allclose(adapted, want, rtol=0, atol=tol)
    assert float(np.abs(adapted - plain)[8:].max()) > 100 * tol  # past the window too
    assert sha(base) == before


# ---------------------------------------------------------------- full fine-tune


@pytest.mark.parametrize("shape", SHAPES)
def test_full_fine_tune_resumes_exactly_and_keeps_the_gemma_keys(shape, data, tmp_path):
    base = base_path(shape)
    before = sha(base)
    cfg = cfg_for(shape, "full", data, tmp_path / "f", 5, **{"optim.lr": 1e-3})
    straight, done, bcfg = resumed(cfg, tmp_path, 3)
    arch = bcfg.architecture
    assert sha(base) == before

    with GGUFFile(straight.checkpoint) as a, GGUFFile(done.checkpoint) as b, GGUFFile(base) as gf:
        # the weights: the resumed run's equal the straight run's; every base tensor, trained; the metadata:
        # the base's, key for key and type for type (architecture, window, caps, RoPE, tokenizer)
        assert_full_checkpoints(a, b, gf, arch, 5)
        assert not np.array_equal(a.tensor_to_float("blk.0.attn_q.weight"), gf.tensor_to_float("blk.0.attn_q.weight"))
        if not bcfg.tied_output:
            assert not np.array_equal(a.tensor_to_float("output.weight"), gf.tensor_to_float("output.weight"))
        assert a.metadata[f"{arch}.attention.sliding_window"] == 8
        if arch == "gemma2":
            caps = a.metadata["gemma2.attn_logit_softcapping"], a.metadata["gemma2.final_logit_softcapping"]
            assert caps == (8.0, 4.0)
        else:
            assert a.metadata["gemma3.rope.freq_base_swa"] == 10000.0 and a.metadata["gemma3.rope.freq_base"] == 1e6
            assert a.metadata["gemma3.rope.scaling.type"] == "linear" and a.metadata["gemma3.final_logit_softcapping"]
        assert models.config_from_gguf(a) == bcfg  # the same model, read back

    ids = ids_past_the_window()
    with toy.load(base, threads=1, kv_type="f32") as m:
        plain = m.logits(ids)
    with toy.load(straight.checkpoint, threads=1, kv_type="f32") as m:
        assert m.cfg == bcfg
        tuned = m.logits(ids)
        out = m.generate(CHAT[:1], max_tokens=6, temperature=0, ignore_eos=True)
    assert np.isfinite(tuned).all() and float(np.abs(tuned - plain).max()) > 1e-3
    assert len(out.tokens) == 6


# ---------------------------------------------------------------- eval over the fine-tune


@pytest.mark.parametrize("shape", SHAPES)
def test_perplexity_and_lmc_between_the_base_and_its_fine_tune(shape, data, tmp_path):
    """``toy.eval``: the perplexity of both ends (``toy.load``), and the loss
    along the line between them (``lmc``, its own engine over interpolated
    weights), whose end points are those perplexities to the last bit (as
    ``toy.eval.lmc`` promises for F32 checkpoints); 32-token windows, four
    of the model's windows each."""
    from toy.eval import lmc, perplexity

    base = base_path(shape)
    res = train(cfg_for(shape, "full", data, tmp_path, 2, eval_every=0, save_every=0, sample_tokens=0))
    ids = ids_past_the_window(97)
    nll = []
    for path in (base, res.checkpoint):
        with toy.load(path, threads=1, n_ctx=32) as m:
            nll.append(perplexity(m, ids, context=32).nll)
    r = lmc(base, res.checkpoint, ids, alphas=(0.0, 0.5, 1.0), context=32, threads=1)
    assert [p.alpha for p in r.points] == [0.0, 0.5, 1.0] and r.n_scored > 0
    assert (r.points[0].nll, r.points[-1].nll) == tuple(nll)
    assert nll[0] != nll[1] and all(math.isfinite(p.nll) for p in r.points) and r.barrier is not None
