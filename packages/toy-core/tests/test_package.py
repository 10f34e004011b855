"""toy-core basics: importable, version in lockstep with toy-ggml, no test-only code, error base."""

import toy
import toy_ggml
from toy import ToyError


def test_versions_move_in_lockstep():
    assert toy.__version__ == toy_ggml.__version__


def test_no_test_only_code_in_toy():
    """The test references (formerly ``toy.reference``) are the test-support package, outside toy-core."""
    import importlib.util
    from pathlib import Path

    import toy_testsupport.reference

    assert importlib.util.find_spec("toy.reference") is None
    assert Path(toy.__file__).parent not in Path(toy_testsupport.reference.__file__).parents


def test_toy_error_carries_hint():
    e = ToyError("bad input", hint="try this")
    assert str(e) == "bad input"
    assert e.hint == "try this"
    assert ToyError("x").hint is None


def test_bad_input_carries_its_field_and_exit_codes_come_from_the_class():
    from toy.errors import BadInputError

    e = BadInputError("temperature=-1 must be >= 0", hint="a temperature is >= 0", field="temperature")
    assert (str(e), e.hint, e.field) == ("temperature=-1 must be >= 0", "a temperature is >= 0", "temperature")
    assert BadInputError("no field").field is None
    assert (ToyError("x").exit_code, e.exit_code) == (1, 2)


def test_each_shared_error_class_exists_once():
    """The modules that raise them re-export toy.errors' classes (no second class of the same name)."""
    from toy import errors
    from toy.runs import plot
    from toy.train import config, data

    assert config.ConfigError is errors.ConfigError
    assert data.DataError is errors.DataError
    assert plot.PlotUnavailableError is errors.PlotUnavailableError
    assert issubclass(errors.ConfigError, errors.BadInputError) and issubclass(errors.DataError, errors.BadInputError)


def test_a_malformed_gguf_file_is_bad_input(tmp_path):
    import pytest

    from toy.errors import BadInputError
    from toy.gguf import GGUFError, GGUFFile

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")  # the magic and version, then nothing
    with pytest.raises(GGUFError) as e:
        GGUFFile(bad)
    assert isinstance(e.value, BadInputError) and e.value.exit_code == 2
