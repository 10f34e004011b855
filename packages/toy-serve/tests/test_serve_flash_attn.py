"""``toy serve --flash-attn``: ggml's fused attention in its row-invariant form (toy-ggml patch 0020).

What is checked, and against what:

- the flag reaches the engine (flash attention on, exact batching on, the default off) and a value
  that is not a boolean is refused before loading (settings.py);
- a LIVE server over SmolLM2 with flash attention: greedy completions sent one at a time, then all
  at once (streamed and plain) are the same text (``assert_concurrent_equal_alone``), and each
  equals the library (``Model.generate``) on a second copy of the model loaded the same way but
  with one slot, so no batching at all. One prompt is 150 tokens long: the server prefills it in
  chunks of ``prefill_chunk`` (128 by default, then 22) while the library prefills it whole, and
  a whole 150-row prefill reaches ggml's tiled kernel, which the switch turns off. Its token
  logprobs must equal the library's (1e-5, as test_openai_api.py), also when it is sent a second
  time and its prefix comes from the cache.
"""

from __future__ import annotations

import pytest

from toy_testsupport.serve_helpers import assert_concurrent_equal_alone

pytestmark = pytest.mark.model

LONG = "The quick brown fox jumps over the lazy dog while the farmer counts his sheep. " * 9
PROMPTS = ["The capital of France is", "1, 2, 3,", "Once upon a time", LONG]


def test_flash_attn_reaches_the_engine(smollm2_path, serve_settings):
    from toy.errors import BadInputError
    from toy_serve.server import Server

    srv = Server(serve_settings(flash_attn=True, ctx=64, parallel=1), None)
    m = srv._load()
    try:
        assert m.engine.flash_attn and m.engine.exact_batching
    finally:
        m.close()
    assert serve_settings().flash_attn is False
    with pytest.raises(BadInputError, match="flash_attn"):
        serve_settings(flash_attn="yes")


@pytest.fixture(scope="module")
def flash(smollm2_path):
    import toy

    served = toy.load(smollm2_path, n_ctx=512, n_slot=4, threads=2, exact_batching=True, flash_attn=True)
    ref = toy.load(smollm2_path, n_ctx=512, n_slot=1, threads=2, exact_batching=True, flash_attn=True)
    yield served, ref
    served.close()
    ref.close()


def test_flash_attention_batches_exactly(flash, serve_settings, serving):
    served, ref = flash
    assert len(ref.tokenize(LONG)) > 128  # chunked by the server, whole in the library
    with serving(serve_settings(flash_attn=True), served) as live:
        client = live.client()
        alias = live.srv.settings.alias
        kw = dict(model=alias, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        alone = assert_concurrent_equal_alone(live, client, PROMPTS, kw)
        for prompt, text in zip(PROMPTS, alone):
            ref.engine.cache.clear()
            assert ref.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True).text == text, prompt
        # the long prompt's logprobs (greedy text alone would hide logits that moved), twice: the second
        # time its prefix comes from a slot's cache
        ref.engine.cache.clear()
        want = ref.generate(LONG, max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
        for _ in range(2):
            lp = client.completions.create(prompt=LONG, logprobs=1, **kw).choices[0].logprobs
            assert len(lp.token_logprobs) == len(want.logprobs) == 12
            for got, ref_lp in zip(lp.token_logprobs, want.logprobs):
                assert got == pytest.approx(ref_lp.logprob, abs=1e-5)
