"""Stop strings over streamed text: StopMatcher and truncate_at_stop.

The reference for "any chunking gives the same result" is a brute-force
loop in this file: walk the text one character at a time and stop at the
first position where some stop string has just been completed.
"""

from __future__ import annotations

import random

import pytest

from toy.engine.stop import StopMatcher, truncate_at_stop
from toy.errors import ToyError


def run(stops, pieces) -> tuple[str, bool, list[str]]:
    """Push every piece (stopping early like an engine would) and flush; return (text, stopped, emitted pieces)."""
    m = StopMatcher(stops)
    emitted = []
    stopped = False
    for piece in pieces:
        out, stopped = m.push(piece)
        emitted.append(out)
        if stopped:
            break
    tail = m.flush()
    emitted.append(tail)
    return "".join(emitted), stopped, emitted


def ref_truncate(text: str, stops) -> tuple[str, bool]:
    """Brute force: the first end position where a stop string completes; among those, the longest stop."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(len(s) for s in done)], True
    return text, False


def test_stop_split_across_many_pushes():
    text, stopped, emitted = run(["<|end|>"], ["Hello", " world<", "|", "en", "d|", ">", " ignored"])
    assert (text, stopped) == ("Hello world", True)
    assert emitted[:2] == ["Hello", " world"]  # "<" held back while it might start the stop
    assert emitted[2:5] == ["", "", ""]


def test_held_back_text_is_released_when_it_turns_out_not_to_be_a_stop():
    m = StopMatcher(["</s>"])
    assert m.push("a</") == ("a", False)
    assert m.pending == "</"
    assert m.push("b>") == ("</b>", False)
    assert m.pending == ""


def test_flush_releases_held_back_text_at_the_end():
    m = StopMatcher(["\n\nUser:"])
    assert m.push("answer\n\nUs") == ("answer", False)
    assert m.flush() == "\n\nUs"
    assert m.flush() == ""


def test_no_false_holding():
    m = StopMatcher(["STOP", "###"])
    held = []
    for piece in ["plain text ", "with S", "ome #", "signs"]:
        out, stopped = m.push(piece)
        assert not stopped
        held.append(m.pending)
    assert held == ["", "S", "#", ""]  # only a suffix that is a prefix of a stop is ever held
    assert m.push("T") == ("T", False)
    m2 = StopMatcher(["STOP"])
    assert m2.push("TOPS TOP") == ("TOPS TOP", False)  # "P" / "OP" / "TOP" are not prefixes of "STOP"
    assert m2.push("ST") == ("", False) and m2.pending == "ST"


def test_empty_stop_list_passes_everything_through():
    m = StopMatcher([])
    for piece in ["a", "<", "</s>", ""]:
        assert m.push(piece) == (piece, False)
        assert m.pending == ""
    assert m.flush() == ""


def test_earliest_of_several_stops_wins():
    text, stopped, _ = run(["\n\n", "User:", "###"], ["The answer is 4. ", "User: next\n\n###"])
    assert (text, stopped) == ("The answer is 4. ", True)
    m = StopMatcher(["\n\n", "User:", "###"])
    m.push("a ### b User:")
    assert m.matched == "###"


def test_overlapping_prefixes():
    # "aab" inside "aaab": after "aa" the matcher must still see the stop starting one character later
    assert run(["aab"], ["a", "a", "a", "b", "c"])[:2] == ("a", True)
    # stops sharing a prefix: the one completed first wins
    assert run(["abcd", "abx"], ["ab", "x"])[:2] == ("", True)
    assert run(["abcd", "abx"], ["ab", "c", "d"])[:2] == ("", True)
    assert run(["abcd", "abx"], ["ab", "c", "e"])[:2] == ("abce", False)


def test_stop_completed_first_wins_over_one_starting_earlier():
    # "b" completes at "ab", before "abc" could; the result does not depend on the chunking
    assert run(["abc", "b"], ["abc"])[:2] == ("a", True)
    assert run(["abc", "b"], ["a", "b", "c"])[:2] == ("a", True)
    m = StopMatcher(["abc", "b"])
    m.push("xabc")
    assert m.matched == "b"
    # same end: the longer stop (it starts earlier) wins
    assert run(["bc", "c"], ["abc"])[:2] == ("a", True)


def test_after_a_stop_nothing_more_is_emitted():
    m = StopMatcher(["."])
    assert m.push("one. two") == ("one", True)
    assert m.push("three") == ("", True)
    assert m.flush() == ""
    assert m.stopped and m.matched == "."
    m.reset()
    assert not m.stopped and m.matched is None
    assert m.push("again.") == ("again", True)


def test_any_chunking_matches_the_reference():
    rng = random.Random(0)
    alphabet = "ab\n:"
    stop_sets = [["a"], ["ab"], ["aab", "b:"], ["\n\n", ":a"], ["abab", "ba", "\n"], ["aaaa"], []]
    for _ in range(400):
        stops = rng.choice(stop_sets)
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        expected = ref_truncate(text, stops)
        assert run(stops, pieces)[:2] == expected, (stops, pieces)
        cut, hit = truncate_at_stop(text, stops)
        assert (cut, hit is not None) == expected


def test_truncate_at_stop():
    assert truncate_at_stop("Hi there\nUser: x", ["\nUser:", "###"]) == ("Hi there", "\nUser:")
    assert truncate_at_stop("no stop here", ["###"]) == ("no stop here", None)
    assert truncate_at_stop("abc", []) == ("abc", None)


def test_single_string_and_duplicates():
    m = StopMatcher("###")  # one stop string, not three "#"
    assert m.stops == ("###",)
    assert m.push("a#b") == ("a#b", False)
    assert StopMatcher(["x", "y", "x"]).stops == ("x", "y")


@pytest.mark.parametrize("stops", [[""], ["ok", ""], [3], None])
def test_bad_stops_raise(stops):
    with pytest.raises(ToyError):
        StopMatcher(stops)


def test_push_rejects_non_text():
    with pytest.raises(ToyError, match="text="):
        StopMatcher(["x"]).push(b"bytes")


def ref_pending(text: str, stops) -> str:
    """Brute force: the longest suffix of ``text`` that is a proper prefix of some stop string."""
    for n in range(len(text), 0, -1):
        if any(len(s) > n and s.startswith(text[-n:]) for s in stops):
            return text[-n:]
    return ""


def test_held_back_text_is_the_longest_prefix_suffix():
    # periodic stops are where a linear matcher's failure links matter (KMP's hard cases)
    rng = random.Random(1)
    stop_sets = [["abaabab"], ["aaaab", "aab"], ["abcabcabd"], ["ab" * 6 + "c", "bab"]]
    for _ in range(300):
        stops = rng.choice(stop_sets)
        m, shown = StopMatcher(stops), ""
        for _ in range(40):
            piece = "".join(rng.choice("abc") for _ in range(rng.randint(0, 3)))
            out, stopped = m.push(piece)
            shown += out
            if stopped:
                break
            assert m.pending == ref_pending(shown + m.pending, stops)


def test_long_stop_strings_cost_linear_memory():
    # Regression: the matcher kept every prefix of every stop in a set, so one 40,000-character stop cost
    # ~800 MB (~L^2/2 characters). Measured in a child process: peak RSS growth while building 16 such
    # matchers and pushing 200,000 characters through one (a stop that keeps almost matching).
    import subprocess
    import sys

    code = """
import resource
from toy.engine.stop import StopMatcher
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
stops = ["a" * 40000 + str(i) for i in range(16)]
m = StopMatcher(stops)
held, shown = 0, 0
for _ in range(200):
    out, stopped = m.push("a" * 1000)
    held, shown = max(held, len(m.pending)), shown + len(out)
assert not stopped and held == 40000 and shown == 200000 - 40000, (held, shown)
assert m.push("7") == ("", True) and m.matched == stops[7]
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    grown_mib = int(r.stdout.split()[-1])
    assert grown_mib < 64, f"peak RSS grew by {grown_mib} MiB"
