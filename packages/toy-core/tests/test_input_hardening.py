"""Hostile input files in the library (issue 42, items 2 and 3).

- Item 3, files that are not files: ``toy.inputs.regular_file`` and every reader that uses it
  refuse a FIFO (it would block the open forever) and a link to ``/dev/zero`` (it never ends)
  with an error naming the path. The readers run in a child under an address-space limit,
  one ``alarm`` per case, so the old code's hang or growth fails a case instead of the run.
- Item 2, long lines: a line over the record bound is refused naming the file and line; long
  text is tokenized in pieces whose ids equal the whole text's, for every pre-tokenizer family
  (the cut rule of ``toy.tokenizer.longtext``), with and without control-token parsing, through
  ``encode``, ``encode_array``, ``encode_batch``, ``encode_protected`` and ``encode_stream``;
  the eval reader stops once it holds the tokens asked for. The memory bounds of the commands
  on a 20 MB line are checked in toy-cli's ``test_cli_input_hardening.py``.
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys

import numpy as np
import pytest

from toy.errors import DataError
from toy.inputs import RECORD_ENV, max_record_bytes, read_line, regular_file
from toy.tokenizer import Tokenizer
from toy.tokenizer.longtext import cut_pieces, safe_cut
from toy.tokenizer.pretok import PRE_TOKENIZERS

AS_LIMIT = 2 << 30  # a child's RLIMIT_AS: /dev/zero read whole fails there instead of taking the machine


# -- item 3: regular files only -----------------------------------------------------------------


@pytest.fixture
def odd(tmp_path):
    """A FIFO, a link to /dev/zero, a folder and a regular file."""
    os.mkfifo(tmp_path / "fifo.jsonl")
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    (tmp_path / "dir.jsonl").mkdir()
    (tmp_path / "ok.jsonl").write_text('{"text": "hi"}\n')
    return tmp_path


def test_regular_file_names_the_path_and_what_it_is(odd):
    assert regular_file(odd / "ok.jsonl") == odd / "ok.jsonl"
    kinds = [("fifo.jsonl", "a FIFO"), ("zero.jsonl", "a character device, through a symbolic link"),
             ("dir.jsonl", "a folder")]  # fmt: skip
    for name, kind in kinds:
        with pytest.raises(DataError) as e:
            regular_file(odd / name, "data.paths")
        assert str(e.value) == f"{odd / name}: not a regular file ({kind})"
        assert e.value.hint and e.value.field == "data.paths"
    with pytest.raises(DataError, match="nope.jsonl: no such file"):
        regular_file(odd / "nope.jsonl")


CHILD = r"""
import json, signal, sys
from pathlib import Path

class Hung(Exception):
    pass

def alarm(*_):
    raise Hung()

signal.signal(signal.SIGALRM, alarm)
from toy import corpus, store
from toy.eval.record import read_eval_ids
from toy.gguf import GGUFFile
from toy.tokenizer import Tokenizer
from toy.tokenizer.chat import ChatTemplate
from toy.train import config, instruct

root, model = Path(sys.argv[1]), sys.argv[2]
tok = Tokenizer.from_file(model)
with GGUFFile(model) as f:
    tmpl = ChatTemplate.from_gguf(f.metadata)
cases = {
    "load_examples": lambda p: instruct.load_examples(p, tok, tmpl, max_length=64),
    "check_file": lambda p: instruct.check_file(p, tok, tmpl, max_length=64),
    "corpus_folder": lambda p: list(corpus.iter_documents(p.parent / (p.stem + "_dir"))),
    "read_eval_ids": lambda p: read_eval_ids(tok, p),
    "load_toml": lambda p: config.load_toml(p),
    "sha256_file": lambda p: store.sha256_file(p),
    "gguf": lambda p: GGUFFile(p),
}
out = {}
for name in ("fifo", "zero"):
    for case, fn in cases.items():
        signal.alarm(10)
        try:
            fn(root / f"{name}.jsonl")
            r = "accepted"
        except Hung:
            r = "hung"
        except MemoryError:
            r = "MemoryError"
        except Exception as e:
            r = f"{type(e).__name__}: {e}"
        signal.alarm(0)
        out[f"{name}/{case}"] = r
