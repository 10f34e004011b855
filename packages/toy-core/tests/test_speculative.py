"""Speculative decoding (toy.engine.speculative, ``LLMEngine.verify``, ``Model.generate(speculative=...)``).

The references are the plain paths, compared bit for bit:

- ``verify`` of n tokens against ``decode`` of the same tokens one at a time (``np.array_equal`` on every row's
  logits, then on the next decode after both: the K/V they wrote), on SmolLM2 (with and without a selectable
  adapter, with flash attention and exact batching) and on a generated Gemma-2 file (sliding windows, soft-caps);
- ``generate(speculative=...)`` against ``generate()`` of the same prompt and params: greedy over random prompts with
  prompt lookup and a draft model, and seeded sampling per seed (the acceptance rule makes them identical);
- ``NgramProposer`` against a brute-force search written from its definition.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import toy
from toy.engine import speculative as spec
from toy.errors import BadInputError
from toy_testsupport import gemma_ref
from toy_testsupport.train_helpers import seeded_adapter

pytestmark = pytest.mark.model

WORDS = (
    "the cat sat on a mat and the dog ran to the park while a bird sang in the tree "
    "def return print value list for in if else open file read write one two three"
).split()


@pytest.fixture(scope="module")
def adapter_file(smollm2_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("spec-adapter")
    recipe = {"seed": 1, "rank": 4, "alpha": 8.0, "targets": ("q", "v", "up"), "std": 0.05}
    return seeded_adapter(smollm2_path, d / "a.gguf", base_name=smollm2_path.name, **recipe)


@pytest.fixture(scope="module")
def smol(smollm2_path, adapter_file):
    with toy.load(smollm2_path, n_ctx=512, n_slot=3, threads=2, adapters={"a": adapter_file}) as m:
        yield m


@pytest.fixture(scope="module")
def lib(smollm2_path):
    """The library's default engine (no exact batching): plain and speculative generate on slot 0."""
    with toy.load(smollm2_path, n_ctx=768, threads=2) as m:
        yield m


def _verify_equals_decode(eng, prompts, drafts, adapters=None):
    """Prefill each prompt into its slot, then: decode each draft one token at a time (the reference), rewind,
    verify all drafts in one call; every row equal; then one more decode step after each equal too (the K/V)."""
    slots = list(range(len(prompts)))
    for s, p in zip(slots, prompts):
        eng.cache.truncate(s, 0)
        if adapters is not None:
            eng.slot_adapter[s] = adapters[s]
        eng.prefill(s, p)
    ref = [np.stack([eng.decode([s], [t])[0] for t in d]) for s, d in zip(slots, drafts)]
    after_ref = eng.decode(slots, [7] * len(slots))
    for s, p in zip(slots, prompts):
        eng.cache.truncate(s, len(p))
    out = eng.verify(slots, drafts)
    assert [o.shape for o in out] == [r.shape for r in ref]
    for o, r in zip(out, ref):
        assert np.array_equal(o, r)
    assert np.array_equal(eng.decode(slots, [7] * len(slots)), after_ref)
    for s, p, d in zip(slots, prompts, drafts):
        assert eng.cache.tokens(s) == [*p, *d, 7]


def test_verify_equals_decode_smollm2_with_adapter(smol):
    eng = smol.engine
    rng = np.random.default_rng(0)
    # lengths that cross a kv_pad boundary inside the verified rows (29 + 9 > 32, 60 + 5 > 64)
    prompts = [rng.integers(0, 49152, n).tolist() for n in (29, 60, 3)]
    drafts = [rng.integers(0, 49152, n).tolist() for n in (9, 5, 1)]
    _verify_equals_decode(eng, prompts, drafts, adapters=[None, 0, 0])
    _verify_equals_decode(eng, prompts, drafts, adapters=[0, None, None])
    # a truncated verify (rejected drafts) leaves cells past the length that are never read
    eng.cache.truncate(0, len(prompts[0]) + 2)
    eng.cache.truncate(1, len(prompts[1]) + 1)
    eng.cache.truncate(2, len(prompts[2]))
    _verify_equals_decode(eng, prompts, [[5, 6], [8], [9, 10, 11, 12]], adapters=[None, 0, None])


