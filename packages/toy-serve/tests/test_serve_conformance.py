"""``toy serve`` on every architecture's generated files: the checks that
each architecture's serve tests repeated, run once over all of them on a
LIVE server (``create_app`` under uvicorn, the conftest's ``file_*``
fixtures over this module's ``file_path``, loaded the way the server loads
a file: ``exact_batching``, 4 slots, or 8 for the mixture-of-experts files
so that eight requests decode in one batch), queried with the official
``openai`` client, greedy (``temperature=0``).

The files, each from the reference helper its architecture's tests use
(``toy_testsupport``):

- llama: a tiny seeded F32 file from ``toy_test_models.write_ascii_tiny_model``
  (toy's GGUF writer; printable ASCII, one character a token), prompted
  with the shared prompts that ASCII spells;
- gpt2: ``gpt2_ref``'s tiny GPT-2 (vocabulary 50257, 2 layers, d 64, 128
  learned positions); gemma2, gemma3: ``gemma_ref``'s gemma2-tiny (sliding
  window 8 on layers 0 and 2, soft-caps, tied head) and gemma3-tiny-untied
  (QK-norm, linear RoPE scaling on the global layer, untied head); the
  mixture-of-experts files: ``moe_ref``'s qwen2moe-tiny in F32 (a shared
  expert), qwen3moe-tiny in Q8_0 (experts Q8_0) and the 256-wide qwen2moe-k
  quantized by toy's ``quantize_model(..., "Q4_K_M")`` (K-quant experts).
  All seeded random Hugging Face models converted by llama.cpp's own
  ``convert_hf_to_gguf.py``; prompts: ``serve_helpers``' lists of each
  family.

Expectations, per file:

- /v1/models lists the file with its context (128);
- greedy completions equal the library, ``toy.Model.generate`` on a second
  copy of the file (``n_slot=1``, slot 0, no worker, no HTTP): text,
  finish reason and token counts;
- a stream equals the same request without ``stream`` (text, finish
  reason, usage);
- concurrency: the prompts sent at once, streamed and plain, give the text
  each gives sent alone (batch invariance: the engine decodes bit-exactly
  whatever else is batched: every layer's own window and cap, the routed
  feed-forward whose expert products run over the whole batch), and alone
  through the server is the library's; for the mixture-of-experts files the
  texts differ from prompt to prompt.

What is particular to an architecture stays in its module
(test_serve_gpt2.py: llama.cpp's recorded tokens; test_serve_gemma.py:
chat template, chats at once, the template's 400; test_serve_moe.py: the
files' experts and routing). No ``model`` marker: the files are generated
(the reference helpers cache them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from toy_testsupport import gemma_ref, gpt2_ref, moe_ref, toy_test_models
from toy_testsupport import serve_helpers as sh

N = 12


@dataclass(frozen=True)
class Case:
    """One file: where it comes from, its slots, its prompts (the first ``n_library`` are compared with the
    library one by one), the stream check's request and finish, whether the texts must differ."""

    path: Callable[[pytest.TempPathFactory], Path]
    prompts: list[str]
    n_library: int = 4
    slots: int = 4
    stream: dict = field(default_factory=lambda: {"prompt": 3, "extra_body": {"ignore_eos": True}})
    stream_finish: str | None = "length"
    distinct: bool = False


def _gemma(shape: str) -> Case:
    return Case(lambda _: gemma_ref.gguf_path(shape, 0, "f32"), sh.GEMMA_PROMPTS)


def _moe(shape: str, outtype: str) -> Case:
    return Case(lambda _: moe_ref.gguf_path(shape, 0, outtype), sh.MOE_PROMPTS, slots=8, distinct=True)


CASES = {
    "llama-tiny": Case(
        lambda tmp: toy_test_models.write_ascii_tiny_model(tmp.mktemp("llama") / "llama-tiny.gguf"),
        [p for p in sh.PROMPTS if "\n" not in p],  # a newline has no token in the ASCII vocabulary
    ),
    # the GPT-2 tests' own stream check: their first prompt, no ignore_eos, whatever finish the model gives
    "gpt2-tiny": Case(
        lambda _: gpt2_ref.gguf_path("tiny", 0, "f32"), sh.GPT2_PROMPTS, n_library=3, stream={"prompt": 0},
        stream_finish=None,
    ),
    "gemma2-tiny": _gemma("gemma2-tiny"),
    "gemma3-tiny-untied": _gemma("gemma3-tiny-untied"),
    "qwen2moe-tiny-f32": _moe("qwen2moe-tiny", "f32"),
    "qwen3moe-tiny-q8_0": _moe("qwen3moe-tiny", "q8_0"),
    "qwen2moe-k-q4_k_m": _moe("qwen2moe-k", "q4_k_m"),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(CASES))
def case(request) -> Case:
    return CASES[request.param]


@pytest.fixture(scope="module")
def file_path(case, tmp_path_factory) -> Path:
    return case.path(tmp_path_factory)


@pytest.fixture(scope="module")
def file_slots(case) -> int:
    return case.slots


def test_models_card(file_live, file_alias, file_ctx):
    sh.assert_models_card(file_live, file_alias, file_ctx)


def test_greedy_completion_equals_library(case, file_client, file_alias, file_ref):
    assert len(case.prompts) >= case.n_library
    for prompt in case.prompts[: case.n_library]:
        sh.assert_completion_equals_library(file_client, file_alias, file_ref, prompt, N)


def test_completion_stream_equals_non_stream(case, file_client, file_alias):
    kw = {**case.stream, "prompt": case.prompts[case.stream["prompt"]]}
    sh.assert_completion_stream_equals_non_stream(
        file_client, case.stream_finish, model=file_alias, max_tokens=N, temperature=0, **kw
    )


def test_concurrent_requests_equal_alone(case, file_live, file_client, file_alias, file_ref):
    kw = dict(model=file_alias, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    alone = sh.assert_concurrent_equal_alone(file_live, file_client, case.prompts, kw)
    # alone through the server is the library's
    want = [file_ref.generate(p, temperature=0, max_tokens=16, ignore_eos=True).text for p in case.prompts]
    assert alone == want
    if case.distinct:
        assert len(set(alone)) == len(case.prompts) and all(alone)
