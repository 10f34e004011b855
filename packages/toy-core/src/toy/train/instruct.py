"""Instruction-tuning data: JSONL examples -> tokens with a loss mask -> packed rows.

Formats, one JSON object a line (blank lines skipped; any other key is an
error, so a typo such as ``"completions"`` is caught; docs/reference/
data-formats.md has examples). The targets (tokens that carry loss) are:

- ``{"text": s}``: BOS (when the tokenizer adds one) + s + EOS, all of them.
- ``{"prompt": p, "completion": c}``: BOS + p + c + EOS, c's tokens and the
  EOS. Decision: plain concatenation, no chat template; p and c are tokenized
  apart (enc(p) + enc(c): what a model given enc(p) sees while generating c).
- ``{"messages": [...]}``: the chat template's rendering; assistant message i
  spans the text from ``render(messages[:i], add_generation_prompt=True)`` to
  ``render(messages[:i+1])``, and its targets run to the span's last
  end-of-generation token inclusive (ChatML: content + ``<|im_end|>``, so the
  model learns to stop; the newline after it is never generated). Decision
  (tokenize per prefix): each prefix is tokenized alone and must start the
  whole text and its ids, else a clear error (a template that rewrites
  earlier turns, a token merging across the boundary) instead of a guess.
  Roles: system, user, assistant, and tool when the template renders it.

Text is tokenized with ``special=True`` (control tokens written in it are
parsed), as the inference prompt path (``Model.prompt_ids``) does, with the
same exception: in a ``messages`` example, control-token text inside the
messages stays plain text, only the template's markup gives control tokens
(``toy.tokenizer.chat``'s injection rule; ``special_in_content=True``,
``data.special_in_content`` in a recipe, turns it off). ``text`` and
``prompt``/``completion`` examples are the author's own raw text and keep
their control tokens. BOS is added per the tokenizer unless the text starts
with it. Over-length examples are truncated
or dropped (``overflow``) and counted, never silently. ``InstructData`` packs
whole examples greedily in file order (next fit) into rows of ``context``
positions: n tokens take n-1 positions, positions restart at 0, ``doc`` is the
index in the row (the block-causal mask keeps examples apart), padding ends
the row (token 0, loss 0, a doc id of its own).

Memory: a line is read with a bound (``toy.inputs.max_record_bytes``, 64 MiB
unless ``TOY_MAX_RECORD_BYTES`` says otherwise; a longer line is refused
naming the file and line, or reported as a problem by ``check_file``) and its
text is tokenized in pieces into int32 arrays (``Tokenizer.encode_array``), so
one record costs a small multiple of its size, never ~140 bytes a character.
Paths that are not regular files (a FIFO, a device) are refused before they
are opened (``toy.inputs.regular_file``).

Invariants: an Example's ``tokens`` (int32) and ``loss`` (bool) have one
length, and token 0 is never a target (nothing precedes it); batches are
``PackedData``'s (int32/float32, (B, context)), so ``BatchStream`` and
``validation_batches`` work unchanged; errors are ``DataError``s naming the
file and the 1-based line.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from itertools import count, groupby
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from toy.corpus import Paths
from toy.errors import DataError
from toy.inputs import RECORD_ENV, max_record_bytes, read_line, regular_file
from toy.train.data import Batch

KINDS = ("text", "prompt_completion", "messages")
_KEYS = {"text": {"text"}, "prompt_completion": {"prompt", "completion"}, "messages": {"messages"}}
ROLES = ("system", "user", "assistant")
_PROBE = "toy-role-probe-7341"
_JTYPE = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array", dict: "an object"}


class _Bad(Exception):
    """One line's problem (the reason; the caller adds file and line)."""


@dataclass
class Example:
    """One example: ``loss[j]`` is True where token j is a target that counts."""

    tokens: np.ndarray  # int32 (n,)
    loss: np.ndarray  # bool (n,)
    source: str
    line: int
    kind: str

    def __post_init__(self) -> None:
        self.tokens, self.loss = np.asarray(self.tokens, np.int32), np.asarray(self.loss, bool)
        if self.tokens.ndim != 1 or self.tokens.shape != self.loss.shape:
            raise DataError(f"{self.source}:{self.line}: tokens and loss must be 1-D arrays of one length")


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise _Bad(f"{what} is {_JTYPE.get(type(v), 'null')}, not a string")
    return v


