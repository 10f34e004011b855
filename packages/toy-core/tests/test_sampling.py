"""Token sampling: params validation, each sampler's effect, the seeded draw, logprobs.

Expected values come from plain Python loops over small vocabularies (math,
not NumPy), an independent reference for the vectorized code. Statistical
tests use fixed seeds, so they are deterministic; their tolerances are still
wide enough that any correct implementation passes for any seed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from toy.engine.sampling import (
    Sampler,
    SamplingError,
    SamplingParams,
    TokenLogprob,
    apply_penalties,
    log_softmax,
    min_p_filter,
    top_k_filter,
    top_logprobs,
    top_p_filter,
)
from toy.errors import ToyError

PROBS4 = [0.5, 0.3, 0.15, 0.05]
NEG_INF = float("-inf")


def logits_of(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def ref_softmax(logits) -> list[float]:
    finite = [v for v in logits if v != NEG_INF]
    m = max(finite)
    e = [math.exp(v - m) if v != NEG_INF else 0.0 for v in logits]
    s = sum(e)
    return [v / s for v in e]


def ref_inverse_cdf(probs, u: float) -> int:
    """The first token whose cumulative probability exceeds u."""
    total = 0.0
    for tok, q in enumerate(probs):
        total += q
        if total > u:
            return tok
    return len(probs) - 1


def kept(x) -> list[int]:
    return [i for i, v in enumerate(np.asarray(x).tolist()) if v != NEG_INF]


def open_params(**kw) -> SamplingParams:
    """Filters and penalties off, so only what a test sets has an effect."""
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    return SamplingParams(**{**base, **kw}).validate()


def frequencies(sampler: Sampler, logits, n: int) -> np.ndarray:
    counts = np.zeros(len(logits))
    for _ in range(n):
        counts[sampler.sample(logits, [])] += 1
    return counts


def chi_square(counts, probs) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


# --- SamplingParams -----------------------------------------------------------------------------------------


def test_defaults_are_valid_and_follow_llama_cpp():
    p = SamplingParams().validate()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert (p.repeat_penalty, p.penalty_last_n, p.seed, p.logprobs) == (1.0, 64, None, None)


def test_lists_and_a_single_stop_string_are_normalized_to_tuples():
    p = SamplingParams(stop=["a", "b"], stop_tokens=[2, np.int64(7)])
    assert p.stop == ("a", "b") and p.stop_tokens == (2, 7)
    assert type(p.stop_tokens[1]) is int
    assert SamplingParams(stop="###").stop == ("###",)
    hash(p)  # still hashable


BAD_VALUES = [
    ("temperature", -1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "hot"),
    ("top_k", -1),
    ("top_k", 2.5),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("min_p", -0.1),
    ("min_p", 1.01),
    ("repeat_penalty", 0.0),
    ("repeat_penalty", -1.0),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -2.01),
    ("presence_penalty", 3.0),
    ("presence_penalty", -3.0),
    ("penalty_last_n", -2),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", 1.5),
    ("max_tokens", -1),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", True),
    ("stop", ("",)),
    ("stop", tuple(f"s{i}" for i in range(17))),
    ("stop", (1,)),
    ("stop_tokens", (-1,)),
    ("stop_tokens", ("x",)),
    ("ignore_eos", "yes"),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_validate_rejects_bad_field(field, value):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**{field: value}).validate()
    assert f"{field}" in str(e.value)
    assert e.value.field == field  # carried as data: the server's param comes from it, not from the message


def test_validate_message_names_field_and_value():
    with pytest.raises(ToyError, match=r"temperature=-1 must be >= 0"):
        SamplingParams(temperature=-1).validate()


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 0), ("top_p", 1.0), ("min_p", 1.0), ("penalty_last_n", -1), ("seed", 2**63 - 1), ("logprobs", 0)],
)
def test_validate_accepts_edges(field, value):
    assert SamplingParams(**{field: value}).validate() is not None


def test_replace_validates_and_names_unknown_fields():
    p = SamplingParams()
    assert p.replace(top_k=5).top_k == 5 and p.top_k == 40
    with pytest.raises(ToyError, match="top_kk") as e:
        p.replace(top_kk=5)
    assert e.value.field == "top_kk"
    with pytest.raises(ToyError, match="top_p=2"):
        p.replace(top_p=2)


def test_greedy_turns_filters_off_and_takes_other_fields():
    g = SamplingParams.greedy(max_tokens=8, repeat_penalty=1.1)
    assert (g.temperature, g.top_k, g.top_p, g.min_p) == (0.0, 0, 1.0, 0.0)
    assert g.max_tokens == 8 and g.repeat_penalty == 1.1
    with pytest.raises(ToyError, match="temperature"):
        SamplingParams.greedy(temperature=0.5)
    with pytest.raises(ToyError, match="bogus"):
        SamplingParams.greedy(bogus=1)


def test_stop_token_ids_respect_ignore_eos():
    assert SamplingParams(stop_tokens=(5,)).stop_token_ids([2, 3]) == {2, 3, 5}
    assert SamplingParams(stop_tokens=(5,), ignore_eos=True).stop_token_ids([2, 3]) == {5}


# --- penalties ------------------------------------------------------------------------------------------------


def ref_penalties(logits, history, rp, fp, pp, last_n):
    window = [] if last_n == 0 else list(history) if last_n == -1 else list(history)[-last_n:]
    out = []
    for tok, v in enumerate(logits):
        c = window.count(tok)
        if c:
            v = v / rp if v > 0 else v * rp
            v = v - c * fp - pp
        out.append(v)
    return out


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    logits = np.array([2.0, -2.0, 1.0, -1.0], dtype=np.float32)
    before = logits.copy()
    out = apply_penalties(logits, [0, 1], 2.0, 0.0, 0.0, 64)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0, -1.0])
    assert np.array_equal(logits, before)  # input untouched
    assert out.dtype == np.float32


def test_frequency_and_presence_penalties_use_counts():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=12).astype(np.float32)
    history = [3, 3, 3, 5, 7, 7, 0]
    out = apply_penalties(logits, history, 1.3, 0.5, 0.25, -1)
    np.testing.assert_allclose(out, ref_penalties(logits.tolist(), history, 1.3, 0.5, 0.25, -1), rtol=1e-6, atol=1e-6)
    # by hand for one token: seen three times, frequency 0.5 and presence 0.25 -> 1.75 lower (repeat off)
    only = apply_penalties(logits, history, 1.0, 0.5, 0.25, -1)
    assert only[3] == pytest.approx(logits[3] - 1.75, abs=1e-6)
    assert only[1] == logits[1]


@pytest.mark.parametrize("last_n", [0, 1, 3, 6, -1, 100])
def test_penalty_window_last_n(last_n):
    logits = np.linspace(-1, 1, 8, dtype=np.float32)
    history = [1, 2, 2, 4, 6, 6, 7]
    out = apply_penalties(logits, history, 1.5, 0.3, 0.2, last_n)
    np.testing.assert_allclose(out, ref_penalties(logits.tolist(), history, 1.5, 0.3, 0.2, last_n), atol=1e-6)


def test_penalties_keep_minus_inf_and_reject_out_of_vocab_ids():
    logits = np.array([NEG_INF, 1.0, 2.0], dtype=np.float32)
    out = apply_penalties(logits, [0, 0, 1], 1.2, 0.5, 0.5, -1)
    assert out[0] == NEG_INF and out[2] == 2.0
    with pytest.raises(ToyError, match="3"):
        apply_penalties(logits, [3], 1.2, 0.0, 0.0, -1)
    with pytest.raises(ToyError, match="-1"):
        apply_penalties(logits, [-1], 1.2, 0.0, 0.0, -1)
    # an out-of-vocab id outside the window does not matter
    assert apply_penalties(logits, [99, 1], 1.2, 0.0, 0.0, 1)[1] == pytest.approx(1.0 / 1.2)


# --- filters --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 5, 17])
def test_top_k_keeps_exactly_k_highest(k):
    rng = np.random.default_rng(k)
    logits = rng.normal(size=30).astype(np.float32)
    out = top_k_filter(logits, k)
    expected = sorted(range(30), key=lambda i: -logits[i])[:k]
    assert kept(out) == sorted(expected)
    assert all(out[i] == logits[i] for i in expected)


def test_top_k_ties_keep_lower_ids_and_off_values():
    logits = np.array([1.0, 3.0, 2.0, 2.0, 2.0, 0.0], dtype=np.float32)
    assert kept(top_k_filter(logits, 3)) == [1, 2, 3]
    assert kept(top_k_filter(logits, 0)) == list(range(6))
    assert kept(top_k_filter(logits, 6)) == list(range(6))
    assert kept(top_k_filter(logits, 99)) == list(range(6))


@pytest.mark.parametrize(("p", "n_kept"), [(0.3, 1), (0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (0.95, 3), (0.96, 4)])
def test_top_p_keeps_smallest_set_reaching_p(p, n_kept):
    # shuffled so ordering by probability is exercised, not just a prefix
    order = [2, 0, 3, 1]
    probs = [PROBS4[i] for i in order]
    out = top_p_filter(logits_of(probs), p)
    ranked = sorted(range(4), key=lambda i: -probs[i])
    assert kept(out) == sorted(ranked[:n_kept])


def test_top_p_reference_on_random_logits_and_edge_cases():
    rng = np.random.default_rng(3)
    logits = rng.normal(scale=2.0, size=40).astype(np.float32)
    probs = ref_softmax(logits.tolist())
    ranked = sorted(range(40), key=lambda i: -probs[i])
    total, expected = 0.0, []
    for i in ranked:  # the reference loop: add the most likely tokens until the mass reaches 0.7
        expected.append(i)
        total += probs[i]
        if total >= 0.7:
            break
    assert kept(top_p_filter(logits, 0.7)) == sorted(expected)
    assert kept(top_p_filter(logits, 1e-9)) == [ranked[0]]  # always at least one
    assert kept(top_p_filter(logits, 1.0)) == list(range(40))
    masked = np.array([NEG_INF, 0.0, NEG_INF, 0.0], dtype=np.float32)
    assert kept(top_p_filter(masked, 0.6)) == [1, 3]


@pytest.mark.parametrize(
    ("p", "expected"),
    [(0.0, [0, 1, 2, 3]), (0.1, [0, 1, 2, 3]), (0.2, [0, 1, 2]), (0.5, [0, 1]), (0.61, [0]), (1.0, [0])],
)
def test_min_p_keeps_tokens_above_fraction_of_top(p, expected):
    probs = PROBS4
    # reference: probability >= p * max probability (0.1 * 0.5 = 0.05 sits exactly on the boundary: kept)
    assert [i for i in range(4) if probs[i] >= p * max(probs) - 1e-12] == expected
    assert kept(min_p_filter(logits_of(probs), p)) == expected


def test_filters_do_not_mutate_and_keep_values():
    logits = logits_of(PROBS4)
    before = logits.copy()
    for out in (top_k_filter(logits, 2), top_p_filter(logits, 0.8), min_p_filter(logits, 0.5)):
        assert np.array_equal(logits, before)
        assert out is not logits
        np.testing.assert_array_equal(out[:2], logits[:2])
        assert np.all(out[2:] == NEG_INF)


# --- log_softmax / top_logprobs -------------------------------------------------------------------------------


def test_log_softmax_matches_float64_reference_and_handles_minus_inf():
    rng = np.random.default_rng(5)
    logits = rng.normal(scale=4.0, size=50).astype(np.float32)
    logits[[3, 17]] = NEG_INF
    ref = [math.log(q) if q > 0 else NEG_INF for q in ref_softmax([float(v) for v in logits])]
    out = log_softmax(logits)
    assert out[3] == NEG_INF and out[17] == NEG_INF
    finite = [i for i in range(50) if i not in (3, 17)]
    np.testing.assert_allclose(out[finite], [ref[i] for i in finite], rtol=1e-12, atol=1e-12)
    assert math.fsum(math.exp(v) for v in out.tolist()) == pytest.approx(1.0, abs=1e-12)


def test_log_softmax_is_stable_and_rejects_unusable_input():
    out = log_softmax(np.array([1000.0, 0.0], dtype=np.float32))
    assert out[0] == pytest.approx(0.0, abs=1e-12) and out[1] == pytest.approx(-1000.0)
    for bad in ([NEG_INF, NEG_INF], [0.0, float("nan")], [0.0, float("inf")]):
        with pytest.raises(ToyError):
            log_softmax(np.array(bad, dtype=np.float32))


def test_top_logprobs_order_ties_and_values():
    logits = np.array([0.0, 2.0, 1.0, 2.0, NEG_INF, 1.0], dtype=np.float32)
    ids, lps = top_logprobs(logits, 4)
    assert ids.tolist() == [1, 3, 2, 5]  # descending; ties by lower id
    ref = ref_softmax(logits.tolist())
    np.testing.assert_allclose(lps, [math.log(ref[i]) for i in [1, 3, 2, 5]], rtol=1e-12)
    assert top_logprobs(logits, 0)[0].size == 0
    ids_all, lps_all = top_logprobs(logits, 99)
    assert ids_all.tolist() == [1, 3, 2, 5, 0, 4] and lps_all[-1] == NEG_INF


# --- Sampler --------------------------------------------------------------------------------------------------


def test_greedy_picks_argmax_lowest_id_on_tie_and_applies_penalties():
    logits = np.array([0.5, 3.0, 1.0, 3.0], dtype=np.float32)
    s = Sampler(SamplingParams.greedy(), 4)
    assert s.sample(logits, []) == 1
    assert s.sample(logits, [1]) == 1  # penalties off
    p = Sampler(SamplingParams.greedy(repeat_penalty=2.0), 4)
    assert p.sample(logits, [1]) == 3  # 3.0 / 2 = 1.5 < 3.0
    assert p.sample(logits, [1, 3]) == 1  # both halved to 1.5: an exact tie again, the lower id wins


def test_draw_is_inverse_cdf_with_one_uniform_per_step():
    logits = logits_of(PROBS4)
    s = Sampler(open_params(seed=42), 4)
    uniforms = np.random.default_rng(42).random(200).tolist()  # the same stream: one uniform per step
    expected = [ref_inverse_cdf(PROBS4, u) for u in uniforms]
    assert [s.sample(logits, []) for _ in range(200)] == expected
    assert s.seed == 42


def test_same_seed_same_tokens_different_seed_differs_and_fresh_seed_is_recorded():
    logits = np.random.default_rng(0).normal(size=64).astype(np.float32)

    def run(params):
        s = Sampler(params, 64)
        hist: list[int] = []
        for _ in range(50):
            hist.append(s.sample(logits, hist))
        return hist, s.seed

    a, _ = run(SamplingParams(seed=7, top_k=0, min_p=0.0))
    b, _ = run(SamplingParams(seed=7, top_k=0, min_p=0.0))
    c, _ = run(SamplingParams(seed=8, top_k=0, min_p=0.0))
    assert a == b and a != c
    fresh, seed = run(SamplingParams(top_k=0, min_p=0.0))
    assert 0 <= seed < 2**63
    assert run(SamplingParams(seed=seed, top_k=0, min_p=0.0))[0] == fresh
    assert Sampler(SamplingParams(), 4).seed != Sampler(SamplingParams(), 4).seed


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_reshapes_distribution(temperature):
    base = [0.5, 0.3, 0.2]
    # reference: softmax(log p / T) is p ** (1/T) renormalized
    w = [q ** (1 / temperature) for q in base]
    expected = [v / sum(w) for v in w]
    counts = frequencies(Sampler(open_params(temperature=temperature, seed=99), 3), logits_of(base), 4000)
    # df = 2: P(chi2 > 25) is about 4e-6, and the seed is fixed anyway
    assert chi_square(counts, expected) < 25
    if temperature != 1.0:
        assert chi_square(counts, base) > 50  # clearly not the untempered distribution
    if temperature < 1.0:
        assert counts[0] / counts.sum() > 0.6  # sharper: the top token gains


def test_sampled_token_is_never_a_filtered_one():
    rng = np.random.default_rng(11)
    logits = rng.normal(scale=1.5, size=100).astype(np.float32)
    logits[rng.choice(100, 10, replace=False)] = NEG_INF
    for params in (
        open_params(top_k=5),
        open_params(top_p=0.5),
        open_params(min_p=0.3),
        open_params(top_k=20, top_p=0.9, min_p=0.1, temperature=3.0),
        open_params(temperature=1e-300),
    ):
        x = logits.copy()
        x = top_k_filter(x, params.top_k)
        x = top_p_filter(x, params.top_p)
        x = min_p_filter(x, params.min_p)
        allowed = set(kept(x))
        s = Sampler(params, 100)
        drawn = {s.sample(logits, []) for _ in range(800)}
        assert drawn <= allowed
        if params.temperature >= 1.0:
            assert drawn == allowed  # and the draw does reach every allowed token


def test_filters_run_in_llama_cpp_order():
    # top_k runs before top_p, so top_p sees the renormalized survivors. Orders that would differ:
    # k=2, p=0.6: after top_k the pair is [0.625, 0.375] -> one token; top_p first would keep two.
    # k=3, p=0.83: after top_k the cumulative is [0.526, 0.842, 1] -> two; top_p first ([0.5, 0.8, ...]) three.
    # (min_p compares to the top probability, which renormalization does not change.)
    logits = logits_of(PROBS4)
    s = Sampler(open_params(top_k=2, top_p=0.6), 4)
    assert {s.sample(logits, []) for _ in range(300)} == {0}
    s = Sampler(open_params(top_k=3, top_p=0.83), 4)
    assert {s.sample(logits, []) for _ in range(300)} == {0, 1}


def test_sampler_penalties_change_the_draw():
    logits = logits_of([0.6, 0.4])
    s = Sampler(open_params(presence_penalty=2.0, penalty_last_n=1), 2)
    counts = np.zeros(2)
    for _ in range(2000):
        counts[s.sample(logits, [0])] += 1
    # reference: logits log(0.6) - 2, log(0.4) -> p0 = 0.6 e^-2 / (0.6 e^-2 + 0.4)
    p0 = 0.6 * math.exp(-2) / (0.6 * math.exp(-2) + 0.4)
    assert chi_square(counts, [p0, 1 - p0]) < 25


def test_sampler_rejects_bad_inputs():
    with pytest.raises(ToyError, match="temperature"):
        Sampler(SamplingParams(temperature=-1), 4)
    with pytest.raises(ToyError, match="n_vocab"):
        Sampler(SamplingParams(), 0)
    with pytest.raises(ToyError, match="stop_tokens") as e:
        Sampler(SamplingParams(stop_tokens=(4,)), 4)
    assert e.value.field == "stop_tokens"
    s = Sampler(SamplingParams(), 4)
    with pytest.raises(ToyError, match="n_vocab"):
        s.sample(np.zeros(5, dtype=np.float32), [])
    with pytest.raises(ToyError, match="NaN") as e:
        s.sample(np.array([0, 1, np.nan, 2], dtype=np.float32), [])
    assert e.value.field is None  # the model's logits are no input of the caller's
    with pytest.raises(ToyError, match="-inf"):
        s.sample(np.full(4, NEG_INF, dtype=np.float32), [])
    with pytest.raises(ToyError):
        s.sample(np.zeros((2, 2), dtype=np.float32), [])


def test_token_logprobs_come_from_raw_logits():
    logits = logits_of(PROBS4)
    assert Sampler(SamplingParams(), 4).token_logprobs(logits, 0) is None
    s = Sampler(open_params(logprobs=2, repeat_penalty=5.0, top_k=1, temperature=0.1), 4)
    tok = s.sample(logits, [0])
    lp = s.token_logprobs(logits, tok)
    assert isinstance(lp, TokenLogprob) and lp.token == tok
    assert lp.logprob == pytest.approx(math.log(PROBS4[tok]), abs=1e-6)  # not the penalized/filtered value
    assert [i for i, _ in lp.top] == [0, 1]
    assert [v for _, v in lp.top] == pytest.approx([math.log(0.5), math.log(0.3)], abs=1e-6)
    assert all(type(i) is int and type(v) is float for i, v in lp.top)
    zero = Sampler(open_params(logprobs=0), 4).token_logprobs(logits, 3)
    assert zero.top == () and zero.logprob == pytest.approx(math.log(0.05), abs=1e-6)
    with pytest.raises(ToyError, match="token=4"):
        s.token_logprobs(logits, 4)


def test_extreme_repeat_penalty_stays_finite():
    """A repetition penalty of 1e-300 boosts seen positive logits enormously;
    they must stay finite (inf - inf would give NaN and a wrong draw)."""
    logits = np.array([1.0, 2.0, -1.0, 0.5], np.float32)
    out = apply_penalties(logits, np.array([1, 3]), 1e-300, 0.0, 0.0, 64)
    assert np.all(np.isfinite(out))
    assert min(out[1], out[3]) > max(out[0], out[2])  # the seen positive logits now lead (both may hit the cap)
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1e-300, seed=1), 4)
    assert s.sample(logits, [1, 3]) in (1, 3)


# ------------------------------------------------------------------ logit_bias


def test_logit_bias_is_normalized_and_hashable():
    a = SamplingParams(logit_bias={5: -1, "2": np.float32(0.5), np.int64(9): 3}).validate()
    assert a.logit_bias == ((2, 0.5), (5, -1.0), (9, 3.0))
    assert a == SamplingParams(logit_bias=[(9, 3.0), (2, 0.5), (5, -1)]).validate()
    assert hash(a) == hash(SamplingParams(logit_bias=((2, 0.5), (5, -1.0), (9, 3.0))))


@pytest.mark.parametrize(
    "bias",
    [{1: 100.5}, {1: -101}, {1: float("nan")}, {1: float("inf")}, {1: True}, {1: "1"}, {-1: 1}, {"x": 1}, {1.5: 1}],
)
def test_logit_bias_rejects_bad_entries(bias):
    with pytest.raises(ToyError, match="logit_bias") as e:
        SamplingParams(logit_bias=bias).validate()
    assert e.value.field == "logit_bias"


def test_logit_bias_rejects_duplicates_too_many_and_ids_outside_the_vocabulary():
    with pytest.raises(ToyError, match="twice"):
        SamplingParams(logit_bias=[(3, 1.0), (3, 2.0)]).validate()
    with pytest.raises(ToyError, match="at most"):
        SamplingParams(logit_bias={i: 1.0 for i in range(2000)}).validate()
    with pytest.raises(ToyError, match="outside the vocabulary") as e:
        Sampler(SamplingParams.greedy(logit_bias={4: 1.0}), 4)
    assert e.value.field == "logit_bias"


def test_logit_bias_moves_the_argmax_before_the_penalties():
    logits = np.array([0.5, 3.0, 1.0, 2.9], dtype=np.float32)
    assert Sampler(SamplingParams.greedy(logit_bias={1: -100}), 4).sample(logits, []) == 3
    assert Sampler(SamplingParams.greedy(logit_bias={0: 2.6}), 4).sample(logits, []) == 0  # 3.1 > 3.0
    # bias first, then the penalty: token 0 at 3.1 is halved to 1.55 once seen, token 1 wins again
    assert Sampler(SamplingParams.greedy(logit_bias={0: 2.6}, repeat_penalty=2.0), 4).sample(logits, [0]) == 1


def test_logit_bias_draws_from_the_biased_distribution():
    """With a seed, a biased sampler draws exactly what an unbiased one draws from the biased logits."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=32).astype(np.float32)
    bias = {3: 2.5, 7: -100.0, 30: -1.25}
    want = logits.astype(np.float64)
    for t, b in bias.items():
        want[t] += b
    biased = Sampler(open_params(logit_bias=bias, seed=5), 32)
    plain = Sampler(open_params(seed=5), 32)
    got = [biased.sample(logits, []) for _ in range(300)]
    assert got == [plain.sample(want.astype(np.float32), []) for _ in range(300)]
    assert 7 not in got
    p3 = ref_softmax(want.tolist())[3]  # token 3's probability under the biased logits
    assert abs(got.count(3) / 300 - p3) < 4 * math.sqrt(p3 * (1 - p3) / 300)
    assert p3 > 5 * ref_softmax(logits.astype(np.float64).tolist())[3]  # the bias of 2.5 at work


def test_logit_bias_leaves_logprobs_the_models_own():
    logits = np.array([0.5, 3.0, 1.0, 2.9], dtype=np.float32)
    a = Sampler(SamplingParams.greedy(logprobs=2, logit_bias={1: -100}), 4)
    b = Sampler(SamplingParams.greedy(logprobs=2), 4)
    assert a.token_logprobs(logits, 3) == b.token_logprobs(logits, 3)