def test_verify_equals_decode_flash_attention_exact(smollm2_path):
    with toy.load(smollm2_path, n_ctx=512, n_slot=2, threads=2, flash_attn=True, exact_batching=True) as m:
        rng = np.random.default_rng(1)
        prompts = [rng.integers(0, 49152, n).tolist() for n in (250, 40)]
        drafts = [rng.integers(0, 49152, n).tolist() for n in (8, 3)]  # 250 + 8 crosses the 256 padding
        _verify_equals_decode(m.engine, prompts, drafts)


def test_flash_attention_without_exact_batching_is_refused(smollm2_path):
    with toy.load(smollm2_path, n_ctx=256, threads=2, flash_attn=True) as m:
        with pytest.raises(BadInputError, match="exact batching") as e:
            m.generate("Hello", max_tokens=2, speculative="ngram")
        assert e.value.field == "speculative"


@pytest.fixture(scope="module")
def gemma():
    with toy.load(gemma_ref.gguf_path("gemma2-tiny", 0, "f32"), n_ctx=128, n_slot=2, threads=2) as m:
        yield m


def test_verify_equals_decode_gemma2_windows(gemma):
    rng = np.random.default_rng(2)
    V = gemma.cfg.n_vocab
    # past the sliding window of the tiny Gemma-2 (a few tokens), so the window masks cut the verified rows
    prompts = [rng.integers(0, V, n).tolist() for n in (40, 7)]
    drafts = [rng.integers(0, V, n).tolist() for n in (6, 9)]
    _verify_equals_decode(gemma.engine, prompts, drafts)


def test_draft_model_with_another_vocabulary_is_refused(lib, gemma):
    with pytest.raises(BadInputError, match="another vocabulary") as e:
        lib.generate("Hello", max_tokens=2, speculative={"type": "draft", "model": gemma})
    assert e.value.field == "draft_model"


def _brute_ngram(h, n_max, n_min, k):
    for n in range(n_max, n_min - 1, -1):
        if n >= len(h):
            continue
        tail = h[-n:]
        for i in range(len(h) - n - 1, -1, -1):  # the most recent earlier occurrence with a token after it
            if h[i : i + n] == tail:
                return h[i + n : i + n + k]
    return []


def test_ngram_proposer_equals_brute_force():
    rnd = random.Random(3)
    for _ in range(400):
        h = [rnd.randrange(4) for _ in range(rnd.randrange(1, 30))]
        n, n_min, k = rnd.randint(1, 4), 1, rnd.randint(1, 8)
        n_min = rnd.randint(1, n)
        assert spec.NgramProposer(n, n_min).propose(h, k) == _brute_ngram(h, n, n_min, k), (h, n, n_min, k)


def test_parse_speculative():
    assert spec.parse_speculative(None) == spec.SpecConfig()
    assert spec.parse_speculative("ngram") == spec.SpecConfig("ngram", 8, 3, 1)
    assert spec.parse_speculative({"type": "ngram", "n": 4, "k": 5}) == spec.SpecConfig("ngram", 5, 4, 1)
    assert spec.parse_speculative({"type": "draft"}).k == 4
    for bad in ("eagle", {"type": "ngram", "k": 0}, {"type": "ngram", "n": 2, "n_min": 3}, {"kk": 1}, 3):
        with pytest.raises(BadInputError) as e:
            spec.parse_speculative(bad)
        assert e.value.field == "speculative"


def test_controller_turns_off_when_drafts_are_rejected_and_retries():
    c = spec.Controller(8, spec.StepCosts(), spec.NgramProposer())
    for _ in range(spec.WINDOW):
        c.record(c.want(), 1)  # nothing accepted: every verify step costs more than a decode step
    assert c.want() == 0 and c.off_windows == 1
    for _ in range(spec.COOLDOWN):
        c.record(0, 1)
    assert c.want() == 1
    good = spec.Controller(8, spec.StepCosts(), spec.NgramProposer())
    for _ in range(3 * spec.WINDOW):
        k = good.want()
        good.record(k, k + 1)  # everything accepted
    assert good.want() == 8 and good.off_windows == 0 and good.accepted == good.drafted


