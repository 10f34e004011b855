"""Hostile input files through the ``toy`` command (issue 42, items 2 and 3).

Every case runs ``toy`` in a child under an address-space limit and a timeout
(``toy_testsupport.limited``), so the old code's hang (a FIFO) or its growth
(``/dev/zero``, a 20 MB line tokenized whole at ~140 bytes a character, 2.9 GB)
fails the test instead of blocking it or taking the machine.

The memory bound, stated in docs/reference/data-formats.md: the peak RSS of ``toy data
check``, ``toy train lora`` and ``toy eval perplexity`` stays under the model
file's size + ``BASE_MB`` + ``PER_BYTE`` x the longest line (SmolLM2 and a 20 MB
line: ~600 MB; measured ~210, ~330 and ~300 MB on CPU).
"""

from __future__ import annotations

import json
import os
import random

import pytest

from toy_testsupport.cli_helpers import run
from toy_testsupport.limited import run_limited

pytestmark = pytest.mark.model

AS_LIMIT = 2 << 30  # the old code needed ~2.9 GB of RSS for a 20 MB line
BASE_MB = 300  # the documented constant: interpreter, ggml, tokenizer, buffers
PER_BYTE = 10  # the documented cost of one byte of the longest line
LINE = 20_000_000


def bound_mb(model) -> float:
    return os.path.getsize(model) / 2**20 + BASE_MB + PER_BYTE * LINE / 2**20


def words(n: int, seed: int = 0) -> str:
    """``n`` characters of plain words on one line."""
    rng = random.Random(seed)
    vocab = ["alpha", "beta", "gamma", "delta", "the", "of", "and", "x1", "42", "foo.bar", "(paren)", "wörld"]
    return " ".join(rng.choice(vocab) for _ in range(n // 5 + 1))[:n]


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A JSONL file whose second line holds a 20 MB "text", with short examples around it, and a
    20 MB text file of one line."""
    d = tmp_path_factory.mktemp("big")
    short = [json.dumps({"text": f"short example number {i}. " * 8}) for i in range(6)]
    (d / "big.jsonl").write_text("\n".join([short[0], json.dumps({"text": words(LINE)}), *short[1:]]) + "\n")
    (d / "big.txt").write_text(words(LINE, seed=1))
    return d


def check_peak(r, model) -> None:
    assert not r.timed_out and r.code == 0, r.err[-2000:]
    assert 0 < r.peak_mb < bound_mb(model), f"peak RSS {r.peak_mb:.0f} MB, bound {bound_mb(model):.0f} MB"


def test_a_20mb_line_in_data_check_stays_bounded(big, smollm2_path):
    r = run_limited(["data", "check", big / "big.jsonl", "-m", smollm2_path, "--show", "1", "--json"],
                    as_limit=AS_LIMIT, timeout=180)  # fmt: skip
    check_peak(r, smollm2_path)
    report = json.loads(r.out)
    assert report["n_examples"] == 7 and report["over_length"] == 1 and not report["problems"]
    assert report["lengths"]["max"] > 1_000_000 and report["samples"][0]["shown_tokens"] <= 512


def test_a_20mb_line_in_train_lora_stays_bounded(big, smollm2_path, tmp_path):
    (tmp_path / "fast.toml").write_text("sample_tokens = 0\n")  # no sample generation: the data is what is tested
    r = run_limited(
        ["train", "lora", big / "big.jsonl", "-m", smollm2_path, "-c", tmp_path / "fast.toml", "--steps", "1",
         "-b", "1", "--context", "32",
         "--max-length", "33", "--eval-every", "0", "--save-every", "0", "--out", tmp_path / "runs", "--json", "-q",
         "--threads", "2", "--device", "cpu"],
        as_limit=AS_LIMIT, timeout=300,
    )  # fmt: skip
    check_peak(r, smollm2_path)
    assert json.loads(r.out)["final_step"] == 1


def test_eval_perplexity_on_a_20mb_line_reads_a_prefix_and_stays_bounded(big, smollm2_path, tmp_path):
    args = ["eval", "perplexity", smollm2_path, big / "big.txt", "--max-chunks", "2", "-c", "64", "--json",
            "--runs-dir", tmp_path / "runs", "--threads", "2"]  # fmt: skip
    r = run_limited(args, as_limit=AS_LIMIT, timeout=180)
    check_peak(r, smollm2_path)
    res = json.loads(r.out)
    assert res["n_windows"] == 2
    # the file has ~6.4M tokens: only the first 1 MB block (~330k tokens) is read and tokenized
    assert 128 <= res["n_tokens"] < 500_000, res["n_tokens"]


def test_a_line_over_the_record_bound_is_a_problem_named_by_line(tmp_path, capsys, smollm2_path, monkeypatch):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"text": t}) for t in ["short", "x" * 3000, "after"]) + "\n")
    monkeypatch.setenv("TOY_MAX_RECORD_BYTES", "2000")
    code, out, err = run(capsys, "data", "check", p, "-m", smollm2_path)
    assert code == 2 and "1 problem in" in err
    assert "line 2: the line is longer than 2,000 bytes, the most one record may hold (TOY_MAX_RECORD_BYTES)" in out
    assert "examples     2 (text 2)" in out


# -- item 3: FIFOs and /dev/zero ---------------------------------------------------------------------


@pytest.fixture
def odd(tmp_path):
    os.mkfifo(tmp_path / "fifo.jsonl")
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    return tmp_path


CASES = {
    "data check": lambda m, p, t: ["data", "check", p, "-m", m],
    "infer -f": lambda m, p, t: ["infer", m, "-f", p, "-n", "1"],
    "train lora": lambda m, p, t: ["train", "lora", p, "-m", m, "--steps", "1", "--out", t / "runs", "-q"],
    "eval perplexity": lambda m, p, t: ["eval", "perplexity", m, p, "--runs-dir", t / "runs"],
}


@pytest.mark.parametrize("kind", ["fifo", "zero"])
@pytest.mark.parametrize("command", list(CASES))
def test_a_fifo_or_dev_zero_is_refused_at_once(odd, smollm2_path, command, kind):
    path = odd / f"{kind}.jsonl"
    r = run_limited(CASES[command](smollm2_path, path, odd), as_limit=AS_LIMIT, timeout=60)
    assert not r.timed_out, f"{command} on a {kind} ran past 60 s"
    what = "a FIFO" if kind == "fifo" else "a character device, through a symbolic link"
    assert r.code == 2, r.err[-2000:]
    assert f"error: {'--prompt-file ' if command == 'infer -f' else ''}{path}: not a regular file ({what})" in r.err
    assert "hint: " in r.err and "Traceback" not in r.err
