"""Preference data: JSONL pairs, unpaired labels and prompts -> one sequence per row.

Three formats, one JSON object a line (blank lines skipped, a byte-order mark
ignored; docs/reference/data-formats.md has examples). The field names are
TRL's, so a TRL preference file reads here unchanged:

- ``pairs`` (DPO, ORPO): ``{"prompt", "chosen", "rejected"}``, either all three
  strings ("standard") or all three lists of messages ("conversational"), or
  ``{"chosen", "rejected"}`` as two whole conversations whose longest common
  run of leading messages is the prompt ("implicit", as TRL's
  ``extract_prompt``; conversations only).
- ``unpaired`` (KTO): ``{"prompt", "completion", "label"}``, strings or message
  lists; ``label`` is a JSON boolean (true: desirable).
- ``prompts`` (GRPO): ``{"prompt": str | messages, ...}``; every other key is
  kept, as given, in ``PrefExample.fields`` for the reward functions (TRL
  passes a dataset's other columns to them the same way).

The format is detected from the first valid line (``chosen`` and ``rejected``:
pairs; ``label``: unpaired; ``prompt`` alone: prompts), or given; a later line
of another format is an error naming both. In ``pairs`` and ``unpaired`` a key
that is not the format's is an error, as in ``toy.train.instruct``.

Tokens are made as SFT makes them (``toy.train.instruct._Encoder``, so the
chat template, the control-token rule and ``special_in_content`` are
the same):

- standard: prompt = BOS (when the tokenizer adds one) + enc(prompt);
  completion = enc(completion) + EOS, tokenized apart (the SFT
  ``prompt``/``completion`` rule). An empty prompt is allowed (without a BOS
  its completion's first token then has nothing before it and is no target).
- conversational: prompt = ``render(prompt, add_generation_prompt=True)``;
  completion = the rest of ``render(prompt + completion)`` up to its last
  end-of-generation token inclusive (ChatML: content + ``<|im_end|>``; the
  newline after it is left out, as in SFT). The completion's first message
  must be an assistant turn; a longer completion (assistant, tool, assistant)
  carries loss on all of it, as in TRL. The rendered prompt must start the
  whole rendering, text and ids (the SFT prefix rule), else a clear error.
  Decision: TRL keeps that trailing newline in the completion; the targets
  here are SFT's, which a generation that stops at ``<|im_end|>`` produces.

Loss is on the completion tokens only. Lengths, decided as TRL does
(``keep_start`` truncation; TRL drops what has no completion left, here that
is an error unless dropping is asked for):
``max_length`` counts the tokens of prompt + completion (a row of ``context``
positions holds ``context + 1``). With ``overflow="truncate"`` (the default)
a longer sequence keeps its prompt and the head of its completion, each side
of a pair cut on its own, and is counted in ``truncated``; a prompt that leaves
no completion token (``len(prompt) >= max_length``) is an error naming the
line, not a silent drop. With ``overflow="drop"`` an over-length example
(either side of a pair) is dropped and counted. ``prompts`` examples must have
a prompt shorter than ``max_length`` (the rollout needs room to generate).

Checks before any training, each a ``DataError`` with ``file:line: reason``
(``check_pref_file`` collects them all): bad UTF-8/JSON, not an object,
missing keys, unknown keys, a value of the wrong type, mixed standard and
conversational fields, an empty (blank) completion, chosen equal to rejected
(same token ids), a non-boolean label, a prompt that fills ``max_length``, a
file without examples.

Batches (``PrefBatch``, a ``toy.train.data.Batch`` with optional extras): one
sequence per row, never packed: ``tokens[r, :m] = seq[:-1]``,
``targets[r, :m] = seq[1:]``, ``loss_mask`` 1 exactly on completion targets,
``pos = arange(T)`` (running on through the padding), ``doc`` 0 on the
sequence and 1 on the padding (token 0, target 0, mask 0). A *row index* of the
data classes is one example (one pair for ``PairData``), which is what
``BatchStream`` shuffles and ``check_batch`` counts: a ``PairData`` batch of
``batch_size`` pairs has ``2 * batch_size`` rows, the chosen sequences first
and the rejected ones after, row ``i`` and row ``i + P`` one pair (TRL's
``per_device_train_batch_size`` also counts pairs). The validation split is
the last ``n_val`` examples (deterministic, as ``InstructData``'s);
``validation_rows`` cuts it into batches of exactly ``batch_size`` rows
(``toy.train.data.validation_batches`` would pad after the rejected rows and
break the pair layout).

KTO's KL batch (``UnpairedData.kl_batch``): TRL 1.16 pairs each prompt with
another example's completion while it prepares the dataset: in dataset order,
in groups of ``per_device_train_batch_size``, it rotates the completions by
one, ``(x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})``, and then samples the
dataset sequentially so a batch is a group. Here the partner is fixed the
same way (``kl_group``, the micro-batch size; per split), so it is a property
of the row (its reference KL log-prob can be computed once) and ``kl_batch``
gives the same KL sequences however ``BatchStream`` shuffles the rows; a KL
sequence longer than ``context + 1`` tokens loses the tail of its completion
(TRL's collator cuts at ``max_length`` too).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from toy.corpus import Paths
from toy.errors import DataError
from toy.train.data import Batch
from toy.train.instruct import _JTYPE, SHOW_TOKENS, _Bad, _Encoder, _str, length_stats, records, segments

FORMATS = ("pairs", "unpaired", "prompts")
STYLES = ("standard", "conversational", "implicit")
_KEYS = {"pairs": {"prompt", "chosen", "rejected"}, "unpaired": {"prompt", "completion", "label"}}
_A = {"pairs": "a pairs", "unpaired": "an unpaired", "prompts": "a prompts"}
_NEED = {"pairs": ("chosen", "rejected"), "unpaired": ("prompt", "completion", "label"), "prompts": ("prompt",)}


@dataclass
class PrefExample:
    """One example: ``prompt`` ids and the ``completions`` ids (int32; pairs:
    (chosen, rejected); unpaired: (completion,); prompts: ()). Every completion
    token carries loss. ``kind`` is the format, ``style`` standard,
    conversational or implicit. ``label`` (unpaired) is True when desirable;
    ``raw_prompt`` is the prompt as written and ``fields`` the other keys
    (prompts)."""

    prompt: np.ndarray
    completions: tuple[np.ndarray, ...]
    source: str
    line: int
    kind: str
    style: str
    label: bool | None = None
    raw_prompt: Any = None
    fields: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prompt = np.asarray(self.prompt, np.int32)
        self.completions = tuple(np.asarray(c, np.int32) for c in self.completions)

    def sequence(self, side: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, loss) of prompt + completion ``side``; loss True on the completion."""
        c = self.completions[side]
        loss = np.concatenate([np.zeros(len(self.prompt), bool), np.ones(len(c), bool)])
        return np.concatenate([self.prompt, c]), loss


