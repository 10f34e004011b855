"""Image training data: the class folder, its split, the decoded cache, batches.

Pipeline: ``ImageFolder`` lists a folder of class sub-folders and splits it
into training and validation images; ``ImageFolder.decode`` decodes every image
once into a uint8 cache on disk (memory-mapped afterwards);
``ImageBatchStream`` hands out (augmented) training batches in a seeded,
resumable order; ``validation_batches`` gives the plainly resized ones.

Decisions:

- Layout: ``DATA/<class>/.../<image>``; class names are the sorted sub-folder
  names (Python string order), a class's index is its position. Class folders
  are searched recursively (hidden entries skipped; symlinked files are read,
  symlinked sub-folders inside a class are not descended). Files whose suffix
  is not .png/.jpg/.jpeg/.webp/.bmp (any case), and files lying directly in
  ``DATA``, are ignored and listed in ``ImageFolder.ignored``.
- A separate validation folder: when ``DATA`` holds a ``train`` sub-folder and
  a ``val`` (or ``validation``) sub-folder, they are the two splits (other
  top-level folders such as ``test`` are ignored and listed in
  ``ignored_dirs``); ``val_dir=`` names one explicitly. The classes are those of
  the training folder; a validation class must be one of them. ``val_fraction``
  is not used then.
- Otherwise the split is per class and deterministic: the class's files are
  ordered by ``sha256(f"{seed}/{relative path}")`` (POSIX path relative to
  ``DATA``, ties by path) and the first ``min(ceil(val_fraction * n), n - 1)``
  go to validation, so every class keeps a training image, and adding files
  to one class never moves files of another.
- The cache holds every image (both splits, in ``samples`` order) resized to
  ``size x size`` (default: the training image size) with the processor's
  bilinear resize, as uint8 ``(N, size, size, C)`` in
  ``<cache_dir>/<key>/pixels.npy`` (``cache_dir`` default
  ``<TOY_HOME>/cache/vit``, see ``toy.store.toy_home``). So a validation image
  at ``size == image_size`` is exactly what ``ViTImageProcessor`` gives for the
  file. The key hashes the format version, size, channels and, per file, its
  split root, relative path, byte size and mtime (ns): not the absolute
  location (a moved folder still hits), not the bytes (a second run is a
  ``stat`` per file, not a re-read).
- Augmentation (training only), on the cached image: torchvision's
  ``RandomResizedCrop`` (area fraction in ``scale``, default (0.5, 1.0); aspect
  ratio w/h log-uniform in ``ratio``, default (3/4, 4/3); 10 tries, then a
  centre crop), the crop resized to ``image_size`` with PIL bilinear, then a
  horizontal flip with probability ``flip`` (default 0.5; 0 disables it:
  digits must not be flipped), then the processor's rescale and normalize.
  The crop's aspect ratio is measured on the cached square image.
- Order and randomness: epoch ``e`` visits the training images in
  ``default_rng([seed, e]).permutation(n_train)``; the image at position ``p``
  of epoch ``e`` is augmented with ``default_rng([seed, e, p])``. So the
  random state is a function of (seed, epoch, cursor) and ``state()`` needs
  nothing else: a resumed stream continues byte-identically, whatever the
  batch size before and after.
- Batches are always full: a batch that reaches the end of an epoch runs on
  into the next (as toy's ``BatchStream``), so every step has one shape.
  Validation batches are padded instead: rows past the end have ``mask`` 0,
  ``label`` 0, ``index`` -1 and zero pixels.

Invariants: a cache folder appears only complete (written into a hidden temp
folder beside it, fsynced, its ``meta.json`` last, renamed into place); a
failed build (a corrupt image, a full disk) leaves nothing behind. Batches are
float32 ``(B, C, H, W)`` pixels, int32 ``(B,)`` labels. Bad input raises
``DataError`` naming the file or folder.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from toy_vit.preprocess import (
    SUFFIXES,
    DataError,
    check_channels,
    check_size,
    crop_box,
    load_image,
    norm_stats,
    normalize_uint8,
    resize_uint8,
)

__all__ = [
    "Augment",
    "DataError",
    "DecodedImages",
    "ImageBatch",
    "ImageBatchStream",
    "ImageFolder",
    "Sample",
    "default_cache_dir",
    "validation_batches",
]

FORMAT_VERSION = 1
VAL_NAMES = ("val", "validation")
_SUFFIX_LIST = " ".join(SUFFIXES)


def default_cache_dir() -> Path:
    """``<TOY_HOME>/cache/vit``, beside toy's token cache."""
    from toy.store import toy_home  # imported here: toy.store is not needed for in-memory use

    return toy_home() / "cache" / "vit"


