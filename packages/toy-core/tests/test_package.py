"""toy-core basics: importable, version in lockstep with toy-ggml, error base."""

import toy
import toy_ggml
from toy import ToyError


def test_versions_move_in_lockstep():
    assert toy.__version__ == toy_ggml.__version__


def test_toy_error_carries_hint():
    e = ToyError("bad input", hint="try this")
    assert str(e) == "bad input"
    assert e.hint == "try this"
    assert ToyError("x").hint is None
