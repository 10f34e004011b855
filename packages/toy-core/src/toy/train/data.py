"""Training data: the token cache, packing into windows, batches.

Pipeline: ``toy.corpus`` reads a corpus (files, folders, JSONL) in chunks;
``TokenCache.build`` tokenizes it once into a flat uint32 file on disk
(memory-mapped afterwards); ``PackedData`` cuts that stream into windows of
``context + 1`` tokens and splits off the last windows for validation;
``BatchStream`` hands out training batches in a seeded, resumable order;
``validation_batches`` gives the fixed validation set.

Decisions:

- Documents are ``toy.corpus``'s (a plain-text file, a JSONL line's ``"text"``).
- Every document is followed by ``eos_id`` in the token stream. Control tokens
  written in the text are parsed (``special=True``) unless the caller says not.
- Large files are tokenized in ``toy.corpus.iter_chunks``'s ~1 MB chunks,
  whose cuts leave the ids equal to those of the whole file.
  SentencePiece-style ("llama") tokenizers add a space prefix to every text,
  so their files are tokenized whole.
- The cache key hashes the file kinds, sizes and bytes (not their names: a
  moved corpus still hits), the tokenizer's serialized form, ``eos_id``, the
  ``special`` flag and the format version.

Invariants: cache files are ``<key>.tokens`` (little-endian uint32),
``<key>.docs.npy`` (int64 document starts) and ``<key>.json``, written last;
each is written aside, fsynced and renamed into place, and a cache counts as
complete only when the JSON exists and the sizes agree with it, so a crash
never leaves a broken cache that looks complete. Batches are int32 ``(B, T)``
(``loss_mask`` float32); every query position may attend at least to itself,
so no attention row is all ``-inf``. Bad input raises ``DataError`` naming the
file (and the 1-based JSONL line).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from toy.corpus import CHUNK_BYTES, Paths, corpus_files, is_jsonl, iter_chunks, read_error
from toy.errors import DataError

FORMAT_VERSION = 1
_BATCH_CHARS = 4 << 20  # text handed to one encode_batch call
_TOKEN_DTYPE = np.dtype("<u4")


# -- the token cache ----------------------------------------------------------


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's serialized HF form (vocabulary, merges, pre-tokenizer)."""
    return hashlib.sha256(tokenizer.hf.to_str().encode("utf-8")).hexdigest()


