"""The OpenAI-compatible API of a LIVE server, driven by the official ``openai`` client (httpx for the rest).

One uvicorn server per module (``create_app`` over the session's SmolLM2
model, ``n_slot=4``, ``exact_batching``, ``n_ctx=512``), on 127.0.0.1.

What each expectation is checked against:

- Generated text (completions, chat), token logprobs and usage: the library,
  ``toy.Model.generate`` on a second copy of the same model file
  (``ref_model``: slot 0, no worker, no HTTP). Greedy output must be equal
  as text; logprobs to 1e-5 (both come from the same sampler over logits the
  engine computes bit-exactly with ``exact_batching``). One documented
  difference (worker.py, docs/guide/serving.md "The generated token is always
  there"): a generated end-of-generation token is reported by the server (a
  logprobs entry, no text) and counted in ``completion_tokens``, while
  ``Generation.tokens`` leaves it out (``Generation.stop`` holds its id);
  ``completion_tokens(gen)`` adds it back. Its logprob is checked against
  ``log_softmax`` of ``Model.logits``.
- Seeded sampling with n=2: the documented rule (schemas.py) "choice i uses
  seed + i", with the OpenAI defaults the server documents (top_k 0, top_p 1,
  min_p 0) passed to ``Model.generate`` explicitly.
- Echo scoring (the lm-eval path): ``toy.eval.logprobs`` on the same text
  (what `toy eval logprobs` prints), abs 1e-4.
- Tokenize/detokenize: ``Model.tokenize`` / ``Model.detokenize``.
- Embeddings: the mean of the hidden states of one plain prefill of the
  reference engine, L2-normalized (app.py's documented definition); the wire
  format is float32, so 1e-5.
- Streams: the same request without ``stream``; concurrency: the same
  request sent alone, before the concurrent round (bit-identical text).
- Error statuses, codes and ``param``: the module docstrings of app.py and
  schemas.py (400 for validation, ``context_length_exceeded``,
  ``model_not_found``, ``invalid_json``, 413, 500 with the request id).
- /metrics: the names and meanings listed in metrics.py's docstring.

After every error the server must still answer a small completion
(``assert_serving``).
"""

from __future__ import annotations

import base64
import json
import re
import time

import httpx
import numpy as np
import openai
import pytest

from toy.engine.sampling import log_softmax
from toy_testsupport.serve_helpers import (
    assert_chat_stream_equals_non_stream,
    assert_concurrent_equal_alone,
    completion_tokens,
)

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"
PROMPTS = [
    "The capital of France is",
    "1, 2, 3,",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
    "My favourite food is",
    "Water boils at",
    "The quick brown fox",
]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
N = 12


@pytest.fixture(scope="module")
def live(serve_model, serve_settings, serving):
    with serving(serve_settings(), serve_model) as s:
        yield s


@pytest.fixture(scope="module")
def client(live):
    with live.client() as c:
        yield c


@pytest.fixture(scope="module")
def alias(live):
    return live.srv.settings.alias


