"""A small English corpus every Python has: the documentation topics of the
standard library (``pydoc_data.topics``, the text ``help('TOPIC')`` shows:
79 topics, about 465 KB on CPython 3.11).

``write_python_docs(folder)`` writes one ``<topic>.txt`` per topic, so the
tutorial and the tests train on real prose without downloading anything.
"""

from __future__ import annotations

import re
from pathlib import Path


def write_python_docs(folder: str | Path) -> list[Path]:
    """Write the topics as text files into ``folder`` (created); returns them
    sorted. Existing files of the same names are replaced."""
    from pydoc_data.topics import topics

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in sorted(topics):
        safe = re.sub(r"[^A-Za-z0-9_-]+", "_", name)
        p = out / f"{safe}.txt"
        p.write_text(topics[name].strip() + "\n", encoding="utf-8")
        paths.append(p)
    return paths


__all__ = ["write_python_docs"]
