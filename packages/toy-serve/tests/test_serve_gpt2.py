"""``toy serve`` on GPT-2: a LIVE server (``create_app`` under uvicorn, the
conftest's ``serving``) over a tiny seeded GPT-2 made by Hugging Face
``transformers`` and converted by llama.cpp's ``convert_hf_to_gguf.py``
(``packages/toy-core/tests/gpt2_ref.py``; vocabulary 50257, 2 layers, d 64,
128 learned positions).

The model is loaded the way the server loads one (``n_slot=4``,
``exact_batching``), as the SmolLM2 serve tests do. Expectations:

- greedy completions (``temperature=0``): the library,
  ``toy.Model.generate`` on a second copy of the file (``n_slot=1``, slot 0,
  no worker, no HTTP), text and token counts equal; and, for the prompts
  of ``fixtures/gpt2_llamacpp.json``, llama.cpp's greedy tokens (16 each,
  end-of-text fed back: ``ignore_eos``), compared as text through the
  library's detokenizer;
- streams: the same request without ``stream`` (text, finish reason,
  usage);
- concurrency: six requests at once on four slots (streams interleaved in
  one decode batch, two waiting in the queue) give the text each gives
  sent alone (the engine decodes bit-exactly whatever else is batched).

No ``model`` marker: the file is generated (cached by ``gpt2_ref``, ~10 s on
a cold cache), not the real SmolLM2.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import gpt2_ref
import pytest

CORE_TESTS = Path(__file__).resolve().parents[2] / "toy-core" / "tests"
FIXTURE = json.loads((CORE_TESTS / "fixtures" / "gpt2_llamacpp.json").read_text())
CTX = 128  # the model's learned positions
N = 12
PROMPTS = [
    "The capital of France is",
    "1, 2, 3,",
    "Once upon a time",
    "def fibonacci(n):",
    "Water boils at",
    "The quick brown fox",
]


@pytest.fixture(scope="module")
def gpt2_path() -> Path:
    return gpt2_ref.gguf_path("tiny", 0, "f32")


@pytest.fixture(scope="module")
def serve_gpt2(gpt2_path):
    import toy

    m = toy.load(gpt2_path, n_ctx=CTX, n_slot=4, threads=1, exact_batching=True)
    yield m
    m.close()


@pytest.fixture(scope="module")
def ref_gpt2(gpt2_path):
    import toy

    m = toy.load(gpt2_path, n_ctx=CTX, n_slot=1, threads=1, exact_batching=True)
    yield m
    m.close()


@pytest.fixture(scope="module")
def live(serve_gpt2, gpt2_path, serving, tmp_path_factory):
    from toy_serve import Settings

    settings = Settings(
        model=str(gpt2_path), runs_dir=str(tmp_path_factory.mktemp("serve-gpt2-runs")), drain_timeout=10.0
    )
    with serving(settings, serve_gpt2) as s:
        yield s


@pytest.fixture(scope="module")
def client(live):
    with live.client() as c:
        yield c


@pytest.fixture(scope="module")
def alias(live, gpt2_path):
    assert live.srv.settings.alias == gpt2_path.stem
    return live.srv.settings.alias


def completion_tokens(gen) -> int:
    """What the server counts for a library ``Generation``: its tokens plus a
    generated stop token (see test_openai_api.py)."""
    return len(gen.tokens) + isinstance(gen.stop, int)


def test_models_card(live, alias):
    raw = live.http.get("/v1/models").json()
    assert [m["id"] for m in raw["data"]] == [alias] and raw["data"][0]["max_model_len"] == CTX


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_greedy_completion_equals_library(client, alias, ref_gpt2, prompt):
    r = client.completions.create(model=alias, prompt=prompt, max_tokens=N, temperature=0)
    want = ref_gpt2.generate(prompt, temperature=0, max_tokens=N)
    c = r.choices[0]
    assert c.text == want.text and c.finish_reason == want.finish_reason
    n_prompt = len(ref_gpt2.tokenize(prompt))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == completion_tokens(want)


@pytest.mark.avx2_reference
@pytest.mark.parametrize("rec", FIXTURE["models"][0]["prompts"], ids=lambda p: p["text"][:12])
def test_greedy_completion_equals_llamacpp(client, alias, ref_gpt2, rec):
    r0 = FIXTURE["models"][0]["recipe"]
    assert (r0["shape"], r0["outtype"], r0["seed"]) == ("tiny", "f32", 0)
    n = FIXTURE["context"]["n_gen"]
    r = client.completions.create(
        model=alias, prompt=rec["ids"], max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens == len(rec["ids"]) and r.usage.completion_tokens == n
    assert r.choices[0].text == ref_gpt2.detokenize(rec["greedy"])


def test_stream_equals_non_stream(client, alias):
    prompt = PROMPTS[0]
    full = client.completions.create(model=alias, prompt=prompt, max_tokens=N, temperature=0)
    chunks = list(
        client.completions.create(
            model=alias,
            prompt=prompt,
            max_tokens=N,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    parts = [ch.choices[0] for ch in chunks if ch.choices]
    assert len(parts) > 1  # really streamed
    assert "".join(p.text for p in parts) == full.choices[0].text
    assert parts[-1].finish_reason == full.choices[0].finish_reason
    assert all(p.finish_reason is None for p in parts[:-1])
    u = chunks[-1].usage
    assert not chunks[-1].choices and u is not None
    assert (u.prompt_tokens, u.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)


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

    async def main():
        async with live.async_client() as c:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))

    results = asyncio.run(main())
    for p, want, (text, finish, _, _) in zip(PROMPTS, alone, results):
        assert finish == "length", p
        assert text == want, p
    # they ran together: some stream was still open when another produced its first chunk
    spans = sorted((first, end) for _, _, first, end in results)
    assert any(spans[i + 1][0] < spans[i][1] for i in range(len(spans) - 1))

    # and non-streamed concurrent requests too
    async def plain():
        async with live.async_client() as c:
            rs = await asyncio.gather(*(c.completions.create(prompt=p, **kw) for p in PROMPTS))
        return [r.choices[0].text for r in rs]

    assert asyncio.run(plain()) == alone
