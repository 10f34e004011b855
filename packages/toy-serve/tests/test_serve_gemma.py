"""``toy serve`` on Gemma 2 and Gemma 3: a LIVE server (``create_app`` under
uvicorn, the conftest's ``serving``) over ``gemma_ref``'s seeded random
Hugging Face Gemmas converted by llama.cpp's ``convert_hf_to_gguf.py``
(packages/toy-core/tests/gemma_ref.py): gemma2-tiny (sliding window 8 on
layers 0 and 2, attention and logit soft-caps 8 and 4, tied head) and
gemma3-tiny-untied (QK-norm, six sliding layers of seven, linear RoPE
scaling on the global one, untied head, logit soft-cap 4), each with a
SentencePiece tokenizer and Gemma 2's chat template.

The model is loaded the way the server loads one (``n_slot=4``,
``exact_batching``), as the SmolLM2 and GPT-2 serve tests do, and queried
with the official ``openai`` client, greedy (``temperature=0``).
Expectations:

- completions and chat completions: the library, ``toy.Model.generate`` on
  a second copy of the file (``n_slot=1``, slot 0, no worker, no HTTP):
  text, finish reason and token counts equal; chat prompts are the
  template's rendering (``Model.prompt_ids``), ``<start_of_turn>model``
  and all. Prompts run from 4 to about 40 tokens, most past the window;
- streams: the same request without ``stream`` (text, finish reason, usage);
- concurrency: eight requests at once on four slots (streams interleaved in
  one decode batch, the rest queued), half of them longer than the window,
  give the text each gives sent alone (batch invariance: the engine decodes
  bit-exactly whatever else is batched, every layer's own window and cap
  included);
- a system message, which Gemma 2's template refuses: a 400 with the
  template's reason, and the server goes on serving.

No ``model`` marker: the files are generated (cached by ``gemma_ref``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import gemma_ref
import openai
import pytest

CTX = 128
N = 12
WINDOW = 8
PROMPTS = [
    "Hello world",
    "The capital of France is Paris, and the capital of Germany is",
    "def add(a, b):\n    return",
    "Once upon a time, there was a little girl who lived in a village near the forest. One day",
    "1, 2, 3,",
    "The weather was cold and windy, so we stayed inside and read books all",
    "Gemma",
    "Attention lets every position look at the positions before it, within a sliding window of",
]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "What is the capital of Italy? Answer in one word, please."}],
    [
        {"role": "user", "content": "Write a short poem about the sea."},
        {"role": "assistant", "content": "The sea is wide, the sea is deep."},
        {"role": "user", "content": "Another line?"},
    ],
]


@pytest.fixture(scope="module", params=["gemma2-tiny", "gemma3-tiny-untied"])
def gemma_path(request) -> Path:
    return gemma_ref.gguf_path(request.param, 0, "f32")


@pytest.fixture(scope="module")
def serve_gemma(gemma_path):
    import toy

    m = toy.load(gemma_path, n_ctx=CTX, n_slot=4, threads=1, exact_batching=True)
    yield m
    m.close()


@pytest.fixture(scope="module")
def ref_gemma(gemma_path):
    import toy

    m = toy.load(gemma_path, n_ctx=CTX, n_slot=1, threads=1, exact_batching=True)
    yield m
    m.close()


@pytest.fixture(scope="module")
def live(serve_gemma, gemma_path, serving, tmp_path_factory):
    from toy_serve import Settings

    settings = Settings(
        model=str(gemma_path), runs_dir=str(tmp_path_factory.mktemp("serve-gemma-runs")), drain_timeout=10.0
    )
    with serving(settings, serve_gemma) as s:
        yield s


@pytest.fixture(scope="module")
def client(live):
    with live.client() as c:
        yield c


@pytest.fixture(scope="module")
def alias(live, gemma_path):
    assert live.srv.settings.alias == gemma_path.stem
    return live.srv.settings.alias


def completion_tokens(gen) -> int:
    """What the server counts for a library ``Generation``: its tokens plus a
    generated stop token (see test_openai_api.py)."""
    return len(gen.tokens) + isinstance(gen.stop, int)


def test_prompts_reach_past_the_window(ref_gemma):
    lengths = [len(ref_gemma.tokenize(p)) for p in PROMPTS]
    assert min(lengths) <= WINDOW and sum(n > WINDOW for n in lengths) >= 4 and max(lengths) > 4 * WINDOW, lengths
    assert all(len(ref_gemma.prompt_ids(m)) > WINDOW for m in CHATS)


def test_models_card(live, alias, gemma_path):
    raw = live.http.get("/v1/models").json()
    assert [m["id"] for m in raw["data"]] == [alias] and raw["data"][0]["max_model_len"] == CTX


@pytest.mark.parametrize("prompt", PROMPTS[:4])
def test_greedy_completion_equals_library(client, alias, ref_gemma, prompt):
    r = client.completions.create(model=alias, prompt=prompt, max_tokens=N, temperature=0)
    want = ref_gemma.generate(prompt, temperature=0, max_tokens=N)
    c = r.choices[0]
    assert c.text == want.text and c.finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(ref_gemma.tokenize(prompt))
    assert r.usage.completion_tokens == completion_tokens(want)


@pytest.mark.parametrize("i", range(len(CHATS)))
def test_greedy_chat_equals_library(client, alias, ref_gemma, i):
    messages = CHATS[i]
    ids = ref_gemma.prompt_ids(messages)
    text = ref_gemma.detokenize(ids)
    assert text.startswith("<bos><start_of_turn>user\n") and text.endswith("<end_of_turn>\n<start_of_turn>model\n")
    r = client.chat.completions.create(model=alias, messages=messages, max_tokens=N, temperature=0)
    want = ref_gemma.generate(messages, temperature=0, max_tokens=N)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == want.text
    assert c.finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == completion_tokens(want)


def test_completion_stream_equals_non_stream(client, alias):
    prompt = PROMPTS[3]
    kw = dict(model=alias, prompt=prompt, max_tokens=N, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    parts = [ch.choices[0] for ch in chunks if ch.choices]
    assert len(parts) > 1  # really streamed
    assert "".join(p.text for p in parts) == full.choices[0].text
    assert parts[-1].finish_reason == full.choices[0].finish_reason == "length"
    assert all(p.finish_reason is None for p in parts[:-1])
    u = chunks[-1].usage
    assert not chunks[-1].choices and u is not None
    assert (u.prompt_tokens, u.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)


def test_chat_stream_equals_non_stream(client, alias):
    kw = dict(model=alias, messages=CHATS[2], max_tokens=N, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    body = [ch for ch in chunks if ch.choices]
    assert body[0].choices[0].delta.role == "assistant"
    content = "".join(ch.choices[0].delta.content or "" for ch in body)
    assert content == full.choices[0].message.content
    assert body[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(ch.choices[0].finish_reason is None for ch in body[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_concurrent_requests_equal_sequential(live, client, alias):
    kw = dict(model=alias, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in PROMPTS]

    async def one(c, prompt):
        parts, finish, first = [], None, None
        stream = await c.completions.create(prompt=prompt, stream=True, **kw)
        async for chunk in stream:
            if first is None:
                first = time.monotonic()
            for ch in chunk.choices:
                parts.append(ch.text)
                finish = ch.finish_reason or finish
        return "".join(parts), finish, first, time.monotonic()

    async def streamed():
        async with live.async_client() as c:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))

    results = asyncio.run(streamed())
    for p, want, (text, finish, _, _) in zip(PROMPTS, alone, results):
        assert finish == "length", p
        assert text == want, p
    # they ran together: some stream was still open when another produced its first chunk
    spans = sorted((first, end) for _, _, first, end in results)
    assert any(spans[i + 1][0] < spans[i][1] for i in range(len(spans) - 1))

    async def plain():
        async with live.async_client() as c:
            rs = await asyncio.gather(*(c.completions.create(prompt=p, **kw) for p in PROMPTS))
        return [r.choices[0].text for r in rs]

    assert asyncio.run(plain()) == alone


def test_concurrent_chats_equal_sequential(live, client, alias):
    kw = dict(model=alias, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    chats = CHATS + [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    alone = [client.chat.completions.create(messages=m, **kw).choices[0].message.content for m in chats]

    async def together():
        async with live.async_client() as c:
            rs = await asyncio.gather(*(c.chat.completions.create(messages=m, **kw) for m in chats))
        return [r.choices[0].message.content for r in rs]

    assert asyncio.run(together()) == alone


def test_a_system_message_is_a_400_naming_the_template(client, alias, ref_gemma):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=alias, messages=messages, max_tokens=4, temperature=0)
    assert e.value.status_code == 400 and "System role not supported" in e.value.message
    # still serving
    r = client.chat.completions.create(model=alias, messages=CHATS[0], max_tokens=4, temperature=0)
    assert r.choices[0].message.content == ref_gemma.generate(CHATS[0], temperature=0, max_tokens=4).text