def _cache_key(files: list[Path], tokenizer: Any, eos_id: int, special: bool) -> str:
    h = hashlib.sha256(f"toy-token-cache/{FORMAT_VERSION}\0{eos_id}\0{int(special)}\0".encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    for path in files:
        try:
            with open(path, "rb") as f:
                h.update(f"\0{'jsonl' if is_jsonl(path) else 'text'}:{os.fstat(f.fileno()).st_size}\0".encode())
                while block := f.read(CHUNK_BYTES):
                    h.update(block)
        except OSError as e:
            raise read_error(path, e) from None
    return h.hexdigest()


def _stat(files: list[Path]) -> list[tuple[int, int]]:
    out = []
    for f in files:
        try:
            st = f.stat()
        except OSError as e:
            raise read_error(f, e) from None
        out.append((st.st_size, st.st_mtime_ns))
    return out


class _Temp:
    """A file written aside next to ``dest`` and renamed onto it by ``commit``
    (after an fsync); ``discard`` removes it unless committed."""

    def __init__(self, dest: Path, registry: list[_Temp]):
        self.dest, self.committed = dest, False
        fd, self.name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        self.file = os.fdopen(fd, "wb")
        registry.append(self)

    def commit(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.name, self.dest)
        self.committed = True

    def discard(self) -> None:
        self.file.close()
        if not self.committed:
            try:
                os.unlink(self.name)
            except OSError:
                pass


class TokenCache:
    """The tokenized corpus: ``tokens`` (uint32, read-only memmap when built
    on disk), ``doc_starts`` (int64 offset of each document's first token)."""

    def __init__(self, tokens: np.ndarray, doc_starts: np.ndarray, *, eos_id: int, key: str, path: Path | None):
        self.tokens = tokens
        self.doc_starts = doc_starts
        self.eos_id = int(eos_id)
        self.key = key
        self.path = path

    @classmethod
    def from_array(cls, tokens: Iterable[int], eos_id: int) -> TokenCache:
        """An in-memory cache over a token array (documents end at each ``eos_id``)."""
        arr = np.asarray(tokens, dtype=np.int64)
        if arr.ndim != 1 or (arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF)):
            raise DataError("tokens must be a 1-D array of uint32 ids")
        arr = arr.astype(np.uint32)
        ends = np.flatnonzero(arr == eos_id) + 1
        starts = np.concatenate([[0], ends[ends < arr.size]]).astype(np.int64) if arr.size else np.zeros(0, np.int64)
        key = hashlib.sha256(arr.tobytes() + f"\0{eos_id}".encode()).hexdigest()
        return cls(arr, starts, eos_id=eos_id, key=key, path=None)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_docs(self) -> int:
        return int(self.doc_starts.shape[0])

    @staticmethod
    def _files(cache_dir: Path, key: str) -> tuple[Path, Path, Path]:
        return cache_dir / f"{key}.tokens", cache_dir / f"{key}.docs.npy", cache_dir / f"{key}.json"

    @classmethod
    def open(cls, cache_dir: str | os.PathLike, key: str) -> TokenCache | None:
        """The complete cache ``key`` in ``cache_dir``, or None."""
        tok_path, docs_path, meta_path = cls._files(Path(cache_dir), key)
        try:
            meta = json.loads(meta_path.read_text("utf-8"))
            n, n_docs = int(meta["n_tokens"]), int(meta["n_docs"])
            if meta.get("format") != FORMAT_VERSION or n < 1 or tok_path.stat().st_size != n * 4:
                return None
            starts = np.load(docs_path)
            if starts.shape != (n_docs,) or starts.dtype != np.int64:
                return None
            eos_id = int(meta["eos_id"])
            tokens = np.memmap(tok_path, dtype=_TOKEN_DTYPE, mode="r", shape=(n,))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return cls(tokens, starts, eos_id=eos_id, key=key, path=tok_path)

    @classmethod
    def build(
        cls,
        paths: Paths,
        tokenizer: Any,
        *,
        eos_id: int,
        cache_dir: str | os.PathLike,
        special: bool = True,
        progress: Callable[[int, int], None] | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> TokenCache:
        """Tokenize ``paths`` into ``cache_dir`` (reused when the key matches)."""
        if not 0 <= eos_id < tokenizer.vocab_size:
            raise DataError(f"eos_id {eos_id} is outside the vocabulary [0, {tokenizer.vocab_size})")
        files = corpus_files(paths)
        before = _stat(files)
        key = _cache_key(files, tokenizer, eos_id, special)
        cache_dir = Path(cache_dir)
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataError(f"{cache_dir}: cannot create the cache folder: {e.strerror or e}") from None
        found = cls.open(cache_dir, key)
        if found is not None:
            return found

        tok_path, docs_path, meta_path = cls._files(cache_dir, key)
        total = sum(size for size, _ in before)
        temps: list[_Temp] = []
        n_tokens = done = chars = 0
        doc_starts: list[int] = []
        at_start = True
        batch: list[tuple[str, bool]] = []

        def flush(out: _Temp) -> None:
            nonlocal n_tokens, at_start
            encoded = tokenizer.encode_batch([t for t, _ in batch], add_special=False, special=special)
            for ids, (_, ends) in zip(encoded, batch):
                if at_start:
                    doc_starts.append(n_tokens)
                if ends:
                    ids.append(eos_id)
                out.file.write(np.asarray(ids, dtype=_TOKEN_DTYPE).tobytes())
                n_tokens += len(ids)
                at_start = ends
            batch.clear()

        try:
            out = _Temp(tok_path, temps)
            chunking = chunk_bytes if getattr(tokenizer, "model", "gpt2") == "gpt2" else None
            for _, text, ends, nbytes in iter_chunks(files, chunking):
                batch.append((text, ends))
                chars += len(text)
                done += nbytes
                if chars >= _BATCH_CHARS or len(batch) >= 4096:
                    flush(out)
                    chars = 0
                    if progress:
                        progress(done, total)
            if batch:
                flush(out)
            if n_tokens == 0:
                names = ", ".join(str(p) for p in files[:3]) + (" ..." if len(files) > 3 else "")
                raise DataError(f"the corpus ({names}) is empty: it holds no text to train on")
            if _stat(files) != before:
                raise DataError("the corpus changed while it was being tokenized", hint="run again")
            out.commit()
            docs = _Temp(docs_path, temps)
            np.save(docs.file, np.asarray(doc_starts, dtype=np.int64))
            docs.commit()
            meta = _Temp(meta_path, temps)  # last: its presence marks the cache complete
            info = {"format": FORMAT_VERSION, "n_tokens": n_tokens, "n_docs": len(doc_starts), "eos_id": eos_id}
            meta.file.write(json.dumps(info).encode())
            meta.commit()
        except OSError as e:
            raise DataError(f"{cache_dir}: cannot write the token cache: {e.strerror or e}") from None
        finally:
            for t in temps:
                t.discard()
        if progress:
            progress(total, total)
        cache = cls.open(cache_dir, key)
        if cache is None:  # only if another process removed the files just now
            raise DataError(f"{cache_dir}: the token cache {key} vanished after it was written")
        return cache


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats/token) of the empirical unigram distribution of ``tokens``:
    the loss of the best model that ignores context."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    step = 1 << 24  # bincount copies to intp: count in slices to bound memory
    for i in range(0, len(tokens), step):
        part = np.asarray(tokens[i : i + step])
        if part.size and int(part.max()) >= vocab_size:
            raise DataError(f"token id {int(part.max())} is outside the vocabulary [0, {vocab_size})")
        counts += np.bincount(part, minlength=vocab_size)
    n = counts.sum()
    if n == 0:
        raise DataError("no tokens to measure")
    p = counts[counts > 0] / n
    return float(-(p * np.log(p)).sum())


