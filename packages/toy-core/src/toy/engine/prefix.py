"""The prefix cache: K/V of processed tokens kept in fixed blocks, shared by every sequence.

A block is the K/V bytes (``KVCache.read``'s layout-independent order) of ``BLOCK`` (16) consecutive
positions. Its key is a chain hash: ``key[i] = sha256(key[i-1] || adapter identity || the block's ids as
little-endian int32)``, and ``key[-1]`` is the *fingerprint*: what K/V bits depend on besides the tokens
(the model file, the LoRA adapters applied to every sequence, the KV type and layout, exact batching, the
attention padding, the ggml CPU variant and the toy-ggml version). So a key names the whole context of its
block: equal keys mean equal tokens before and in the block, computed by the same model, adapter and
kernels.

Exactness: the engine runs with exact batching (``toy.engine.llm``), so a position's K/V depend only on its
context. Bytes of a cached block written into any slot are the bytes a prefill there would write; a
sequence continued from them gets, bit for bit, the logits of one prefilled from scratch.

Tiers:

- RAM: a byte budget, LRU. A hit touches its chain leaf to root and an insert adds it leaf to root, so
  eviction drops the leaf end of a chain first (a root without its leaves is still useful; leaves
  without their root are not).
- Disk (optional): a folder, its own byte bound. Blocks evicted from RAM are written there (and every
  RAM block on ``close``, so the cache survives a restart), one file per block, ``<key hex>.kvb`` in a
  subfolder named by the fingerprint's hex (another model file's folder is simply never looked at). A file
  is a header (magic, format version, fingerprint, key, token count, meta and payload lengths, the payload's
  sha256) then the ids, the meta (JSON) and the K/V bytes; written to a temporary name and renamed. The
  index is built by listing the folder at start-up; a file whose header or checksum does not match is
  deleted with a warning and never used. The folder is bounded by deleting the least recently used files
  (mtime, touched on each hit).

Slot files (``save_slot``/``load_slot``: the server's slot save and restore) use the same format with the
fingerprint's parts in the meta, so restoring a file of another model names what differs.

Not thread-safe: one ``PrefixCache`` belongs to the thread that owns the engine (the server's worker).
CPU only, as ``KVCache.read``/``write``. See docs/concepts/architecture.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import struct
from collections import OrderedDict
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

import toy_ggml
from toy.errors import BadInputError

log = logging.getLogger("toy.engine.prefix")

BLOCK = 16  # tokens per block
MAGIC = b"TOYKVBLK"
VERSION = 1
_HEAD = struct.Struct("<8sI32s32sIIQ32s")  # magic, version, fingerprint, key, n_tokens, meta len, payload len, sha
SUFFIX = ".kvb"


class SlotFileError(BadInputError):
    """A slot file that cannot be restored here: damaged, or saved by another model or KV setup."""


@dataclass(frozen=True)
class Fingerprint:
    """What K/V bits depend on besides the tokens: ``parts`` by name, ``digest`` their sha256."""

    parts: tuple[tuple[str, str], ...]

    @cached_property
    def digest(self) -> bytes:
        return hashlib.sha256(json.dumps(dict(self.parts), sort_keys=True).encode()).digest()

    @property
    def hex(self) -> str:
        return self.digest.hex()

    def mismatch(self, other: dict[str, str]) -> list[str]:
        """The parts that differ from ``other`` (a file's), as "name: here vs file"."""
        mine = dict(self.parts)
        return [f"{k}: {other.get(k)!r} in the file, {mine.get(k)!r} here" for k in sorted(set(mine) | set(other))
                if mine.get(k) != other.get(k)]  # fmt: skip


def file_identity(path, full: bool) -> str:
    """A file's identity: the sha256 of its bytes (``full``: streamed), else its path, size and mtime."""
    p = Path(path)
    if full:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        return "sha256:" + h.hexdigest()
    st = p.stat()
    return f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def fingerprint(model, full: bool = False) -> Fingerprint:
    """The fingerprint of a ``toy.Model``'s K/V. ``full``: identify the model file (and applied adapters)
    by the sha256 of their bytes, as blocks on disk and slot files need; else by path, size and mtime."""
    eng = model.engine
    lora = []
    for path, scale in getattr(model, "adapters", ()):
        # an in-memory adapter has no identity outside this process: a nonce keeps its K/V to itself
        ident = file_identity(path, full) if path else "memory:" + secrets.token_hex(8)
        lora.append(f"{ident}*{float(scale)!r}")
    parts = {
        "model": file_identity(model.path, full),
        "lora": ";".join(lora),
        "kv_type": eng.cache.kv_type.name,
        "layout": "flash_attn" if eng.flash_attn else "v_transposed",
        "kv_pad": str(eng.kv_pad),
        "exact_batching": str(bool(eng.exact_batching)),
        "device": str(eng.runtime.device),
        "cpu_variant": toy_ggml.cpu_variant().tag,
        "toy_ggml": toy_ggml.__version__,
    }
    return Fingerprint(tuple(sorted(parts.items())))


def chain_keys(fp: Fingerprint, ids, adapter_id: str, n_blocks: int | None = None) -> list[bytes]:
    """The keys of the full blocks of ``ids`` (the first ``n_blocks`` of them when given)."""
    a = np.asarray(ids, dtype="<i4")
    n = len(a) // BLOCK if n_blocks is None else min(n_blocks, len(a) // BLOCK)
    tag = adapter_id.encode()
    tag = struct.pack("<I", len(tag)) + tag
    keys, prev = [], fp.digest
    for i in range(n):
        prev = hashlib.sha256(prev + tag + a[i * BLOCK : (i + 1) * BLOCK].tobytes()).digest()
        keys.append(prev)
    return keys


# ----------------------------------------------------------------------------- the file format


def write_file(path: Path, fp: Fingerprint, key: bytes, ids, payload, meta: dict | None = None) -> int:
    """Write a block or slot file atomically (a temporary name, then a rename); returns its size in bytes."""
    ids_b = np.asarray(ids, dtype="<i4").tobytes()
    meta_b = json.dumps(meta or {}, sort_keys=True).encode()
    data = (
        bytes(payload) if isinstance(payload, (bytes, bytearray)) else np.ascontiguousarray(payload, np.uint8).tobytes()
    )
    sha = hashlib.sha256(ids_b + meta_b + data).digest()
    head = _HEAD.pack(MAGIC, VERSION, fp.digest, key, len(ids_b) // 4, len(meta_b), len(data), sha)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(head + ids_b + meta_b)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return _HEAD.size + len(ids_b) + len(meta_b) + len(data)


@dataclass
class FileContents:
    fingerprint: bytes
    key: bytes
    ids: list[int]
    meta: dict[str, Any]
    payload: bytes
    size: int  # of the whole file


def read_file(path: Path) -> FileContents:
    """Read and check a block or slot file; ``ValueError`` saying what is wrong (header, length, checksum)."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < _HEAD.size:
        raise ValueError(f"{len(raw)} bytes, shorter than the header")
    magic, version, fp, key, n, n_meta, n_data, sha = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise ValueError("not a toy KV file (bad magic)")
    if version != VERSION:
        raise ValueError(f"format version {version}, this toy reads {VERSION}")
    body = raw[_HEAD.size :]
    if len(body) != 4 * n + n_meta + n_data:
        raise ValueError(f"{len(body)} bytes after the header, the header says {4 * n + n_meta + n_data}")
    if hashlib.sha256(body).digest() != sha:
        raise ValueError("the checksum does not match (damaged file)")
    ids = np.frombuffer(body[: 4 * n], dtype="<i4").tolist()
    try:
        meta = json.loads(body[4 * n : 4 * n + n_meta])
    except ValueError as e:
        raise ValueError(f"bad meta: {e}") from e
    return FileContents(fp, key, ids, meta, body[4 * n + n_meta :], len(raw))


# ----------------------------------------------------------------------------- the cache


@dataclass
class PrefixStats:
    hits: int = 0  # blocks found by lookups
    misses: int = 0  # full prompt blocks lookups did not find
    tokens: int = 0  # tokens restored into slots
    evictions: int = 0  # blocks dropped from RAM (spilled to disk when there is one)
    disk_evictions: int = 0  # block files deleted to keep the folder within its bound
    discarded: int = 0  # damaged or foreign block files deleted
    ram_bytes: int = 0
    disk_bytes: int = 0
    ram_blocks: int = 0
    disk_blocks: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class PrefixCache:
    """Blocks of K/V by chain key (see the module docstring): ``ram_bytes`` of RAM, and optionally a
    ``disk_dir`` bounded to ``disk_bytes``, for the model whose ``fp`` (``fingerprint``) it is."""

    def __init__(self, fp: Fingerprint, ram_bytes: int, disk_dir=None, disk_bytes: int = 2048 << 20):
        if ram_bytes < 0 or disk_bytes < 0:
            raise BadInputError(f"prefix cache bounds must be >= 0 (got RAM {ram_bytes}, disk {disk_bytes})")
        self.fp, self.ram_limit, self.disk_limit = fp, ram_bytes, disk_bytes
        self.stats = PrefixStats()
        self._ram: OrderedDict[bytes, np.ndarray] = OrderedDict()  # LRU first
        self._disk: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        self._loaded: dict[bytes, np.ndarray] = {}  # disk blocks the last lookup read, for restore
        self.dir: Path | None = None
        if disk_dir is not None:
            self.dir = Path(disk_dir) / fp.hex
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()

    # -- lookups and copies

    def lookup(self, ids, adapter_id: str) -> int:
        """How many leading tokens of ``ids`` cached blocks cover (a multiple of ``BLOCK``)."""
        self._loaded.clear()
        keys = chain_keys(self.fp, ids, adapter_id)
        found = 0
        for k in keys:
            if k in self._ram:
                found += 1
            elif k in self._disk and (block := self._read_block(k)) is not None:
                self._loaded[k] = block
                found += 1
            else:
                break
        self.stats.hits += found
        self.stats.misses += len(keys) - found
        for k in reversed(keys[:found]):  # leaf to root: the root ends most recent
            if k in self._ram:
                self._ram.move_to_end(k)
        return found * BLOCK

    def restore(self, cache, slot: int, ids, adapter_id: str, start: int, n: int) -> None:
        """Write positions ``[start, start + n)`` of ``ids`` from cached blocks into ``slot`` of ``cache`` (a
        ``KVCache`` holding at least ``start`` tokens), after a ``lookup`` that covered them. ``n`` <= 0 copies
        nothing and lets go of the disk blocks the lookup read."""
        if n <= 0:
            self._loaded.clear()
            return
        end = start + n
        keys = chain_keys(self.fp, ids, adapter_id, -(-end // BLOCK))
        parts = []
        for b in range(start // BLOCK, -(-end // BLOCK)):
            k = keys[b]
            block = self._ram.get(k)
            if block is None:
                block = self._loaded.get(k)
            if block is None:
                raise RuntimeError("restore: a block is not cached (lookup first)")
            lo, hi = max(start, b * BLOCK) - b * BLOCK, min(end, (b + 1) * BLOCK) - b * BLOCK
            parts.append(block.reshape(cache.cfg.n_layer, 2, BLOCK, -1)[:, :, lo:hi])
        cache.write(slot, start, np.concatenate(parts, axis=2), ids[start:end])
        self.stats.tokens += n
        loaded = [k for k in keys if k in self._loaded]
        for k in reversed(loaded):  # read from disk: back into RAM, leaf to root
            self._put(k, self._loaded[k])
        self._loaded.clear()
        for k in reversed(keys):
            if k in self._ram:
                self._ram.move_to_end(k)

    def insert(self, cache, slot: int, adapter_id: str) -> int:
        """Store every full block of ``slot``'s tokens that is not cached yet; returns how many were added."""
        if self.ram_limit == 0 and self.dir is None:
            return 0
        ids = cache.tokens(slot)
        keys = chain_keys(self.fp, ids, adapter_id)
        added = 0
        for b in reversed(range(len(keys))):  # leaf to root: the root is the last one evicted
            k = keys[b]
            if k in self._ram:
                self._ram.move_to_end(k)
            elif k not in self._disk:
                self._put(k, cache.read(slot, b * BLOCK, BLOCK))
                added += 1
        return added

    def flush(self) -> int:
        """Write every RAM block that is not on disk yet (no-op without a disk folder); returns how many."""
        if self.dir is None:
            return 0
        todo = [k for k in self._ram if k not in self._disk]
        for k in todo:
            self._disk_put(k, self._ram[k])
        return len(todo)

    def close(self) -> None:
        """Flush RAM blocks to disk (so a restarted server finds them) and drop the RAM tier."""
        try:
            self.flush()
        except OSError as e:
            log.warning("prefix cache: could not write blocks to %s: %s", self.dir, e)
        self._ram.clear()
        self.stats.ram_bytes = self.stats.ram_blocks = 0

    # -- tiers

    def _put(self, k: bytes, block: np.ndarray) -> None:
        if block.nbytes > self.ram_limit:
            if self.dir is not None and k not in self._disk:
                self._disk_put(k, block)
            return
        self._ram[k] = block
        self.stats.ram_bytes += block.nbytes
        while self.stats.ram_bytes > self.ram_limit:
            old, data = self._ram.popitem(last=False)
            self.stats.ram_bytes -= data.nbytes
            self.stats.evictions += 1
            if self.dir is not None and old not in self._disk:
                self._disk_put(old, data)
        self.stats.ram_blocks = len(self._ram)

    def _path(self, k: bytes) -> Path:
        assert self.dir is not None
        return self.dir / (k.hex() + SUFFIX)

    def _disk_put(self, k: bytes, block: np.ndarray) -> None:
        if block.nbytes > self.disk_limit:
            return
        try:
            size = write_file(self._path(k), self.fp, k, [], block)
        except OSError as e:
            log.warning("prefix cache: could not write a block to %s: %s", self.dir, e)
            return
        self._disk[k] = size
        self.stats.disk_bytes += size
        self._trim_disk()

    def _drop_disk(self, k: bytes) -> None:
        self.stats.disk_bytes -= self._disk.pop(k)
        self._path(k).unlink(missing_ok=True)
        self.stats.disk_blocks = len(self._disk)

    def _trim_disk(self) -> None:
        while self.stats.disk_bytes > self.disk_limit and self._disk:
            self._drop_disk(next(iter(self._disk)))
            self.stats.disk_evictions += 1
        self.stats.disk_blocks = len(self._disk)

    def _read_block(self, k: bytes) -> np.ndarray | None:
        """A disk block, checked (header, checksum, key, fingerprint); a bad one is deleted with a warning."""
        path = self._path(k)
        try:
            f = read_file(path)
            if f.fingerprint != self.fp.digest or f.key != k:
                raise ValueError("its header names another model setup or block")
            if f.ids or not f.payload or len(f.payload) % BLOCK:
                raise ValueError("its payload is not one block")
        except (OSError, ValueError) as e:
            log.warning("prefix cache: discarding block file %s: %s", path, e)
            self.stats.discarded += 1
            self._drop_disk(k)
            return None
        self._disk.move_to_end(k)
        try:
            os.utime(path)
        except OSError:
            pass
        return np.frombuffer(f.payload, np.uint8)

    def _scan(self) -> None:
        """The disk index: every block file of this fingerprint's folder, least recently used first."""
        assert self.dir is not None
        found = []
        for p in self.dir.iterdir():
            if p.name.endswith(".tmp"):  # a write cut short by a crash
                p.unlink(missing_ok=True)
                continue
            if not p.name.endswith(SUFFIX):
                continue
            try:
                k = bytes.fromhex(p.name[: -len(SUFFIX)])
                st = p.stat()
            except (ValueError, OSError):
                continue
            if len(k) == 32:
                found.append((st.st_mtime_ns, k, st.st_size))
        for _, k, size in sorted(found):
            self._disk[k] = size
            self.stats.disk_bytes += size
        self._trim_disk()


# ----------------------------------------------------------------------------- slot files


def save_slot(cache, slot: int, path: Path, fp: Fingerprint, adapter_id: str) -> tuple[int, int]:
    """Write ``slot``'s tokens and K/V to ``path``; returns (tokens, bytes written)."""
    ids = cache.tokens(slot)
    data = cache.read(slot, 0, len(ids))
    key = hashlib.sha256(adapter_id.encode() + b"\0" + np.asarray(ids, "<i4").tobytes()).digest()
    meta = {"kind": "slot", "adapter": adapter_id, "fingerprint": dict(fp.parts), "shape": list(data.shape)}
    return len(ids), write_file(path, fp, key, ids, data, meta)


def load_slot(cache, slot: int, path: Path, fp: Fingerprint) -> tuple[list[int], str, int]:
    """Read a slot file into ``slot`` (replacing what it held); returns (ids, adapter identity, bytes read).
    ``SlotFileError`` when the file is damaged, not a slot file, saved by another model or KV setup (the
    message names the parts that differ) or longer than the slot."""
    try:
        f = read_file(path)
    except ValueError as e:
        raise SlotFileError(f"{path.name} cannot be restored: {e}", field="filename") from e
    if f.meta.get("kind") != "slot":
        raise SlotFileError(f"{path.name} is not a slot file", field="filename")
    if f.fingerprint != fp.digest:
        diff = fp.mismatch(f.meta.get("fingerprint") or {})
        raise SlotFileError(
            f"{path.name} was saved for another model or KV setup ({'; '.join(diff) or 'fingerprint differs'})",
            hint="restore it on a server running the same model file with the same options",
            field="filename",
        )
    n = len(f.ids)
    if n > cache.n_ctx:
        raise SlotFileError(f"{path.name} holds {n} tokens, more than a slot's {cache.n_ctx}", field="filename")
    shape = (cache.cfg.n_layer, 2, n, cache.row_bytes)
    if len(f.payload) != int(np.prod(shape)):
        raise SlotFileError(f"{path.name}: {len(f.payload)} bytes of K/V, expected {shape}", field="filename")
    cache.truncate(slot, 0)
    cache.write(slot, 0, np.frombuffer(f.payload, np.uint8).reshape(shape), f.ids)
    return f.ids, str(f.meta.get("adapter", "")), f.size


__all__ = [
    "BLOCK",
    "Fingerprint",
    "PrefixCache",
    "PrefixStats",
    "SlotFileError",
    "chain_keys",
    "fingerprint",
    "load_slot",
    "read_file",
    "save_slot",
    "write_file",
]
