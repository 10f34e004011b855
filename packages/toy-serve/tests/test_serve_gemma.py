"""``toy serve`` on Gemma 2 and Gemma 3: a LIVE server (``create_app`` under
uvicorn, the conftest's ``serving``) over ``gemma_ref``'s seeded random
Hugging Face Gemmas converted by llama.cpp's ``convert_hf_to_gguf.py``
(tests/support/src/toy_testsupport/gemma_ref.py): gemma2-tiny (sliding window 8 on
layers 0 and 2, attention and logit soft-caps 8 and 4, tied head) and
gemma3-tiny-untied (QK-norm, six sliding layers of seven, linear RoPE
scaling on the global one, untied head, logit soft-cap 4), each with a
SentencePiece tokenizer and Gemma 2's chat template.

The model is loaded the way the server loads one (``n_slot=4``,
``exact_batching``), as the SmolLM2 and GPT-2 serve tests do, and queried
with the official ``openai`` client, greedy (``temperature=0``).
Completions (the library's, streamed as sent plain, eight at once on four
slots as each alone) are test_serve_conformance.py's, on these files and
every other architecture's, with this module's prompts
(``serve_helpers.GEMMA_PROMPTS``). Expectations here:

- the prompts run from 4 to about 40 tokens, most past the window;
- chat completions: the library, ``toy.Model.generate`` on a second copy of
  the file (``n_slot=1``, slot 0, no worker, no HTTP): text, finish reason
  and token counts equal; chat prompts are the template's rendering
  (``Model.prompt_ids``), ``<start_of_turn>model`` and all;
- a chat stream: the same request without ``stream`` (text, finish reason,
  usage);
- concurrency: chats sent at once give the text each gives sent alone
  (batch invariance: the engine decodes bit-exactly whatever else is
  batched, every layer's own window and cap included);
- a system message, which Gemma 2's template refuses: a 400 with the
  template's reason, and the server goes on serving.

No ``model`` marker: the files are generated (cached by ``gemma_ref``).
Fixtures: the conftest's ``file_*`` over this module's ``file_path``; the
chat stream check is ``serve_helpers``'.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from toy_testsupport import gemma_ref
from toy_testsupport import serve_helpers as sh

N = 12
WINDOW = 8
PROMPTS = sh.GEMMA_PROMPTS
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
def file_path(request) -> Path:
    return gemma_ref.gguf_path(request.param, 0, "f32")


def test_prompts_reach_past_the_window(file_ref):
    lengths = [len(file_ref.tokenize(p)) for p in PROMPTS]
    assert min(lengths) <= WINDOW and sum(n > WINDOW for n in lengths) >= 4 and max(lengths) > 4 * WINDOW, lengths
    assert all(len(file_ref.prompt_ids(m)) > WINDOW for m in CHATS)


@pytest.mark.parametrize("i", range(len(CHATS)))
def test_greedy_chat_equals_library(file_client, file_alias, file_ref, i):
    messages = CHATS[i]
    ids = file_ref.prompt_ids(messages)
    text = file_ref.detokenize(ids)
    assert text.startswith("<bos><start_of_turn>user\n") and text.endswith("<end_of_turn>\n<start_of_turn>model\n")
    r = file_client.chat.completions.create(model=file_alias, messages=messages, max_tokens=N, temperature=0)
    want = file_ref.generate(messages, temperature=0, max_tokens=N)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == want.text
    assert c.finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == sh.completion_tokens(want)


def test_chat_stream_equals_non_stream(file_client, file_alias):
    sh.assert_chat_stream_equals_non_stream(
        file_client, model=file_alias, messages=CHATS[2], max_tokens=N, temperature=0
    )


def test_concurrent_chats_equal_sequential(file_live, file_client, file_alias):
    kw = dict(model=file_alias, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    chats = CHATS + [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    alone = [file_client.chat.completions.create(messages=m, **kw).choices[0].message.content for m in chats]

    async def together():
        async with file_live.async_client() as c:
            rs = await asyncio.gather(*(c.chat.completions.create(messages=m, **kw) for m in chats))
        return [r.choices[0].message.content for r in rs]

    assert asyncio.run(together()) == alone


def test_a_system_message_is_a_400_naming_the_template(file_client, file_alias, file_ref):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        file_client.chat.completions.create(model=file_alias, messages=messages, max_tokens=4, temperature=0)
    assert e.value.status_code == 400 and "System role not supported" in e.value.message
    # still serving
    r = file_client.chat.completions.create(model=file_alias, messages=CHATS[0], max_tokens=4, temperature=0)
    assert r.choices[0].message.content == file_ref.generate(CHATS[0], temperature=0, max_tokens=4).text
