"""What the llama.cpp parity tests share (test-only helper): file digests,
toy's side of a greedy comparison and the comparison itself.

- ``sha256_file(path)``: a file's sha256 (``gpt2_ref.sha256``, the one of
  tools/fetch_ggml.py); ``weights_sha256(path)``: the sha256 over a GGUF's
  tensors (name, then bytes, in name order), the weights without the
  metadata (which names a training run): what test_train_pinned.py,
  test_gpt2_llamacpp_files.py, test_gemma_llamacpp.py and
  tools/fixtures/record_train.py record and compare.
- ``toy_tokens(path, prompts, ...)``: toy's prompt ids, greedy tokens, last
  prompt position's logits and each greedy step's chosen logit through the
  decode path ``generate`` takes; ``logit_diffs`` and ``assert_like_llamacpp``
  compare them with a fixture's per-prompt records (``ids``, ``greedy``,
  ``last_logits_head``, ``greedy_logits``).
- ``Recorded``: one fixture file recorded on a reference helper's models
  (``gemma_ref``, ``moe_ref``): its records as pytest parameters, each model
  file re-created and checked by sha256, the seeded LoRA adapters, and the
  checks the fixture's test modules run alike.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from toy_testsupport import gpt2_ref
from toy_testsupport.train_helpers import seeded_adapter

sha256_file = gpt2_ref.sha256


def weights_sha256(path) -> str:
    """sha256 over a GGUF's tensors (name, then raw bytes, in name order):
    the weights without the metadata (which holds a run's id)."""
    from toy.gguf import GGUFFile

    h = hashlib.sha256()
    with GGUFFile(path) as gf:
        for name in sorted(gf.tensors):
            h.update(name.encode() + b"\0")
            h.update(gf.tensor_bytes(name))
    return h.hexdigest()


def toy_tokens(model_path, prompts, *, n_gen: int, threads: int = 1, lora=None) -> dict:
    """toy's prompt ids (its tokenizer, the file's BOS rule), greedy tokens
    (``generate``), the prompt's last-position logits (``logits``: every
    row's head computed, as llama.cpp's ``logits_all``) and the chosen
    token's logit at each greedy step through the decode path ``generate``
    takes (the engine's prefill of the prompt, then one-token decodes), all
    with toy's defaults: F16 KV cache, no flash attention (and Gemma's GELU
    "table"). The weights stay in the file's layout (``repack=False``): the
    records whose files have repackable types are llama.cpp's plain CPU
    kernels (``use_extra_bufts`` false), which toy's plain ones equal."""
    import toy

    out = {"prompt_ids": [], "greedy": [], "last_prompt_logits": [], "greedy_logits": []}
    load = {"n_ctx": 256, "kv_type": "f16", "flash_attn": False, "repack": False}
    with toy.load(model_path, threads=threads, lora=lora, **load) as m:
        for p in prompts:
            ids = m.tokenize(p)
            g = m.generate(ids, max_tokens=n_gen, temperature=0, ignore_eos=True).tokens
            last = np.asarray(m.logits(ids)[-1], np.float32)
            eng = m.engine
            eng.cache.clear(0)
            try:
                rows = [eng.prefill(0, ids)] + [eng.decode([0], [t])[0] for t in g[:-1]]
            finally:
                eng.cache.clear(0)
            assert [int(np.argmax(r)) for r in rows] == list(g)  # the same path as generate
            out["prompt_ids"].append(list(ids))
            out["greedy"].append(list(g))
            out["last_prompt_logits"].append(last)
            out["greedy_logits"].append(np.array([r[t] for r, t in zip(rows, g)], np.float32))
    return out


def logit_diffs(got: dict, prompts: list[dict]) -> tuple[float, float]:
    """max |toy - llama.cpp| over the prompts: (last-position heads, greedy
    steps), in float32 (the fixture's decimals round-trip float32 values)."""
    head = step = 0.0
    for i, p in enumerate(prompts):
        want = np.asarray(p["last_logits_head"], np.float32)
        head = max(head, float(np.abs(got["last_prompt_logits"][i][: len(want)] - want).max()))
        step = max(step, float(np.abs(got["greedy_logits"][i] - np.asarray(p["greedy_logits"], np.float32)).max()))
    return head, step


def assert_like_llamacpp(got: dict, prompts: list[dict], what: str, atol: float) -> None:
    """toy's ``toy_tokens`` against a fixture's per-prompt records: the ids
    and greedy tokens exactly, the logits within ``atol``."""
    for i, p in enumerate(prompts):
        assert got["prompt_ids"][i] == p["ids"], f"{what} {p['text']!r}: prompt ids"
        assert got["greedy"][i] == p["greedy"], f"{what} {p['text']!r}: greedy tokens"
    head, step = logit_diffs(got, prompts)
    assert head <= atol, f"{what}: last-position logits differ from llama.cpp's by {head:.3g}"
    assert step <= atol, f"{what}: greedy-step logits differ from llama.cpp's by {step:.3g}"


def recipe_id(r: dict) -> str:
    return f"{r['shape']}-seed{r['seed']}-{r['outtype']}"


class Recorded:
    """A llama.cpp fixture (``fixtures/NAME``, or None before it is recorded)
    of files a reference helper ``ref`` makes (``ref.gguf_path``,
    ``ref.recipe``), recorded by ``tools/fixtures/RECORDER``; ``lora``: the
    adapters' recipes by base shape (``train_helpers.seeded_adapter``).
    ``n_gen``, ``threads`` and ``atol`` are the test module's comparison."""

    def __init__(self, path: Path, ref, recorder: str, *, lora: dict, n_gen: int, threads: int, atol: float):
        self.path, self.ref, self.recorder, self.lora = path, ref, recorder, lora
        self.n_gen, self.threads, self.atol = n_gen, threads, atol
        self.fix = json.loads(path.read_text()) if path.is_file() else None
        self.needed = pytest.mark.skipif(self.fix is None, reason=f"{path.name} not recorded yet")

    def params(self, key: str, ident) -> list:
        """The fixture's ``key`` records as pytest parameters, ``ident(record)`` their ids."""
        return [pytest.param(r, id=ident(r)) for r in self.fix[key]] if self.fix else []

    def model_params(self) -> list:
        return self.params("models", lambda m: recipe_id(m["recipe"]))

    def lora_params(self) -> list:
        return self.params("lora", lambda lo: lo["base"]["recipe"]["shape"])

    def model_file(self, rec: dict) -> Path:
        """The record's file, re-created by the helper: the recorded recipe, the recorded bytes."""
        r = rec["recipe"]
        assert r == self.ref.recipe(r["shape"], r["seed"], r["outtype"])
        path = self.ref.gguf_path(r["shape"], r["seed"], r["outtype"])
        assert sha256_file(path) == rec["sha256"], (
            f"the regenerated {path.name} differs from the recorded one (torch, transformers, the converter or "
            f"{self.ref.__name__} changed?): re-record with tools/fixtures/{self.recorder}"
        )
        return path

    def lora_base(self, shape: str) -> Path:
        return self.ref.gguf_path(shape, 0, "f32")

    def make_adapter(self, shape: str, out_path) -> Path:
        """The fixture's adapter for ``shape`` (``seeded_adapter`` with ``lora[shape]``;
        ``toy.lora.base`` is the base file's name, fixed whatever its folder)."""
        base = self.lora_base(shape)
        return seeded_adapter(base, out_path, base_name=base.name, **self.lora[shape])

    def toy_tokens(self, model_path, prompts, lora=None, n_gen: int | None = None) -> dict:
        return toy_tokens(model_path, prompts, n_gen=n_gen or self.n_gen, threads=self.threads, lora=lora)

    def assert_like_llamacpp(self, got: dict, prompts: list[dict], what: str) -> None:
        assert_like_llamacpp(got, prompts, what, self.atol)

    def assert_model_like_llamacpp(self, rec: dict) -> None:
        """toy on a model record's file gives its greedy tokens and logits."""
        got = self.toy_tokens(self.model_file(rec), [p["text"] for p in rec["prompts"]])
        self.assert_like_llamacpp(got, rec["prompts"], recipe_id(rec["recipe"]))

    def lora_files(self, lo: dict, folder: Path) -> tuple[Path, Path]:
        """(the base, the adapter re-created in ``folder``) of a LoRA record,
        checked against the recorded recipe and bytes."""
        shape = lo["base"]["recipe"]["shape"]
        assert lo["base"]["recipe"] == self.ref.recipe(shape, 0, "f32")
        base = self.lora_base(shape)
        assert sha256_file(base) == lo["base"]["sha256"]
        path = self.make_adapter(shape, folder / "lora.gguf")
        assert sha256_file(path) == lo["adapter"]["sha256"]  # numpy's stream and toy's writer: the same bytes
        return base, path

    def assert_lora_like_llamacpp(self, lo: dict, folder: Path) -> None:
        """toy on a LoRA record's base with its adapter gives its greedy tokens and logits."""
        base, path = self.lora_files(lo, folder)
        got = self.toy_tokens(base, [p["text"] for p in lo["prompts"]], lora=[(path, lo["adapter"]["lora_scale"])])
        self.assert_like_llamacpp(got, lo["prompts"], f"{lo['base']['recipe']['shape']} + adapter")