# -- the folder and its split -------------------------------------------------


@dataclass(frozen=True)
class Sample:
    path: Path  # the file
    rel: str  # POSIX path relative to its split root ("cat/001.png")
    label: int  # index into ImageFolder.classes
    split_root: str  # "train" (the data folder, or DATA/train) or "val" (the validation folder)


def _visible(name: str) -> bool:
    return not name.startswith(".")


def _scan_class(folder: Path, ignored: list[Path]) -> list[Path]:
    """Image files under ``folder`` (recursively), sorted by relative path."""
    found: list[Path] = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if _visible(d))
        for n in names:
            if not _visible(n):
                continue
            (found if n.lower().endswith(SUFFIXES) else ignored).append(Path(root, n))
    return sorted(found, key=lambda f: f.relative_to(folder).parts)


def _scan(root: Path, ignored: list[Path]) -> dict[str, list[Path]]:
    """{class name: image files} of a split root, checked (see ImageFolder)."""
    if not root.exists():
        raise DataError(f"{root}: no such folder")
    if not root.is_dir():
        raise DataError(f"{root}: not a folder")
    try:
        with os.scandir(root) as it:
            entries = sorted((e for e in it if _visible(e.name)), key=lambda e: e.name)
    except OSError as e:
        raise DataError(f"{root}: cannot list the folder: {e.strerror or e}") from None
    dirs = [e for e in entries if e.is_dir()]
    loose = [Path(e.path) for e in entries if not e.is_dir()]
    if not dirs:
        if any(p.name.lower().endswith(SUFFIXES) for p in loose):
            raise DataError(
                f"{root}: the images lie directly in the folder; an image folder has one sub-folder per class",
                hint=f"move them into {root}/<class name>/",
            )
        raise DataError(f"{root}: no class folders (expected {root}/<class name>/<image>)")
    ignored += loose
    files = {e.name: _scan_class(Path(e.path), ignored) for e in dirs}
    if not any(files.values()):
        raise DataError(f"{root}: no images ({_SUFFIX_LIST}) in any of its {len(files)} class folder(s)")
    for name, fs in files.items():
        if not fs:
            raise DataError(f"{root / name}: the class folder holds no images ({_SUFFIX_LIST})")
    return files


def _split_hash(seed: int, rel: str) -> bytes:
    return hashlib.sha256(f"{seed}/{rel}".encode()).digest()


