"""Preference data (toy.train.prefdata): the three formats, batches, the KTO
KL batch, every line error.

Expected ids come from the hand-made byte-level tokenizer of test_instruct
(one token per ASCII character, BOS added, EOS ``<|endoftext|>``,
``<|im_end|>`` ends generation) and ChatML, written out by hand with
``ids()``; batch layouts are checked against TRL 1.16's own collators
(``DataCollatorForPreference``, ``DataCollatorForUnpairedPreference``) fed the
same ids, and the KL pairing against TRL's ``KTOTrainer._prepare_dataset``
run on the same rows. The real SmolLM2 tokenizer and template (``model``
tests) check the conversational spans as decoded text.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from toy.errors import DataError
from toy.gguf import GGUFFile
from toy.tokenizer import Tokenizer
from toy.tokenizer.chat import ChatTemplate
from toy.train.data import BatchStream
from toy.train.prefdata import (
    PairData,
    PrefBatch,
    PromptData,
    UnpairedData,
    check_pref_file,
    detect_file,
    load_pref,
)

SPECIAL = ["<|endoftext|>", "<s>", "<|im_start|>", "<|im_end|>"]
EOT, BOS, IM_START, IM_END = 0, 1, 2, 3


def ids(text: str) -> list[int]:
    return [4 if c == "\n" else 5 if c == " " else 6 + ord(c) - 0x21 for c in text]


def chatml_prompt(*turns: tuple[str, str]) -> list[int]:
    """BOS + ChatML turns + the generation prompt, by hand."""
    out = [BOS]
    for role, content in turns:
        out += [IM_START, *ids(f"{role}\n{content}"), IM_END, *ids("\n")]
    return out + [IM_START, *ids("assistant\n")]


def hand_md() -> dict:
    tokens = SPECIAL + ["Ċ", "Ġ"] + [chr(c) for c in range(0x21, 0x7F)]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array([3] * 4 + [1] * (len(tokens) - 4), dtype=np.int32),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": BOS,
        "tokenizer.ggml.eos_token_id": EOT,
        "tokenizer.ggml.add_bos_token": True,
    }


@pytest.fixture(scope="module")
def hand():
    return Tokenizer.from_gguf(hand_md())


@pytest.fixture(scope="module")
def chatml():
    return ChatTemplate.default()


def write_jsonl(path, rows) -> str:
    out = b""
    for r in rows:
        line = r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode()
        out += line + b"\n"
    path.write_bytes(out)
    return str(path)


def load(tmp_path, tok, tpl, rows, name="d.jsonl", **kw):
    kw.setdefault("max_length", 4096)
    return load_pref(write_jsonl(tmp_path / name, rows), tok, tpl, **kw)


def user(c):
    return {"role": "user", "content": c}


def asst(c):
    return {"role": "assistant", "content": c}


# -- formats -> ids


def test_pairs_standard_conversational_implicit(tmp_path, hand, chatml):
    rows = [
        {"prompt": "ab", "chosen": "c", "rejected": "de"},
        {"prompt": [user("q")], "chosen": [asst("y")], "rejected": [asst("no")]},
        {
            "chosen": [user("q"), asst("a"), user("r"), asst("y")],
            "rejected": [user("q"), asst("a"), user("r"), asst("n")],
        },
        {"prompt": "", "chosen": "x", "rejected": "z"},
    ]
    exs, st = load(tmp_path, hand, chatml, rows)
    std, conv, imp, empty = exs
    assert std.prompt.tolist() == [BOS, *ids("ab")]
    assert [c.tolist() for c in std.completions] == [[*ids("c"), EOT], [*ids("de"), EOT]]
    # the completion is the assistant turn up to <|im_end|> inclusive; the newline after it is not part of it
    assert conv.prompt.tolist() == chatml_prompt(("user", "q"))
    assert [c.tolist() for c in conv.completions] == [[*ids("y"), IM_END], [*ids("no"), IM_END]]
    # implicit prompt: the longest common run of leading messages (q, a, r)
    assert imp.prompt.tolist() == chatml_prompt(("user", "q"), ("assistant", "a"), ("user", "r"))
    assert [c.tolist() for c in imp.completions] == [[*ids("y"), IM_END], [*ids("n"), IM_END]]
    assert imp.raw_prompt == [user("q"), asst("a"), user("r")]
    assert empty.prompt.tolist() == [BOS]
    assert [e.style for e in exs] == ["standard", "conversational", "implicit", "standard"]
    assert (st.format, st.styles, st.n_examples) == ("pairs", {"standard": 2, "conversational": 1, "implicit": 1}, 4)
    assert st.n_loss == 2 + 3 + 2 + 3 + 2 + 2 + 2 + 2
    assert st.n_tokens == sum(len(e.prompt) * 2 + sum(len(c) for c in e.completions) for e in exs)
    assert [(e.line, e.kind) for e in exs] == [(1, "pairs"), (2, "pairs"), (3, "pairs"), (4, "pairs")]


def test_unpaired_and_prompts(tmp_path, hand, chatml):
    rows = [
        {"prompt": "p", "completion": "good", "label": True},
        {"prompt": [user("q")], "completion": [asst("bad")], "label": False},
    ]
    exs, st = load(tmp_path, hand, chatml, rows)
    assert st.format == "unpaired" and (st.n_desirable, st.n_undesirable) == (1, 1)
    assert [e.label for e in exs] == [True, False]
    assert exs[0].prompt.tolist() == [BOS, *ids("p")] and exs[0].completions[0].tolist() == [*ids("good"), EOT]
    assert exs[1].prompt.tolist() == chatml_prompt(("user", "q"))
    assert exs[1].completions[0].tolist() == [*ids("bad"), IM_END]

    rows = [{"prompt": "2+2=", "answer": "4", "meta": {"k": [1]}}, {"prompt": [user("hi")], "answer": "x"}]
    exs, st = load(tmp_path, hand, chatml, rows, name="p.jsonl")
    assert st.format == "prompts" and st.n_loss == 0
    assert exs[0].prompt.tolist() == [BOS, *ids("2+2=")] and exs[0].completions == ()
    assert exs[0].fields == {"answer": "4", "meta": {"k": [1]}} and exs[0].raw_prompt == "2+2="
    assert exs[1].prompt.tolist() == chatml_prompt(("user", "hi")) and exs[1].style == "conversational"
    data = PromptData(exs, 32, val_fraction=0)
    assert [e.line for e in data.prompts([1, 0])] == [2, 1]
    b = data.batch([0])
    assert b.tokens[0].tolist() == [BOS, *ids("2+2="), *[0] * 27] and b.n_targets == 0
    assert b.doc[0].tolist() == [0] * 5 + [1] * 27 and b.pos[0].tolist() == list(range(32))
    with pytest.raises(DataError, match="a sequence of 5 tokens does not fit a row of 4 positions"):
        PromptData(exs, 4)


def test_detection_and_explicit_format(tmp_path, hand, chatml):
    pairs = write_jsonl(tmp_path / "a.jsonl", ["", {"prompt": "a", "chosen": "b", "rejected": "c"}])
    kto = write_jsonl(tmp_path / "b.jsonl", ["{bad", {"prompt": "a", "completion": "b", "label": False}])
    prompts = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "a", "answer": "1"}])
    sft = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
    assert [detect_file(p) for p in (pairs, kto, prompts, sft)] == ["pairs", "unpaired", "prompts", None]
    # an explicit format: a prompts line read as pairs misses its fields
    with pytest.raises(DataError, match=r"c\.jsonl:1: a prompts example \(keys answer, prompt\) in a pairs file"):
        load_pref(prompts, hand, chatml, format="pairs", max_length=64)
    with pytest.raises(DataError, match=r'd\.jsonl:1: "label" is missing \(an unpaired example has prompt, completion'):
        load_pref(sft, hand, chatml, format="unpaired", max_length=64)
    with pytest.raises(DataError, match=r"d\.jsonl:1: cannot tell the preference format"):
        load_pref(sft, hand, chatml, max_length=64)
    with pytest.raises(DataError, match="unknown preference data format 'dpo'"):
        load_pref(pairs, hand, chatml, format="dpo", max_length=64)


# -- batches


def expected_rows(seqs, t):
    """The interfaces.md layout written out position by position."""
    b = len(seqs)
    tokens, targets, doc = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32), np.ones((b, t), np.int32)
    mask = np.zeros((b, t), np.float32)
    for r, (prompt, comp) in enumerate(seqs):
        seq = list(prompt) + list(comp)
        for j in range(len(seq) - 1):
            tokens[r, j], targets[r, j], doc[r, j] = seq[j], seq[j + 1], 0
            mask[r, j] = 1.0 if j + 1 >= len(prompt) else 0.0
    return tokens, targets, mask, np.tile(np.arange(t, dtype=np.int32), (b, 1)), doc


def assert_batch(batch, exp):
    for name, want in zip(("tokens", "targets", "loss_mask", "pos", "doc"), exp):
        got = getattr(batch, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_pair_batch_layout(tmp_path, hand, chatml):
    rows = [
        {"prompt": "ab", "chosen": "c", "rejected": "de"},
        {"prompt": [user("q")], "chosen": [asst("y")], "rejected": [asst("no")]},
        {"prompt": "x", "chosen": "yy", "rejected": "z"},
    ]
    exs, _ = load(tmp_path, hand, chatml, rows)
    data = PairData(exs, 24, val_fraction=0)
    assert (data.n_train, data.n_val, data.rows_per_item) == (3, 0, 2)
    b = data.batch([2, 0])
    assert isinstance(b, PrefBatch) and b.tokens.shape == (4, 24) and b.ref_logps is None
    c2, r2 = [*ids("yy"), EOT], [*ids("z"), EOT]
    c0, r0 = [*ids("c"), EOT], [*ids("de"), EOT]
    p2, p0 = [BOS, *ids("x")], [BOS, *ids("ab")]
    assert_batch(b, expected_rows([(p2, c2), (p0, c0), (p2, r2), (p0, r0)], 24))  # chosen rows, then rejected
    assert b.n_targets == 3 + 2 + 2 + 3


def test_pair_batch_matches_trl_collator(tmp_path, hand, chatml):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    rows = [
        {"prompt": "abc", "chosen": "defgh", "rejected": "ij"},
        {"prompt": [user("q")], "chosen": [asst("yes")], "rejected": [asst("no")]},
    ]
    exs, _ = load(tmp_path, hand, chatml, rows)
    t = 30
    got = PairData(exs, t, val_fraction=0).batch([0, 1])
    feats = [
        {
            "prompt_ids": e.prompt.tolist(),
            "chosen_ids": e.completions[0].tolist(),
            "rejected_ids": e.completions[1].tolist(),
        }
        for e in exs
    ]
    trl = DataCollatorForPreference(pad_token_id=0, max_length=t + 1)(feats)
    ids_, cm, am = (trl[k].numpy() for k in ("input_ids", "completion_mask", "attention_mask"))
    w = ids_.shape[1] - 1
    np.testing.assert_array_equal(got.tokens[:, :w], ids_[:, :-1] * am[:, 1:])
    np.testing.assert_array_equal(got.targets[:, :w], ids_[:, 1:] * am[:, 1:])
    np.testing.assert_array_equal(got.loss_mask[:, :w], cm[:, 1:].astype(np.float32))
    np.testing.assert_array_equal(got.doc[:, :w], 1 - am[:, 1:])


def test_pairs_with_batch_stream_and_validation(tmp_path, hand, chatml):
    rows = [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(7)]
    exs, _ = load(tmp_path, hand, chatml, rows)
    data = PairData(exs, 8, val_fraction=0.3)
    assert (data.n_windows, data.n_val, data.n_train) == (7, 2, 5)
    stream = BatchStream(data, 2, seed=3)
    order = np.random.default_rng([3, 0]).permutation(5)
    b = stream.next()
    assert b.tokens.shape == (4, 8)  # batch_size counts pairs: 2 pairs, 4 rows
    want = [[BOS, *ids(f"p{i}")] for i in order[:2]]
    assert [b.tokens[r, :3].tolist() for r in range(4)] == want + want
    assert [b.targets[r, 2] for r in range(4)] == [ids("c")[0]] * 2 + [ids("r")[0]] * 2
    with pytest.raises(DataError, match="the training split has 5 pair"):
        data.check_batch(6)
    assert data.validation_rows(3) == [[5, 6, 5]]  # filled up from the start of the split
    assert data.validation_rows(1) == [[5], [6]]
    with pytest.raises(DataError, match="too few"):
        PairData(exs[:1], 8, val_fraction=0.5)
    with pytest.raises(DataError, match=r"d\.jsonl:1: a sequence of 6 tokens does not fit a row of 4 positions"):
        PairData(exs, 4)


def test_unpaired_batch_and_kl_pairing(tmp_path, hand, chatml):
    labels = [True, False, True, False, True, True, False]
    rows = [
        {"prompt": "p" * (i % 3 + 1), "completion": chr(97 + i) * (i % 2 + 1), "label": lab}
        for i, lab in enumerate(labels)
    ]
    exs, _ = load(tmp_path, hand, chatml, rows)
    data = UnpairedData(exs, 10, val_fraction=0.3, kl_group=2)  # train rows 0-4, validation rows 5-6
    b = data.batch([3, 0, 4])
    np.testing.assert_array_equal(b.desirable, np.asarray([0, 1, 1], np.float32))
    assert_batch(b, expected_rows([(exs[i].prompt, exs[i].completions[0]) for i in (3, 0, 4)], 10))
    # groups of 2 per split, each rotated by one: train [0 1] [2 3] [4], validation [5 6]
    assert [data.kl_partner(i) for i in range(7)] == [1, 0, 3, 2, 4, 6, 5]
    kl = data.kl_batch([3, 0, 4])
    assert_batch(kl, expected_rows([(exs[i].prompt, exs[j].completions[0]) for i, j in ((3, 2), (0, 1), (4, 4))], 10))
    # without kl_group: the rotation of the rows as given
    free = UnpairedData(exs, 10, val_fraction=0.3)
    got = free.kl_batch([3, 0, 4])
    assert_batch(got, expected_rows([(exs[i].prompt, exs[j].completions[0]) for i, j in ((3, 4), (0, 3), (4, 0))], 10))
    # a KL sequence longer than context + 1 tokens loses the tail of its completion
    long = load(
        tmp_path,
        hand,
        chatml,
        [
            {"prompt": "p", "completion": "abcdefgh", "label": True},
            {"prompt": "ppppp", "completion": "x", "label": False},
        ],
        name="l.jsonl",
        max_length=9,
    )[0]
    cut = UnpairedData(long, 8, val_fraction=0, kl_group=2).kl_batch([1])
    assert_batch(cut, expected_rows([(long[1].prompt, long[0].completions[0][:3])], 8))
    with pytest.raises(DataError, match="kl_group must be at least 1"):
        UnpairedData(exs, 10, kl_group=0)


def test_kl_pairing_is_trls(tmp_path, hand, chatml):
    """TRL's own dataset preparation pairs the same rows; its collator lays out the same KL sequences."""
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference, KTOTrainer

    texts = [("a", "bb", True), ("cc", "d", False), ("e", "fff", True), ("gg", "h", False), ("i", "jj", True)]
    texts += [("k", "ll", False), ("mm", "n", True), ("o", "pp", False)]
    rows = [{"prompt": p, "completion": c, "label": lab} for p, c, lab in texts]
    exs, _ = load(tmp_path, hand, chatml, rows)
    group, t = 3, 12
    data = UnpairedData(exs, t, val_fraction=0.25, kl_group=group)  # train 0-5, validation 6-7
    hf = PreTrainedTokenizerFast(tokenizer_object=hand.hf, eos_token="<|endoftext|>")
    stub = SimpleNamespace(calculate_KL=True, _tokenizer=hf, desirable_weight=1.0, undesirable_weight=1.0)
    args = SimpleNamespace(dataset_num_proc=None, per_device_train_batch_size=group, max_length=None)
    completions = [e.completions[0].tolist() for e in exs]
    for lo, hi, name in ((0, data.n_train, "train"), (data.n_train, 8, "eval")):
        ds = KTOTrainer._prepare_dataset(stub, Dataset.from_list(rows[lo:hi]), hf, args, name)
        # completions carry no BOS (TRL's tokenizer here adds none to the prompts), so they compare directly
        assert [r["completion_ids"] for r in ds] == completions[lo:hi]
        trl_partner = [lo + completions[lo:hi].index(r["KL_completion_ids"]) for r in ds]
        assert trl_partner == [data.kl_partner(i) for i in range(lo, hi)]
    rows_drawn = [4, 1, 5, 0]
    feats = [
        {
            "prompt_ids": exs[i].prompt.tolist(),
            "completion_ids": completions[i],
            "label": exs[i].label,
            "KL_completion_ids": completions[data.kl_partner(i)],
        }
        for i in rows_drawn
    ]
    trl = DataCollatorForUnpairedPreference(pad_token_id=0, max_length=t + 1)(feats)
    got = data.kl_batch(rows_drawn)
    ids_, cm, am = (trl[k].numpy() for k in ("KL_input_ids", "KL_completion_mask", "KL_attention_mask"))
    w = ids_.shape[1] - 1
    np.testing.assert_array_equal(got.tokens[:, :w], ids_[:, :-1] * am[:, 1:])
    np.testing.assert_array_equal(got.targets[:, :w], ids_[:, 1:] * am[:, 1:])
    np.testing.assert_array_equal(got.loss_mask[:, :w], cm[:, 1:].astype(np.float32))