def assert_serving(client, alias):
    """The server still answers (after an error)."""
    r = client.completions.create(model=alias, prompt="Hello", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 2


def wait_until(pred, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def error_of(r: httpx.Response) -> dict:
    """The OpenAI error object of a raw response (asserting the shape)."""
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert r.headers.get("x-request-id")
    return err


# ------------------------------------------------------------------ plain endpoints


def test_health(live):
    r = live.http.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}
    assert r.headers["x-request-id"]


def test_models_lists_the_alias(live, client, alias, smollm2_path):
    models = client.models.list()
    assert [m.id for m in models.data] == [alias] == [smollm2_path.stem]
    m = models.data[0]
    assert m.object == "model" and m.owned_by == "toy" and isinstance(m.created, int)
    raw = live.http.get("/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == 512


def test_server_info_names_the_alias_never_a_path(live, alias):
    """The route routers of the SGLang family ask a worker (sglang-router names the model after it)."""
    r = live.http.get("/server_info")
    assert r.status_code == 200
    assert r.json() == {
        "model_path": alias,
        "served_model_name": alias,
        "is_generation": True,
        "max_context_length": 512,
    }
    assert "/server_info" not in live.http.get("/openapi.json").json()["paths"]


@pytest.mark.parametrize("text", ["Hello world", "héllo wörld 日本語 🙂", "<|im_start|>user\nhi<|im_end|>"])
def test_tokenize_detokenize_round_trip(live, ref_model, text):
    r = live.http.post("/tokenize", json={"content": text})
    assert r.status_code == 200
    tokens = r.json()["tokens"]
    assert tokens == ref_model.tokenize(text)
    for special in (True, False):
        r = live.http.post("/tokenize", json={"prompt": text, "add_special": special})  # vLLM's field name
        assert r.status_code == 200 and r.json()["tokens"] == ref_model.tokenize(text, add_special=special)
    r = live.http.post("/detokenize", json={"tokens": tokens})
    assert r.status_code == 200
    assert r.json() == {"content": ref_model.detokenize(tokens), "prompt": ref_model.detokenize(tokens)}
    assert r.json()["content"] == text


# ------------------------------------------------------------------ completions


def test_completion_greedy_equals_library(client, alias, ref_model):
    r = client.completions.create(model=alias, prompt=PROMPT, max_tokens=N, temperature=0)
    want = ref_model.generate(PROMPT, temperature=0, max_tokens=N)
    assert r.object == "text_completion" and r.model == alias and r.id.startswith("cmpl-")
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.logprobs is None
    assert c.text == want.text
    assert c.finish_reason == want.finish_reason
    n_prompt = len(ref_model.tokenize(PROMPT))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == completion_tokens(want)
    assert r.usage.total_tokens == n_prompt + completion_tokens(want)


def test_logit_bias_bans_and_forces_tokens(client, alias, ref_model):
    """logit_bias -100 on the greedy first token makes the server pick another, as the library does with
    the same bias; +100 on one token makes every greedy token that one; chat applies it too."""
    plain = ref_model.generate(PROMPT, temperature=0, max_tokens=N)
    first = plain.tokens[0]
    banned = ref_model.generate(PROMPT, temperature=0, max_tokens=N, logit_bias={first: -100})
    assert banned.tokens[0] != first
    r = client.completions.create(
        model=alias, prompt=PROMPT, max_tokens=N, temperature=0, logit_bias={str(first): -100}
    )
    assert r.choices[0].text == banned.text
    forced = ref_model.tokenize(" banana", add_special=False)[0]
    r = client.completions.create(
        model=alias, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(forced): 100}
    )
    assert r.choices[0].text == ref_model.detokenize([forced] * 3)
    chat = dict(model=alias, messages=MESSAGES, max_tokens=4, temperature=0)
    a = client.chat.completions.create(**chat).choices[0].message.content
    b = client.chat.completions.create(**chat, logit_bias={str(forced): 100}).choices[0].message.content
    assert a != b and b == ref_model.detokenize([forced] * 4)


def test_completion_model_names(client, smollm2_path):
    """Documented names for ``model``: the alias, the file name, the path as given; none means the served one."""
    for name in (smollm2_path.stem, smollm2_path.name, str(smollm2_path)):
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0)
        assert r.choices[0].text
    r = client.completions.create(model="", prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.choices[0].text


def test_completion_stream_equals_non_stream(client, alias):
    full = client.completions.create(model=alias, prompt=PROMPT, max_tokens=N, temperature=0)
    parts, finishes, usage_chunks = [], [], []
    stream = client.completions.create(
        model=alias,
        prompt=PROMPT,
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    for ch in chunks:
        if not ch.choices:
            usage_chunks.append(ch)
            continue
        assert len(ch.choices) == 1 and ch.choices[0].index == 0
        assert ch.usage is None  # include_usage: null on every chunk but the last
        parts.append(ch.choices[0].text)
        finishes.append(ch.choices[0].finish_reason)
    assert "".join(parts) == full.choices[0].text
    assert finishes[-1] == full.choices[0].finish_reason and all(f is None for f in finishes[:-1])
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0]
    u = usage_chunks[0].usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
        full.usage.total_tokens,
    )
    assert len({ch.id for ch in chunks}) == 1