# -- packing and batches --------------------------------------------------------


@dataclass
class Batch:
    """One batch of ``B`` rows of ``T`` positions (see the module docstring)."""

    tokens: np.ndarray  # int32 (B, T) inputs
    targets: np.ndarray  # int32 (B, T) next tokens
    loss_mask: np.ndarray  # float32 (B, T) 1 where the target counts
    pos: np.ndarray  # int32 (B, T) RoPE positions
    doc: np.ndarray  # int32 (B, T) segment id within the row

    @property
    def n_targets(self) -> int:
        return int(self.loss_mask.sum())


class PackedData:
    """Windows of ``context + 1`` tokens with stride ``context``; training
    windows first, the last ``n_val`` windows for validation."""

    def __init__(self, cache: TokenCache, context: int, *, val_fraction: float = 0.05, block_causal: bool = True):
        if context < 1:
            raise DataError(f"context must be at least 1 (got {context})")
        if not 0 <= val_fraction < 1:
            raise DataError(f"val_fraction must be in [0, 1) (got {val_fraction})")
        self.cache, self.context, self.block_causal = cache, int(context), block_causal
        self.n_windows = max(0, (cache.n_tokens - 1) // self.context)
        self.n_val = max(1, round(val_fraction * self.n_windows)) if val_fraction > 0 else 0
        if self.n_windows - self.n_val < 1:
            raise DataError(
                f"the corpus has {cache.n_tokens} tokens: {self.n_windows} window(s) of {self.context} tokens, "
                f"too few for {self.n_val} validation window(s) and at least one for training",
                hint="add text, lower the context or lower val_fraction",
            )

    @property
    def n_train(self) -> int:
        return self.n_windows - self.n_val

    def batch(self, windows: Iterable[int]) -> Batch:
        """The rows of the given window indices (0 <= i < n_windows)."""
        idx = np.asarray(list(windows), dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n_windows):
            raise IndexError(f"window index out of range [0, {self.n_windows})")
        t = self.context
        w = np.asarray(self.cache.tokens[idx[:, None] * t + np.arange(t + 1)], dtype=np.int64)  # (B, T+1)
        inputs, targets = w[:, :-1], w[:, 1:]
        b = len(idx)
        if self.block_causal:
            eos = inputs == self.cache.eos_id
            # doc: eos tokens strictly before t; pos: t minus the start of its segment
            doc = np.cumsum(eos, axis=1) - eos
            marks = np.where(eos, np.arange(1, t + 1), 0)
            seg_start = np.maximum.accumulate(np.concatenate([np.zeros((b, 1), np.int64), marks[:, :-1]], 1), axis=1)
            pos = np.arange(t) - seg_start
            mask = (~eos).astype(np.float32)
        else:
            doc = np.zeros((b, t), np.int64)
            pos = np.broadcast_to(np.arange(t), (b, t))
            mask = np.ones((b, t), np.float32)
        i32 = np.int32
        return Batch(inputs.astype(i32), targets.astype(i32), mask, pos.astype(i32), doc.astype(i32))

    def window(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, targets, loss_mask, pos, doc) of window ``i``, each (T,)."""
        b = self.batch([i])
        return b.tokens[0], b.targets[0], b.loss_mask[0], b.pos[0], b.doc[0]

    def check_batch(self, batch_size: int) -> None:
        if batch_size < 1:
            raise DataError(f"batch size must be at least 1 (got {batch_size})")
        if self.n_train < batch_size:
            need = batch_size * self.context + 1
            raise DataError(
                f"the training split has {self.n_train} window(s) ({self.n_train * self.context + 1} tokens); "
                f"a batch of {batch_size} x {self.context} needs {need} tokens",
                hint="add text, or lower the batch size, the context or val_fraction",
            )


class BatchStream:
    """Training batches in a seeded order: epoch ``e`` visits the training
    windows in ``default_rng([seed, e]).permutation(n_train)``; a batch takes
    the next ``B`` entries, running on into the next epoch."""

    def __init__(self, data: PackedData, batch_size: int, seed: int, state: dict | None = None):
        data.check_batch(batch_size)
        self.data, self.batch_size, self.seed = data, int(batch_size), int(seed)
        self._epoch, self._index = 0, 0
        if state is not None:
            try:
                epoch, index = int(state["epoch"]), int(state["index"])
                n_train, seed_s = int(state.get("n_train", data.n_train)), int(state.get("seed", seed))
            except (KeyError, TypeError, ValueError):
                raise DataError(f"bad data stream state {state!r}") from None
            if n_train != data.n_train or seed_s != self.seed:
                raise DataError(
                    f"the data stream state is for {n_train} training windows and seed {seed_s}, "
                    f"not {data.n_train} and {self.seed}: the corpus or settings changed"
                )
            if epoch < 0 or not 0 <= index <= n_train:
                raise DataError(f"bad data stream state {state!r}")
            self._epoch, self._index = epoch, index
        self._order_epoch, self._order = -1, np.zeros(0, np.int64)

    def _order_for(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.data.n_train)
            self._order_epoch = epoch
        return self._order

    def next(self) -> Batch:
        picks: list[np.ndarray] = []
        need = self.batch_size
        while need:
            if self._index >= self.data.n_train:
                self._epoch, self._index = self._epoch + 1, 0
            take = self._order_for(self._epoch)[self._index : self._index + need]
            picks.append(take)
            self._index += len(take)
            need -= len(take)
        return self.data.batch(np.concatenate(picks))

    def state(self) -> dict:
        """A JSON-serializable cursor; pass it back as ``state=`` to resume."""
        return {"epoch": self._epoch, "index": self._index, "seed": self.seed, "n_train": self.data.n_train}

    @property
    def epoch(self) -> float:
        """Epochs completed so far, fractional."""
        return self._epoch + self._index / self.data.n_train


def validation_batches(data: PackedData, batch_size: int, max_batches: int | None = None) -> list[Batch]:
    """Every validation window in order, ``batch_size`` rows a batch; the last
    batch is padded with rows whose ``loss_mask`` is 0."""
    if batch_size < 1:
        raise DataError(f"batch size must be at least 1 (got {batch_size})")
    windows = list(range(data.n_train, data.n_windows))
    out: list[Batch] = []
    for start in range(0, len(windows), batch_size):
        if max_batches is not None and len(out) >= max_batches:
            break
        b = data.batch(windows[start : start + batch_size])
        pad = batch_size - b.tokens.shape[0]
        if pad:
            t = data.context
            z = np.zeros((pad, t), np.int32)
            ar = np.broadcast_to(np.arange(t, dtype=np.int32), (pad, t))
            b = Batch(
                np.concatenate([b.tokens, z]),
                np.concatenate([b.targets, z]),
                np.concatenate([b.loss_mask, np.zeros((pad, t), np.float32)]),
                np.concatenate([b.pos, ar]),
                np.concatenate([b.doc, z]),
            )
        out.append(b)
    return out