# -- lengths


def test_truncate_and_drop(tmp_path, hand, chatml):
    rows = [
        {"prompt": "ab", "chosen": "cdefgh", "rejected": "i"},  # 3 + 7 and 3 + 2 tokens
        {"prompt": "x", "chosen": "y", "rejected": "z"},
    ]
    exs, st = load(tmp_path, hand, chatml, rows, max_length=6)
    # TRL's keep_start: the prompt is kept, each side's completion cut on its own
    assert exs[0].completions[0].tolist() == ids("cde") and exs[0].completions[1].tolist() == [*ids("i"), EOT]
    assert (st.truncated, st.dropped, st.n_examples) == (1, 0, 2)
    assert st.lengths["max"] == 10  # before truncation
    exs, st = load(tmp_path, hand, chatml, rows, max_length=6, overflow="drop")
    assert (st.truncated, st.dropped, [e.line for e in exs]) == (0, 1, [2])
    # a prompt that leaves no completion token: an error naming the line (or dropped with overflow="drop")
    rows.append({"prompt": "abcdef", "chosen": "y", "rejected": "z"})
    with pytest.raises(DataError, match=r"d\.jsonl:3: the prompt has 7 tokens, which leaves no completion token") as e:
        load(tmp_path, hand, chatml, rows, max_length=6)
    assert "raise the context" in e.value.hint
    _, st = load(tmp_path, hand, chatml, rows, max_length=6, overflow="drop")
    assert st.dropped == 2
    with pytest.raises(DataError, match=r"no preference example in .*every example was over-length"):
        load(tmp_path, hand, chatml, rows[2:], max_length=6, overflow="drop")
    with pytest.raises(DataError, match=r"d\.jsonl:1: the prompt has 5 tokens"):
        load(tmp_path, hand, chatml, [{"prompt": "abcd", "answer": 1}], max_length=5)