class _Encoder:
    """One line -> an ``Example``, with a tokenizer and a chat template."""

    def __init__(self, tokenizer: Any, template: Any, special_in_content: bool = False):
        self.tok, self.template, self.special_in_content = tokenizer, template, special_in_content
        try:  # "tool" is a role when the template renders a tool message at all
            out = template.render([{"role": "user", "content": "q"}, {"role": "tool", "content": _PROBE}])
        except Exception:
            out = ""
        self.roles = ROLES + (("tool",) if _PROBE in out else ())

    def ids(self, text: str, bos: bool = True, plain: list | None = None) -> np.ndarray:
        """int32 ids (a long text is encoded in pieces, never as one list of Python ints)."""
        try:
            if plain:  # spans of message text holding control-token text: kept as text
                ids = np.asarray(self.tok.encode_protected(text, plain, add_special=False), np.int32)
            else:
                ids = self.tok.encode_array(text, add_special=False, special=True)
        except Exception as e:  # TokenizerError, or a lone surrogate
            raise _Bad(f"cannot tokenize: {e}") from None
        b = self.tok.bos_id
        if bos and self.tok.add_bos and b is not None and (not len(ids) or ids[0] != b):
            ids = np.concatenate([np.asarray([b], np.int32), ids])
        return ids

    def eos(self) -> int:
        if self.tok.eos_id is None:
            raise _Bad("the tokenizer has no EOS token to end the example with")
        return self.tok.eos_id

    def render(self, messages: list, gen: bool) -> tuple[str, list]:
        """The rendering and the spans of it to keep as plain text (none with ``special_in_content``)."""
        try:
            if self.special_in_content:
                return self.template.render(messages, add_generation_prompt=gen), []
            return self.template.render_protected(messages, self.tok.special_spans, add_generation_prompt=gen)
        except Exception as e:  # ChatTemplateError
            raise _Bad(f"chat template: {e}") from None

    def example(self, raw: bytes, source: str, line: int) -> Example:
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise _Bad("not valid UTF-8") from None
        except ValueError as e:
            raise _Bad(f"not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise _Bad(f"expected a JSON object, got {_JTYPE.get(type(obj), 'null')}")
        keys = set(obj)
        kinds = [k for k in KINDS if _KEYS[k] & keys]
        expect = 'expected "text", "prompt" and "completion", or "messages"'
        if not kinds:
            raise _Bad(f"no known format ({'keys ' + ', '.join(sorted(keys)) if keys else 'empty object'}); {expect}")
        if len(kinds) > 1:
            raise _Bad(f"mixed formats (keys {', '.join(sorted(keys))}); {expect}, one format per line")
        kind = kinds[0]
        if keys - _KEYS[kind]:
            raise _Bad(f"unknown key(s) {', '.join(sorted(keys - _KEYS[kind]))} in a {kind} example")
        if kind == "text":
            text = _str(obj["text"], '"text"')
            if not text:
                raise _Bad("empty text")
            tokens = np.append(self.ids(text), np.int32(self.eos()))
            loss = np.ones(len(tokens), bool)
            loss[0] = False
        elif kind == "prompt_completion":
            if _KEYS[kind] - keys:
                raise _Bad(f'"{min(_KEYS[kind] - keys)}" is missing (a prompt_completion example has both)')
            prompt, comp = _str(obj["prompt"], '"prompt"'), _str(obj["completion"], '"completion"')
            if not comp.strip():
                raise _Bad("empty completion")
            head, tail = self.ids(prompt), np.append(self.ids(comp, bos=False), np.int32(self.eos()))
            tokens = np.concatenate([head, tail])
            loss = np.concatenate([np.zeros(len(head), bool), np.ones(len(tail), bool)])
        else:
            tokens, loss = self.conversation(self.messages(obj["messages"]))
        return Example(np.asarray(tokens, np.int32), np.asarray(loss, bool), source, line, kind)

    def messages(self, msgs: Any, name: str = "messages", need_assistant: bool = True) -> list[dict]:
        """``msgs`` checked as a list of messages; ``name`` is the key the reasons call it by
        (``toy.train.prefdata`` checks its ``prompt``/``chosen``/``rejected`` lists here too)."""
        if not isinstance(msgs, list):
            raise _Bad(f'"{name}" is {_JTYPE.get(type(msgs), "null")}, not an array')
        if not msgs:
            raise _Bad(f'"{name}" is empty')
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise _Bad(f"{name}[{i}] is {_JTYPE.get(type(m), 'null')}, not an object")
            for k in ("role", "content"):
                if k not in m:
                    raise _Bad(f'{name}[{i}] has no "{k}"')
                _str(m[k], f'{name}[{i}]["{k}"]')
            if m["role"] not in self.roles:
                raise _Bad(f"{name}[{i}]: unknown role {m['role']!r} (allowed: {', '.join(self.roles)})")
            if m["role"] == "assistant" and not m["content"].strip():
                raise _Bad(f"{name}[{i}]: empty assistant content")
        if need_assistant and not any(m["role"] == "assistant" for m in msgs):
            raise _Bad("the conversation has no assistant turn")
        return msgs

    def conversation(self, msgs: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        full, plain = self.render(msgs, False)
        ids = self.ids(full, plain=plain)
        loss, eog = np.zeros(len(ids), bool), np.fromiter(self.tok.eog_ids, np.int64)
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                a, b = self.prefix(full, ids, msgs[:i], True, i), self.prefix(full, ids, msgs[: i + 1], False, i)
                if b <= a:
                    raise _Bad(f"messages[{i}]: the chat template renders this assistant turn as nothing")
                ends = np.flatnonzero(np.isin(ids[a:b], eog))
                end = a + int(ends[-1]) + 1 if len(ends) else b
                loss[a:end] = True
        return ids, loss

    def prefix(self, full: str, ids: np.ndarray, msgs: list[dict], gen: bool, i: int) -> int:
        """The number of tokens of ``render(msgs, gen)``, checked to be a prefix."""
        text, plain = self.render(msgs, gen)
        p = self.ids(text, plain=plain) if full.startswith(text) else None
        if p is None or not np.array_equal(ids[: len(p)], p):
            how = "text" if p is None else "token ids"
            raise _Bad(
                f"messages[{i}]: the chat template's rendering up to this assistant turn does not start the whole "
                f"conversation's ({how} differ), so the turn's loss span cannot be located"
            )
        return len(p)


def _skip_line(f: BinaryIO) -> None:
    """Read past the rest of the current line, a block at a time."""
    while (block := f.readline(1 << 20)) and not block.endswith(b"\n"):
        pass


def records(path: Path, *, keep_going: bool = False) -> Iterator[tuple[int, bytes | str]]:
    """(1-based line, its bytes or why it has none) per non-blank line of a JSONL
    file, a leading byte-order mark dropped. A line over the record bound
    (``toy.inputs.max_record_bytes``) raises, or with ``keep_going`` is skipped
    and reported; a file that cannot be read is a ``DataError``. The instruction
    and preference readers (``toy.train.prefdata``) share it."""
    path, limit = regular_file(path), max_record_bytes()
    try:
        with open(path, "rb") as f:
            for n in count(1):
                try:
                    raw = read_line(f, f"{path}:{n}", limit)
                except DataError:
                    if not keep_going:
                        raise
                    _skip_line(f)
                    yield n, f"the line is longer than {limit:,} bytes, the most one record may hold ({RECORD_ENV})"
                    continue
                if not raw:
                    break
                raw = raw[3:] if n == 1 and raw.startswith(b"\xef\xbb\xbf") else raw
                if raw.strip():
                    yield n, raw
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None


def _read(path: Path, enc: _Encoder, *, keep_going: bool = False) -> Iterator[tuple[int, Example | str]]:
    """(1-based line, its Example or the reason it has none) per non-blank line (``records``)."""
    for n, raw in records(path, keep_going=keep_going):
        if isinstance(raw, str):
            yield n, raw
            continue
        try:
            yield n, enc.example(raw, str(path), n)
        except _Bad as e:
            yield n, str(e)


def length_stats(lengths: Iterable[int]) -> dict[str, float]:
    """min, median, p95 (nearest rank: the ceil(0.95 n)-th smallest) and max; 0s when empty."""
    s = sorted(lengths)
    if not s:
        return {"min": 0, "median": 0, "p95": 0, "max": 0}
    mid = len(s) // 2
    median = s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
    return {"min": s[0], "median": median, "p95": s[math.ceil(0.95 * len(s)) - 1], "max": s[-1]}


@dataclass
class _Counts:
    kinds: dict[str, int] = field(default_factory=dict)  # valid examples per kind
    n_examples: int = 0
    n_tokens: int = 0
    n_loss: int = 0  # target tokens
    lengths: dict[str, float] = field(default_factory=dict)  # min, median, p95, max

    def _count(self, examples: list[Example], kinds: Counter, lengths: list[int]) -> None:
        self.kinds = {k: kinds[k] for k in KINDS if kinds[k]}
        self.n_examples, self.lengths = len(examples), length_stats(lengths)
        self.n_tokens = sum(len(e.tokens) for e in examples)
        self.n_loss = sum(int(e.loss.sum()) for e in examples)


@dataclass
class Stats(_Counts):
    """``load_examples``' counts: ``kinds`` and ``lengths`` cover every valid
    example before truncation; ``n_examples``/``n_tokens``/``n_loss`` what was kept."""

    truncated: int = 0
    dropped: int = 0  # over-length, overflow="drop"
    no_loss: int = 0  # truncated, then dropped because no target was left


def load_examples(
    paths: Paths,
    tokenizer: Any,
    template: Any,
    *,
    max_length: int,
    overflow: str = "truncate",
    special_in_content: bool = False,
) -> tuple[list[Example], Stats]:
    """Every example of the JSONL files (a folder: its ``*.jsonl``, sorted), in
    order; the first bad line raises ``DataError`` (``path:line: reason``)."""
    if overflow not in ("truncate", "drop"):
        raise DataError(f'overflow must be "truncate" or "drop" (got {overflow!r})')
    if max_length < 2:
        raise DataError(f"max_length must be at least 2 (got {max_length})")
    kinds: Counter[str]
    enc, stats, out, kinds, lengths = _Encoder(tokenizer, template, special_in_content), Stats(), [], Counter(), []
    given = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    for path in (f for p in given for f in (sorted(p.rglob("*.jsonl")) if p.is_dir() else [p])):
        for line, ex in _read(path, enc):
            if isinstance(ex, str):
                raise DataError(f"{path}:{line}: {ex}")
            kinds[ex.kind] += 1
            lengths.append(len(ex.tokens))
            if len(ex.tokens) > max_length:
                if overflow == "drop":
                    stats.dropped += 1
                    continue
                stats.truncated += 1
                ex.tokens, ex.loss = ex.tokens[:max_length].copy(), ex.loss[:max_length].copy()  # not views of it all
                if not ex.loss.any():
                    stats.no_loss += 1
                    continue
            out.append(ex)
    stats._count(out, kinds, lengths)
    return out, stats


class InstructData:
    """Examples packed into rows of ``context`` positions (module docstring);
    the last ``n_val`` rows validate. ``seed`` is accepted for the recipe's
    call: packing and split are deterministic in file order (``BatchStream``
    shuffles the rows)."""

    block_causal = True

    def __init__(self, examples: list[Example], context: int, *, val_fraction: float = 0.05, seed: int = 0):
        if context < 1:
            raise DataError(f"context must be at least 1 (got {context})")
        if not 0 <= val_fraction < 1:
            raise DataError(f"val_fraction must be in [0, 1) (got {val_fraction})")
        self.context, self.seed, self.examples = int(context), int(seed), list(examples)
        self.rows: list[list[int]] = []  # example indices per row
        used = self.context
        for i, ex in enumerate(self.examples):
            n = len(ex.tokens)
            if n > self.context + 1:
                raise DataError(
                    f"{ex.source}:{ex.line}: the example has {n} tokens, more than context + 1 = {self.context + 1}",
                    hint=f"load the examples with max_length <= {self.context + 1} (truncate or drop)",
                )
            if n < 2:
                raise DataError(f"{ex.source}:{ex.line}: the example has {n} token(s); at least 2 are needed")
            if used + n - 1 > self.context:
                self.rows.append([])
                used = 0
            self.rows[-1].append(i)
            used += n - 1
        self.n_windows = len(self.rows)
        self.n_val = max(1, round(val_fraction * self.n_windows)) if val_fraction > 0 else 0
        if self.n_windows - self.n_val < 1:
            raise DataError(
                f"{len(self.examples)} example(s) pack into {self.n_windows} row(s) of {self.context} positions, "
                f"too few for {self.n_val} validation row(s) and at least one for training",
                hint="add examples, lower the context or lower val_fraction",
            )

    @property
    def n_train(self) -> int:
        return self.n_windows - self.n_val

    def batch(self, rows: Iterable[int]) -> Batch:
        """The given rows (0 <= i < n_windows), shaped as ``PackedData.batch``'s."""
        idx = [int(i) for i in rows]
        if any(not 0 <= i < self.n_windows for i in idx):
            raise IndexError(f"row index out of range [0, {self.n_windows})")
        b, t = len(idx), self.context
        tokens, targets, pos, doc = (np.zeros((b, t), np.int32) for _ in range(4))
        mask = np.zeros((b, t), np.float32)
        for r, row in enumerate(idx):
            o = 0
            for d, e in enumerate(self.rows[row]):
                ex = self.examples[e]
                m = len(ex.tokens) - 1
                tokens[r, o : o + m], targets[r, o : o + m] = ex.tokens[:-1], ex.tokens[1:]
                mask[r, o : o + m], pos[r, o : o + m], doc[r, o : o + m] = ex.loss[1:], np.arange(m), d
                o += m
            pos[r, o:], doc[r, o:] = np.arange(t - o), len(self.rows[row])
        return Batch(tokens, targets, mask, pos, doc)

    def check_batch(self, batch_size: int) -> None:
        if batch_size < 1:
            raise DataError(f"batch size must be at least 1 (got {batch_size})")
        if self.n_train < batch_size:
            raise DataError(
                f"the training split has {self.n_train} packed row(s); a batch needs {batch_size}",
                hint="add examples, or lower the batch size, the context or val_fraction",
            )


@dataclass
class CheckReport(_Counts):
    """``check_file``'s findings over every valid example. A sample is a dict:
    line, kind, n_tokens, n_loss, segments ((text, is a target) runs of the
    first ``shown_tokens`` tokens). A problem's line is 1-based; 0 means the
    whole file."""

    path: str = ""
    max_length: int = 0
    over_length: int = 0  # examples longer than max_length
    samples: list[dict[str, Any]] = field(default_factory=list)
    problems: list[tuple[int, str]] = field(default_factory=list)  # (line, reason)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["samples"] = [{**s, "segments": [{"text": t, "loss": c} for t, c in s["segments"]]} for s in self.samples]
        d["problems"] = [{"line": n, "reason": r} for n, r in self.problems]
        return d


def segments(tokenizer: Any, tokens: Iterable[int], loss: Iterable[bool]) -> list[tuple[str, bool]]:
    """The decoded text in runs of equal loss flags (a UTF-8 character split
    across a run boundary lands in the later run)."""
    dec = tokenizer.incremental_decoder()
    texts = [dec.feed(int(t)) for t in tokens]
    texts[-1:] = [t + dec.flush() for t in texts[-1:]]  # an incomplete UTF-8 tail becomes U+FFFD
    runs = groupby(zip(texts, map(bool, loss)), key=lambda p: p[1])
    return [("".join(t for t, _ in run), flag) for flag, run in runs]


#: ``check_file`` shows at most this many tokens of an example (a 20 MB line is not printed whole).
SHOW_TOKENS = 512


def check_file(
    path: str | os.PathLike,
    tokenizer: Any,
    template: Any,
    *,
    max_length: int,
    show: int = 3,
    special_in_content: bool = False,
) -> CheckReport:
    """Read every line of ``path``, collecting problems instead of stopping.

    A sample shows the first ``SHOW_TOKENS`` tokens of its example (``shown_tokens`` says how many; the
    rest is counted, not decoded). A file without a single example (empty, or blank lines only) is a
    problem (line 0: the whole file), since training refuses it."""
    enc = _Encoder(tokenizer, template, special_in_content)
    report = CheckReport(path=str(path), max_length=int(max_length))
    kinds: Counter[str]
    examples, kinds = [], Counter()
    for line, ex in _read(Path(path), enc, keep_going=True):
        if isinstance(ex, str):
            report.problems.append((line, ex))
            continue
        examples.append(ex)
        kinds[ex.kind] += 1
        report.over_length += len(ex.tokens) > max_length
        if len(report.samples) < show:
            n, k = len(ex.tokens), min(len(ex.tokens), SHOW_TOKENS)
            segs = segments(tokenizer, ex.tokens[:k], ex.loss[:k])
            report.samples.append({"line": line, "kind": ex.kind, "n_tokens": n, "n_loss": int(ex.loss.sum())})
            report.samples[-1].update(segments=segs, shown_tokens=k)
    if not examples and not report.problems:
        report.problems.append((0, "the file holds no example (it is empty or has only blank lines)"))
    report._count(examples, kinds, [len(e.tokens) for e in examples])
    return report