def _type(v: Any) -> str:
    return _JTYPE.get(type(v), "null")


def detect(obj: Any) -> str | None:
    """The preference format of a parsed line, or None (not one of them)."""
    if not isinstance(obj, dict):
        return None
    if "chosen" in obj and "rejected" in obj:
        return "pairs"
    if "label" in obj:
        return "unpaired"
    if "prompt" in obj and not {"completion", "text", "messages", "chosen", "rejected"} & set(obj):
        return "prompts"
    return None


class _PrefEncoder:
    """One line -> a ``PrefExample`` of the given format."""

    def __init__(self, enc: _Encoder):
        self.enc = enc

    @staticmethod
    def parse(raw: bytes) -> dict:
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise _Bad("not valid UTF-8") from None
        except ValueError as e:
            raise _Bad(f"not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise _Bad(f"expected a JSON object, got {_type(obj)}")
        return obj

    def example(self, obj: dict, fmt: str, source: str, line: int) -> PrefExample:
        keys = set(obj)
        found = detect(obj)
        if found is not None and found != fmt:
            raise _Bad(f"{_A[found]} example (keys {', '.join(sorted(keys))}) in {_A[fmt]} file; one format per file")
        for k in _NEED[fmt]:
            if k not in obj:
                raise _Bad(f'"{k}" is missing ({_A[fmt]} example has {", ".join(_NEED[fmt])})')
        if fmt in _KEYS and keys - _KEYS[fmt]:
            raise _Bad(f"unknown key(s) {', '.join(sorted(keys - _KEYS[fmt]))} in {_A[fmt]} example")
        kw: dict[str, Any] = {"source": source, "line": line, "kind": fmt}
        if fmt == "prompts":
            prompt = obj["prompt"]
            if isinstance(prompt, list):
                ids, style = (
                    self.prompt_ids(self.enc.messages(prompt, "prompt", need_assistant=False)),
                    "conversational",
                )
            else:
                ids, style = self.enc.ids(_str(prompt, '"prompt"')), "standard"
            if not len(ids):
                raise _Bad("empty prompt (it gives no token to generate after)")
            fields = {k: v for k, v in obj.items() if k != "prompt"}
            return PrefExample(ids, (), style=style, raw_prompt=prompt, fields=fields, **kw)
        if fmt == "unpaired":
            label = obj["label"]
            if not isinstance(label, bool):
                raise _Bad(f'"label" is {_type(label)}, not a boolean (true: desirable, false: undesirable)')
            prompt, comps, style = self.sides(obj["prompt"], {"completion": obj["completion"]})
            return PrefExample(prompt, comps, style=style, label=label, raw_prompt=obj["prompt"], **kw)
        if "prompt" in obj:
            sides = {"chosen": obj["chosen"], "rejected": obj["rejected"]}
            prompt, comps, style = self.sides(obj["prompt"], sides)
            raw = obj["prompt"]
        else:
            raw, sides = self.implicit(obj["chosen"], obj["rejected"])
            prompt, comps, _ = self.sides(raw, sides)
            style = "implicit"
        if np.array_equal(comps[0], comps[1]):
            raise _Bad("chosen and rejected are identical (the same tokens): the pair prefers nothing")
        return PrefExample(prompt, comps, style=style, raw_prompt=raw, **kw)

    def implicit(self, chosen: Any, rejected: Any) -> tuple[list, dict[str, Any]]:
        """TRL's implicit prompt: the longest common run of leading messages."""
        for name, v in (("chosen", chosen), ("rejected", rejected)):
            if not isinstance(v, list):
                raise _Bad(
                    f'"{name}" is {_type(v)}; without "prompt", "chosen" and "rejected" are whole conversations '
                    "(arrays of messages) that share their first messages"
                )
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        if n == 0:
            raise _Bad('"chosen" and "rejected" share no first message, so there is no implicit prompt')
        return chosen[:n], {"chosen": chosen[n:], "rejected": rejected[n:]}

    def sides(self, prompt: Any, comps: dict[str, Any]) -> tuple[np.ndarray, tuple[np.ndarray, ...], str]:
        """Prompt ids, completion ids per side, and the style."""
        conv = [k for k, v in (("prompt", prompt), *comps.items()) if isinstance(v, list)]
        if conv and len(conv) != 1 + len(comps):
            plain = [k for k in ("prompt", *comps) if k not in conv]
            raise _Bad(
                f"{', '.join(conv)} {'is' if len(conv) == 1 else 'are'} messages but {', '.join(plain)} "
                f"{'is' if len(plain) == 1 else 'are'} not: a line is either all strings or all message arrays"
            )
        if not conv:
            p = self.enc.ids(_str(prompt, '"prompt"'))
            out = []
            for name, c in comps.items():
                if not _str(c, f'"{name}"').strip():
                    raise _Bad(f'empty {name} (a blank "{name}" gives nothing to learn)')
                out.append(np.append(self.enc.ids(c, bos=False), np.int32(self.enc.eos())))
            return p, tuple(out), "standard"
        pmsgs = self.enc.messages(prompt, "prompt", need_assistant=False)
        p = self.prompt_ids(pmsgs)
        out = []
        for name, c in comps.items():
            cm = self.enc.messages(c, name, need_assistant=False)
            if cm[0]["role"] != "assistant":
                raise _Bad(f"{name}[0]: the completion starts with a {cm[0]['role']!r} turn, not an assistant turn")
            out.append(self.completion(pmsgs, p, cm, name))
        return p, tuple(out), "conversational"

    def prompt_ids(self, msgs: list[dict]) -> np.ndarray:
        text, plain = self.enc.render(msgs, True)
        return self.enc.ids(text, plain=plain)

    def completion(self, prompt: list[dict], p: np.ndarray, comp: list[dict], name: str) -> np.ndarray:
        full, plain = self.enc.render(prompt + comp, False)
        head, _ = self.enc.render(prompt, True)
        ids = self.enc.ids(full, plain=plain)
        if not full.startswith(head) or not np.array_equal(ids[: len(p)], p):
            how = "text" if not full.startswith(head) else "token ids"
            raise _Bad(
                f"{name}: the chat template's rendering of the prompt does not start the rendering of prompt + "
                f"{name} ({how} differ), so the completion cannot be located"
            )
        tail = ids[len(p) :]
        ends = np.flatnonzero(np.isin(tail, np.fromiter(self.enc.tok.eog_ids, np.int64)))
        tail = tail[: int(ends[-1]) + 1] if len(ends) else tail
        if not len(tail):
            raise _Bad(f"{name}: the chat template renders the completion as nothing")
        return tail


def _read(
    path: Path, penc: _PrefEncoder, fmt: str | None, *, keep_going: bool = False
) -> Iterator[tuple[int, PrefExample | str, str | None]]:
    """(1-based line, its example or the reason it has none, the format) per non-blank line
    (``toy.train.instruct.records``); the format is ``fmt`` or, when None, the one detected from the
    first line that parses."""
    for n, raw in records(path, keep_going=keep_going):
        if isinstance(raw, str):
            yield n, raw, fmt
            continue
        try:
            obj = penc.parse(raw)
            if fmt is None:
                fmt = detect(obj)
                if fmt is None:
                    keys = ", ".join(sorted(obj)) or "none"
                    raise _Bad(
                        f"cannot tell the preference format from the keys ({keys}): expected "
                        '"chosen" and "rejected" (pairs), "label" (unpaired) or "prompt" alone (prompts)'
                    )
            yield n, penc.example(obj, fmt, str(path), n), fmt
        except _Bad as e:
            yield n, str(e), fmt


def _check_format(fmt: str | None) -> None:
    if fmt is not None and fmt not in FORMATS:
        raise DataError(f"unknown preference data format {fmt!r} (expected one of {', '.join(FORMATS)})")


def _too_long_prompt(ex: PrefExample, max_length: int) -> str:
    return f"the prompt has {len(ex.prompt)} tokens, which leaves no completion token within max_length {max_length}"


@dataclass
class PrefStats:
    """``load_pref``'s counts: ``styles`` and ``lengths`` (of every sequence,
    prompt + completion, before truncation) cover every valid example;
    ``n_examples``, ``n_tokens`` (every sequence's tokens) and ``n_loss``
    (completion tokens) what was kept."""

    format: str = ""
    styles: dict[str, int] = field(default_factory=dict)
    n_examples: int = 0
    n_tokens: int = 0
    n_loss: int = 0
    lengths: dict[str, float] = field(default_factory=dict)
    truncated: int = 0  # examples with a completion cut (either side of a pair)
    dropped: int = 0  # over-length, overflow="drop"
    n_desirable: int = 0  # unpaired
    n_undesirable: int = 0


def _seq_lengths(ex: PrefExample) -> list[int]:
    return [len(ex.prompt) + len(c) for c in ex.completions] or [len(ex.prompt)]


def _count(stats: Any, kept: list[PrefExample], styles: Counter, lengths: list[int]) -> None:
    stats.styles = {s: styles[s] for s in STYLES if styles[s]}
    stats.n_examples, stats.lengths = len(kept), length_stats(lengths)
    stats.n_tokens = sum(sum(_seq_lengths(e)) for e in kept)
    stats.n_loss = sum(len(c) for e in kept for c in e.completions)
    stats.n_desirable = sum(e.label is True for e in kept)
    stats.n_undesirable = sum(e.label is False for e in kept)


def load_pref(
    paths: Paths,
    tokenizer: Any,
    template: Any,
    *,
    format: str | None = None,
    max_length: int,
    overflow: str = "truncate",
    special_in_content: bool = False,
) -> tuple[list[PrefExample], PrefStats]:
    """Every example of the JSONL files (a folder: its ``*.jsonl``, sorted) in
    order; the first bad line raises ``DataError`` (``path:line: reason``).
    ``format`` None: detected from the first line (module docstring)."""
    _check_format(format)
    if overflow not in ("truncate", "drop"):
        raise DataError(f'overflow must be "truncate" or "drop" (got {overflow!r})')
    if max_length < 2:
        raise DataError(f"max_length must be at least 2 (got {max_length})")
    penc = _PrefEncoder(_Encoder(tokenizer, template, special_in_content))
    stats, out, styles, lengths = PrefStats(), [], Counter[str](), []
    given = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    files = [f for p in given for f in (sorted(p.rglob("*.jsonl")) if p.is_dir() else [p])]
    fmt = format
    for path in files:
        for line, ex, found in _read(path, penc, fmt):
            fmt = found
            if isinstance(ex, str):
                raise DataError(f"{path}:{line}: {ex}")
            styles[ex.style] += 1
            lengths.extend(_seq_lengths(ex))
            over = max(_seq_lengths(ex)) > max_length if ex.completions else False
            if ex.completions and over and overflow == "drop":
                stats.dropped += 1
                continue
            if len(ex.prompt) >= max_length:
                hint = "raise the context (max_length), shorten the prompt, or drop over-length examples"
                raise DataError(f"{path}:{line}: {_too_long_prompt(ex, max_length)}", hint=hint)
            if over:
                room = max_length - len(ex.prompt)
                ex.completions = tuple(c[:room].copy() for c in ex.completions)
                stats.truncated += 1
            out.append(ex)
    if not out:
        names = ", ".join(str(p) for p in files[:3]) + (" ..." if len(files) > 3 else "")
        why = " (every example was over-length and dropped)" if stats.dropped else ""
        raise DataError(f"no preference example in {names or 'the given paths'}{why}")
    stats.format = fmt or ""
    _count(stats, out, styles, lengths)
    return out, stats


# -- batches ---------------------------------------------------------------------


@dataclass
class PrefBatch(Batch):
    """A ``Batch`` of one sequence per row (module docstring) with the
    objectives' extras, each None until set: ``ref_logps`` (B,) reference
    sequence log-probs (GRPO: (B, T) per token), ``desirable`` (B,) 1/0 (KTO),
    ``kl`` the KTO KL estimate, ``advantages`` (B,) and ``old_logps`` (B, T)
    (GRPO), ``completion_mask`` (B, T) the completion targets when ``loss_mask``
    marks more (ORPO's NLL term runs over the whole chosen sequence)."""

    ref_logps: np.ndarray | None = None
    desirable: np.ndarray | None = None
    kl: float | None = None
    advantages: np.ndarray | None = None
    old_logps: np.ndarray | None = None
    completion_mask: np.ndarray | None = None


def sequence_batch(seqs: Sequence[tuple[np.ndarray, np.ndarray]], context: int) -> PrefBatch:
    """Rows from (tokens, loss) sequences of at most ``context + 1`` tokens."""
    b, t = len(seqs), int(context)
    tokens, targets, doc = (np.zeros((b, t), np.int32) for _ in range(3))
    mask = np.zeros((b, t), np.float32)
    pos = np.ascontiguousarray(np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)))
    for r, (seq, loss) in enumerate(seqs):
        m = len(seq) - 1
        if not 1 <= m <= t:
            raise DataError(f"a sequence of {len(seq)} tokens does not fit a row of {t} positions")
        tokens[r, :m], targets[r, :m], mask[r, :m] = seq[:-1], seq[1:], loss[1:]
        doc[r, m:] = 1
    return PrefBatch(tokens, targets, mask, pos, doc)