# -- line errors


M = {"role": "user", "content": "q"}
A = {"role": "assistant", "content": "a"}


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{bad json", "not valid JSON"),
        (b"\xff\xfe", "not valid UTF-8"),
        ("[1, 2]", "expected a JSON object, got an array"),
        ({"prompt": "a", "chosen": "b"}, '"rejected" is missing'),
        ({"chosen": "b", "rejected": "c"}, '"chosen" is a string; without "prompt"'),
        ({"prompt": "a", "chosen": "b", "rejected": "c", "id": 3}, "unknown key(s) id in a pairs example"),
        ({"prompt": "a", "chosen": 3, "rejected": "c"}, '"chosen" is a number, not a string'),
        ({"prompt": 1, "chosen": "b", "rejected": "c"}, '"prompt" is a number, not a string'),
        ({"prompt": "a", "chosen": [A], "rejected": "c"}, "chosen is messages but prompt, rejected are not"),
        ({"prompt": "a", "chosen": " ", "rejected": "c"}, 'empty chosen (a blank "chosen" gives nothing to learn)'),
        (
            {"prompt": [M], "chosen": [A], "rejected": [{"role": "assistant", "content": ""}]},
            "rejected[0]: empty assistant content",
        ),
        ({"prompt": [M], "chosen": [M, A], "rejected": [A]}, "chosen[0]: the completion starts with a 'user' turn"),
        (
            {"prompt": [{"role": "bot", "content": "x"}], "chosen": [A], "rejected": [A]},
            "prompt[0]: unknown role 'bot'",
        ),
        ({"prompt": [], "chosen": [A], "rejected": [A]}, '"prompt" is empty'),
        ({"prompt": "a", "chosen": "same", "rejected": "same"}, "chosen and rejected are identical"),
        ({"prompt": [M], "chosen": [A], "rejected": [A]}, "chosen and rejected are identical"),
        ({"chosen": [M, A], "rejected": [M]}, '"rejected" is empty'),
        ({"chosen": [A, M], "rejected": [M, A]}, "share no first message"),
        (
            {"prompt": "a", "completion": "b", "label": True},
            "an unpaired example (keys completion, label, prompt) in a pairs file",
        ),
    ],
)
def test_pair_line_errors(tmp_path, hand, chatml, line, reason):
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "ok", "chosen": "y", "rejected": "n"}, "", line])
    with pytest.raises(DataError) as e:
        load_pref(path, hand, chatml, max_length=64)
    assert str(e.value).startswith(f"{path}:3: ") and reason in str(e.value)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ({"prompt": "a", "completion": "b", "label": "yes"}, '"label" is a string, not a boolean'),
        ({"prompt": "a", "completion": "b", "label": 1}, '"label" is a number, not a boolean'),
        ({"prompt": "a", "completion": "", "label": True}, "empty completion"),
        ({"prompt": "a", "label": True}, '"completion" is missing'),
        ({"prompt": "a", "completion": "b", "label": True, "x": 1}, "unknown key(s) x in an unpaired example"),
    ],
)
def test_unpaired_line_errors(tmp_path, hand, chatml, line, reason):
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "ok", "completion": "y", "label": True}, line])
    with pytest.raises(DataError) as e:
        load_pref(path, hand, chatml, max_length=64)
    assert str(e.value).startswith(f"{path}:2: ") and reason in str(e.value)


