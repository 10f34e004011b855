"""``toy.engine.decoding``: the token step both generation drivers share (``DecodeState``) and the prefix-reuse
rule (``reuse_prefix``).

A tiny SentencePiece vocabulary (pieces that split a stop string, byte tokens of a three-byte character, EOS)
and hand-made logit rows whose argmax is the token a test wants: greedy steps then pick exactly that token, so
each test spells out the order of operations (sample -> stop token -> logprobs -> history -> stop strings ->
token limit) and what ``finish()`` releases.
"""

from __future__ import annotations

import numpy as np
import pytest

from toy.engine.constrain import Constraint
from toy.engine.decoding import DecodeState, Step, reuse_prefix
from toy.engine.sampling import SamplingParams, TokenLogprob, log_softmax
from toy.tokenizer import Tokenizer
from toy_testsupport.tiny_vocab import EOS, ID, N_VOCAB, tokenizer

PROMPT = [1, ID[" the"], ID[" end"]]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return tokenizer()


def row(token: int, seed: int = 0) -> np.ndarray:
    """Logits whose argmax is ``token`` (noise elsewhere, so logprobs are not trivial)."""
    x = np.random.default_rng(seed).standard_normal(N_VOCAB).astype(np.float32)
    x[token] = x.max() + 3.0
    return x


def run(state: DecodeState, pieces: list[str]) -> list[Step]:
    """Advance over rows that pick ``pieces`` in order, stopping at the step that ends generation."""
    steps = []
    for i, piece in enumerate(pieces):
        steps.append(state.advance(row(ID[piece], seed=i)))
        if steps[-1].finish_reason is not None:
            break
    return steps


def state(tok, count_stop_token: bool = False, **kw) -> DecodeState:
    return DecodeState(SamplingParams.greedy(**kw), tok, N_VOCAB, PROMPT, count_stop_token=count_stop_token)


def test_a_stop_string_split_across_tokens_is_held_back_then_cut(tok):
    s = state(tok, stop=["STOP"], max_tokens=10)
    steps = run(s, [" Hello", " wor", "ld", "ST", "OP", "!"])
    # the first token loses the space prefix; "ST" may start "STOP": held back, then cut when "OP" completes it
    assert [st.text for st in steps] == ["Hello", " wor", "ld", "", ""]
    assert steps[-1] == Step(ID["OP"], "", None, "stop", stop="STOP")
    assert (s.finish_reason, s.stop) == ("stop", "STOP")
    assert s.finish() == ""  # nothing after a stop string, and nothing is flushed
    assert s.tokens == [ID[p] for p in [" Hello", " wor", "ld", "ST", "OP"]]


def test_held_back_text_is_released_once_it_cannot_be_a_stop(tok):
    s = state(tok, stop=["STOP"], max_tokens=3)
    steps = run(s, ["ST", "ld", "!"])
    assert [st.text for st in steps] == ["", "STld", "!"]
    assert steps[-1].finish_reason == "length" and s.finish() == ""


def test_length_releases_the_held_back_text_and_stays_length(tok):
    s = state(tok, stop=["STOP"], max_tokens=2)
    steps = run(s, ["ld", "ST"])
    assert [st.text for st in steps] == ["ld", ""]
    assert steps[-1].finish_reason == "length"
    assert s.finish() == "ST"
    assert (s.finish_reason, s.stop) == ("length", None)


def test_released_text_that_completes_a_stop_string_makes_it_stop(tok):
    # "a" may start "a\ufffd"; the lone byte 0xE2 decodes to nothing until the end, when it becomes U+FFFD
    s = state(tok, stop=["a\ufffd"], max_tokens=2)
    steps = run(s, ["a", "<0xE2>"])
    assert [st.text for st in steps] == ["", ""] and steps[-1].finish_reason == "length"
    assert s.finish() == ""
    assert (s.finish_reason, s.stop) == ("stop", "a\ufffd")


def test_a_multibyte_character_is_held_until_complete(tok):
    s = state(tok, max_tokens=4)
    steps = run(s, ["<0xE2>", "<0x82>", "<0xAC>", "!"])
    assert [st.text for st in steps] == ["", "", "\u20ac", "!"]


def test_a_stop_token_on_the_last_allowed_step_ends_with_stop(tok):
    # max_tokens=2 and the second token is EOS: the stop token is checked before the limit
    s = state(tok, max_tokens=2, logprobs=2)
    steps = run(s, [" Hello", "</s>"])
    last = steps[-1]
    assert (last.token, last.text, last.finish_reason, last.stop, last.stop_token) == (EOS, "", "stop", EOS, True)
    assert last.logprob is None  # the library leaves the stop token out of the completion
    assert s.tokens == [ID[" Hello"]] and s.history == PROMPT + [ID[" Hello"]]
    assert s.finish() == ""