print(json.dumps(out))
"""


def test_readers_refuse_a_fifo_and_dev_zero_without_blocking(odd, smollm2_path):
    for name in ("fifo", "zero"):  # the same thing found inside a corpus folder
        (odd / f"{name}_dir").mkdir()
        (odd / f"{name}_dir" / "a.txt").write_text("text")
        if name == "fifo":
            os.mkfifo(odd / f"{name}_dir" / "b.txt")
        else:
            (odd / f"{name}_dir" / "b.txt").symlink_to("/dev/zero")

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))

    p = subprocess.run([sys.executable, "-c", CHILD, str(odd), str(smollm2_path)], preexec_fn=limit,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(got) == 14
    for case, r in got.items():
        name = case.split("/")[0]
        where = "b.txt" if case.endswith("corpus_folder") else f"{name}.jsonl"
        kind = "a FIFO" if name == "fifo" else "a character device"
        assert f"{where}: not a regular file ({kind}" in r, (case, r)
        assert r.split(":")[0] in ("DataError", "GGUFError", "ConfigError"), (case, r)


# -- item 2: the record bound -----------------------------------------------------------------------


def test_read_line_bound(tmp_path, monkeypatch):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b"a" * 10 + b"\n" + b"b" * 11 + b"\n" + b"c" * 10)
    with open(p, "rb") as f:
        assert read_line(f, "x:1", 10) == b"a" * 10 + b"\n"  # exactly the bound, newline not counted
        with pytest.raises(DataError, match=r"x:2: the line is longer than 10 bytes") as e:
            read_line(f, "x:2", 10)
        assert RECORD_ENV in e.value.hint
    with open(p, "rb") as f:
        f.seek(23)
        assert read_line(f, "x:3", 10) == b"c" * 10 and read_line(f, "x:4", 10) == b""
    monkeypatch.delenv(RECORD_ENV, raising=False)
    assert max_record_bytes() == 64 << 20
    monkeypatch.setenv(RECORD_ENV, "1_000")
    assert max_record_bytes() == 1000
    monkeypatch.setenv(RECORD_ENV, "lots")
    with pytest.raises(DataError, match=RECORD_ENV):
        max_record_bytes()


def test_a_line_over_the_bound_names_file_and_line(tmp_path, monkeypatch, smol):
    from toy.corpus import iter_documents
    from toy.train.instruct import check_file, load_examples

    tok, tmpl = smol
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"text": t}) for t in ["short", "x" * 3000, "after"]) + "\n")
    monkeypatch.setenv(RECORD_ENV, "2000")
    with pytest.raises(DataError, match=rf"{p}:2: the line is longer than 2,000 bytes") as e:
        load_examples(p, tok, tmpl, max_length=64)
    assert RECORD_ENV in e.value.hint
    with pytest.raises(DataError, match=rf"{p}:2: the line is longer than 2,000 bytes"):
        list(iter_documents(p))
    report = check_file(p, tok, tmpl, max_length=64)  # reported, and the lines after it still read
    assert report.n_examples == 2
    assert report.problems == [(2, f"the line is longer than 2,000 bytes, the most one record may hold ({RECORD_ENV})")]


# -- item 2: long text in pieces, the same ids ------------------------------------------------------

ALPHABET = ["the", " ", "  ", "\n", "\n\n", "\r\n", " \n", "Hello", "wörld", "日本語", "😀", "1234567", "x1y2",
            "it's", " 's", "'S", "foo.bar", "(paren)", "\t", "  \n ", "—", "e\u0301", ".", ",", "'", '"', "ab",
            "CD", "9", "<|im_start|>", "<|im_end|>", "#!", "$$", "\u00a0"]  # fmt: skip


def mixed_text(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(ALPHABET) for _ in range(n))


@pytest.fixture(scope="module")
def smol(smollm2_path):
    from toy.gguf import GGUFFile
    from toy.tokenizer.chat import ChatTemplate

    with GGUFFile(smollm2_path) as f:
        return Tokenizer.from_gguf(f.metadata), ChatTemplate.from_gguf(f.metadata)


def whole(tok: Tokenizer, text: str, special: bool = True) -> list[int]:
    """What HF tokenizers gives for the text in one piece (the reference)."""
    return tok._encoder(special).encode(text, add_special_tokens=False).ids


def test_cut_points_are_where_the_rule_says():
    text = "ab cd\nef  g\n\nh"
    assert safe_cut(text, 0, len(text)) == 11  # before the line break after "g"
    assert safe_cut(text, 0, 8) == 6  # after the newline between "d" and "e"
    assert safe_cut(text, 0, 4) == 2  # before " cd"
    assert safe_cut("a  b", 0, 4) == -1  # two spaces: the first may join a whitespace run
    assert safe_cut("aaaa", 0, 4) == -1
    pieces = list(cut_pieces("w " * 50_000, piece=1000, scan=5000))
    assert "".join(pieces) == "w " * 50_000 and all(p.startswith(" ") for p in pieces[1:])
    hard = list(cut_pieces("a" * 12_000, piece=1000, scan=5000))  # no safe point: cut at the scan bound
    assert [len(p) for p in hard] == [5000, 5000, 2000]


@pytest.mark.parametrize("special", [True, False])
def test_long_text_in_pieces_gives_the_whole_texts_ids(smol, special):
    tok = smol[0]
    text = mixed_text(90_000)
    assert len(text) > 4 * (1 << 16)  # several pieces
    want = whole(tok, text, special)
    assert tok.encode(text, add_special=False, special=special) == want
    arr = tok.encode_array(text, add_special=True, special=special)
    assert arr.dtype == np.int32 and arr.tolist() == tok._wrap(list(want), True)
    assert tok.encode_batch(["short", text], add_special=False, special=special)[1] == want
    blocks = iter([text[:1000], text[1000:300_001], text[300_001:]])
    assert np.concatenate(list(tok.encode_stream(blocks, special))).tolist() == want


FAMILIES = sorted({s.family: n for n, s in PRE_TOKENIZERS.items()}.values())


@pytest.mark.parametrize("name", FAMILIES)
def test_the_cut_rule_holds_for_every_pre_tokenizer_family(smollm2_path, name):
    tok = Tokenizer.from_file(smollm2_path)
    tok._hf.pre_tokenizer = PRE_TOKENIZERS[name].build()  # the family's regexes over SmolLM2's merges
    text = mixed_text(60_000, seed=3)
    assert tok.encode(text, add_special=False) == whole(tok, text)


def test_protected_spans_and_special_matches_of_long_text(smol):
    tok = smol[0]
    text = mixed_text(100_000, seed=5)
    spans = tok.special_spans(text)
    ref = tok.hf.encode(text, add_special_tokens=False)
    assert spans and spans == [(a, b) for i, (a, b) in zip(ref.ids, ref.offsets) if i in tok._control]
    plain = spans[::2]  # these stay text, the others are control tokens
    keep = [m for m in spans if m not in plain]
    want, pos = [], 0
    for a, b in keep:
        want += whole(tok, text[pos:a], special=False) + [tok.hf.token_to_id(text[a:b])]
        pos = b
    want += whole(tok, text[pos:], special=False)
    assert tok.encode_protected(text, plain, add_special=False) == want


def test_eval_reader_stops_once_it_has_the_tokens(smol, tmp_path, monkeypatch):
    from toy.eval import read_eval_ids, read_eval_text, record, text_ids, tokens_needed

    tok = smol[0]
    monkeypatch.setattr(record, "READ_BYTES", 1 << 16)  # 64 KB blocks: a 1 MB file is many of them

    class Model:
        tokenizer = tok

    p = tmp_path / "one-line.txt"
    p.write_text(mixed_text(300_000, seed=7).replace("\n", " ").replace("\r", " "))  # ~1 MB, one line
    full, whole_read = read_eval_ids(tok, p)
    assert whole_read and full.tolist() == text_ids(Model, read_eval_text(p))
    need = tokens_needed(64, 0, 2)
    assert need == 128 and tokens_needed(64, 16, 3) == 64 + 2 * 16 + 1 and tokens_needed(64) is None
    part, whole_read = read_eval_ids(tok, p, need)
    assert not whole_read and need <= len(part) < len(full) // 2
    assert part.tolist() == full[: len(part)].tolist()
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["one", "two three", "four"]))
    ids, whole_read = read_eval_ids(tok, docs)
    assert whole_read and ids.tolist() == text_ids(Model, read_eval_text(docs))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="no text in it"):
        read_eval_ids(tok, empty)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok " * 10 + b"\xff")
    with pytest.raises(DataError, match=r"bad.txt: not valid UTF-8 text \(byte 30\)"):
        read_eval_ids(tok, bad)


def test_instruct_examples_of_long_text_equal_whole_tokenization(smol, tmp_path):
    from toy.train.instruct import load_examples

    tok, tmpl = smol
    text = mixed_text(100_000, seed=9)
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"text": text}) + "\n" + json.dumps({"prompt": "q", "completion": text}) + "\n")
    (a, b), _ = load_examples(p, tok, tmpl, max_length=10**7)
    ids = whole(tok, text)
    assert a.tokens.tolist() == ids + [tok.eos_id] and int(a.loss.sum()) == len(ids)
    assert b.tokens.tolist() == whole(tok, "q") + ids + [tok.eos_id]
