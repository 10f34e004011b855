"""`toy data check` and `toy data demo-chat`, driven in-process through
``toy_cli.main.main`` with captured stdout/stderr.

``check`` loads only the tokenizer and chat template of the real
SmolLM2-135M-Instruct file (ChatML, EOS = ``<|im_end|>``, no BOS added), so
the expected marks are worked out from its template by hand: the assistant
content and the ``<|im_end|>`` after it carry loss, the header and the newline
after it do not. Captured stdout is not a terminal, so loss spans come out
wrapped in ``[[``/``]]``.
"""

from __future__ import annotations

import json
import sys

import pytest

from toy_testsupport.cli_helpers import run

pytestmark = pytest.mark.model


def write(path, rows):
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return path


GOOD = [
    {"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."}]},
    {"prompt": "Capital of France:", "completion": " Paris"},
    {"text": "Hello world"},
]


def test_check_good_file(tmp_path, capsys, smollm2_path):
    path = write(tmp_path / "good.jsonl", GOOD)
    code, out, err = run(capsys, "data", "check", path, "--model", smollm2_path)
    assert code == 0, err
    assert "error:" not in err
    sys_prompt = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    assert (
        sys_prompt + "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n[[2 + 3 = 5.<|im_end|>]]\n"
    ) in out
    assert "Capital of France:[[ Paris<|im_end|>]]\n" in out
    assert "Hello[[ world<|im_end|>]]\n" in out  # token 0 ("Hello") is never a target
    assert "── example 1: line 1, messages," in out and "── example 3: line 3, text, 3 tokens, 2 carry loss" in out
    lines = out.splitlines()
    assert "examples     3 (text 1, prompt_completion 1, messages 1)" in lines
    assert "over-length  0 longer than --max-length 2048 (truncated or dropped in training)" in lines
    assert "problems     0" in lines
    assert any(ln.startswith("length       min 3, median ") for ln in lines)
    assert any(ln.startswith("tokens       ") and "carry loss" in ln for ln in lines)

    # --show 1 prints one example; --max-length 3 counts the two longer ones
    code, out, _ = run(capsys, "data", "check", path, "-m", smollm2_path, "--show", "1", "--max-length", "3")
    assert code == 0 and "── example 2" not in out and "── example 1" in out
    assert "over-length  2 longer than --max-length 3 (truncated or dropped in training)" in out.splitlines()

    code, out, _ = run(capsys, "data", "check", path, "-m", smollm2_path, "--json")
    report = json.loads(out)
    assert code == 0 and report["problems"] == [] and report["n_examples"] == 3
    assert report["samples"][2]["segments"] == [
        {"text": "Hello", "loss": False},
        {"text": " world<|im_end|>", "loss": True},
    ]


def test_check_colour_and_no_color(tmp_path, capsys, monkeypatch, smollm2_path):
    path = write(tmp_path / "good.jsonl", GOOD[2:])
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.delenv("NO_COLOR", raising=False)
    code, out, _ = run(capsys, "data", "check", path, "-m", smollm2_path)
    assert code == 0 and "[[" not in out and "\x1b[" in out  # styled, not bracketed
    monkeypatch.setenv("NO_COLOR", "1")
    code, out, _ = run(capsys, "data", "check", path, "-m", smollm2_path)
    assert code == 0 and "Hello[[ world<|im_end|>]]" in out and "\x1b[" not in out
    monkeypatch.delenv("NO_COLOR")
    code, out, _ = run(capsys, "data", "check", path, "-m", smollm2_path, "--plain")
    assert code == 0 and "Hello[[ world<|im_end|>]]" in out and "\x1b[" not in out


BAD = [
    (b"{oops", "not valid JSON"),
    (b'"just a string"', "expected a JSON object, got a string"),
    (b'{"input": "x"}', "no known format (keys input)"),
    (b'{"text": "a", "messages": []}', "mixed formats"),
    (b'{"text": ["a"]}', '"text" is an array, not a string'),
    (b'{"prompt": "a", "completion": ""}', "empty completion"),
    (b'{"messages": []}', '"messages" is empty'),
    (
        b'{"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}',
        "unknown role 'robot'",
    ),
    (b'{"messages": [{"role": "user", "content": "x"}]}', "the conversation has no assistant turn"),
    (
        b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]}',
        "empty assistant content",
    ),
    (b"\xff\xfe", "not valid UTF-8"),
]


def test_check_bad_file(tmp_path, capsys, smollm2_path):
    path = write(tmp_path / "bad.jsonl", [GOOD[0], *(raw for raw, _ in BAD), GOOD[2]])
    code, out, err = run(capsys, "data", "check", path, "--model", smollm2_path)
    assert code == 2
    assert f"error: {len(BAD)} problems in {path}" in err and "Traceback" not in err
    lines = out.splitlines()
    problems = [ln for ln in lines if ln.startswith("line ")]
    assert len(problems) == len(BAD)
    for n, ((_, reason), got) in enumerate(zip(BAD, problems), start=2):
        assert got.startswith(f"line {n}: ") and reason in got, got
    assert f"problems     {len(BAD)}" in lines
    assert "examples     2 (text 1, messages 1)" in lines  # the good lines still count

    code, out, err = run(capsys, "data", "check", path, "-m", smollm2_path, "--json")
    assert code == 2 and "error: " in err
    assert [p["line"] for p in json.loads(out)["problems"]] == list(range(2, 2 + len(BAD)))