def test_completion_stream_raw_sse_ends_with_done(live, alias):
    body = {"model": alias, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with live.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == "length"
    assert "usage" not in last  # no stream_options: no usage field at all


@pytest.mark.parametrize("prompt", ["日本の首都は", "Emoji: 🙂🙂", "Ünïcödé façade"])
def test_completion_stream_multibyte(client, alias, ref_model, prompt):
    """Tokens that are parts of a UTF-8 character: the stream holds them back, nothing is lost or doubled."""
    want = ref_model.generate(prompt, temperature=0, max_tokens=N)
    full = client.completions.create(model=alias, prompt=prompt, max_tokens=N, temperature=0)
    assert full.choices[0].text == want.text
    stream = client.completions.create(model=alias, prompt=prompt, max_tokens=N, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in stream) == want.text


def test_completion_stream_n2(client, alias):
    kw = dict(model=alias, prompt=PROMPT, max_tokens=8, temperature=0.9, seed=77, n=2)
    full = client.completions.create(**kw)
    parts: dict[int, list[str]] = {0: [], 1: []}
    finish: dict[int, str] = {}
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    for ch in chunks[:-1]:
        (c,) = ch.choices
        assert c.index not in finish  # nothing after a choice's finish chunk
        parts[c.index].append(c.text)
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    for c in full.choices:
        assert "".join(parts[c.index]) == c.text
        assert finish[c.index] == c.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completion_prompt_list(client, alias, ref_model):
    prompts = PROMPTS[:3]
    r = client.completions.create(model=alias, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c, p in zip(r.choices, prompts):
        assert c.text == ref_model.generate(p, temperature=0, max_tokens=8).text, p
    assert r.usage.prompt_tokens == sum(len(ref_model.tokenize(p)) for p in prompts)
    assert r.usage.completion_tokens == sum(
        completion_tokens(ref_model.generate(p, temperature=0, max_tokens=8)) for p in prompts
    )


def test_completion_prompt_token_ids(client, alias, ref_model):
    ids = ref_model.tokenize(PROMPT)
    by_text = client.completions.create(model=alias, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=alias, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    ids2 = ref_model.tokenize(PROMPTS[1])
    both = client.completions.create(model=alias, prompt=[ids, ids2], max_tokens=8, temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == by_text.choices[0].text
    assert both.choices[1].text == ref_model.generate(PROMPTS[1], temperature=0, max_tokens=8).text


def test_completion_n2_seeded(client, alias, ref_model):
    kw = dict(model=alias, prompt=PROMPT, max_tokens=N, temperature=0.9, seed=1234, n=2)
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1]
    for i, c in enumerate(r.choices):
        want = ref_model.generate(PROMPT, temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=1234 + i, max_tokens=N)
        assert c.text == want.text, i
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # reproducible
    assert r.usage.prompt_tokens == len(ref_model.tokenize(PROMPT))  # the prompt counts once
    assert r.usage.completion_tokens == sum(
        completion_tokens(
            ref_model.generate(PROMPT, temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=1234 + i, max_tokens=N)
        )
        for i in range(2)
    )


def test_completion_stop_string(client, alias, ref_model):
    prompt, stop = "1, 2, 3,", [" 6"]
    want = ref_model.generate(prompt, temperature=0, max_tokens=20, stop=stop)
    assert want.finish_reason == "stop" and want.stop == " 6"  # the reference really stops on the string
    r = client.completions.create(model=alias, prompt=prompt, max_tokens=20, temperature=0, stop=stop)
    assert r.choices[0].text == want.text
    assert " 6" not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=alias, prompt=prompt, max_tokens=20, temperature=0, stop=stop, stream=True)
    chunks = [ch.choices[0] for ch in stream]
    assert "".join(c.text for c in chunks) == want.text
    assert chunks[-1].finish_reason == "stop"


def test_completion_logprobs(client, alias, ref_model):
    r = client.completions.create(model=alias, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    want = ref_model.generate(PROMPT, temperature=0, max_tokens=6, logprobs=2)
    assert want.finish_reason == "length"  # no stop token here (test_generated_stop_token_* covers that)
    c = r.choices[0]
    lp = c.logprobs
    n = r.usage.completion_tokens
    assert n == len(want.tokens) == len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert len(lp.text_offset) == n
    assert "".join(lp.tokens) == c.text == want.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(n)]
    for i, (tok, val, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
        ref = want.logprobs[i]
        assert tok == ref_model.detokenize([ref.token])
        assert val == pytest.approx(ref.logprob, abs=1e-5)
        assert len(top) == 2  # greedy: the chosen token is the top one, so 2 entries (OpenAI: up to logprobs+1)
        assert top[tok] == pytest.approx(val, abs=1e-9) and val == max(top.values())
        want_top = {ref_model.detokenize([t]): v for t, v in ref.top}
        assert set(top) == set(want_top)
        for k, v in want_top.items():
            assert top[k] == pytest.approx(v, abs=1e-5)


def test_completion_echo_scoring_equals_toy_eval_logprobs(client, alias, ref_model):
    import toy.eval

    text = "The quick brown fox jumps over the lazy dog."
    r = client.completions.create(model=alias, prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0)
    ids = ref_model.tokenize(text)
    c = r.choices[0]
    assert c.text == text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert lp.tokens == [ref_model.detokenize([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.token_logprobs) == len(ids) == len(lp.text_offset)
    assert lp.text_offset == [len(ref_model.detokenize(ids[:i])) for i in range(len(ids))]
    # the reference: `toy eval logprobs` on the same text (toy.eval.logprobs)
    ref = toy.eval.logprobs(ref_model, text, top_k=1)
    assert [t.id for t in ref.tokens] == ids
    for i in range(1, len(ids)):
        want = ref.tokens[i]
        assert lp.token_logprobs[i] == pytest.approx(want.logprob, abs=1e-4), i
        top = lp.top_logprobs[i]
        assert 1 <= len(top) <= 2  # the top alternative plus the prompt's token (the same when it is the top)
        (best_id, best_text, best_lp) = want.top[0]
        assert top[best_text] == pytest.approx(best_lp, abs=1e-4)


def test_completion_echo_with_completion(client, alias, ref_model):
    """echo + generated tokens: one text, one logprobs list (prompt tokens then generated ones)."""
    r = client.completions.create(model=alias, prompt=PROMPT, max_tokens=4, echo=True, logprobs=1, temperature=0)
    want = ref_model.generate(PROMPT, temperature=0, max_tokens=4)
    assert want.finish_reason == "length"
    ids = ref_model.tokenize(PROMPT)
    c = r.choices[0]
    assert c.text == PROMPT + want.text
    lp = c.logprobs
    assert lp.tokens == [ref_model.detokenize([t]) for t in ids + want.tokens]
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == completion_tokens(want)


def test_generated_stop_token_is_reported_and_counted(client, alias, ref_model):
    """lm-eval's loglikelihood request (max_tokens=1, echo, logprobs) on a context whose greedy next token is
    the end-of-turn token: the entry is there (docs/guide/serving.md), with no text, and counted."""
    context = ref_model.render_chat([{"role": "user", "content": "Hi"}]) + "Hello! How can I help you today?"
    ids = ref_model.tokenize(context)
    want = ref_model.generate(ids, temperature=0, max_tokens=1)
    assert want.finish_reason == "stop" and isinstance(want.stop, int) and want.tokens == []  # the precondition
    r = client.completions.create(model=alias, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1
    assert c.text == ref_model.detokenize(ids)  # the stop token adds no text
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids) + 1
    assert lp.tokens[-1] == ref_model.tokenizer.token_to_piece(want.stop).decode()
    assert lp.text_offset[-1] == len(c.text)
    ref = np.array([log_softmax(row) for row in ref_model.logits(ids)])
    assert lp.token_logprobs[-1] == pytest.approx(ref[-1, want.stop], abs=1e-4)
    assert lp.token_logprobs[-1] == pytest.approx(ref[-1].max(), abs=1e-4)  # greedy: it was the top token
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]], abs=1e-4)


# ------------------------------------------------------------------ chat


def test_chat_greedy_equals_library(client, alias, ref_model):
    r = client.chat.completions.create(model=alias, messages=MESSAGES, max_tokens=N, temperature=0)
    want = ref_model.generate(MESSAGES, temperature=0, max_tokens=N)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == alias
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant"
    assert c.message.content == want.text
    assert c.finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(ref_model.prompt_ids(MESSAGES))
    assert r.usage.completion_tokens == completion_tokens(want)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_ending_on_the_end_of_turn_token(client, alias, ref_model):
    messages = [{"role": "user", "content": "Hi"}]
    want = ref_model.generate(messages, temperature=0, max_tokens=16)
    assert want.finish_reason == "stop" and isinstance(want.stop, int)  # the precondition
    r = client.chat.completions.create(model=alias, messages=messages, max_tokens=16, temperature=0, logprobs=True)
    c = r.choices[0]
    assert c.message.content == want.text and c.finish_reason == "stop"
    assert r.usage.completion_tokens == len(want.tokens) + 1  # the end-of-turn token is counted
    content = c.logprobs.content
    assert len(content) == len(want.tokens) + 1
    assert "".join(e.token for e in content[:-1]) == want.text
    assert content[-1].token == ref_model.tokenizer.token_to_piece(want.stop).decode()
    stream = client.chat.completions.create(model=alias, messages=messages, max_tokens=16, temperature=0, stream=True)
    chunks = [ch.choices[0] for ch in stream]
    assert "".join(ch.delta.content or "" for ch in chunks) == want.text
    assert chunks[-1].finish_reason == "stop"


def test_chat_stream_equals_non_stream(client, alias):
    assert_chat_stream_equals_non_stream(client, model=alias, messages=MESSAGES, max_tokens=N, temperature=0)


def test_chat_logprobs(client, alias, ref_model):
    r = client.chat.completions.create(
        model=alias, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    want = ref_model.generate(MESSAGES, temperature=0, max_tokens=6, logprobs=2)
    assert want.finish_reason == "length"
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == len(want.tokens)
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e, ref in zip(content, want.logprobs):
        assert e.token == ref_model.detokenize([ref.token])
        assert bytes(e.bytes) == e.token.encode()
        assert e.logprob == pytest.approx(ref.logprob, abs=1e-5)
        assert len(e.top_logprobs) == 2
        assert [t.token for t in e.top_logprobs] == [ref_model.detokenize([t]) for t, _ in ref.top]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx([v for _, v in ref.top], abs=1e-5)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob


# ------------------------------------------------------------------ embeddings


def _reference_embedding(ref_model, text):
    ids = ref_model.tokenize(text)
    eng = ref_model.engine
    eng.cache.clear(0)
    try:
        h = eng.prefill(0, ids, all_logits=True, hidden=True).astype(np.float64).mean(axis=0)
    finally:
        eng.cache.clear(0)
    return h / np.linalg.norm(h), len(ids)


def test_embeddings(live, client, alias, ref_model, serve_model):
    texts = ["The cat sat on the mat.", "Quantum chromodynamics", "The cat sat on the mat."]
    r = client.embeddings.create(model=alias, input=texts, encoding_format="float")
    assert r.object == "list" and r.model == alias
    assert [d.index for d in r.data] == [0, 1, 2]
    vecs = [np.array(d.embedding, dtype=np.float64) for d in r.data]
    d_model = serve_model.cfg.d_model
    for v in vecs:
        assert v.shape == (d_model,)
        assert np.linalg.norm(v) == pytest.approx(1.0, abs=1e-5)
    assert np.array_equal(vecs[0], vecs[2])  # same text -> identical vector
    assert not np.allclose(vecs[0], vecs[1], atol=1e-3)  # different text -> different vector
    n_tokens = 0
    for v, t in zip(vecs, texts):
        want, n = _reference_embedding(ref_model, t)
        n_tokens += n
        np.testing.assert_allclose(v, want, atol=1e-5)
    assert r.usage.prompt_tokens == r.usage.total_tokens == n_tokens

    one = client.embeddings.create(model=alias, input=texts[0], encoding_format="float")
    assert len(one.data) == 1 and np.array_equal(np.array(one.data[0].embedding), vecs[0])
    default = client.embeddings.create(model=alias, input=texts[0])  # the client asks for base64 and decodes it
    assert np.array_equal(np.array(default.data[0].embedding, dtype=np.float64), vecs[0])

    raw = live.http.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"})
    assert raw.status_code == 200
    for d, v in zip(raw.json()["data"], vecs):
        got = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        assert np.array_equal(got.astype(np.float64), v)


def test_embeddings_token_ids_and_unnormalized(live, ref_model):
    text = "The cat sat on the mat."
    ids = ref_model.tokenize(text)
    a = live.http.post("/v1/embeddings", json={"input": text}).json()["data"][0]["embedding"]
    b = live.http.post("/v1/embeddings", json={"input": ids}).json()["data"][0]["embedding"]
    assert a == b
    raw = live.http.post("/v1/embeddings", json={"input": text, "normalize": False}).json()["data"][0]["embedding"]
    ids_ = ref_model.tokenize(text)
    eng = ref_model.engine
    eng.cache.clear(0)
    want = eng.prefill(0, ids_, all_logits=True, hidden=True).astype(np.float64).mean(axis=0)
    eng.cache.clear(0)
    np.testing.assert_allclose(np.array(raw), want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ concurrency and cancellation


def test_concurrent_streams_equal_alone(live, client, alias):
    kw = dict(model=alias, max_tokens=16, temperature=0)
    assert_concurrent_equal_alone(live, client, PROMPTS, kw, finishes=("length", "stop"), plain=False)
    assert_serving(client, alias)


def test_stream_cancelled_when_client_leaves(live, client, alias):
    cancelled = {"finish_reason": "cancelled"}
    before = live.metric("toy_sequences_finished_total", cancelled)
    tokens_before = live.metric("toy_completion_tokens_total")
    stream = client.completions.create(
        model=alias, prompt=PROMPT, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(stream)
    for _ in range(3):
        assert next(it).choices[0].finish_reason is None
    stream.close()
    wait_until(lambda: live.metric("toy_sequences_finished_total", cancelled) == before + 1, what="the cancellation")
    wait_until(lambda: live.metric("toy_active_sequences") == 0, what="a free server")
    assert live.srv.worker.busy() == 0
    assert live.metric("toy_completion_tokens_total") - tokens_before < 400
    t0 = time.monotonic()
    r = client.completions.create(model=alias, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason == "length" and time.monotonic() - t0 < 10


def test_non_stream_cancelled_when_client_leaves(live, client, alias):
    cancelled = {"finish_reason": "cancelled"}
    before = live.metric("toy_sequences_finished_total", cancelled)
    tokens_before = live.metric("toy_completion_tokens_total")
    body = {"model": alias, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=live.url, timeout=httpx.Timeout(1.0)) as h, pytest.raises(httpx.ReadTimeout):
        h.post("/v1/completions", json=body)  # gives up after 1 s and closes the connection
    wait_until(lambda: live.metric("toy_sequences_finished_total", cancelled) == before + 1, what="the cancellation")
    wait_until(lambda: live.metric("toy_active_sequences") == 0, what="a free server")
    assert live.metric("toy_completion_tokens_total") - tokens_before < 400
    assert_serving(client, alias)


# ------------------------------------------------------------------ errors


def test_context_overflow(client, alias):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=alias, prompt=PROMPT, max_tokens=510)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    assert "512" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=alias, messages=MESSAGES, max_tokens=500)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=alias, input="word " * 600)
    assert e.value.code == "context_length_exceeded" and e.value.param == "input"
    assert_serving(client, alias)


def test_budget_at_the_limit_is_accepted(live, client, alias, ref_model):
    n_prompt = len(ref_model.tokenize(PROMPT))
    body = {"model": alias, "prompt": PROMPT, "temperature": 0, "stop": ["\n"]}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**body, max_tokens=513 - n_prompt)
    assert e.value.code == "context_length_exceeded"
    # prompt + max_tokens == the context is admitted (the stop string ends it early)
    r = client.completions.create(**body, max_tokens=512 - n_prompt)
    assert r.choices[0].finish_reason == "stop"
    # an explicit null means the rest of the context (documented in schemas.py)
    r = live.http.post("/v1/completions", json={**body, "max_tokens": None})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"


def test_empty_prompt(client, alias):
    for prompt in ("", [], [""]):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=alias, prompt=prompt, max_tokens=4)
        assert e.value.param in ("prompt", "prompt.0") and e.value.type == "invalid_request_error"
    assert_serving(client, alias)


def test_unknown_model(client, alias):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=4)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    assert alias in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=4)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="gpt-4o", input="x")
    assert e.value.code == "model_not_found"
    assert_serving(client, alias)