def test_prompt_line_errors_and_empty_file(tmp_path, hand, chatml):
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "ok"}, {"prompt": 3}])
    with pytest.raises(DataError, match=r"e\.jsonl:2: \"prompt\" is a number, not a string"):
        load_pref(path, hand, chatml, max_length=64)
    nobos = Tokenizer.from_gguf({**hand_md(), "tokenizer.ggml.add_bos_token": False})
    path = write_jsonl(tmp_path / "f.jsonl", [{"prompt": ""}])
    with pytest.raises(DataError, match=r"f\.jsonl:1: empty prompt"):
        load_pref(path, nobos, chatml, max_length=64)
    path = write_jsonl(tmp_path / "g.jsonl", ["", ""])
    with pytest.raises(DataError, match="no preference example in"):
        load_pref(path, hand, chatml, max_length=64)


def test_check_file_collects_every_problem(tmp_path, hand, chatml):
    rows = [
        {"prompt": "ab", "chosen": "cd", "rejected": "e"},
        "{oops",
        {"prompt": "a", "chosen": "x", "rejected": "x"},
        "",
        {"prompt": "abcdefghij", "chosen": "x", "rejected": "y"},
        {"prompt": "a", "chosen": "long completion", "rejected": "y"},
    ]
    rep = check_pref_file(write_jsonl(tmp_path / "c.jsonl", rows), hand, chatml, max_length=10, show=5)
    assert rep.format == "pairs" and rep.n_examples == 2 and rep.over_length == 1
    assert [n for n, _ in rep.problems] == [2, 3, 5]
    assert "not valid JSON" in rep.problems[0][1] and "identical" in rep.problems[1][1]
    assert rep.problems[2][1] == "the prompt has 11 tokens, which leaves no completion token within max_length 10"
    s = rep.samples[0]
    assert [(x["name"], x["n_tokens"], x["n_loss"]) for x in s["sides"]] == [("chosen", 6, 3), ("rejected", 5, 2)]
    assert s["sides"][0]["segments"] == [("<s>ab", False), ("cd<|endoftext|>", True)]
    d = rep.to_dict()
    assert d["problems"][0]["line"] == 2 and d["samples"][0]["sides"][1]["segments"][1] == {
        "text": "e<|endoftext|>",
        "loss": True,
    }
    empty = check_pref_file(write_jsonl(tmp_path / "z.jsonl", [""]), hand, chatml, max_length=10)
    assert empty.problems == [(0, "the file holds no example (it is empty or has only blank lines)")]


