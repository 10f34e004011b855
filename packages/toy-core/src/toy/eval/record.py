"""Eval inputs and run bundles: reading the evaluated text, and writing an
``eval`` run (``runs/eval-…/``) so a figure lives next to how it was made.

Decisions:

- An eval file is a text file (read whole, as llama-perplexity reads it:
  UTF-8, a BOM dropped) or JSONL with one ``{"text": …}`` per line; JSONL
  documents are joined with a blank line (``"\\n\\n"``) into one text. A
  folder is read like a training corpus (its text and JSONL files in sorted
  order). Errors name the file and line (``toy.corpus`` reads it).
- ``read_eval_ids`` reads and tokenizes that text as a stream (blocks of
  1 MB, tokenized in pieces cut where no token crosses, see
  ``toy.tokenizer.longtext``) and stops once it holds ``limit`` tokens (what
  ``--max-chunks`` windows need, ``toy.eval.windows.tokens_needed``), so a
  20 MB one-line file costs a small multiple of what is read, and with
  ``--max-chunks 2`` only a prefix of it is read. Its ids equal
  ``text_ids(read_eval_text(path))`` up to where it stopped (the caveats of
  ``toy.tokenizer.longtext`` apply; SentencePiece-style vocabularies read the
  whole text).
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
from typing import TYPE_CHECKING, Any

import numpy as np

from toy.corpus import corpus_files, iter_documents, iter_text
from toy.errors import DataError
from toy.runs import RunWriter

if TYPE_CHECKING:
    from toy.tokenizer import Tokenizer

#: what ``read_eval_ids`` reads from a plain-text file at a time
READ_BYTES = 1 << 20


def read_eval_text(path: str | os.PathLike[str]) -> str:
    """The text of an eval file or folder (see the module docstring)."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file or folder")
    texts = [text for _, text in iter_documents([p])]
    if not texts:
        raise DataError(f"{p}: no text in it")
    return "\n\n".join(texts)


def check_eval_path(path: str | os.PathLike[str]) -> list[Path]:
    """The files an eval path reads (errors for a missing path, a FIFO, a device: before a model loads)."""
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise DataError(f"{p}: no such file or folder")
    return corpus_files([p])


def _eval_blocks(path: Path) -> Iterator[str]:
    """The eval text (module docstring) as blocks: documents joined with a blank line."""
    first = True
    for _, text, starts in iter_text([path], READ_BYTES):
        if starts and not first:
            yield "\n\n"
        first = False
        yield text
    if first:
        raise DataError(f"{path}: no text in it")


def read_eval_ids(
    tokenizer: Tokenizer, path: str | os.PathLike[str], limit: int | None = None
) -> tuple[np.ndarray, bool]:
    """(ids, whole) of an eval file or folder, tokenized as ``toy.eval.score.text_ids`` does (the file's
    BOS/EOS flags, control-token text not parsed), reading no further than ``limit`` tokens need: ``whole``
    says whether the whole text was read (the EOS, when the tokenizer adds one, ends only a whole text)."""
    p = Path(path)
    check_eval_path(p)
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    parts = [np.asarray([bos] if tokenizer.add_bos and bos is not None else [], np.int32)]
    n, stream = len(parts[0]), tokenizer.encode_stream(_eval_blocks(p), special=False)
    for ids in stream:
        parts.append(ids)
        n += len(ids)
        if limit is not None and n >= limit:
            stream.close()  # stop reading: the file is closed as the generators unwind
            return np.concatenate(parts), False
    if tokenizer.add_eos and eos is not None:
        parts.append(np.asarray([eos], np.int32))
    return np.concatenate(parts), True


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


__all__ = ["check_eval_path", "eval_run", "model_info", "read_eval_ids", "read_eval_text"]