class ImageFolder:
    """A classified image folder and its train/validation split (see the
    module docstring). ``samples`` lists every image (training root first,
    then the validation root); ``train_indices`` / ``val_indices`` index it."""

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        val_fraction: float = 0.1,
        seed: int = 0,
        val_dir: str | os.PathLike | None = None,
    ):
        if not (isinstance(val_fraction, (int, float)) and 0 <= val_fraction < 1):
            raise DataError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
        if not isinstance(seed, int) or seed < 0:
            raise DataError(f"the split seed must be a non-negative integer, got {seed!r}")
        self.root, self.seed = Path(root), seed
        self.ignored: list[Path] = []
        self.ignored_dirs: list[Path] = []
        train_root, val_root = self.root, Path(val_dir) if val_dir is not None else None
        if val_root is None and self.root.is_dir():
            with os.scandir(self.root) as it:
                names = {e.name for e in it if e.is_dir() and _visible(e.name)}
            found = [v for v in VAL_NAMES if v in names]
            if "train" in names and found:
                train_root, val_root = self.root / "train", self.root / found[0]
                others = sorted(names - {"train", found[0]})
                self.ignored_dirs = [self.root / n for n in others]
        self.train_root, self.val_root = train_root, val_root
        self.val_fraction = 0.0 if val_root is not None else float(val_fraction)

        train_files = _scan(train_root, self.ignored)
        self.classes = sorted(train_files)
        if len(self.classes) < 2:
            raise DataError(f"{train_root}: only one class folder ({self.classes[0]}); a classifier needs at least two")
        label = {c: i for i, c in enumerate(self.classes)}
        samples: list[Sample] = []
        val: list[int] = []
        for c in self.classes:
            start = len(samples)
            samples += [Sample(f, f.relative_to(train_root).as_posix(), label[c], "train") for f in train_files[c]]
            n = len(samples) - start
            n_val = min(math.ceil(round(self.val_fraction * n, 9)), n - 1)
            if n_val > 0:
                ranked = sorted(
                    range(start, start + n), key=lambda i: (_split_hash(seed, samples[i].rel), samples[i].rel)
                )
                val += ranked[:n_val]
        if val_root is not None:
            val_files = _scan(val_root, self.ignored)
            for c in sorted(val_files):
                if c not in label:
                    raise DataError(
                        f"{val_root / c}: the validation class '{c}' has no training folder in {train_root}",
                        hint=f"the training classes are: {', '.join(self.classes)}",
                    )
                start = len(samples)
                samples += [Sample(f, f.relative_to(val_root).as_posix(), label[c], "val") for f in val_files[c]]
                val += range(start, len(samples))
        self.samples = samples
        in_val = np.zeros(len(samples), bool)
        in_val[val] = True
        self.val_indices = np.flatnonzero(in_val)
        self.train_indices = np.flatnonzero(~in_val)
        self.labels = np.array([s.label for s in samples], np.int32)
        self._decoded: dict[tuple, DecodedImages] = {}

    @property
    def n_train(self) -> int:
        return len(self.train_indices)

    @property
    def n_val(self) -> int:
        return len(self.val_indices)

    def class_counts(self, split: str = "train") -> list[int]:
        return np.bincount(self.labels[_indices(self, split)], minlength=len(self.classes)).tolist()

    def decode(
        self,
        size: int,
        channels: int,
        *,
        cache_dir: str | os.PathLike | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> DecodedImages:
        """Every image decoded and resized to ``size x size`` with ``channels``,
        from the cache (built on first use; ``progress(done, total)`` is called
        while it is built, not when it is reused)."""
        size, channels = check_size(size, "the cache size"), check_channels(channels)
        where = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        k = (size, channels, str(where))
        if k not in self._decoded:
            self._decoded[k] = _build_cache(self, size, channels, where, progress)
        return self._decoded[k]


def _indices(folder: ImageFolder, split: str) -> np.ndarray:
    if split == "train":
        return folder.train_indices
    if split == "val":
        return folder.val_indices
    if split == "all":
        return np.arange(len(folder.samples))
    raise DataError(f"split must be 'train', 'val' or 'all', got {split!r}")


# -- the decoded-image cache ----------------------------------------------------


@dataclass
class DecodedImages:
    """uint8 ``(N, size, size, C)`` pixels of ``folder.samples`` (read-only
    memmap when cached on disk) and their int32 labels."""

    pixels: np.ndarray
    labels: np.ndarray
    size: int
    channels: int
    key: str
    path: Path | None


def _stat(samples: list[Sample]) -> list[tuple[int, int]]:
    out = []
    for s in samples:
        try:
            st = s.path.stat()
        except OSError as e:
            raise DataError(f"{s.path}: cannot read: {e.strerror or e}") from None
        out.append((st.st_size, st.st_mtime_ns))
    return out


def _cache_key(samples: list[Sample], stats: list[tuple[int, int]], size: int, channels: int) -> str:
    h = hashlib.sha256(f"toy-vit-image-cache/{FORMAT_VERSION}\0{size}\0{channels}\0".encode())
    for s, (nbytes, mtime) in zip(samples, stats):
        h.update(f"{s.split_root}\0{s.rel}\0{nbytes}\0{mtime}\0".encode())
    return h.hexdigest()[:32]


def _open_cache(path: Path, n: int, size: int, channels: int) -> np.ndarray | None:
    """The cached pixels if ``path`` holds a complete cache of this shape."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("format") != FORMAT_VERSION or meta.get("n") != n:
            return None
        pixels = np.load(path / "pixels.npy", mmap_mode="r")
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    if pixels.shape != (n, size, size, channels) or pixels.dtype != np.uint8:
        return None
    return pixels


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on folders
    finally:
        os.close(fd)


def _build_cache(
    folder: ImageFolder, size: int, channels: int, cache_dir: Path, progress: Callable[[int, int], None] | None
) -> DecodedImages:
    samples = folder.samples
    before = _stat(samples)
    key = _cache_key(samples, before, size, channels)
    final = cache_dir / key
    n = len(samples)
    found = _open_cache(final, n, size, channels)
    if found is not None:
        return DecodedImages(found, folder.labels, size, channels, key, final)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".tmp", dir=cache_dir))
    except OSError as e:
        raise DataError(f"{cache_dir}: cannot create the image cache folder: {e.strerror or e}") from None
    try:
        pixels = np.lib.format.open_memmap(
            tmp / "pixels.npy", mode="w+", dtype=np.uint8, shape=(n, size, size, channels)
        )
        every = max(1, n // 200)
        for i, s in enumerate(samples):
            pixels[i] = resize_uint8(load_image(s.path, channels), size)
            if progress and (i + 1) % every == 0 and i + 1 < n:
                progress(i + 1, n)
        pixels.flush()
        del pixels
        if _stat(samples) != before:
            raise DataError(f"{folder.root}: images changed while they were being decoded", hint="run again")
        _fsync_path(tmp / "pixels.npy")
        meta = {"format": FORMAT_VERSION, "n": n, "size": size, "channels": channels, "root": str(folder.root)}
        with open(tmp / "meta.json", "w") as f:  # last: its presence marks the cache complete
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp, directory=True)
        if final.exists() and _open_cache(final, n, size, channels) is None:
            shutil.rmtree(final, ignore_errors=True)  # a damaged folder under our key: replace it
        try:
            os.rename(tmp, final)
        except OSError:
            if _open_cache(final, n, size, channels) is None:  # not another process finishing first
                raise
        _fsync_path(cache_dir, directory=True)
    except OSError as e:
        raise DataError(f"{cache_dir}: cannot write the image cache: {e.strerror or e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        progress(n, n)
    found = _open_cache(final, n, size, channels)
    if found is None:  # only if another process removed it just now
        raise DataError(f"{final}: the image cache vanished after it was written")
    return DecodedImages(found, folder.labels, size, channels, key, final)


# -- augmentation and batches ---------------------------------------------------


@dataclass(frozen=True)
class Augment:
    """Training augmentation (see the module docstring): torchvision
    ``RandomResizedCrop(scale, ratio)`` then a horizontal flip with
    probability ``flip``."""

    scale: tuple[float, float] = (0.5, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5

    def __post_init__(self):
        try:
            object.__setattr__(self, "scale", tuple(float(v) for v in self.scale))
            object.__setattr__(self, "ratio", tuple(float(v) for v in self.ratio))
            object.__setattr__(self, "flip", float(self.flip))
        except (TypeError, ValueError):
            raise DataError(f"bad augmentation settings {self!r}") from None
        if len(self.scale) != 2 or len(self.ratio) != 2:
            raise DataError(f"crop scale and ratio are (min, max) pairs, got {self.scale!r} and {self.ratio!r}")
        lo, hi = self.scale
        if not 0 < lo <= hi <= 1:
            raise DataError(f"crop scale {self.scale!r} must satisfy 0 < min <= max <= 1")
        lo, hi = self.ratio
        if not 0 < lo <= hi or not math.isfinite(hi):
            raise DataError(f"crop ratio {self.ratio!r} must satisfy 0 < min <= max")
        if not 0 <= self.flip <= 1:
            raise DataError(f"flip probability {self.flip!r} must be in [0, 1]")


@dataclass
class ImageBatch:
    pixels: np.ndarray  # float32 (B, C, H, W), normalized
    labels: np.ndarray  # int32 (B,)
    index: np.ndarray  # int64 (B,) position in ImageFolder.samples, -1 for padding
    mask: np.ndarray  # float32 (B,) 1 for real rows, 0 for padding

    @property
    def n(self) -> int:
        return int(self.mask.sum())


def _resize(img: np.ndarray, size: int) -> np.ndarray:
    """uint8 (h, w, C) -> (size, size, C), PIL bilinear (a no-op at the same size)."""
    if img.shape[0] == img.shape[1] == size:
        return img
    return resize_uint8(Image.fromarray(img[:, :, 0] if img.shape[2] == 1 else img), size)


def augment_image(img: np.ndarray, size: int, aug: Augment, rng: np.random.Generator) -> np.ndarray:
    """uint8 (h, w, C) -> a random resized crop at (size, size, C), maybe flipped."""
    top, left, h, w = crop_box(img.shape[0], img.shape[1], rng, aug.scale, aug.ratio)
    out = _resize(np.ascontiguousarray(img[top : top + h, left : left + w]), size)
    if rng.random() < aug.flip:  # drawn even when flip is 0, so crops do not depend on it
        out = out[:, ::-1]
    return out


def _channels_for(mean, channels: int | None) -> int:
    if channels is None:
        channels = len(mean) if isinstance(mean, Sequence) and len(mean) in (1, 3) else 3
    return check_channels(channels)


class ImageBatchStream:
    """Training batches in a seeded, resumable order (see the module docstring)."""

    def __init__(
        self,
        folder: ImageFolder,
        batch_size: int,
        seed: int,
        image_size: int,
        mean: float | Sequence[float],
        std: float | Sequence[float],
        *,
        augment: Augment | None = Augment(),
        channels: int | None = None,
        cache_size: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        progress: Callable[[int, int], None] | None = None,
        state: dict | None = None,
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"batch size must be a positive integer, got {batch_size!r}")
        if not isinstance(seed, int) or seed < 0:
            raise DataError(f"the seed must be a non-negative integer, got {seed!r}")
        if folder.n_train < batch_size:
            raise DataError(
                f"{folder.root}: the training split has {folder.n_train} image(s), fewer than a batch of {batch_size}",
                hint="lower the batch size or val_fraction, or add images",
            )
        self.folder, self.batch_size, self.seed, self.augment = folder, batch_size, seed, augment
        self.image_size = check_size(image_size)
        self.channels = _channels_for(mean, channels)
        self.mean, self.std = norm_stats(mean, std, self.channels)
        cache_size = self.image_size if cache_size is None else cache_size
        self.images = folder.decode(cache_size, self.channels, cache_dir=cache_dir, progress=progress)
        self._epoch = self._cursor = 0
        if state is not None:
            try:
                epoch, cursor = int(state["epoch"]), int(state["cursor"])
                n_train, seed_s = int(state["n_train"]), int(state["seed"])
            except (KeyError, TypeError, ValueError):
                raise DataError(f"bad image stream state {state!r}") from None
            if n_train != folder.n_train or seed_s != seed:
                raise DataError(
                    f"the image stream state is for {n_train} training images and seed {seed_s}, "
                    f"not {folder.n_train} and {seed}: the data or settings changed"
                )
            if epoch < 0 or not 0 <= cursor <= n_train:
                raise DataError(f"bad image stream state {state!r}")
            self._epoch, self._cursor = epoch, cursor
        self._order_epoch, self._order = -1, np.zeros(0, np.int64)

    def _order_for(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.folder.n_train)
            self._order_epoch = epoch
        return self._order

    def _image(self, epoch: int, pos: int, idx: int) -> np.ndarray:
        img = self.images.pixels[idx]
        if self.augment is None:
            return _resize(img, self.image_size)
        rng = np.random.default_rng([self.seed, epoch, pos])
        return augment_image(img, self.image_size, self.augment, rng)

    def next(self) -> ImageBatch:
        n = self.folder.n_train
        rows: list[np.ndarray] = []
        index: list[int] = []
        while len(rows) < self.batch_size:
            if self._cursor >= n:
                self._epoch, self._cursor = self._epoch + 1, 0
            pos = self._cursor
            idx = int(self.folder.train_indices[self._order_for(self._epoch)[pos]])
            rows.append(self._image(self._epoch, pos, idx))
            index.append(idx)
            self._cursor += 1
        index_a = np.asarray(index, np.int64)
        pixels = normalize_uint8(np.stack(rows), self.mean, self.std)
        return ImageBatch(pixels, self.folder.labels[index_a], index_a, np.ones(len(rows), np.float32))

    def state(self) -> dict:
        """A JSON-serializable cursor; pass it back as ``state=`` to resume.
        The augmentation RNG is derived from (seed, epoch, cursor), so this is all of it."""
        return {"epoch": self._epoch, "cursor": self._cursor, "seed": self.seed, "n_train": self.folder.n_train}

    @property
    def epoch(self) -> float:
        """Epochs completed so far, fractional."""
        return self._epoch + self._cursor / self.folder.n_train


def validation_batches(
    folder: ImageFolder,
    batch_size: int,
    image_size: int,
    mean: float | Sequence[float],
    std: float | Sequence[float],
    *,
    split: str = "val",
    channels: int | None = None,
    cache_size: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: Callable[[int, int], None] | None = None,
    max_batches: int | None = None,
) -> Iterator[ImageBatch]:
    """The images of ``split`` ("val", "train" or "all") in order, plainly
    resized (no augmentation), ``batch_size`` a batch, the last one padded
    (``mask`` 0). The cache is built before this returns; batches are made lazily."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise DataError(f"batch size must be a positive integer, got {batch_size!r}")
    idx = _indices(folder, split)
    size = check_size(image_size)
    ch = _channels_for(mean, channels)
    m, s = norm_stats(mean, std, ch)
    images = folder.decode(size if cache_size is None else cache_size, ch, cache_dir=cache_dir, progress=progress)

    def batches() -> Iterator[ImageBatch]:
        for k, start in enumerate(range(0, len(idx), batch_size)):
            if max_batches is not None and k >= max_batches:
                return
            part = idx[start : start + batch_size]
            pad = batch_size - len(part)
            rows = np.stack([_resize(images.pixels[i], size) for i in part])
            pixels = normalize_uint8(rows, m, s)
            labels, index, mask = folder.labels[part], part.astype(np.int64), np.ones(len(part), np.float32)
            if pad:
                pixels = np.concatenate([pixels, np.zeros((pad, *pixels.shape[1:]), np.float32)])
                labels = np.concatenate([labels, np.zeros(pad, np.int32)])
                index = np.concatenate([index, np.full(pad, -1, np.int64)])
                mask = np.concatenate([mask, np.zeros(pad, np.float32)])
            yield ImageBatch(pixels, labels, index, mask)

    return batches()
