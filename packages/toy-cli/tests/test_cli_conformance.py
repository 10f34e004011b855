"""`toy infer` and `toy describe` on every architecture toy runs: the checks
that each architecture's CLI tests repeated, run once over all of them.

The files, each from the reference helper its architecture's tests use
(``toy_testsupport``):

- llama, qwen2 (QKV biases), qwen3 (QK-norm): tiny seeded F32 files from
  ``toy_test_models.write_ascii_tiny_model`` (toy's GGUF writer; a
  vocabulary of printable ASCII, one character a token);
- gpt2: ``gpt2_ref``'s tiny GPT-2, and the Gemma and mixture-of-experts files:
  seeded random Hugging Face models converted by llama.cpp's own
  ``convert_hf_to_gguf.py`` (``gemma_ref``: gemma2-tiny and
  gemma3-tiny-untied, a sliding window of 8 and a SentencePiece tokenizer;
  ``moe_ref``: olmoe-tiny, qwen2moe-tiny and qwen3moe-tiny in F32 and
  qwen3moe-tiny in Q8_0, 8 experts, top-2, GPT-2's tokenizer).

Expectations, per file:

- ``toy infer PATH PROMPT -n 8 --greedy --ignore-eos``: exit 0, no
  traceback, the timings line says 8 tokens and ``finish: length``, stdout is
  the library's text and a newline; with ``--json -q`` (quiet: nothing on
  stderr) the prompt ids, tokens and text are the library's (``toy.load`` +
  ``Model.generate``, no CLI), plus what the file's prompt must show: past
  the Gemma window (15 tokens), no BOS with GPT-2's tokenizer;
- ``toy describe PATH``: exit 0, the architecture and layers rows, the
  algorithm card of that architecture; ``--json``: the same architecture and
  layer count.

What is particular to an architecture (its describe rows and card lines,
chat templates, the variants toy refuses) stays in test_cli_gemma.py and
test_cli_moe.py; the real SmolLM2 against llama.cpp's recorded outputs is
test_cli_infer.py. Every run is pinned to the CPU and one thread (as
test_cli_infer.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from toy_testsupport import gemma_ref, gpt2_ref, moe_ref, toy_test_models
from toy_testsupport.cli_helpers import infer_json_and_library, row, run

N = 8
GEMMA_PROMPT = "The quick brown fox jumps over the lazy dog."  # 15 tokens: past the window of 8
GEMMA_WINDOW = 8
GPT2_PROMPT = "The weather was cold and windy, so we stayed inside and"  # GPT-2's tokenizer (gpt2, the MoE files)
ASCII_PROMPT = "The weather was cold and windy"
TINY = {"llama": {}, "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True}}


@dataclass(frozen=True)
class Case:
    """One file: its architecture, layer count, where it comes from, the prompt and what its ids must show."""

    arch: str
    n_layer: int
    path: Callable[[Path], Path]  # (a folder for files written here) -> the file
    prompt: str
    check_ids: Callable[[list[int]], bool] = lambda ids: True


def ascii_tiny(arch: str) -> Callable[[Path], Path]:
    return lambda folder: toy_test_models.write_ascii_tiny_model(folder / f"{arch}.gguf", arch=arch, **TINY[arch])


def no_bos(ids: list[int]) -> bool:
    return gpt2_ref.N_VOCAB - 1 not in ids  # GPT-2's <|endoftext|>, its BOS: the tokenizer adds none


CASES = {
    **{a: Case(a, 2, ascii_tiny(a), ASCII_PROMPT) for a in TINY},
    "gpt2": Case("gpt2", gpt2_ref.SHAPES["tiny"]["n_layer"], lambda _: gpt2_ref.gguf_path("tiny", 0, "f32"),
                 GPT2_PROMPT, no_bos),
    **{
        s: Case(s.split("-")[0], gemma_ref.SHAPES[s]["num_hidden_layers"],
                lambda _, s=s: gemma_ref.gguf_path(s, 0, "f32"), GEMMA_PROMPT, lambda ids: len(ids) > GEMMA_WINDOW)
        for s in ("gemma2-tiny", "gemma3-tiny-untied")
    },
    **{
        f"{s}-{t}": Case(moe_ref.SHAPES[s]["arch"], moe_ref.SHAPES[s]["num_hidden_layers"],
                         lambda _, s=s, t=t: moe_ref.gguf_path(s, 0, t), GPT2_PROMPT, no_bos)
        for s, t in [("olmoe-tiny", "f32"), ("qwen2moe-tiny", "f32"), ("qwen3moe-tiny", "f32"), ("qwen3moe-tiny", "q8_0")]
    },
}  # fmt: skip


@pytest.fixture(autouse=True)
def _cpu_one_thread(monkeypatch):
    monkeypatch.setenv("TOY_DEVICE", "cpu")
    monkeypatch.setenv("TOY_THREADS", "1")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Callable[[str], Path]:
    """A case's file, made once per module (the reference helpers cache theirs on disk too)."""
    folder, made = tmp_path_factory.mktemp("conformance"), {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = CASES[name].path(folder)
        return made[name]

    return get


@pytest.fixture(params=list(CASES))
def case(request, files) -> tuple[Case, Path]:
    return CASES[request.param], files(request.param)


def test_the_files_are_their_architecture(case):
    from toy.gguf import GGUFFile

    c, path = case
    with GGUFFile(path) as gf:
        assert gf.architecture == c.arch and gf.metadata[f"{c.arch}.block_count"] == c.n_layer


def test_infer_greedy_equals_the_library(capsys, case):
    c, path = case
    code, out, err = run(capsys, "infer", path, c.prompt, "-n", N, "--greedy", "--ignore-eos")
    assert code == 0, err
    assert "Traceback" not in err and out.endswith("\n") and out.strip()
    assert f"{N} tok generated" in err and "finish: length" in err
    d, ids, want = infer_json_and_library(capsys, path, c.prompt, N)
    assert d["prompt_ids"] == ids and c.check_ids(ids), ids
    assert d["tokens"] == want.tokens and d["text"] == want.text and len(d["tokens"]) == N
    assert out == want.text + "\n"  # the plain run prints the generated text


def test_describe_names_the_architecture(capsys, case):
    c, path = case
    code, out, err = run(capsys, "describe", path)
    assert code == 0, err
    row(out, "architecture", c.arch)
    row(out, "layers", str(c.n_layer))
    assert f"Algorithm: P ← {c.arch}(x | θ)" in out
    code, out, err = run(capsys, "describe", path, "--json")
    assert code == 0, err
    d = json.loads(out)
    assert (d["summary"]["architecture"], d["summary"]["n_layer"]) == (c.arch, c.n_layer)
    assert f"P ← {c.arch}(x | θ)" in d["card"]