class _PrefData:
    """Shared by the three: examples, the split, row checks. ``rows_per_item``:
    batch rows per row index (2 for pairs)."""

    block_causal = False
    kind = ""
    rows_per_item = 1

    def __init__(self, examples: list[PrefExample], context: int, *, val_fraction: float = 0.05, seed: int = 0):
        if context < 1:
            raise DataError(f"context must be at least 1 (got {context})")
        if not 0 <= val_fraction < 1:
            raise DataError(f"val_fraction must be in [0, 1) (got {val_fraction})")
        self.context, self.seed, self.examples = int(context), int(seed), list(examples)
        for ex in self.examples:
            if ex.kind != self.kind:
                raise DataError(f"{ex.source}:{ex.line}: {_A[ex.kind]} example, not {_A[self.kind]} one")
            for n in _seq_lengths(ex):
                if n > self.context + (1 if ex.completions else 0) or (ex.completions and n < 2):
                    raise DataError(
                        f"{ex.source}:{ex.line}: a sequence of {n} tokens does not fit a row of {self.context} "
                        f"positions (at most context + 1 = {self.context + 1} tokens, at least 2)",
                        hint=f"load the examples with max_length <= {self.context + 1}",
                    )
        self.n_windows = len(self.examples)
        self.n_val = max(1, round(val_fraction * self.n_windows)) if val_fraction > 0 else 0
        if self.n_windows - self.n_val < 1:
            raise DataError(
                f"{self.n_windows} example(s): too few for {self.n_val} validation example(s) and at least one "
                "for training",
                hint="add examples or lower val_fraction",
            )

    @property
    def n_train(self) -> int:
        return self.n_windows - self.n_val

    def _rows(self, rows: Iterable[int]) -> list[int]:
        idx = [int(i) for i in rows]
        if any(not 0 <= i < self.n_windows for i in idx):
            raise IndexError(f"row index out of range [0, {self.n_windows})")
        return idx

    def check_batch(self, batch_size: int) -> None:
        if batch_size < 1:
            raise DataError(f"batch size must be at least 1 (got {batch_size})")
        if self.n_train < batch_size:
            what = "pair(s)" if self.kind == "pairs" else "example(s)"
            raise DataError(
                f"the training split has {self.n_train} {what}; a batch needs {batch_size}",
                hint="add examples, or lower the batch size or val_fraction",
            )

    def validation_rows(self, batch_size: int) -> list[list[int]]:
        """The validation examples in order, ``batch_size`` a batch; the last
        batch is filled up with validation rows from the start (so every batch
        has the engine's shape), which are then counted twice."""
        if batch_size < 1:
            raise DataError(f"batch size must be at least 1 (got {batch_size})")
        val = list(range(self.n_train, self.n_windows))
        out = [val[i : i + batch_size] for i in range(0, len(val), batch_size)]
        if out and len(out[-1]) < batch_size:
            out[-1] += [val[i % len(val)] for i in range(batch_size - len(out[-1]))]
        return out


