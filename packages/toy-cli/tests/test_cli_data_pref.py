"""`toy data check` on preference data (pairs, unpaired, prompts), in-process
through ``toy_cli.main.main``.

The real SmolLM2-135M-Instruct tokenizer and ChatML template (EOS =
``<|im_end|>``, no BOS added, a default system message): the expected marks
are worked out from the template by hand, as in test_cli_data.py: the
completion (assistant content + ``<|im_end|>``, or the completion text + EOS)
carries loss, the prompt does not. Captured stdout is not a terminal, so loss
spans come out wrapped in ``[[``/``]]``.
"""

from __future__ import annotations

import json

import pytest

from toy_testsupport.cli_helpers import run

pytestmark = pytest.mark.model

SYS = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def write(path, rows):
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return path


def user(c):
    return {"role": "user", "content": c}


def asst(c):
    return {"role": "assistant", "content": c}


PAIRS = [
    {"prompt": [user("What is 2 + 3?")], "chosen": [asst("5.")], "rejected": [asst("6.")]},
    {"prompt": "Capital of Italy:", "chosen": " Rome", "rejected": " Milan"},
]


def test_pairs_detected_and_marked(tmp_path, capsys, smollm2_path):
    path = write(tmp_path / "pairs.jsonl", PAIRS)
    code, out, err = run(capsys, "data", "check", path, "--model", smollm2_path)
    assert code == 0, err
    head = SYS + "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert "── example 1: line 1, pairs (conversational)\nchosen: " in out
    assert head + "[[5.<|im_end|>]]\nrejected: " in out and head + "[[6.<|im_end|>]]\n" in out
    assert "Capital of Italy:[[ Rome<|im_end|>]]\n" in out and "Capital of Italy:[[ Milan<|im_end|>]]\n" in out
    lines = out.splitlines()
    assert "format       pairs (2 sequences (chosen, rejected) each)" in lines
    assert "examples     2 (standard 1, conversational 1)" in lines
    code, out, _ = run(capsys, "data", "check", path, "-m", smollm2_path, "--json")
    rep = json.loads(out)
    assert code == 0 and rep["format"] == "pairs" and rep["problems"] == []
    sides = rep["samples"][1]["sides"]
    assert [s["name"] for s in sides] == ["chosen", "rejected"]
    assert sides[0]["segments"] == [
        {"text": "Capital of Italy:", "loss": False},
        {"text": " Rome<|im_end|>", "loss": True},
    ]
    assert rep["n_loss"] == sum(s["n_loss"] for x in rep["samples"] for s in x["sides"])
    assert "problems     0" in lines


def test_pairs_problems_with_line_numbers(tmp_path, capsys, smollm2_path):
    rows = [
        PAIRS[1],
        b"{not json",
        {"prompt": "Capital of France:", "chosen": " Paris", "rejected": " Paris"},
        {"prompt": "x", "chosen": ""},
        {"prompt": "Q:", "chosen": " ", "rejected": " no"},
        {"prompt": "a long prompt " * 20, "chosen": " y", "rejected": " n"},
        {"prompt": [user("q")], "chosen": [user("again")], "rejected": [asst("n")]},
    ]
    path = write(tmp_path / "bad.jsonl", rows)
    code, out, err = run(capsys, "data", "check", path, "-m", smollm2_path, "--max-length", "40")
    assert code == 2 and "error: 6 problems in" in err
    got = [ln for ln in out.splitlines() if ln.startswith("line ")]
    assert [ln.split(":")[0] for ln in got] == ["line 2", "line 3", "line 4", "line 5", "line 6", "line 7"]
    assert got[0].startswith("line 2: not valid JSON")
    assert got[1] == "line 3: chosen and rejected are identical (the same tokens): the pair prefers nothing"
    assert got[2].startswith('line 4: "rejected" is missing')
    assert got[3].startswith("line 5: empty chosen")
    assert got[4].startswith("line 6: the prompt has ") and got[4].endswith("within max_length 40")
    assert got[5].startswith("line 7: chosen[0]: the completion starts with a 'user' turn")


def test_unpaired_and_prompts(tmp_path, capsys, smollm2_path):
    rows = [
        {"prompt": "2 + 2 =", "completion": " 4", "label": True},
        {"prompt": [user("2 + 2?")], "completion": [asst("5")], "label": False},
        {"prompt": "x", "completion": "y", "label": "yes"},
    ]
    path = write(tmp_path / "kto.jsonl", rows)
    code, out, err = run(capsys, "data", "check", path, "-m", smollm2_path)
    assert code == 2 and "error: 1 problem in" in err
    assert "completion (desirable): " in out and "2 + 2 =[[ 4<|im_end|>]]\n" in out
    assert "completion (undesirable): " in out and "<|im_start|>assistant\n[[5<|im_end|>]]\n" in out
    lines = out.splitlines()
    assert "labels       1 desirable, 1 undesirable" in lines
    assert 'line 3: "label" is a string, not a boolean (true: desirable, false: undesirable)' in lines

    path = write(tmp_path / "prompts.jsonl", [{"prompt": "2 + 2 =", "answer": "4"}, {"prompt": [user("hi")], "id": 1}])
    code, out, err = run(capsys, "data", "check", path, "-m", smollm2_path)
    assert code == 0, err
    lines = out.splitlines()
    assert (
        "format       prompts (prompts only)" in lines
        and "fields       answer, id (passed to the reward functions)" in lines
    )
    assert (
        "[[" not in out and "prompt: 5 tokens, 0 carry loss" in lines
    )  # SmolLM2 splits digits: "2", " +", " ", "2", " ="

    assert not any(ln.startswith("over-length") for ln in lines)


def test_explicit_format_and_sft_unchanged(tmp_path, capsys, smollm2_path):
    # an SFT prompt/completion file is checked as SFT; --format makes it a preference check
    path = write(tmp_path / "sft.jsonl", [{"prompt": "Capital of France:", "completion": " Paris"}])
    code, out, _ = run(capsys, "data", "check", path, "-m", smollm2_path)
    assert code == 0 and "examples     1 (prompt_completion 1)" in out.splitlines()
    code, out, _ = run(capsys, "data", "check", path, "-m", smollm2_path, "--format", "unpaired")
    assert code == 2 and 'line 1: "label" is missing (an unpaired example has prompt, completion, label)' in out
    code, _, err = run(capsys, "data", "check", path, "-m", smollm2_path, "--format", "dpo")
    assert code == 2 and "--format must be pairs, unpaired or prompts" in err
