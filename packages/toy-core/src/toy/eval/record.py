"""Eval inputs and run bundles: reading the evaluated text, and writing an
``eval`` run (``runs/eval-…/``) so a figure lives next to how it was made.

Decisions:

- An eval file is a text file (read whole, as llama-perplexity reads it:
  UTF-8, a BOM dropped) or JSONL with one ``{"text": …}`` per line; JSONL
  documents are joined with a blank line (``"\\n\\n"``) into one text. A
  folder is read like a training corpus (its text and JSONL files in sorted
  order). Errors name the file and line (``toy.corpus`` reads it).
- An eval run (``run_kind`` "eval") records ``config`` (the command and its
  arguments: ``command``, ``model``, ``model_b`` when there is one, file,
  context, …), ``run_start`` with ``model`` (the file name and its
  architecture dims), one ``eval`` event per figure (``name`` = the command
  or, for lmc, ``lmc@<alpha>``; ``loss`` = mean NLL in nats; ``ppl``; the
  rest of the result as extra keys) and ``run_end`` ("completed", or
  "interrupted"/"errored" when the evaluation did not finish).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from toy.corpus import iter_documents
from toy.errors import DataError
from toy.runs import RunWriter


def read_eval_text(path: str | os.PathLike[str]) -> str:
    """The text of an eval file or folder (see the module docstring)."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file or folder")
    texts = [text for _, text in iter_documents([p])]
    if not texts:
        raise DataError(f"{p}: no text in it")
    return "\n\n".join(texts)


def model_info(model: object) -> dict[str, Any]:
    """What ``run_start`` says about an evaluated model."""
    cfg = getattr(model, "cfg", None)
    info: dict[str, Any] = {"path": str(getattr(model, "path", "")) or None}
    if cfg is not None:
        info.update(
            architecture=cfg.architecture,
            n_vocab=cfg.n_vocab,
            d_model=cfg.d_model,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_head_kv=cfg.n_head_kv,
        )
    return info


@contextmanager
def eval_run(
    command: str, config: dict[str, Any], runs_dir: str | os.PathLike[str] | None = None, **start: Any
) -> Iterator[RunWriter]:
    """A run bundle for one evaluation: ``run_end`` "completed" when the
    block finishes, "interrupted" on Ctrl-C, "errored" (with the message) on
    any other exception, which is re-raised."""
    writer = RunWriter("eval", {"command": command, **config}, root=runs_dir, **start)
    try:
        yield writer
    except KeyboardInterrupt:
        writer.end("interrupted")
        raise
    except BaseException as e:
        writer.end("errored", error=f"{type(e).__name__}: {e}")
        raise
    writer.end("completed")


__all__ = ["eval_run", "model_info", "read_eval_text"]
