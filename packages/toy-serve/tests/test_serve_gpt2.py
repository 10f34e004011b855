"""``toy serve`` on GPT-2: a LIVE server (``create_app`` under uvicorn, the
conftest's ``serving``) over a tiny seeded GPT-2 made by Hugging Face
``transformers`` and converted by llama.cpp's ``convert_hf_to_gguf.py``
(``packages/toy-core/tests/gpt2_ref.py``; vocabulary 50257, 2 layers, d 64,
128 learned positions).

The model is loaded the way the server loads one (``n_slot=4``,
``exact_batching``), as the SmolLM2 serve tests do. Expectations:

- greedy completions (``temperature=0``): the library,
  ``toy.Model.generate`` on a second copy of the file (``n_slot=1``, slot 0,
  no worker, no HTTP), text and token counts equal; and, for the prompts
  of ``fixtures/gpt2_llamacpp.json``, llama.cpp's greedy tokens (16 each,
  end-of-text fed back: ``ignore_eos``), compared as text through the
  library's detokenizer;
- streams: the same request without ``stream`` (text, finish reason,
  usage);
- concurrency: six requests at once on four slots (streams interleaved in
  one decode batch, two waiting in the queue) give the text each gives
  sent alone (the engine decodes bit-exactly whatever else is batched).

No ``model`` marker: the file is generated (cached by ``gpt2_ref``, ~10 s on
a cold cache), not the real SmolLM2. The server and library fixtures
(``file_*``, over ``file_path``; a context of 128, the model's learned
positions) are the conftest's, the shared checks ``serve_helpers``'.
"""

from __future__ import annotations

import json
from pathlib import Path

import gpt2_ref
import pytest
import serve_helpers as sh

CORE_TESTS = Path(__file__).resolve().parents[2] / "toy-core" / "tests"
FIXTURE = json.loads((CORE_TESTS / "fixtures" / "gpt2_llamacpp.json").read_text())
N = 12
PROMPTS = [
    "The capital of France is",
    "1, 2, 3,",
    "Once upon a time",
    "def fibonacci(n):",
    "Water boils at",
    "The quick brown fox",
]


@pytest.fixture(scope="module")
def file_path() -> Path:
    return gpt2_ref.gguf_path("tiny", 0, "f32")


def test_models_card(file_live, file_alias, file_ctx):
    assert file_ctx == gpt2_ref.SHAPES["tiny"]["n_positions"]  # the model's learned positions
    sh.assert_models_card(file_live, file_alias, file_ctx)


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_greedy_completion_equals_library(file_client, file_alias, file_ref, prompt):
    sh.assert_completion_equals_library(file_client, file_alias, file_ref, prompt, N)


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


def test_stream_equals_non_stream(file_client, file_alias):
    sh.assert_completion_stream_equals_non_stream(
        file_client, model=file_alias, prompt=PROMPTS[0], max_tokens=N, temperature=0
    )


def test_concurrent_requests_equal_sequential(file_live, file_client, file_alias):
    kw = dict(model=file_alias, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    sh.assert_concurrent_equal_alone(file_live, file_client, PROMPTS, kw)
