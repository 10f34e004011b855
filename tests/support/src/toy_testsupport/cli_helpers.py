"""Helpers shared by the CLI tests (``from toy_testsupport.cli_helpers import
run``): run ``toy`` in-process, check a clean error, fake a stdin,
read `toy describe` rows, compare `toy infer --json` with the library."""

from __future__ import annotations

import io
import json
import re

from toy_cli.main import main


def run(capsys, *args):
    """``toy ARGS`` in this process: (exit code, stdout, stderr)."""
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_clean_error(code, err, want_code, *fragments, hint: bool = False):
    """An ``error:`` line (and a ``hint:`` line when ``hint``), no traceback."""
    assert code == want_code, err
    assert err.startswith("error: ") or "\nerror: " in err, err
    if hint:
        assert "hint: " in err, err
    assert "Traceback" not in err, err
    for f in fragments:
        assert f in err, err


class FakeStdin(io.StringIO):
    """A stdin with ``text`` that says whether it is a terminal."""

    def __init__(self, text: str = "", tty: bool = False):
        super().__init__(text)
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def row(out: str, label: str, value: str) -> None:
    """``label`` then ``value`` on one line of `toy describe` (the label column is padded)."""
    assert re.search(rf"^{re.escape(label)}\s+{re.escape(value)}$", out, re.M), f"{label!r}: {value!r} not in\n{out}"


def no_row(out: str, label: str) -> None:
    """No ``label`` line in `toy describe`'s output."""
    assert not re.search(rf"^{re.escape(label)}\s", out, re.M), f"{label!r} row in\n{out}"


def infer_json_and_library(capsys, path, prompt: str, n: int):
    """`toy infer PATH PROMPT -n N --greedy --ignore-eos --json -q` (which
    must succeed quietly) and the library's answer (``toy.load`` on one
    thread, ``generate`` greedy): (the JSON, the prompt ids, the Generation)."""
    import toy

    code, out_json, err = run(capsys, "infer", path, prompt, "-n", n, "--greedy", "--ignore-eos", "--json", "-q")
    assert code == 0 and err == ""
    d = json.loads(out_json)
    with toy.load(path, threads=1) as m:
        ids = m.tokenize(prompt)
        want = m.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True)
    return d, ids, want


__all__ = ["FakeStdin", "assert_clean_error", "infer_json_and_library", "no_row", "row", "run"]
