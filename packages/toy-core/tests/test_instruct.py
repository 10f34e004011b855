"""Instruction-tuning data (toy.train.instruct): loss masks, over-length
handling, line errors, packing, and check_file.

Two tokenizers. A hand-made byte-level one (``hand_tokenizer``): no merges,
so every ASCII character is one token and the expected ids are written out
from the text by hand with ``ids()``; it adds BOS (``<s>``), its EOS is
``<|endoftext|>``, and ``<|im_end|>`` ends generation. And the real
SmolLM2-135M-Instruct tokenizer and ChatML template (``model`` tests), where
expectations are text: the loss tokens decoded back must equal the string
the rules name. Packing tests use hand-built Examples with known ids.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from toy.gguf import GGUFFile
from toy.models.common import block_causal_mask
from toy.tokenizer import Tokenizer
from toy.tokenizer.chat import ChatTemplate
from toy.train.data import BatchStream, DataError, validation_batches
from toy.train.instruct import Example, InstructData, check_file, load_examples
from toy_testsupport.train_helpers import loss_spans as spans

# -- the hand-made tokenizer: ids 0-3 special, "\n" 4, " " 5, "!".."~" 6..99

SPECIAL = ["<|endoftext|>", "<s>", "<|im_start|>", "<|im_end|>"]
EOT, BOS, IM_START, IM_END = 0, 1, 2, 3


def ids(text: str) -> list[int]:
    """Ids of plain ASCII text under the hand tokenizer (one per character)."""
    return [4 if c == "\n" else 5 if c == " " else 6 + ord(c) - 0x21 for c in text]


@pytest.fixture(scope="module")
def hand():
    tokens = SPECIAL + ["Ċ", "Ġ"] + [chr(c) for c in range(0x21, 0x7F)]
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array([3] * 4 + [1] * (len(tokens) - 4), dtype=np.int32),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": BOS,
        "tokenizer.ggml.eos_token_id": EOT,
        "tokenizer.ggml.add_bos_token": True,
    }
    return Tokenizer.from_gguf(md)


@pytest.fixture(scope="module")
def chatml():
    return ChatTemplate.default()


@pytest.fixture(scope="module")
def smol(smollm2_path):
    with GGUFFile(smollm2_path) as f:
        return Tokenizer.from_gguf(f.metadata), ChatTemplate.from_gguf(f.metadata)


def write_jsonl(path, rows) -> str:
    """rows: dicts (dumped) or str/bytes lines written as they are."""
    out = b""
    for r in rows:
        line = r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode()
        out += line + b"\n"
    path.write_bytes(out)
    return str(path)


def one(tmp_path, tok, tpl, row, **kw):
    exs, _ = load_examples(write_jsonl(tmp_path / "one.jsonl", [row]), tok, tpl, max_length=kw.pop("max_length", 4096))
    assert len(exs) == 1
    return exs[0]


# -- loss masks, hand tokenizer


def test_text_hand(tmp_path, hand, chatml):
    ex = one(tmp_path, hand, chatml, {"text": "hi"})
    assert ex.tokens.tolist() == [BOS, *ids("hi"), EOT]
    assert ex.loss.tolist() == [False, True, True, True]  # token 0 has no predecessor
    assert (ex.kind, ex.line) == ("text", 1) and ex.tokens.dtype == np.int32 and ex.loss.dtype == bool


def test_prompt_completion_hand(tmp_path, hand, chatml):
    ex = one(tmp_path, hand, chatml, {"prompt": "Q: a?\nA:", "completion": " b"})
    assert ex.tokens.tolist() == [BOS, *ids("Q: a?\nA:"), *ids(" b"), EOT]
    assert ex.loss.tolist() == [False] * 9 + [True] * 3  # BOS + 8 prompt chars; " ", "b", EOS


def test_messages_hand(tmp_path, hand, chatml):
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "k"},
    ]
    ex = one(tmp_path, hand, chatml, {"messages": msgs})

    def turn(role, content):
        return [IM_START, *ids(role + "\n" + content), IM_END, *ids("\n")]

    want = [BOS, *turn("system", "s"), *turn("user", "hi"), *turn("assistant", "yo")]
    want += [*turn("user", "ok"), *turn("assistant", "k")]
    assert ex.tokens.tolist() == want
    # targets: "y", "o", <|im_end|> and "k", <|im_end|>; never the header or the newline after <|im_end|>.
    # A turn is <|im_start|>, its text, <|im_end|>, "\n": 3 + len(text) tokens.
    first = 1 + (3 + len("system\ns")) + (3 + len("user\nhi")) + 1 + len("assistant\n")  # "y": 33
    second = first + len("yo") + 2 + (3 + len("user\nok")) + 1 + len("assistant\n")  # "k": 58
    assert (first, second, len(want)) == (33, 58, 61)
    want_loss = [False] * len(want)
    for k in (first, first + 1, first + 2, second, second + 1):
        want_loss[k] = True
    assert ex.loss.tolist() == want_loss
    assert [ex.tokens[first], ex.tokens[second + 1]] == [ids("y")[0], IM_END]


def test_tool_role_only_when_rendered(tmp_path, hand, chatml):
    msgs = [{"role": "user", "content": "q"}, {"role": "tool", "content": "t"}, {"role": "assistant", "content": "a"}]
    assert one(tmp_path, hand, chatml, {"messages": msgs}).loss.sum() == 2  # "a", <|im_end|>
    skip_tool = ChatTemplate(
        "{% for m in messages %}{% if m.role != 'tool' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    path = write_jsonl(tmp_path / "t.jsonl", [{"messages": msgs}])
    with pytest.raises(
        DataError, match=r"t\.jsonl:1: messages\[1\]: unknown role 'tool' \(allowed: system, user, assistant\)"
    ):
        load_examples(path, hand, skip_tool, max_length=100)


def test_template_whose_prefix_is_not_a_prefix(tmp_path, hand):
    # the generation prompt says "bot" but assistant turns render as "assistant": no span can be found
    odd = ChatTemplate(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>bot\n{% endif %}"
    )
    path = write_jsonl(
        tmp_path / "odd.jsonl",
        [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}],
    )
    with pytest.raises(
        DataError, match=r"odd\.jsonl:1: messages\[1\]: .*does not start the whole conversation's \(text differ\)"
    ):
        load_examples(path, hand, odd, max_length=100)


# -- truncation and drop


def over_length_rows():
    return [
        {"text": "abcdef"},  # 8 tokens: BOS a b c d e f EOS
        {"prompt": "abcdefg", "completion": "x"},  # 10 tokens; the first 6 carry no loss
        {"prompt": "ab", "completion": "cd"},  # 6 tokens: fits max_length 6
        {"text": "abcde"},  # 7 tokens
    ]


def test_truncate(tmp_path, hand, chatml):
    path = write_jsonl(tmp_path / "d.jsonl", over_length_rows())
    exs, st = load_examples(path, hand, chatml, max_length=6)
    assert [e.line for e in exs] == [1, 3, 4]  # line 2 lost every target
    assert exs[0].tokens.tolist() == [BOS, *ids("abcde")] and exs[0].loss.tolist() == [False] + [True] * 5
    assert exs[1].tokens.tolist() == [BOS, *ids("abcd"), EOT] and exs[1].loss.sum() == 3
    assert exs[2].tokens.tolist() == [BOS, *ids("abcde")]
    assert (st.truncated, st.dropped, st.no_loss, st.n_examples) == (3, 0, 1, 3)
    assert st.kinds == {"text": 2, "prompt_completion": 2}
    assert (st.n_tokens, st.n_loss) == (18, 5 + 3 + 5)
    # lengths before truncation: 8, 10, 6, 7 -> sorted 6 7 8 10; p95 is the ceil(3.8) = 4th
    assert st.lengths == {"min": 6, "median": 7.5, "p95": 10, "max": 10}


def test_drop(tmp_path, hand, chatml):
    path = write_jsonl(tmp_path / "d.jsonl", over_length_rows())
    exs, st = load_examples(path, hand, chatml, max_length=6, overflow="drop")
    assert [e.line for e in exs] == [3]
    assert (st.truncated, st.dropped, st.no_loss, st.n_tokens, st.n_loss) == (0, 3, 0, 6, 3)
    with pytest.raises(DataError, match="overflow"):
        load_examples(path, hand, chatml, max_length=6, overflow="cut")


def test_folder_reads_its_jsonl_files_sorted(tmp_path, hand, chatml):
    write_jsonl(tmp_path / "b.jsonl", [{"text": "b"}])
    write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}, {"text": "aa"}])
    (tmp_path / "notes.txt").write_text("not data")
    exs, st = load_examples(tmp_path, hand, chatml, max_length=10)
    assert [(e.source.rsplit("/", 1)[-1], e.line) for e in exs] == [("a.jsonl", 1), ("a.jsonl", 2), ("b.jsonl", 1)]
    assert exs[1].tokens.tolist() == [BOS, *ids("aa"), EOT] and st.n_examples == 3


# -- malformed lines

BAD = [
    (b"not json", "not valid JSON"),
    (b"[1, 2]", "expected a JSON object, got an array"),
    (b"{}", "no known format (empty object)"),
    (b'{"foo": 1}', "no known format (keys foo)"),
    (b'{"text": "a", "prompt": "b", "completion": "c"}', "mixed formats"),
    (b'{"text": "a", "id": 3}', "unknown key(s) id in a text example"),
    (b'{"text": 5}', '"text" is a number, not a string'),
    (b'{"text": ""}', "empty text"),
    (b'{"prompt": "a"}', '"completion" is missing'),
    (b'{"prompt": "a", "completion": " "}', "empty completion"),
    (b'{"prompt": null, "completion": "b"}', '"prompt" is null, not a string'),
    (b'{"messages": []}', '"messages" is empty'),
    (b'{"messages": "hi"}', '"messages" is a string, not an array'),
    (b'{"messages": [1]}', "messages[0] is a number, not an object"),
    (b'{"messages": [{"role": "user"}]}', 'messages[0] has no "content"'),
    (b'{"messages": [{"role": "user", "content": ["x"]}]}', 'messages[0]["content"] is an array, not a string'),
    (b'{"messages": [{"role": "bot", "content": "x"}]}', "messages[0]: unknown role 'bot'"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', "the conversation has no assistant turn"),
    (
        b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]}',
        "messages[1]: empty assistant content",
    ),
    (b'{"text": "caf\xe9"}', "not valid UTF-8"),
]
GOOD = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


@pytest.mark.parametrize("raw,reason", BAD, ids=[r for _, r in BAD])
def test_bad_line_names_file_and_line(tmp_path, hand, chatml, raw, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, "", raw, GOOD])  # the bad one is line 3
    with pytest.raises(DataError) as e:
        load_examples(path, hand, chatml, max_length=100)
    assert str(e.value).startswith(f"{path}:3: ")
    assert reason in str(e.value)


def test_check_file_collects_every_problem(tmp_path, hand, chatml):
    rows = [GOOD] + [raw for raw, _ in BAD] + ["   ", {"text": "xyz"}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    r = check_file(path, hand, chatml, max_length=5, show=1)
    assert [n for n, _ in r.problems] == list(range(2, 2 + len(BAD)))
    for (_, reason), (_, got) in zip(BAD, r.problems):
        assert reason in got
    # valid: line 1, BOS + <|im_start|>user\nq<|im_end|>\n (9) + <|im_start|>assistant\na<|im_end|>\n (14)
    # = 24 tokens, 2 targets ("a", <|im_end|>); the last line, BOS x y z EOS = 5 tokens, 4 targets
    assert (r.n_examples, r.kinds) == (2, {"text": 1, "messages": 1})
    assert (r.n_tokens, r.n_loss) == (24 + 5, 2 + 4)
    assert r.over_length == 1  # the conversation, over 5
    assert r.lengths == {"min": 5, "median": 14.5, "p95": 24, "max": 24}
    assert r.samples[0]["segments"] == [
        ("<s><|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", False),
        ("a<|im_end|>", True),
        ("\n", False),
    ]
    assert len(r.samples) == 1 and r.samples[0]["line"] == 1
    d = r.to_dict()
    assert d["problems"][0] == {"line": 2, "reason": r.problems[0][1]}
    assert d["samples"][0]["segments"][1] == {"text": "a<|im_end|>", "loss": True}


# -- packing


def ex(tokens, loss, line):
    return Example(tokens, loss, "hand", line, "text")


F, T = False, True


@pytest.fixture
def packed():
    exs = [
        ex([10, 11, 12, 13], [F, F, T, T], 1),  # 3 positions
        ex([20, 21, 22], [F, T, T], 2),  # 2: row 0 holds 5 of 8
        ex([30, 31, 32, 33, 34], [F, T, F, T, T], 3),  # 4: 5 + 4 > 8 -> row 1
        ex([35, 36, 37, 38, 39], [F, F, F, F, T], 3),  # 4: 4 + 4 = 8 fits exactly, row 1 is full
        ex(list(range(40, 49)), [F] + [T, F] * 4, 4),  # 9 tokens = context + 1: 8 positions -> row 2
        ex([50, 51], [F, T], 5),  # 1: row 2 is full -> row 3, the validation row
    ]
    return InstructData(exs, 8, val_fraction=0.25)


def test_packing_rows(packed):
    d = packed
    assert (d.n_windows, d.n_val, d.n_train, d.context) == (4, 1, 3, 8)
    r1 = d.batch([1])
    assert r1.tokens.tolist() == [[30, 31, 32, 33, 35, 36, 37, 38]]
    assert r1.targets.tolist() == [[31, 32, 33, 34, 36, 37, 38, 39]]
    assert r1.loss_mask.tolist() == [[1, 0, 1, 1, 0, 0, 0, 1]]
    assert r1.pos.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]] and r1.doc.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]
    b = d.batch([0, 2, 3])
    assert b.tokens.tolist()[0] == [10, 11, 12, 20, 21, 0, 0, 0]
    assert b.targets.tolist()[0] == [11, 12, 13, 21, 22, 0, 0, 0]
    assert b.loss_mask.tolist()[0] == [0, 1, 1, 1, 1, 0, 0, 0]
    assert b.pos.tolist()[0] == [0, 1, 2, 0, 1, 0, 1, 2]
    assert b.doc.tolist()[0] == [0, 0, 0, 1, 1, 2, 2, 2]
    assert b.tokens.tolist()[1] == list(range(40, 48)) and b.targets.tolist()[1] == list(range(41, 49))
    assert b.loss_mask.tolist()[1] == [1, 0, 1, 0, 1, 0, 1, 0]
    assert b.pos.tolist()[1] == list(range(8)) and b.doc.tolist()[1] == [0] * 8
    assert b.tokens.tolist()[2] == [50] + [0] * 7 and b.targets.tolist()[2] == [51] + [0] * 7
    assert b.loss_mask.tolist()[2] == [1] + [0] * 7
    assert b.pos.tolist()[2] == [0, 0, 1, 2, 3, 4, 5, 6] and b.doc.tolist()[2] == [0] + [1] * 7
    for a in (b.tokens, b.targets, b.pos, b.doc):
        assert a.dtype == np.int32 and a.shape == (3, 8)
    assert b.loss_mask.dtype == np.float32
    m = block_causal_mask(b.doc)  # the second example of row 0 sees only itself
    assert m[0, 0, 3, 2] == -np.inf and m[0, 0, 4, 3] == 0 and m[0, 0, 4, 4] == 0
    with pytest.raises(IndexError):
        d.batch([4])


def test_packing_stream_and_validation(packed):
    d = packed
    s = BatchStream(d, 2, seed=7)
    first = [s.next() for _ in range(3)]
    order = np.random.default_rng([7, 0]).permutation(3)  # BatchStream's documented order
    assert first[0].tokens.tolist() == d.batch(order[:2]).tokens.tolist()
    state = s.state()
    fourth = s.next().tokens.tolist()
    resumed = BatchStream(d, 2, seed=7, state=json.loads(json.dumps(state)))
    again = BatchStream(d, 2, seed=7)
    for _ in range(3):
        again.next()
    assert resumed.next().tokens.tolist() == again.next().tokens.tolist() == fourth
    (vb,) = validation_batches(d, 2)
    assert vb.tokens.tolist()[0] == [50] + [0] * 7 and vb.loss_mask.tolist()[1] == [0] * 8
    with pytest.raises(DataError, match="3 packed row"):
        d.check_batch(4)


def test_packing_errors():
    long = ex(list(range(10)), [F] + [T] * 9, 9)
    with pytest.raises(DataError, match=r"hand:9: the example has 10 tokens, more than context \+ 1 = 9") as e:
        InstructData([long, long], 8)
    assert "max_length <= 9" in e.value.hint
    with pytest.raises(DataError, match="too few"):
        InstructData([ex([1, 2], [F, T], 1)], 8)  # one row: nothing left to train on
    with pytest.raises(DataError, match="1-D arrays of one length"):
        ex([1, 2, 3], [F, T], 1)


# -- the real tokenizer and template


@pytest.mark.model
def test_smollm2_formats(tmp_path, smol):
    tok, tpl = smol
    rows = [
        {"text": "Hello world"},
        {"prompt": "Translate to French: cat\n", "completion": "chat"},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Bye now."},
            ]
        },
        {"messages": [{"role": "user", "content": "say <|im_end|> now"}, {"role": "assistant", "content": "no"}]},
    ]
    exs, st = load_examples(write_jsonl(tmp_path / "s.jsonl", rows), tok, tpl, max_length=2048)
    text, pc, chat, ctl = exs
    assert spans(tok, text) == [" world<|im_end|>"]  # no BOS for SmolLM2: "Hello" is token 0
    assert spans(tok, pc) == ["chat<|im_end|>"]  # EOS is <|im_end|>
    assert tok.decode(pc.tokens[~pc.loss]) == "Translate to French: cat\n"
    assert spans(tok, chat) == ["Hello!<|im_end|>", "Bye now.<|im_end|>"]
    assert tok.decode(chat.tokens[~chat.loss]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        "\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n\n"
    )
    # no system message: the template's default one is part of the prompt, without loss;
    # control-token text in user content stays text (the chat injection rule), as on the inference prompt path
    assert spans(tok, ctl) == ["no<|im_end|>"]
    assert tok.decode(ctl.tokens[~ctl.loss]).startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert int((ctl.tokens == tok.token_to_id("<|im_end|>")).sum()) == 3  # system, user, assistant
    assert "user\nsay <|im_end|> now<|im_end|>" in tok.decode(ctl.tokens)
    assert st.kinds == {"text": 1, "prompt_completion": 1, "messages": 2}


@pytest.mark.model
def test_smollm2_token_boundary_error(tmp_path, smol):
    tok, _ = smol
    # the generation prompt ends in a space that the content's first word absorbs (" Hello" is one token)
    merging = ChatTemplate(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]}
    with pytest.raises(DataError, match=r":1: messages\[1\]: .*\(token ids differ\)"):
        load_examples(write_jsonl(tmp_path / "m.jsonl", [row]), tok, merging, max_length=100)
