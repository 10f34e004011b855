"""Training data: corpus reading (``toy.corpus``), the token cache, packing, batches.

Expected values are worked out independently of ``toy.corpus`` and ``toy.train.data``: by hand
for the hand-built token arrays (each test spells out the windows), with
``Tokenizer.encode`` per document for the token cache, with the documented
``default_rng([seed, epoch]).permutation`` for the batch order, and with the
entropy formula for ``unigram_entropy``. The tokenizer is a tiny byte-level
BPE trained on a few strings by ``toy.train.bpe.train_bpe``.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from toy import corpus
from toy.corpus import iter_chunks, iter_documents
from toy.errors import DataError
from toy.models.common import block_causal_mask
from toy.tokenizer import Tokenizer
from toy.train.bpe import train_bpe
from toy.train.data import (
    BatchStream,
    PackedData,
    TokenCache,
    unigram_entropy,
    validation_batches,
)

SAMPLE = (
    "The quick brown fox jumps over the lazy dog.\n"
    "Le café de Zürich est très naïf, n'est-ce pas?\n"
    "Numbers 12345 and 3.14159; emoji 😀👍🏽.\n"
    "    indented code(x) = y  # comment\r\n"
)


@pytest.fixture(scope="module")
def bpe_meta(tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe")
    (d / "train.txt").write_text(SAMPLE * 3, "utf-8")
    return train_bpe([d / "train.txt"], 400, min_frequency=1)


@pytest.fixture(scope="module")
def tok(bpe_meta):
    return Tokenizer.from_gguf(bpe_meta)


def write(path, text: str | bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, "utf-8", newline="")
    return path


# -- iter_documents ------------------------------------------------------------


def test_iter_documents_folder_order_kinds_and_sources(tmp_path):
    root = tmp_path / "corpus"
    write(root / "b.txt", "bee")
    write(root / "a.md", "ay\r\n")
    write(root / "sub" / "c.rst", "sea")
    write(root / "sub" / "Z.TEXT", "zed")  # suffixes match case-insensitively
    write(root / "d.jsonl", '{"text": "one"}\n\n{"text": ""}\n{"text": "four", "id": 4}\n')
    write(root / "skip.py", "print()")
    write(root / ".hidden.txt", "hidden")
    write(root / "empty.txt", "")
    write(root / "bom.txt", b"\xef\xbb\xbfbom")
    docs = list(iter_documents(root))
    assert docs == [
        (str(root / "a.md"), "ay\r\n"),  # line endings kept
        (str(root / "b.txt"), "bee"),
        (str(root / "bom.txt"), "bom"),  # BOM dropped
        (f"{root / 'd.jsonl'}:1", "one"),
        (f"{root / 'd.jsonl'}:4", "four"),  # blank line 2 and empty text (line 3) skipped
        (str(root / "sub" / "Z.TEXT"), "zed"),
        (str(root / "sub" / "c.rst"), "sea"),
    ]
    # files given one by one keep their order, and any suffix is read as text
    other = write(tmp_path / "notes.log", "log")
    assert list(iter_documents([root / "b.txt", str(other)])) == [(str(root / "b.txt"), "bee"), (str(other), "log")]
    assert list(iter_documents(root / "b.txt")) == [(str(root / "b.txt"), "bee")]


@pytest.mark.parametrize(
    "bad, why",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('"text"', "expected a JSON object"),
        ('{"txt": "x"}', 'no "text" field'),
        ('{"text": 5}', '"text" is int'),
        ('{"text": null}', '"text" is NoneType'),
        ('{"text": ["a"]}', '"text" is list'),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path, bad, why):
    p = write(tmp_path / "bad.jsonl", '{"text": "fine"}\n\n' + bad + '\n{"text": "later"}\n')
    with pytest.raises(DataError, match=f"bad.jsonl:3: .*{why}") as e:
        list(iter_documents(p))
    assert e.value.exit_code == 2  # a BadInputError


def test_jsonl_invalid_utf8_line(tmp_path):
    p = write(tmp_path / "u.jsonl", b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(DataError, match=r"u\.jsonl:2: not valid UTF-8"):
        list(iter_documents(p))


def test_missing_empty_and_undecodable(tmp_path):
    with pytest.raises(DataError, match="nope.txt: no such file"):
        list(iter_documents(tmp_path / "nope.txt"))
    write(tmp_path / "only" / "x.bin", "data")
    with pytest.raises(DataError, match="holds no"):
        list(iter_documents(tmp_path / "only"))
    bad = write(tmp_path / "latin1.txt", "caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt: not valid UTF-8 text \(byte 3\)"):
        list(iter_documents(bad))
    with pytest.raises(DataError, match=r"latin1\.txt: not valid UTF-8"):
        list(iter_chunks(bad))


# -- chunked reading -----------------------------------------------------------

ATOMS = ["word", "Zed", "42", "3.5", ".", ",", "'s", "é", "😀", "(x)", "-", "  ", " ", "\t", "a"]
BREAKS = ["\n", "\r\n", "\n\n", "\n  ", " \n", ".\n", "\n\t", "!\r\n", "\n-", "\u3000\n", "\n\u00a0"]


def random_text(rng: random.Random, n_lines: int) -> str:
    lines = []
    for _ in range(n_lines):
        line = "".join(rng.choice(ATOMS) + rng.choice(["", " "]) for _ in range(rng.randint(1, 6)))
        end = rng.choice(["", "word", "7", ")", "é"])  # some lines end where a cut is safe
        lines.append(line + end + rng.choice(BREAKS))
    return "".join(lines)


@pytest.mark.parametrize("pre", ["gpt-2", "llama3", "qwen2", "smollm", "default"])
def test_chunk_cuts_do_not_change_tokens(tmp_path, bpe_meta, monkeypatch, pre):
    """Cutting a file at the points _safe_cut picks gives, for every
    pre-tokenizer family, the ids of the whole text."""
    tok = Tokenizer.from_gguf({**bpe_meta, "tokenizer.ggml.pre": pre})

    def no_fallback(buf):
        raise AssertionError("the fallback cut was used")

    monkeypatch.setattr(corpus, "_fallback_cut", no_fallback)
    rng = random.Random(pre)
    for i in range(20):
        text = random_text(rng, 40)
        p = write(tmp_path / f"t{i}.txt", text)
        chunks = [c for _, c, _, _ in iter_chunks(p, 64)]
        assert "".join(chunks) == text and len(chunks) > 3
        ids = [t for c in chunks for t in tok.encode(c, add_special=False)]
        assert ids == tok.encode(text, add_special=False), (pre, chunks)


def test_chunks_without_safe_points_stay_bounded(tmp_path):
    text = "x" * 300 + "é" * 200 + "\n" + "y" * 100  # no letter before a line break, no line start
    p = write(tmp_path / "long.txt", text)
    chunks = list(iter_chunks(p, 16))
    assert "".join(c for _, c, _, _ in chunks) == text
    assert all(len(c.encode()) <= 9 * 16 for _, c, _, _ in chunks)
    assert [last for *_, last, _ in chunks] == [False] * (len(chunks) - 1) + [True]
    assert sum(n for *_, n in chunks) == len(text.encode())


# -- TokenCache ------------------------------------------------------------------


def make_corpus(root):
    write(root / "a.txt", SAMPLE * 5)  # > 1 chunk at chunk_bytes=64
    write(root / "b.jsonl", json.dumps({"text": "hello world"}) + "\n" + json.dumps({"text": "Zürich 😀"}) + "\n")
    write(root / "c" / "d.md", "# Title\n\nSome *text*.\n")
    return root


def expected_tokens(tok, root, eos):
    """Independent: encode each document whole, append eos."""
    docs = [tok.encode(t, add_special=False) + [eos] for _, t in iter_documents(root)]
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    return np.array([t for d in docs for t in d], dtype=np.uint32), starts


def test_token_cache_contents_and_memmap(tmp_path, tok):
    root = make_corpus(tmp_path / "corpus")
    seen = []
    cache = TokenCache.build(
        root, tok, eos_id=0, cache_dir=tmp_path / "cache", chunk_bytes=64, progress=lambda d, t: seen.append((d, t))
    )
    want, starts = expected_tokens(tok, root, 0)
    assert isinstance(cache.tokens, np.memmap) and cache.tokens.dtype == np.uint32
    assert not cache.tokens.flags.writeable
    np.testing.assert_array_equal(cache.tokens, want)
    np.testing.assert_array_equal(cache.doc_starts, starts)
    assert cache.doc_starts.dtype == np.int64
    assert (cache.n_tokens, cache.n_docs, cache.eos_id) == (len(want), 4, 0)
    assert len(cache.key) == 64 and cache.path == tmp_path / "cache" / f"{cache.key}.tokens"
    total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert seen[-1] == (total, total)


def test_token_cache_reused_without_tokenizing(tmp_path, tok, bpe_meta, monkeypatch):
    root = make_corpus(tmp_path / "corpus")
    first = TokenCache.build(root, tok, eos_id=0, cache_dir=tmp_path / "cache")
    fresh = Tokenizer.from_gguf(bpe_meta)  # a new object for the same tokenizer: same fingerprint

    def boom(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(fresh, "encode_batch", boom)
    monkeypatch.setattr(fresh, "encode", boom)
    again = TokenCache.build(root, fresh, eos_id=0, cache_dir=tmp_path / "cache")
    assert again.key == first.key
    np.testing.assert_array_equal(again.tokens, first.tokens)
    np.testing.assert_array_equal(again.doc_starts, first.doc_starts)
    # a moved corpus (same bytes, other folder name) still hits
    moved = make_corpus(tmp_path / "elsewhere")
    assert TokenCache.build(moved, fresh, eos_id=0, cache_dir=tmp_path / "cache").key == first.key


def test_token_cache_key_changes(tmp_path, tok, bpe_meta):
    root = make_corpus(tmp_path / "corpus")
    cdir = tmp_path / "cache"
    k0 = TokenCache.build(root, tok, eos_id=0, cache_dir=cdir).key
    k_eos = TokenCache.build(root, tok, eos_id=1, cache_dir=cdir).key
    k_special = TokenCache.build(root, tok, eos_id=0, cache_dir=cdir, special=False).key
    other = Tokenizer.from_gguf({**bpe_meta, "tokenizer.ggml.merges": bpe_meta["tokenizer.ggml.merges"][:-1]})
    k_tok = TokenCache.build(root, other, eos_id=0, cache_dir=cdir).key
    write(root / "a.txt", SAMPLE * 5 + "!")
    edited = TokenCache.build(root, tok, eos_id=0, cache_dir=cdir)
    assert len({k0, k_eos, k_special, k_tok, edited.key}) == 5
    assert edited.tokens[-2] == tok.encode("# Title\n\nSome *text*.\n")[-1]  # the content really was re-read


def test_crash_leftovers_are_not_a_complete_cache(tmp_path, tok, monkeypatch):
    root = make_corpus(tmp_path / "corpus")
    key = TokenCache.build(root, tok, eos_id=0, cache_dir=tmp_path / "probe").key
    want, _ = expected_tokens(tok, root, 0)
    cdir = tmp_path / "cache"
    cdir.mkdir()
    # what a crash can leave: a temp file, a renamed token file but no metadata
    (cdir / f".{key}.tokens.x1y2.tmp").write_bytes(b"\0" * 64)
    (cdir / f"{key}.tokens").write_bytes(np.zeros(len(want), np.uint32).tobytes())
    calls = []
    real = tok.encode_batch
    monkeypatch.setattr(tok, "encode_batch", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = TokenCache.build(root, tok, eos_id=0, cache_dir=cdir)
    assert calls, "the leftovers were taken for a complete cache"
    np.testing.assert_array_equal(cache.tokens, want)
    # metadata that disagrees with the token file (truncated) is not complete either
    (cdir / f"{key}.tokens").write_bytes(np.asarray(want[:-3]).tobytes())
    assert TokenCache.open(cdir, key) is None
    calls.clear()
    np.testing.assert_array_equal(TokenCache.build(root, tok, eos_id=0, cache_dir=cdir).tokens, want)
    assert calls


def test_failed_build_leaves_nothing(tmp_path, tok, monkeypatch):
    root = make_corpus(tmp_path / "corpus")
    cdir = tmp_path / "cache"

    def fail(*a, **k):
        raise RuntimeError("killed")

    monkeypatch.setattr(tok, "encode_batch", fail)
    with pytest.raises(RuntimeError, match="killed"):
        TokenCache.build(root, tok, eos_id=0, cache_dir=cdir)
    assert list(cdir.iterdir()) == []


def test_token_cache_errors(tmp_path, tok):
    write(tmp_path / "e" / "empty.txt", "")
    write(tmp_path / "e" / "blank.jsonl", '{"text": ""}\n\n')
    with pytest.raises(DataError, match="is empty"):
        TokenCache.build(tmp_path / "e", tok, eos_id=0, cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match="eos_id 999"):
        TokenCache.build(tmp_path / "e", tok, eos_id=999, cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match="no such file"):
        TokenCache.build(tmp_path / "missing", tok, eos_id=0, cache_dir=tmp_path / "cache")


# -- packing -------------------------------------------------------------------------

#              doc 0     | doc 1 |    doc 2       | doc 3 (no eos yet)
HAND = [5, 6, 7, 0, 8, 9, 0, 10, 11, 12, 13, 0, 14]


def test_windows_by_hand():
    data = PackedData(TokenCache.from_array(HAND, eos_id=0), 4, val_fraction=0)
    assert (data.n_windows, data.n_train, data.n_val) == (3, 3, 0)  # (13 - 1) // 4
    # window i = tokens[4i : 4i + 5]
    expect = [
        # inputs         targets          loss_mask     pos           doc
        ([5, 6, 7, 0], [6, 7, 0, 8], [1, 1, 1, 0], [0, 1, 2, 3], [0, 0, 0, 0]),
        ([8, 9, 0, 10], [9, 0, 10, 11], [1, 1, 0, 1], [0, 1, 2, 0], [0, 0, 0, 1]),
        ([11, 12, 13, 0], [12, 13, 0, 14], [1, 1, 1, 0], [0, 1, 2, 3], [0, 0, 0, 0]),
    ]
    for i, want in enumerate(expect):
        got = data.window(i)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        assert [g.dtype for g in got] == [np.int32, np.int32, np.float32, np.int32, np.int32]


def test_eos_runs_and_plain_causal():
    cache = TokenCache.from_array([0, 3, 0, 0, 4, 5], eos_id=0)
    inputs, targets, mask, pos, doc = PackedData(cache, 5, val_fraction=0).window(0)
    np.testing.assert_array_equal(inputs, [0, 3, 0, 0, 4])
    np.testing.assert_array_equal(targets, [3, 0, 0, 4, 5])
    np.testing.assert_array_equal(mask, [0, 1, 0, 0, 1])  # targets after an eos input don't count
    np.testing.assert_array_equal(pos, [0, 0, 1, 0, 0])
    np.testing.assert_array_equal(doc, [0, 1, 1, 2, 3])
    _, _, mask, pos, doc = PackedData(cache, 5, val_fraction=0, block_causal=False).window(0)
    np.testing.assert_array_equal(mask, [1, 1, 1, 1, 1])
    np.testing.assert_array_equal(pos, [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(doc, [0, 0, 0, 0, 0])


def test_split_sizes():
    cache = TokenCache.from_array(np.arange(1, 1002), eos_id=0)  # 1001 tokens, T=10: 100 windows
    data = PackedData(cache, 10)
    assert (data.n_windows, data.n_train, data.n_val) == (100, 95, 5)
    np.testing.assert_array_equal(data.window(95)[0], np.arange(951, 961))  # the first validation window
    assert PackedData(cache, 10, val_fraction=0.001).n_val == 1  # at least one
    assert PackedData(cache, 10, val_fraction=0).n_val == 0
    assert PackedData(cache, 10, val_fraction=0.5).n_train == 50
    small = TokenCache.from_array(np.arange(1, 12), eos_id=0)  # 11 tokens, T=10: one window
    with pytest.raises(DataError, match="at least one for training"):
        PackedData(small, 10)
    assert PackedData(small, 10, val_fraction=0).n_train == 1
    with pytest.raises(DataError):
        PackedData(TokenCache.from_array(np.arange(1, 11), eos_id=0), 10, val_fraction=0)  # no window
    with pytest.raises(DataError):
        PackedData(cache, 10, val_fraction=1.0)


def test_attention_mask_by_hand():
    n = -np.inf
    doc = np.array([[0, 0, 1, 1], [0, 0, 0, 0]])
    m = block_causal_mask(doc)
    assert m.shape == (2, 1, 4, 4) and m.dtype == np.float32
    np.testing.assert_array_equal(m[0, 0], [[0, n, n, n], [0, 0, n, n], [n, n, 0, n], [n, n, 0, 0]])
    causal = [[0, n, n, n], [0, 0, n, n], [0, 0, 0, n], [0, 0, 0, 0]]
    np.testing.assert_array_equal(m[1, 0], causal)
    np.testing.assert_array_equal(block_causal_mask(doc, block_causal=False)[0, 0], causal)


# -- batches -----------------------------------------------------------------------


def stream_data():
    # 161 tokens, T=8: 20 windows, window i starts with token 1 + 8i; 4 for validation
    return PackedData(TokenCache.from_array(np.arange(1, 162), eos_id=0), 8, val_fraction=0.2)


def window_ids(batch):
    return ((batch.tokens[:, 0] - 1) // 8).tolist()


def test_batch_stream_order_and_epochs():
    data = stream_data()
    assert (data.n_train, data.n_val) == (16, 4)
    s = BatchStream(data, 3, seed=7)
    got = [w for _ in range(16) for w in window_ids(s.next())]  # 48 windows = 3 epochs
    want = np.concatenate([np.random.default_rng([7, e]).permutation(16) for e in range(3)]).tolist()
    assert got == want
    for e in range(3):
        assert sorted(got[16 * e : 16 * e + 16]) == list(range(16))  # each training window once per epoch
    assert s.epoch == 3.0
    b = BatchStream(data, 3, seed=7).next()
    assert b.tokens.shape == (3, 8) and b.tokens.dtype == np.int32 and b.n_targets == 24
    np.testing.assert_array_equal(b.targets, b.tokens + 1)
    assert window_ids(BatchStream(data, 3, seed=8).next()) != window_ids(b)


def test_batch_stream_resume():
    data = stream_data()
    a = BatchStream(data, 3, seed=1)
    for _ in range(7):
        a.next()
    assert a.epoch == 21 / 16
    state = json.loads(json.dumps(a.state()))
    b = BatchStream(data, 3, seed=1, state=state)
    for _ in range(10):
        x, y = a.next(), b.next()
        for f in ("tokens", "targets", "loss_mask", "pos", "doc"):
            np.testing.assert_array_equal(getattr(x, f), getattr(y, f))
    with pytest.raises(DataError, match="changed"):
        BatchStream(PackedData(data.cache, 8, val_fraction=0.1), 3, seed=1, state=state)
    with pytest.raises(DataError, match="state"):
        BatchStream(data, 3, seed=1, state={"epoch": "x"})


def test_check_batch():
    data = stream_data()
    data.check_batch(16)
    with pytest.raises(DataError, match=r"16 window\(s\) \(129 tokens\).*17 x 8 needs 137 tokens"):
        data.check_batch(17)
    with pytest.raises(DataError):
        BatchStream(data, 17, seed=0)


def test_validation_batches_padding():
    data = stream_data()
    vb = validation_batches(data, 3)
    assert len(vb) == 2 and all(b.tokens.shape == (3, 8) for b in vb)
    assert window_ids(vb[0]) == [16, 17, 18]
    last = vb[1]
    np.testing.assert_array_equal(last.tokens[0], np.arange(1 + 19 * 8, 1 + 20 * 8))
    np.testing.assert_array_equal(last.loss_mask, [[1] * 8, [0] * 8, [0] * 8])
    assert last.n_targets == 8 and last.loss_mask.dtype == np.float32
    np.testing.assert_array_equal(last.pos[1:], [list(range(8))] * 2)  # padding rows still attend to themselves
    assert len(validation_batches(data, 3, max_batches=1)) == 1
    assert validation_batches(PackedData(data.cache, 8, val_fraction=0), 3) == []


def test_unigram_entropy_by_hand():
    # p = (1/2, 1/4, 1/4): H = 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2
    assert unigram_entropy(np.array([0, 0, 1, 2], np.uint32), 5) == pytest.approx(1.5 * math.log(2))
    assert unigram_entropy(np.arange(8) % 4, 4) == pytest.approx(math.log(4))
    assert unigram_entropy(np.zeros(10, np.uint32), 3) == 0.0
    with pytest.raises(DataError):
        unigram_entropy(np.array([7]), 5)
    with pytest.raises(DataError):
        unigram_entropy(np.array([], np.uint32), 5)
