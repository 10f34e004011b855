"""Checks the live-server tests share (test-only helper, imported as
``from toy_testsupport import serve_helpers``; the fixtures are in
packages/toy-serve/tests/conftest.py).

- ``PROMPTS``: the prompts the generated-model tests (Gemma, MoE) share;
  ``GEMMA_PROMPTS`` and ``MOE_PROMPTS``: those and two of each family's
  own, ``GPT2_PROMPTS`` the GPT-2 tests' (test_serve_conformance.py runs each
  family's files on its own list, as do the family's modules);
- ``completion_tokens(gen)``: what the server counts for a library
  ``Generation``;
- ``assert_models_card``, ``assert_completion_equals_library``,
  ``assert_completion_stream_equals_non_stream``,
  ``assert_chat_stream_equals_non_stream``: one request against the
  library or against itself;
- ``assert_concurrent_equal_alone``: requests sent at once, streamed (and
  plain) through the async client, give the text each gives sent alone, and
  really ran together.
"""

from __future__ import annotations

import asyncio
import time

# prose, code, digits, a very short and a long prompt (the Gemma and MoE serve tests add two of their own)
PROMPTS = [
    "Hello world",
    "The capital of France is Paris, and the capital of Germany is",
    "def add(a, b):\n    return",
    "Once upon a time, there was a little girl who lived in a village near the forest. One day",
    "1, 2, 3,",
    "The weather was cold and windy, so we stayed inside and read books all",
]
# a short one and one far past the sliding window of 8
GEMMA_PROMPTS = [
    *PROMPTS,
    "Gemma",
    "Attention lets every position look at the positions before it, within a sliding window of",
]
MOE_PROMPTS = [*PROMPTS, "Experts", "A router sends every token to two of its eight experts, and the experts"]
GPT2_PROMPTS = [
    "The capital of France is",
    "1, 2, 3,",
    "Once upon a time",
    "def fibonacci(n):",
    "Water boils at",
    "The quick brown fox",
]


def completion_tokens(gen) -> int:
    """What the server counts for a library ``Generation``: its tokens plus a
    generated stop token (see test_openai_api.py)."""
    return len(gen.tokens) + isinstance(gen.stop, int)


def assert_models_card(live, alias: str, ctx: int) -> None:
    """/v1/models lists the one served model with its context length."""
    raw = live.http.get("/v1/models").json()
    assert [m["id"] for m in raw["data"]] == [alias] and raw["data"][0]["max_model_len"] == ctx


def assert_completion_equals_library(client, alias: str, ref, prompt, n: int) -> None:
    """A greedy completion over HTTP equals ``ref.generate`` (the library on
    another copy of the file): text, finish reason and token counts."""
    r = client.completions.create(model=alias, prompt=prompt, max_tokens=n, temperature=0)
    want = ref.generate(prompt, temperature=0, max_tokens=n)
    c = r.choices[0]
    assert c.text == want.text and c.finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(ref.tokenize(prompt))
    assert r.usage.completion_tokens == completion_tokens(want)


def assert_completion_stream_equals_non_stream(client, finish: str | None = None, **kw) -> None:
    """The completion ``kw`` streamed (with usage) equals it sent plain:
    text, finish reason (``finish`` when given) only on the last chunk, usage."""
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    parts = [ch.choices[0] for ch in chunks if ch.choices]
    assert len(parts) > 1  # really streamed
    assert "".join(p.text for p in parts) == full.choices[0].text
    assert parts[-1].finish_reason == full.choices[0].finish_reason
    if finish is not None:
        assert full.choices[0].finish_reason == finish
    assert all(p.finish_reason is None for p in parts[:-1])
    u = chunks[-1].usage
    assert not chunks[-1].choices and u is not None
    assert (u.prompt_tokens, u.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)


def assert_chat_stream_equals_non_stream(client, **kw) -> None:
    """The chat completion ``kw`` streamed (with usage) equals it sent
    plain: chunk objects, the role alone in the first chunk, the content,
    the finish reason only on the last chunk, the usage."""
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    body = [ch for ch in chunks if ch.choices]
    assert body[0].choices[0].delta.role == "assistant"  # the role comes first
    assert not body[0].choices[0].delta.content
    assert all(ch.choices[0].delta.role is None for ch in body[1:])
    content = "".join(ch.choices[0].delta.content or "" for ch in body)
    assert content == full.choices[0].message.content
    assert body[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(ch.choices[0].finish_reason is None for ch in body[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


async def _streamed(c, prompt, kw: dict):
    """One streamed completion: (text, finish reason, time of the first chunk, time of the end)."""
    parts, finish, first = [], None, None
    stream = await c.completions.create(prompt=prompt, stream=True, **kw)
    async for chunk in stream:
        if first is None:
            first = time.monotonic()
        for ch in chunk.choices:
            parts.append(ch.text)
            finish = ch.finish_reason or finish
    return "".join(parts), finish, first, time.monotonic()


def assert_concurrent_equal_alone(
    live, client, prompts, kw: dict, finishes=("length",), plain: bool = True
) -> list[str]:
    """The completions of ``prompts`` (``kw``: model, max_tokens, ...) sent
    one at a time, then all at once streamed (and, with ``plain``, all at
    once not streamed): the same texts, each finish in ``finishes``, and the
    streams overlapped. Returns the texts sent alone."""
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    async def streamed():
        async with live.async_client() as c:
            return await asyncio.gather(*(_streamed(c, p, kw) for p in prompts))

    results = asyncio.run(streamed())
    for p, want, (text, finish, _, _) in zip(prompts, alone, results):
        assert finish in finishes, p
        assert text == want, p
    # they ran together: some stream was still open when another produced its first chunk
    spans = sorted((first, end) for _, _, first, end in results)
    assert any(spans[i + 1][0] < spans[i][1] for i in range(len(spans) - 1))

    if plain:

        async def together():
            async with live.async_client() as c:
                rs = await asyncio.gather(*(c.completions.create(prompt=p, **kw) for p in prompts))
            return [r.choices[0].text for r in rs]

        assert asyncio.run(together()) == alone
    return alone