def test_check_bad_arguments(tmp_path, capsys, smollm2_path):
    code, _, err = run(capsys, "data", "check", tmp_path / "missing.jsonl", "-m", smollm2_path)
    assert code == 2 and "error: " in err and "missing.jsonl" in err
    code, _, err = run(capsys, "data", "check", tmp_path / "x.jsonl", "-m", tmp_path / "nope.gguf")
    assert code == 2 and "error: " in err
    code, _, err = run(capsys, "data", "check", tmp_path / "x.jsonl", "-m", smollm2_path, "--max-length", "1")
    assert code == 2 and "--max-length must be at least 2" in err


def test_demo_chat_passes_check(tmp_path, capsys, smollm2_path):
    out_path = tmp_path / "sub" / "chat.jsonl"
    code, out, err = run(capsys, "data", "demo-chat", out_path)
    assert code == 0 and out.strip() == str(out_path) and "wrote 600 conversations" in err
    rows = [json.loads(line) for line in out_path.read_text("utf-8").splitlines()]
    assert len(rows) == 600 and all(list(r) == ["messages"] for r in rows)
    answers = [m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
    assert all(a.endswith(" — toy") for a in answers)
    code, out, err = run(capsys, "data", "check", out_path, "-m", smollm2_path, "--show", "1")
    assert code == 0, err
    lines = out.splitlines()
    assert "examples     600 (messages 600)" in lines and "problems     0" in lines
    assert " — toy<|im_end|>]]" in out

    # deterministic: same seed, same bytes; another seed, another file
    again, other = tmp_path / "again.jsonl", tmp_path / "other.jsonl"
    assert run(capsys, "data", "demo-chat", again)[0] == 0
    assert run(capsys, "data", "demo-chat", other, "--seed", "1", "--n", "20")[0] == 0
    assert again.read_bytes() == out_path.read_bytes()
    other_lines = other.read_text("utf-8").splitlines()
    assert len(other_lines) == 20 and other_lines != out_path.read_text("utf-8").splitlines()[:20]


def test_check_empty_file_is_a_problem(tmp_path, capsys, smollm2_path):
    # Regression: an empty file passed ("problems 0", exit 0) although training refuses it.
    for name, body in [("empty.jsonl", b""), ("blank.jsonl", b"\n  \n\n")]:
        path = tmp_path / name
        path.write_bytes(body)
        code, out, err = run(capsys, "data", "check", path, "--model", smollm2_path)
        assert code == 2, out
        assert EMPTY in out.splitlines()
        assert "problems     1" in out.splitlines()
        assert f"error: 1 problem in {path}" in err
        code, out, _ = run(capsys, "data", "check", path, "--model", smollm2_path, "--json")
        assert code == 2 and json.loads(out)["problems"] == [{"line": 0, "reason": EMPTY}]


EMPTY = "the file holds no example (it is empty or has only blank lines)"


def test_check_shows_a_bounded_part_of_a_long_example(tmp_path, capsys, smollm2_path):
    # Regression: an over-long example was printed whole (20 MB for one line). Now at most SHOW_TOKENS
    # tokens of it are decoded and shown, then a count of the rest; the statistics still cover all of it.
    from toy.train.instruct import SHOW_TOKENS

    long_text = "word " * 200_000  # 1 MB, one line
    path = write(tmp_path / "long.jsonl", [{"text": long_text}])
    code, out, err = run(capsys, "data", "check", path, "--model", smollm2_path)
    assert code == 0, err
    n = next(int(ln.split()[1].replace(",", "")) for ln in out.splitlines() if ln.startswith("tokens       "))
    assert n > 100_000
    assert f"… {n - SHOW_TOKENS:,} more tokens not shown" in out
    assert len(out) < 10_000
    code, out, _ = run(capsys, "data", "check", path, "--model", smollm2_path, "--json")
    sample = json.loads(out)["samples"][0]
    assert sample["n_tokens"] == n and sample["shown_tokens"] == SHOW_TOKENS
    assert len("".join(s["text"] for s in sample["segments"])) < 5 * SHOW_TOKENS + 10


def test_check_injected_markup_stays_text(tmp_path, capsys, smollm2_path):
    row = {"messages": [{"role": "user", "content": "a<|im_end|>b"}, {"role": "assistant", "content": "ok"}]}
    path = write(tmp_path / "inj.jsonl", [row])
    code, out, _ = run(capsys, "data", "check", path, "--model", smollm2_path, "--json")
    plain = json.loads(out)["samples"][0]["n_tokens"]
    code2, out, _ = run(capsys, "data", "check", path, "--model", smollm2_path, "--json", "--special-in-content")
    raw = json.loads(out)["samples"][0]["n_tokens"]
    assert code == code2 == 0 and plain > raw  # "<|im_end|>" as text takes several tokens, as a control one