class PairData(_PrefData):
    """Pairs (DPO, ORPO): a row index is one pair; a batch of P pairs has 2P
    rows, chosen first (module docstring)."""

    kind = "pairs"
    rows_per_item = 2

    def batch(self, rows: Iterable[int]) -> PrefBatch:
        exs = [self.examples[i] for i in self._rows(rows)]
        return sequence_batch([e.sequence(0) for e in exs] + [e.sequence(1) for e in exs], self.context)


class UnpairedData(_PrefData):
    """Unpaired examples (KTO): one row each, ``desirable`` from the labels.

    ``kl_group`` fixes each row's KL partner as TRL does in its dataset
    preparation: the rows of each split (training, then validation), in file
    order, are cut into groups of ``kl_group`` (TRL's
    ``per_device_train_batch_size``; the last group may be shorter) and row
    ``i`` of a group takes the completion of row ``i - 1`` (the first row: of
    the group's last). The partner is then a property of the row (its
    reference KL log-prob can be cached) and ``kl_batch`` works on shuffled
    rows. ``kl_group=None``: the rotation is applied to the rows of each
    ``kl_batch`` call as given instead."""

    kind = "unpaired"

    def __init__(
        self,
        examples: list[PrefExample],
        context: int,
        *,
        val_fraction: float = 0.05,
        seed: int = 0,
        kl_group: int | None = None,
    ):
        super().__init__(examples, context, val_fraction=val_fraction, seed=seed)
        if kl_group is not None and kl_group < 1:
            raise DataError(f"kl_group must be at least 1 (got {kl_group})")
        self.kl_group = kl_group

    def batch(self, rows: Iterable[int]) -> PrefBatch:
        exs = [self.examples[i] for i in self._rows(rows)]
        out = sequence_batch([e.sequence(0) for e in exs], self.context)
        out.desirable = np.asarray([1.0 if e.label else 0.0 for e in exs], np.float32)
        return out

    def kl_partner(self, row: int) -> int:
        """The row whose completion follows ``row``'s prompt in the KL batch (needs ``kl_group``)."""
        if self.kl_group is None:
            raise DataError("the KL partner of a row is fixed only with kl_group (the micro-batch size)")
        (i,) = self._rows([row])
        start, end = (0, self.n_train) if i < self.n_train else (self.n_train, self.n_windows)
        g0 = start + (i - start) // self.kl_group * self.kl_group
        g1 = min(g0 + self.kl_group, end)
        return g1 - 1 if i == g0 else i - 1

    def kl_batch(self, rows: Iterable[int]) -> PrefBatch:
        """The KL rows of ``rows``: row r = prompt of ``rows[r]`` + the completion
        of its KL partner (``kl_partner``; without ``kl_group``: of ``rows[r - 1]``,
        row 0 of the last), cut to ``context + 1`` tokens. Loss on that completion."""
        idx = self._rows(rows)
        if self.kl_group is None:
            partners = [idx[r - 1] for r in range(len(idx))]
        else:
            partners = [self.kl_partner(i) for i in idx]
        seqs = []
        for i, j in zip(idx, partners):
            p = self.examples[i].prompt
            c = self.examples[j].completions[0][: self.context + 1 - len(p)]
            seqs.append((np.concatenate([p, c]), np.concatenate([np.zeros(len(p), bool), np.ones(len(c), bool)])))
        return sequence_batch(seqs, self.context)


