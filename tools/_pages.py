"""Shared by the tools that generate a docs page (``ggml_coverage.py``,
``serve_api_docs.py``): write the page, or with ``--check`` fail on a stale one."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path


def write_or_check(root: Path, page: Path, text: str, check: bool, tool: str, recipe: str) -> int:
    """Write ``root / page`` when it differs from ``text``; with ``check``,
    print a diff and return 1 instead when it is stale (``recipe`` is the
    `just` recipe that regenerates it)."""
    path = root / page
    old = path.read_text(encoding="utf-8") if path.is_file() else None
    if check:
        if old != text:
            print(f"error: {page} is stale: run `just {recipe}`", file=sys.stderr)
            diff = list(
                difflib.unified_diff((old or "").splitlines(), text.splitlines(), "committed", "generated", lineterm="")
            )
            for line in diff[:40]:
                print(line, file=sys.stderr)
            if len(diff) > 40:
                print(f"... ({len(diff) - 40} more diff lines)", file=sys.stderr)
            return 1
        print(f"{tool}: {page} is up to date", file=sys.stderr)
        return 0
    if old != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"{tool}: wrote {page}", file=sys.stderr)
    else:
        print(f"{tool}: {page} is up to date", file=sys.stderr)
    return 0
