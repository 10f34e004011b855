"""Helpers shared by the CLI tests (registered under this name by the root
conftest.py): run ``toy`` in-process, check a clean error, fake a stdin."""

from __future__ import annotations

import io

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


__all__ = ["FakeStdin", "assert_clean_error", "run"]