class PromptData(_PrefData):
    """Prompts (GRPO): ``prompts(rows)`` gives the examples to roll out;
    ``batch`` (what ``BatchStream`` calls) gives prompt rows: ``tokens[r, :n]``
    the prompt's n ids, no target, ``doc`` 1 after it. Rollouts build their own
    rows with ``sequence_batch``."""

    kind = "prompts"

    def batch(self, rows: Iterable[int]) -> PrefBatch:
        idx = self._rows(rows)
        b, t = len(idx), self.context
        out = PrefBatch(
            np.zeros((b, t), np.int32),
            np.zeros((b, t), np.int32),
            np.zeros((b, t), np.float32),
            np.ascontiguousarray(np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))),
            np.ones((b, t), np.int32),
        )
        for r, i in enumerate(idx):
            p = self.examples[i].prompt
            out.tokens[r, : len(p)], out.doc[r, : len(p)] = p, 0
        return out

    def prompts(self, rows: Iterable[int]) -> list[PrefExample]:
        return [self.examples[i] for i in self._rows(rows)]


DATA_CLASSES: dict[str, type[_PrefData]] = {"pairs": PairData, "unpaired": UnpairedData, "prompts": PromptData}


# -- checking a file -----------------------------------------------------------------


@dataclass
class PrefCheckReport:
    """``check_pref_file``'s findings over every valid example. A sample is a
    dict: line, style, and ``sides``, one per sequence (pairs: chosen and
    rejected; unpaired: completion, with ``label``; prompts: the prompt),
    each with n_tokens, n_loss, segments and shown_tokens as ``toy.train.
    instruct.CheckReport``'s. A problem's line is 1-based; 0: the whole file."""

    path: str = ""
    format: str = ""
    styles: dict[str, int] = field(default_factory=dict)
    n_examples: int = 0
    n_tokens: int = 0
    n_loss: int = 0
    lengths: dict[str, float] = field(default_factory=dict)
    n_desirable: int = 0
    n_undesirable: int = 0
    max_length: int = 0
    over_length: int = 0  # examples with a sequence longer than max_length (truncated in training)
    fields: list[str] = field(default_factory=list)  # prompts: the other keys seen
    samples: list[dict[str, Any]] = field(default_factory=list)
    problems: list[tuple[int, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for s in d["samples"]:
            for side in s["sides"]:
                side["segments"] = [{"text": t, "loss": c} for t, c in side["segments"]]
        d["problems"] = [{"line": n, "reason": r} for n, r in self.problems]
        return d


def _side(tokenizer: Any, name: str, tokens: np.ndarray, loss: np.ndarray) -> dict[str, Any]:
    k = min(len(tokens), SHOW_TOKENS)
    segs = segments(tokenizer, tokens[:k], loss[:k]) if k else []
    return {"name": name, "n_tokens": len(tokens), "n_loss": int(loss.sum()), "segments": segs, "shown_tokens": k}


def check_pref_file(
    path: str | os.PathLike,
    tokenizer: Any,
    template: Any,
    *,
    format: str | None = None,
    max_length: int,
    show: int = 3,
    special_in_content: bool = False,
) -> PrefCheckReport:
    """Read every line of ``path``, collecting problems instead of stopping
    (``load_pref``'s checks; a prompt that fills ``max_length`` is a problem)."""
    _check_format(format)
    penc = _PrefEncoder(_Encoder(tokenizer, template, special_in_content))
    report = PrefCheckReport(path=str(path), max_length=int(max_length), format=format or "")
    styles, kept, lengths, fields = Counter[str](), [], [], dict[str, None]()
    for line, ex, fmt in _read(Path(path), penc, format, keep_going=True):
        report.format = fmt or report.format
        if isinstance(ex, str):
            report.problems.append((line, ex))
            continue
        if len(ex.prompt) >= max_length:
            report.problems.append((line, _too_long_prompt(ex, max_length)))
            continue
        kept.append(ex)
        styles[ex.style] += 1
        lengths.extend(_seq_lengths(ex))
        fields.update(dict.fromkeys(ex.fields))
        report.over_length += max(_seq_lengths(ex)) > max_length
        if len(report.samples) < show:
            if ex.kind == "prompts":
                sides = [_side(tokenizer, "prompt", ex.prompt, np.zeros(len(ex.prompt), bool))]
            else:
                names = ("chosen", "rejected") if ex.kind == "pairs" else ("completion",)
                sides = [_side(tokenizer, n, *ex.sequence(i)) for i, n in enumerate(names)]
            sample: dict[str, Any] = {"line": line, "style": ex.style, "sides": sides}
            if ex.label is not None:
                sample["label"] = ex.label
            report.samples.append(sample)
    if not kept and not report.problems:
        report.problems.append((0, "the file holds no example (it is empty or has only blank lines)"))
    report.fields = list(fields)
    _count(report, kept, styles, lengths)
    return report


def detect_file(path: str | os.PathLike) -> str | None:
    """The preference format of the first line of ``path`` that parses as a
    JSON object, or None (an instruction-tuning file, or nothing to tell)."""
    for _, raw in records(Path(path), keep_going=True):
        if isinstance(raw, str):  # a line over the record bound: look further
            continue
        try:
            return detect(_PrefEncoder.parse(raw))
        except _Bad:
            continue
    return None