def test_count_stop_token_puts_it_in_the_tokens_with_its_logprob(tok):
    s = state(tok, count_stop_token=True, max_tokens=2, logprobs=2)
    steps = run(s, [" Hello", "</s>"])
    lp = log_softmax(row(EOS, seed=1))
    assert s.tokens == [ID[" Hello"], EOS]
    assert s.history == PROMPT + [ID[" Hello"]]  # the history (penalties) never sees it
    assert isinstance(steps[-1].logprob, TokenLogprob)
    assert steps[-1].logprob.token == EOS and steps[-1].logprob.logprob == pytest.approx(float(lp[EOS]))


def test_a_token_completing_a_stop_string_at_the_limit_ends_with_stop(tok):
    s = state(tok, stop=["STOP"], max_tokens=2)
    steps = run(s, ["ST", "OP"])
    assert steps[-1].finish_reason == "stop" and steps[-1].stop == "STOP"


def test_logprobs_are_under_the_raw_logits(tok):
    s = state(tok, max_tokens=2, logprobs=3, logit_bias={ID["!"]: 50.0})
    x = row(ID["ld"])
    step = s.advance(x)
    assert step.token == ID["!"]  # the bias picks it ...
    lp = log_softmax(x)
    assert step.logprob.logprob == pytest.approx(float(lp[ID["!"]]))  # ... the logprob is the model's own
    assert [t for t, _ in step.logprob.top] == [int(i) for i in np.argsort(-lp, kind="stable")[:3]]


def test_max_tokens_zero_samples_nothing(tok):
    s = state(tok, max_tokens=0)
    assert s.advance(row(ID["!"])) == Step(None, "", finish_reason="length")
    assert s.tokens == [] and s.finish() == ""


def test_a_state_is_used_once(tok):
    s = state(tok, max_tokens=1)
    run(s, ["!"])
    with pytest.raises(RuntimeError):
        s.advance(row(ID["!"]))
    s2 = state(tok, max_tokens=5)
    s2.advance(row(ID["!"]))
    assert s2.finish() == "" and s2.done  # ended early (a cancelled request)
    with pytest.raises(RuntimeError):
        s2.advance(row(ID["!"]))


def test_a_complete_constraint_ends_with_stop():
    plain = tokenizer(**{"tokenizer.ggml.add_space_prefix": False})  # the constraint sees the text as decoded
    s = state(plain, max_tokens=10, constraint=Constraint.regex("ab"))
    steps = [s.advance(row(ID["!"], seed=i)) for i in range(2)]  # the mask forces "a" then "b"
    assert [st.token for st in steps] == [ID["a"], ID["b"]]
    assert steps[-1].finish_reason == "stop" and steps[-1].stop is None


def test_same_seed_same_rows_same_steps(tok):
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7, max_tokens=30, logprobs=1)
    rows = np.random.default_rng(3).standard_normal((30, N_VOCAB)).astype(np.float32)
    a, b = (DecodeState(params, tok, N_VOCAB, PROMPT) for _ in range(2))
    steps_a = [a.advance(r) for r in rows if not a.done]
    steps_b = [b.advance(r) for r in rows if not b.done]
    assert steps_a == steps_b and len({st.token for st in steps_a}) > 1 and a.seed == b.seed == 7


class Cache:
    def __init__(self, held: list[list[int]]):
        self.held = held

    def common_prefix(self, slot: int, ids) -> int:
        n = 0
        for a, b in zip(self.held[slot], ids):
            if a != b:
                break
            n += 1
        return n


def test_reuse_prefix_longest_then_lowest_slot_and_one_token_left():
    prompt = [5, 6, 7, 8]
    cache = Cache([[5, 9], [5, 6, 7], [5, 6, 7, 8, 9], [5, 6, 7]])
    base = [None] * 4
    # slot 2 holds the whole prompt: it wins over slots 1 and 3 (which hold all but the last token, the same
    # keep once capped), and keeps all but the last token, whose logits pick the first generated token
    assert reuse_prefix(cache, [0, 1, 2, 3], prompt, base, None) == (2, 3)
    assert reuse_prefix(cache, [0, 1, 3], prompt, base, None) == (1, 3)  # a tie: the lowest index
    assert reuse_prefix(cache, [0], prompt, base, None) == (0, 1)
    assert reuse_prefix(Cache([[]]), [0], prompt, [None], None) == (0, 0)


def test_reuse_prefix_ignores_a_cache_of_another_adapter():
    prompt = [5, 6, 7, 8]
    cache = Cache([[5, 6], [5, 6, 7, 8]])
    assert reuse_prefix(cache, [0, 1], prompt, [0, 1], 0) == (0, 2)  # slot 1 was computed with adapter 1
    assert reuse_prefix(cache, [0, 1], prompt, [0, None], None) == (1, 3)
    assert reuse_prefix(cache, [1], prompt, [None, 0], None) == (1, 0)