@pytest.mark.parametrize(
    "body",
    [b"{bad json", b'{"prompt": "Hi",}', b'{"prompt": "Hi", "temperature": NaN}', b"\xff\xfe", b"[1, 2]", b'"hi"', b""],
    ids=["garbage", "trailing-comma", "nan", "not-utf8", "array", "string", "empty"],
)
def test_bad_json(live, client, alias, body):
    r = live.http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = error_of(r)
    assert err["type"] == "invalid_request_error"
    assert_serving(client, alias)


C, CHAT, EMB = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
HI = {"prompt": "Hi", "max_tokens": 2}
MSG = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
INVALID = [
    (C, {**HI, "temperature": -1}, "temperature"),
    (C, {**HI, "temperature": 2.5}, "temperature"),
    (C, {**HI, "temperature": "0.5"}, "temperature"),
    (C, {**HI, "top_p": 2}, "top_p"),
    (C, {**HI, "n": 0}, "n"),
    (C, {**HI, "n": 9}, "n"),
    (C, {**HI, "max_tokens": -1}, "max_tokens"),
    (C, {**HI, "max_tokens": 1.5}, "max_tokens"),
    (C, {**HI, "logprobs": 50}, "logprobs"),
    (C, {**HI, "stream": "yes"}, "stream"),
    (C, {**HI, "seed": -2}, "seed"),
    (C, {**HI, "stop": ""}, "stop"),
    (C, {**HI, "stop": [""]}, "stop.0"),
    (C, {**HI, "logit_bias": {"x5": -100}}, "logit_bias"),
    (C, {**HI, "logit_bias": {"5": -101}}, "logit_bias"),
    (C, {**HI, "logit_bias": {"5": "high"}}, "logit_bias.5"),
    (C, {**HI, "logit_bias": {"999999": 1}}, "logit_bias"),
    (CHAT, {**MSG, "logit_bias": {"-3": 1}}, "logit_bias"),
    (C, {**HI, "suffix": "x"}, "suffix"),
    (C, {**HI, "best_of": 2}, "best_of"),
    (C, {**HI, "prompt": 5}, "prompt"),
    (C, {**HI, "prompt": [1, -1]}, "prompt.1"),
    (C, {**HI, "prompt": [10**9]}, "prompt"),
    (C, {"max_tokens": 2}, "prompt"),
    (CHAT, {"max_tokens": 2}, "messages"),
    (CHAT, {**MSG, "messages": []}, "messages"),
    (CHAT, {**MSG, "messages": "hi"}, "messages"),
    (CHAT, {**MSG, "messages": [{"content": "hi"}]}, "messages.0.role"),
    (CHAT, {**MSG, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    (CHAT, {**MSG, "temperature": -1}, "temperature"),
    (CHAT, {**MSG, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {**MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {**MSG, "max_completion_tokens": -1}, "max_completion_tokens"),
    (CHAT, {**MSG, "tools": [{"type": "function"}]}, "tools.0.function"),
    (CHAT, {**MSG, "response_format": {"type": "json_schema"}}, "response_format"),
    (CHAT, {**MSG, "response_format": {"type": "xml"}}, "response_format.type"),
    (
        C,
        {**HI, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
        "response_format.json_schema.schema",
    ),
    (C, {**HI, "grammar": 'root ::= "a'}, "grammar"),
    (C, {**HI, "grammar": 'root ::= "a" undefined_rule'}, "grammar"),
    (C, {**HI, "regex": "(unclosed"}, "regex"),
    (C, {**HI, "json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "json_schema"),
    (C, {**HI, "grammar": 'root ::= "a"', "regex": "a"}, "regex"),
    (CHAT, {**MSG, "response_format": {"type": "json_object"}, "json_schema": {}}, "json_schema"),
    (EMB, {}, "input"),
    (EMB, {"input": ""}, "input"),
    (EMB, {"input": "hi", "dimensions": 7}, "dimensions"),
    (EMB, {"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ("/tokenize", {}, "content"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
]


@pytest.mark.parametrize(("path", "body", "param"), INVALID, ids=[f"{p}:{prm}" for p, _, prm in INVALID])
def test_invalid_request_names_the_field(live, client, alias, path, body, param):
    r = live.http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert_serving(client, alias)


def test_invalid_through_the_client(client, alias):
    """The openai client surfaces the same 400s as ``BadRequestError`` with ``param``."""
    cases = [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=2), "top_p"),
        (dict(n=0), "n"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(logprobs=50), "logprobs"),
    ]
    for kw, param in cases:
        kw = {"model": alias, "prompt": "Hi", "max_tokens": 2, **kw}
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**kw)
        assert e.value.param == param, kw
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=alias, messages=[], max_tokens=2)
    assert e.value.param == "messages"
    assert_serving(client, alias)


def test_oversized_body(live, client, alias):
    limit = live.srv.settings.max_body_bytes
    big = json.dumps({"prompt": "x" * (limit + 10), "max_tokens": 1}).encode()
    r = live.http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert error_of(r)["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    r = live.http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert error_of(r)["code"] == "request_too_large"
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=alias, prompt="x" * (limit + 10), max_tokens=1)
    assert e.value.status_code == 413
    assert_serving(client, alias)


def test_unknown_route_and_method(live, client, alias):
    r = live.http.post("/v1/nope", json={})
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"
    r = live.http.get("/v1/completions")
    assert r.status_code == 405 and error_of(r)["code"] == "method_not_allowed"
    assert_serving(client, alias)


def test_internal_error_in_the_app_is_500(live, client, alias, serve_model, monkeypatch):
    real, calls = serve_model.tokenize, []

    def boom(*a, **kw):
        calls.append(a)
        if len(calls) == 1:
            raise RuntimeError("forced failure")
        return real(*a, **kw)

    monkeypatch.setattr(serve_model, "tokenize", boom)
    raw = client.completions.with_raw_response
    with pytest.raises(openai.InternalServerError) as e:
        raw.create(model=alias, prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 500
    assert e.value.type == "server_error" and e.value.code == "internal_error"
    rid = e.value.response.headers["x-request-id"]
    assert rid and rid in e.value.message
    assert len(calls) == 1
    assert_serving(client, alias)


def test_engine_failure_is_500_and_the_worker_survives(live, client, alias, serve_model, monkeypatch):
    real, calls = serve_model.engine.decode, []

    def boom(*a, **kw):
        calls.append(a)
        if len(calls) == 1:
            raise RuntimeError("forced engine failure")
        return real(*a, **kw)

    monkeypatch.setattr(serve_model.engine, "decode", boom)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=alias, prompt=PROMPT, max_tokens=4, temperature=0)
    assert e.value.code == "internal_error"
    assert e.value.response.headers["x-request-id"] in e.value.message
    assert_serving(client, alias)
    # a stream that fails after its headers were sent ends with an error chunk, then [DONE]
    calls.clear()
    body = {"model": alias, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with live.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][len("data: ") :])["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    monkeypatch.undo()
    assert_serving(client, alias)


# ------------------------------------------------------------------ metrics


METRICS = {
    "toy_requests_total": "counter",
    "toy_prompt_tokens_total": "counter",
    "toy_completion_tokens_total": "counter",
    "toy_sequences_finished_total": "counter",
    "toy_queue_depth": "gauge",
    "toy_active_sequences": "gauge",
    "toy_kv_cells_used": "gauge",
    "toy_time_to_first_token_seconds": "histogram",
    "toy_inter_token_latency_seconds": "histogram",
    "toy_queue_wait_seconds": "histogram",
    "toy_request_duration_seconds": "histogram",
}


def test_metrics(live, client, alias, ref_model):
    assert_serving(client, alias)  # every series exists
    r = live.http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    for name, kind in METRICS.items():
        assert re.search(rf"^# TYPE {name} {kind}$", r.text, re.M), name
    m = live.metric
    ok = {"endpoint": "/v1/completions", "status": "200"}
    bad = {"endpoint": "/v1/completions", "status": "400"}
    dur = {"endpoint": "/v1/completions"}
    before = {
        "ok": m("toy_requests_total", ok),
        "bad": m("toy_requests_total", bad),
        "prompt": m("toy_prompt_tokens_total"),
        "completion": m("toy_completion_tokens_total"),
        "length": m("toy_sequences_finished_total", {"finish_reason": "length"}),
        "ttft": m("toy_time_to_first_token_seconds_count"),
        "itl": m("toy_inter_token_latency_seconds_count"),
        "wait": m("toy_queue_wait_seconds_count"),
        "dur": m("toy_request_duration_seconds_count", dur),
    }
    out = client.completions.create(
        model=alias, prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=alias, prompt=PROMPT, max_tokens=-1)
    n_prompt = len(ref_model.tokenize(PROMPT))
    want = {
        "ok": before["ok"] + 1,
        "bad": before["bad"] + 1,
        "prompt": before["prompt"] + n_prompt,
        "completion": before["completion"] + 5,
        "length": before["length"] + 1,
        "ttft": before["ttft"] + 1,
        "itl": before["itl"] + 4,
        "wait": before["wait"] + 1,
        "dur": before["dur"] + 2,
    }

    def now():
        return {
            "ok": m("toy_requests_total", ok),
            "bad": m("toy_requests_total", bad),
            "prompt": m("toy_prompt_tokens_total"),
            "completion": m("toy_completion_tokens_total"),
            "length": m("toy_sequences_finished_total", {"finish_reason": "length"}),
            "ttft": m("toy_time_to_first_token_seconds_count"),
            "itl": m("toy_inter_token_latency_seconds_count"),
            "wait": m("toy_queue_wait_seconds_count"),
            "dur": m("toy_request_duration_seconds_count", dur),
        }

    try:
        wait_until(lambda: now() == want, timeout=5, what="the metrics")
    except AssertionError:
        assert now() == want
    assert m("toy_active_sequences") == 0 and m("toy_queue_depth") == 0
    assert m("toy_kv_cells_used") > 0  # the finished sequences stay cached for prefix reuse
    # unknown paths share one label value
    live.http.get("/no/such/path-1")
    live.http.get("/no/such/path-2")
    wait_until(lambda: m("toy_requests_total", {"endpoint": "other", "status": "404"}) >= 2, what="other")
    assert "path-1" not in live.http.get("/metrics").text
