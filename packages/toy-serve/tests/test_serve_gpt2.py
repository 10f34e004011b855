"""``toy serve`` on GPT-2: a LIVE server (``create_app`` under uvicorn, the
conftest's ``serving``) over a tiny seeded GPT-2 made by Hugging Face
``transformers`` and converted by llama.cpp's ``convert_hf_to_gguf.py``
(``tests/support/src/toy_testsupport/gpt2_ref.py``; vocabulary 50257, 2 layers, d 64,
128 learned positions).

The model is loaded the way the server loads one (``n_slot=4``,
``exact_batching``), as the SmolLM2 serve tests do. Completions against the
library, streams against the same request sent plain and six requests at
once on four slots against each alone are test_serve_conformance.py's, on
this file (with ``serve_helpers.GPT2_PROMPTS``) and every other
architecture's. Expectations here:

- the server's context is the model's 128 learned positions;
- greedy completions (``temperature=0``) of the prompts of
  ``fixtures/gpt2_llamacpp.json``: llama.cpp's greedy tokens (16 each,
  end-of-text fed back: ``ignore_eos``), compared as text through the
  library's detokenizer (``toy.Model.detokenize`` on a second copy of the
  file).

No ``model`` marker: the file is generated (cached by ``gpt2_ref``, ~10 s on
a cold cache), not the real SmolLM2. The server and library fixtures
(``file_*``, over ``file_path``; a context of 128, the model's learned
positions) are the conftest's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toy_testsupport import gpt2_ref

CORE_TESTS = Path(__file__).resolve().parents[2] / "toy-core" / "tests"
FIXTURE = json.loads((CORE_TESTS / "fixtures" / "gpt2_llamacpp.json").read_text())


@pytest.fixture(scope="module")
def file_path() -> Path:
    return gpt2_ref.gguf_path("tiny", 0, "f32")


def test_the_context_is_the_learned_positions(file_ctx):
    assert file_ctx == gpt2_ref.SHAPES["tiny"]["n_positions"]  # the server's context (the conformance models card)


@pytest.mark.avx2_reference
@pytest.mark.parametrize("rec", FIXTURE["models"][0]["prompts"], ids=lambda p: p["text"][:12])
def test_greedy_completion_equals_llamacpp(file_client, file_alias, file_ref, rec):
    r0 = FIXTURE["models"][0]["recipe"]
    assert (r0["shape"], r0["outtype"], r0["seed"]) == ("tiny", "f32", 0)
    n = FIXTURE["context"]["n_gen"]
    r = file_client.completions.create(
        model=file_alias, prompt=rec["ids"], max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens == len(rec["ids"]) and r.usage.completion_tokens == n
    assert r.choices[0].text == file_ref.detokenize(rec["greedy"])
