"""GRPO's reward functions (``toy.train.rewards``): each built-in on
hand-checked strings, user functions named ``module:function``, a reward
that raises or returns garbage (reported, counted 0, never raised), None
(TRL's "not applicable") and weights."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from toy.errors import BadInputError, DataError
from toy.train.rewards import RewardSet, answers_equal, expected_answer, extract_answer, parse


def score1(spec: str, completion: str, example: dict | None = None) -> float | None:
    v = RewardSet([spec]).score([completion], [example or {}], ["p"]).per_reward[0, 0]
    return None if math.isnan(v) else float(v)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("so the answer is 42.", "42"),  # the last number; a full stop is not its decimal point
        ("3 apples and 5 pears: 8", "8"),
        ("it costs $1,234.50 in all", "$1,234.50"),
        ("the temperature fell to -7", "-7"),
        ("step 1: 2 + 2 = 4\n#### 4 \nthanks 9", "4"),  # GSM8K's mark wins over the last number
        ("no digits here", None),
    ],
)
def test_extract_answer_default_rule(text, want):
    assert extract_answer(text) == want


def test_extract_answer_with_a_pattern_takes_the_last_match_and_its_group():
    import re

    p = re.compile(r"<answer>(.*?)</answer>")
    assert extract_answer("<answer>1</answer> then <answer> 7 </answer>", p) == " 7 "
    assert extract_answer("nothing", p) is None
    assert extract_answer("x=3, x=5", re.compile(r"x=\d")) == "x=5"  # no group: the whole match


def test_expected_answer_and_equality():
    assert expected_answer("Natalia sold 48 clips ... #### 72") == "72"
    assert expected_answer(72) == "72"
    assert answers_equal("72.", "72") and answers_equal("3.0", "3") and answers_equal("$1,000", "1000")
    assert not answers_equal("72", "720")
    assert answers_equal(" Paris ", "Paris") and not answers_equal("paris", "Paris")


def test_exact_answer_reward():
    ex = {"answer": "#### 18"}
    assert score1("exact_answer", "16 - 3 - 4 = 9 eggs, 9 * 2 = 18", ex) == 1.0
    assert score1("exact_answer", "the answer is 17", ex) == 0.0
    assert score1("exact_answer", "I do not know", ex) == 0.0
    assert score1(r"exact_answer=\\boxed\{([^}]*)\}", r"so \boxed{18} (not 19)", ex) == 1.0
    assert score1(r"exact_answer=\\boxed\{([^}]*)\}", "18", ex) == 0.0  # the pattern does not match


def test_regex_reward():
    assert score1(r"regex=^<think>.*</think>", "<think>hm</think> 4") == 1.0
    assert score1(r"regex=^<think>.*</think>", " <think>hm</think>") == 0.0  # anchored at the start
    assert score1(r"regex=(?s)^a.*b$", "a\n\nb") == 1.0
    with pytest.raises(BadInputError, match="needs a pattern"):
        parse("regex")
    with pytest.raises(BadInputError, match="not a regular expression"):
        parse("regex=(unclosed")


def test_json_reward_with_and_without_a_schema(tmp_path):
    pytest.importorskip("jsonschema")  # an optional dependency of toy-core; the dev environment has it
    assert score1("json", ' {"a": 1} ') == 1.0
    assert score1("json", "```json\n[1, 2]\n```") == 1.0  # one fenced block is unwrapped
    assert score1("json", "{'a': 1}") == 0.0  # not JSON
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    f = tmp_path / "s.json"
    f.write_text(json.dumps(schema))
    assert score1(f"json={f}", '{"n": 3}') == 1.0
    assert score1(f"json={f}", '{"n": "3"}') == 0.0
    assert score1("json=" + json.dumps(schema), '{"m": 3}') == 0.0  # inline
    # without a configured schema, the example's own
    assert score1("json", '{"n": 1.5}', {"schema": schema}) == 0.0
    assert score1("json", '{"n": 1}', {"schema": schema}) == 1.0
    with pytest.raises(BadInputError, match="cannot read the schema file"):
        parse(f"json={tmp_path / 'missing.json'}")
    with pytest.raises(BadInputError, match="not a valid JSON schema"):
        parse('json={"type": 12}')


def test_length_penalty():
    assert score1("length=10", "x" * 10) == 0.0
    assert score1("length=10", "x" * 15) == pytest.approx(-0.5)
    assert score1("length=4", "") == 0.0
    with pytest.raises(BadInputError, match="N must be"):
        parse("length=0")


def test_unknown_reward_names_the_built_ins():
    with pytest.raises(BadInputError, match="exact_answer, regex, json, length"):
        parse("exactanswer")


def test_user_function_from_the_current_folder(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        "def has_units(completion, example, *, prompt):\n"
        "    return 1.0 if completion.endswith(example['unit']) else 0.0\n"
        "def only_long(completion, example, *, prompt):\n"
        "    return None if len(prompt) < 5 else float(len(completion))\n"
        "def two_args(completion, example):\n"
        "    return 0.0\n"
    )
    monkeypatch.chdir(tmp_path)
    rs = RewardSet(["my_rewards_mod:has_units", "my_rewards_mod:only_long"], [2.0, 0.5])
    sc = rs.score(["3 kg", "3"], [{"unit": "kg"}, {"unit": "kg"}], ["short", "no"])
    assert rs.labels == ["my_rewards_mod:has_units", "my_rewards_mod:only_long"]
    np.testing.assert_array_equal(sc.per_reward[:, 0], [1.0, 0.0])
    assert sc.per_reward[0, 1] == 4.0 and math.isnan(sc.per_reward[1, 1])
    # weighted sum over the rewards that applied (TRL: nansum of w * r)
    np.testing.assert_array_equal(sc.total, [2.0 * 1.0 + 0.5 * 4.0, 0.0])
    with pytest.raises(BadInputError, match="cannot be called"):
        RewardSet(["my_rewards_mod:two_args"])
    with pytest.raises(BadInputError, match="has no 'nope'"):
        RewardSet(["my_rewards_mod:nope"])
    with pytest.raises(BadInputError, match="cannot import module"):
        RewardSet(["no_such_module_xyz:f"])


def test_a_reward_that_raises_is_reported_and_counted_zero(tmp_path, monkeypatch):
    (tmp_path / "bad_rewards_mod.py").write_text(
        "def boom(completion, example, *, prompt):\n"
        "    if 'x' in completion:\n"
        "        raise ValueError('no x please')\n"
        "    return 1.0\n"
        "def text(completion, example, *, prompt):\n"
        "    return 'high'\n"
        "def nan(completion, example, *, prompt):\n"
        "    return float('nan')\n"
    )
    monkeypatch.chdir(tmp_path)
    rs = RewardSet(["bad_rewards_mod:boom", "bad_rewards_mod:text", "bad_rewards_mod:nan"])
    sc = rs.score(["x", "y"], [{}, {}], ["p", "p"])
    np.testing.assert_array_equal(sc.per_reward, [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert sc.errors[0][0] == {"reward": "bad_rewards_mod:boom", "error": "ValueError: no x please"}
    assert [e["reward"] for e in sc.errors[1]] == ["bad_rewards_mod:text", "bad_rewards_mod:nan"]
    assert "not a finite number" in sc.errors[1][0]["error"]


def test_every_reward_none_leaves_the_total_nan():
    rs = RewardSet(["regex=a"])
    rs.rewards[0].fn = lambda c, e, *, prompt: None
    sc = rs.score(["a"], [{}], ["p"])
    assert math.isnan(sc.total[0])


def test_examples_are_checked_before_training():
    rs = RewardSet(["exact_answer"])
    rs.check_examples([{"answer": 1}], ["f.jsonl:1"])
    with pytest.raises(DataError, match=r"f\.jsonl:2: the exact_answer reward needs the example's 'answer'"):
        rs.check_examples([{"answer": 1}, {"prompt": "x"}], ["f.jsonl:1", "f.jsonl:2"])


def test_weights_and_duplicate_labels():
    rs = RewardSet(["regex=a", "regex=b"], [1.0, -1.0])
    assert rs.labels == ["regex", "regex#2"]
    sc = rs.score(["ab", "a", "c"], [{}] * 3, ["p"] * 3)
    np.testing.assert_array_equal(sc.total, [0.0, 1.0, 0.0])
    with pytest.raises(BadInputError, match="2 reward weights for 1 rewards"):
        RewardSet(["regex=a"], [1.0, 2.0])
    with pytest.raises(BadInputError, match="at least one reward"):
        RewardSet([])