# -- the real tokenizer and template


@pytest.fixture(scope="module")
def smol(smollm2_path):
    with GGUFFile(smollm2_path) as f:
        return Tokenizer.from_gguf(f.metadata), ChatTemplate.from_gguf(f.metadata)


@pytest.mark.model
def test_smollm2_conversational(tmp_path, smol):
    tok, tpl = smol
    rows = [
        {"prompt": [user("What is 2 + 3?")], "chosen": [asst("5.")], "rejected": [asst("6.")]},
        {"prompt": "Capital of France:", "chosen": " Paris", "rejected": " Lyon"},
    ]
    exs, _ = load(tmp_path, tok, tpl, rows, max_length=2048)
    conv, std = exs
    sys_prompt = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    assert (
        tok.decode(conv.prompt.tolist())
        == sys_prompt + "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert [tok.decode(c.tolist()) for c in conv.completions] == ["5.<|im_end|>", "6.<|im_end|>"]
    # the whole chosen sequence is the SFT rendering's ids, minus the newline after <|im_end|>
    full = tpl.render([user("What is 2 + 3?"), asst("5.")], add_generation_prompt=False)
    whole = tok.encode(full, add_special=False, special=True)
    assert conv.sequence(0)[0].tolist() == whole[:-1] and tok.decode(whole[-1:]) == "\n"
    assert tok.decode(std.prompt.tolist()) == "Capital of France:"
    assert [tok.decode(c.tolist()) for c in std.completions] == [" Paris<|im_end|>", " Lyon<|im_end|>"]