def _random_prompt(rnd):
    words = [rnd.choice(WORDS) for _ in range(rnd.randint(8, 40))]
    text = " ".join(words)
    return text + " " + text[: rnd.randint(0, len(text))]  # a repeat: prompt lookup finds matches


def test_greedy_speculative_equals_plain_over_random_prompts(lib, smollm2_path):
    rnd = random.Random(4)
    drafted = accepted = 0
    for i in range(8):
        prompt = _random_prompt(rnd)
        plain = lib.generate(prompt, max_tokens=40, temperature=0, ignore_eos=i % 2 == 0)
        kinds = [{"type": "ngram", "n": rnd.randint(1, 4), "k": rnd.randint(1, 10)}]
        if i < 3:
            kinds.append({"type": "draft", "model": smollm2_path, "k": rnd.randint(1, 6)})
        for sp in kinds:
            g = lib.generate(prompt, max_tokens=40, temperature=0, ignore_eos=i % 2 == 0, speculative=sp)
            assert g.tokens == plain.tokens and g.text == plain.text, (prompt, sp)
            assert g.finish_reason == plain.finish_reason
            drafted += g.timings["draft_tokens"]
            accepted += g.timings["draft_accepted"]
    assert 0 < accepted < drafted  # drafts were made, some accepted, some rejected


def test_seeded_sampling_speculative_equals_plain_per_seed(lib):
    prompt = "one two three one two three one two three one two"
    kw = {"max_tokens": 24, "temperature": 1.0, "top_k": 40, "ignore_eos": True}
    drafted = accepted = 0
    for seed in range(6):
        plain = lib.generate(prompt, seed=seed, logprobs=2, **kw)
        g = lib.generate(prompt, seed=seed, logprobs=2, speculative={"type": "ngram", "k": 6}, **kw)
        assert g.tokens == plain.tokens and g.text == plain.text
        assert [lp.logprob for lp in g.logprobs] == [lp.logprob for lp in plain.logprobs]
        drafted += g.timings["draft_tokens"]
        accepted += g.timings["draft_accepted"]
    assert 0 < accepted < drafted


def test_stop_strings_and_budget_inside_a_verified_run(lib):
    prompt = "a b c d e f g a b c d e f g a b c d e f g a b c"
    for kw in ({"stop": ["f g"]}, {"max_tokens": 5}, {"max_tokens": 1}):
        args = {"max_tokens": 30, "temperature": 0, "ignore_eos": True, **kw}
        plain = lib.generate(prompt, **args)
        g = lib.generate(prompt, speculative={"type": "ngram", "k": 8}, **args)
        assert (g.text, g.tokens, g.finish_reason, g.stop) == (
            plain.text,
            plain.tokens,
            plain.finish_reason,
            plain.stop,
        )


def test_toy_infer_speculative_flags(capsys, smollm2_path):
    import json

    from toy_testsupport.cli_helpers import run

    prompt = "one two three four one two three four one two"
    common = (smollm2_path, prompt, "--greedy", "-n", 16, "--ignore-eos", "--threads", 2, "--json")
    code, out, err = run(capsys, "infer", *common)
    assert code == 0, err
    plain = json.loads(out)
    code, out, err = run(capsys, "infer", *common, "--speculative", "ngram", "--draft-max", 4)
    assert code == 0, err
    d = json.loads(out)
    assert d["tokens"] == plain["tokens"] and d["text"] == plain["text"]
    assert d["timings"]["draft_tokens"] > 0 and "drafts" in err and "accepted" in err
    code, out, err = run(capsys, "infer", smollm2_path, "Hi", "--speculative", "draft")
    assert code == 2 and "--draft-model" in err
